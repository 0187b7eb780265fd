"""rlbench.training.token_log_probs: log pi(o_t) and H(pi) from the logits without the [N, V]
log-softmax, against the closed forms (float64) and against log_softmax + gather (float32)."""

import pytest
import torch

from rlbench.training import token_log_probs as module
from rlbench.training.token_log_probs import token_log_probs


def closed_form(logits, targets, temperature):
    """log pi(o_t) = z_t - log sum_j exp z_j and H = -sum_j pi_j log pi_j, z = logits / temperature."""
    z = logits / temperature
    lse = torch.log(torch.exp(z).sum(-1))
    logp = z.gather(-1, targets[..., None]).squeeze(-1) - lse
    p = torch.exp(z - lse[..., None])
    return logp, -(p * (z - lse[..., None])).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("slice_elements", [1, 40, 1 << 19])  # one row per slice, a few rows, all rows
def test_values_and_gradients_equal_the_closed_forms(monkeypatch, temperature, slice_elements):
    monkeypatch.setattr(module, "SLICE_ELEMENTS", slice_elements)
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (3, 5), generator=g)
    w_logp, w_ent = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)

    logp, entropy = token_log_probs(logits, targets, temperature, with_entropy=True)
    ref_logp, ref_entropy = closed_form(logits, targets, temperature)
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(entropy, ref_entropy, atol=1e-12)
    # the gradients of both outputs, alone and together: d logp/dz = 1_t - pi, dH/dz_j = -pi_j (log pi_j + H)
    for weights in ((w_logp, None), (None, w_ent), (w_logp, w_ent)):
        def objective(lp, h):
            return sum((w * x).sum() for w, x in zip(weights, (lp, h)) if w is not None)
        (grad,) = torch.autograd.grad(objective(*token_log_probs(logits, targets, temperature, True)), logits)
        (ref,) = torch.autograd.grad(objective(*closed_form(logits, targets, temperature)), logits)
        assert torch.allclose(grad, ref, atol=1e-12)
    z = logits.detach() / temperature
    p = torch.softmax(z, -1)
    by_hand = (torch.nn.functional.one_hot(targets, 11) - p) * w_logp[..., None] / temperature
    (grad,) = torch.autograd.grad((w_logp * token_log_probs(logits, targets, temperature)[0]).sum(), logits)
    assert torch.allclose(grad, by_hand, atol=1e-12)


def test_float32_matches_log_softmax_and_gather():
    g = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(4, 7, 4096, generator=g)).requires_grad_()
    targets = torch.randint(0, 4096, (4, 7), generator=g)
    logp, entropy = token_log_probs(logits, targets, 0.8, with_entropy=True)
    log_probs = torch.log_softmax(logits / 0.8, -1)
    assert torch.allclose(logp, log_probs.gather(-1, targets[..., None]).squeeze(-1), atol=2e-6)
    assert torch.allclose(entropy, -(log_probs.exp() * log_probs).sum(-1), atol=2e-5)
    (mine,) = torch.autograd.grad(logp.sum() + 0.1 * entropy.sum(), logits)
    (ref,) = torch.autograd.grad(
        log_probs.gather(-1, targets[..., None]).sum() - 0.1 * (log_probs.exp() * log_probs).sum(), logits
    )
    assert torch.allclose(mine, ref, atol=1e-6)


def test_no_entropy_unless_asked_and_shapes_checked():
    logits = torch.randn(2, 3, 5)
    logp, entropy = token_log_probs(logits, torch.zeros(2, 3, dtype=torch.long))
    assert entropy is None and logp.shape == (2, 3)
    with pytest.raises(ValueError, match="leading shape"):
        token_log_probs(logits, torch.zeros(2, 4, dtype=torch.long))
