"""Log-probability of the sampled token and entropy of the distribution, straight from the logits,
without materialising the [tokens, vocabulary] log-softmax.

For logits x over a vocabulary and sampling temperature tau, z = x / tau and

    log pi(o_t) = z_{o_t} - logsumexp(z)                      (the policy-gradient log-prob)
    H(pi)       = logsumexp(z) - sum_j pi_j z_j               (= -sum_j pi_j log pi_j)
    sum_j pi_j^2 = sum_j exp(2 (z_j - m)) / (sum_j exp(z_j - m))^2, m = max_j z_j   (no gradient; the
                  optimal token baseline's squared score norm, rlbench/algorithm/advantages/verl_pieces.py)

with gradients (pi = softmax(z), 1_{o_t} the one-hot of the sampled token)

    d log pi(o_t) / dz = 1_{o_t} - pi
    d H / dz_j         = -pi_j (log pi_j + H).

``F.log_softmax`` followed by ``gather`` writes the whole [N, V] log-softmax (and, for the entropy,
its exp and product: 113 MB each for SmolLM2's 49,152 ids at 576 tokens), and its backward writes a
zero-filled [N, V] scatter and then the softmax gradient. Here the rows are taken in slices of about
:data:`SLICE_ELEMENTS` that stay in cache; the backward recomputes pi from the saved logits and
``logsumexp`` and writes the logits' gradient once. The values equal the log-softmax's up to float
rounding (tested against it in float64).
"""

from __future__ import annotations

import torch

SLICE_ELEMENTS = 1 << 19  # logits per slice on CPU (2 MiB of float32): fits in a core's share of the cache
DEVICE_SLICE_ELEMENTS = 1 << 28  # on an accelerator: slices only bound the temporaries (1 GiB), not the launches


def _rows_per_slice(logits: torch.Tensor) -> int:
    elements = SLICE_ELEMENTS if logits.device.type == "cpu" else DEVICE_SLICE_ELEMENTS
    return max(1, elements // logits.shape[-1])


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                with_sum_pi_squared: bool):
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1, 1)
        n = flat.shape[0]
        lse = flat.new_empty(n)
        logp = flat.new_empty(n)
        entropy = flat.new_empty(n) if with_entropy else None
        sum_pi_squared = flat.new_empty(n) if with_sum_pi_squared else None
        step = _rows_per_slice(flat)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            z = flat[rows] if temperature == 1.0 else flat[rows] / temperature
            top = z.amax(-1, keepdim=True)
            shifted = z - top
            weights = shifted.exp()
            total = weights.sum(-1)
            log_total = total.log()
            lse[rows] = top.squeeze(-1) + log_total
            logp[rows] = shifted.gather(-1, flat_targets[rows]).squeeze(-1) - log_total  # log_softmax's rounding
            if entropy is not None:
                entropy[rows] = log_total - (weights * shifted).sum(-1) / total
            if sum_pi_squared is not None:  # from the same exponentials: sum_j w_j^2 / (sum_j w_j)^2
                sum_pi_squared[rows] = weights.square().sum(-1) / total.square()
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, lse, entropy)
        shape = targets.shape
        if sum_pi_squared is not None:
            sum_pi_squared = sum_pi_squared.view(shape)
            ctx.mark_non_differentiable(sum_pi_squared)
        return logp.view(shape), None if entropy is None else entropy.view(shape), sum_pi_squared

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_sum_pi_squared=None):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1, 1)
        n = flat.shape[0]
        g_logp = None if grad_logp is None else grad_logp.reshape(-1, 1)
        g_entropy = None if grad_entropy is None else grad_entropy.reshape(-1, 1)
        grad = torch.empty_like(flat)
        step = _rows_per_slice(flat)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            out = grad[rows]
            z = flat[rows] if temperature == 1.0 else flat[rows] / temperature
            torch.sub(z, lse[rows, None], out=out)  # log pi
            # coefficient of -pi: g_logp + g_H (log pi + H)
            coefficient = None
            if g_entropy is not None:
                coefficient = (out + entropy[rows, None]).mul_(g_entropy[rows])
                if g_logp is not None:
                    coefficient.add_(g_logp[rows])
            elif g_logp is not None:
                coefficient = g_logp[rows]
            out.exp_()
            if coefficient is None:
                out.zero_()
            else:
                out.mul_(coefficient).neg_()
            if g_logp is not None:
                out.scatter_add_(-1, flat_targets[rows], g_logp[rows])
            if temperature != 1.0:
                out.div_(temperature)
        return grad.view_as(logits), None, None, None, None


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log pi(targets), H(pi))`` of ``softmax(logits / temperature)`` over the last dimension:
    logits [..., V], targets [...] (token ids) -> two [...] tensors (entropy None unless
    ``with_entropy``). Differentiable in both outputs; the module docstring gives the formulas."""
    logp, entropy, _ = token_distribution_stats(logits, targets, temperature, with_entropy)
    return logp, entropy


def token_distribution_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(log pi(targets), H(pi), sum_v pi(v)^2)`` of ``softmax(logits / temperature)``, one pass over the
    logits: the entropy None unless ``with_entropy``, the sum of squared probabilities (no gradient) None
    unless ``with_sum_pi_squared``."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have the logits' leading shape {tuple(logits.shape[:-1])}")
    if not temperature or temperature <= 0:
        temperature = 1.0
    return _TokenLogProbs.apply(logits, targets, float(temperature), with_entropy, with_sum_pi_squared)
