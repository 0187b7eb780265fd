"""Turning rollouts into a training batch, and the policy update.

Layout of a batch: prompts are LEFT-padded to a common width P and responses RIGHT-padded to a
common length T, so every response starts at column P. The logits that predict response token t
sit at column P - 1 + t, and only the last T + 1 columns need the LM head.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from rlbench.algorithm import Algorithm
from rlbench.rollout.base import Completion


ADDITIVE_METRICS = {"policy_loss", "kl", "value_loss"}


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    response_mask: torch.Tensor  # [B, T] float
    prompt_width: int  # P
    group_index: torch.Tensor  # [B] long
    rewards: torch.Tensor | None = None  # [B]
    advantages: torch.Tensor | None = None  # [B, T]
    old_logp: torch.Tensor | None = None  # [B, T]
    ref_logp: torch.Tensor | None = None  # [B, T]
    token_weights: torch.Tensor | None = None  # [B, T] policy-loss token mask (e.g. top-entropy), None = all 1
    old_values: torch.Tensor | None = None  # [B, T] critic values of the sampling policy
    returns: torch.Tensor | None = None  # [B, T] critic regression targets
    sampling_logp: torch.Tensor | None = None  # [B, T] the rollout engine's log-probs (Completion.logprobs)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """The sub-batch of ``rows``, trimmed to the longest response it holds."""
        response_len = int(self.response_mask[rows].sum(-1).max().item()) if len(rows) else 0
        keep = max(response_len, 1)
        width = self.prompt_width + keep

        def take(t: torch.Tensor | None, token_level: bool) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[rows]
            return t[:, :keep] if token_level else t

        return replace(
            self,
            input_ids=self.input_ids[rows, :width],
            attention_mask=self.attention_mask[rows, :width],
            response_mask=self.response_mask[rows, :keep],
            group_index=self.group_index[rows],
            rewards=take(self.rewards, False),
            advantages=take(self.advantages, True),
            old_logp=take(self.old_logp, True),
            ref_logp=take(self.ref_logp, True),
            token_weights=take(self.token_weights, True),
            old_values=take(self.old_values, True),
            returns=take(self.returns, True),
            sampling_logp=take(self.sampling_logp, True),
        )


def collate(groups: Sequence[Sequence[Completion]], pad_token_id: int, device: torch.device | str = "cpu") -> TrainBatch:
    """Stack completions (grouped per prompt) into a left/right padded batch."""
    flat = [(g, c) for g, group in enumerate(groups) for c in group]
    if not flat:
        raise ValueError("no completions to train on")
    prompt_width = max(len(c.prompt_ids) for _, c in flat)
    response_len = max(1, max(len(c.response_ids) for _, c in flat))
    B = len(flat)
    input_ids = torch.full((B, prompt_width + response_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(B, response_len)
    sampling_logp = torch.zeros(B, response_len)
    for row, (_, c) in enumerate(flat):
        p, r = len(c.prompt_ids), len(c.response_ids)
        input_ids[row, prompt_width - p : prompt_width] = torch.tensor(c.prompt_ids, dtype=torch.long)
        attention_mask[row, prompt_width - p : prompt_width] = 1
        if r:
            input_ids[row, prompt_width : prompt_width + r] = torch.tensor(c.response_ids, dtype=torch.long)
            attention_mask[row, prompt_width : prompt_width + r] = 1
            response_mask[row, :r] = 1
            sampling_logp[row, :r] = torch.tensor(c.logprobs, dtype=sampling_logp.dtype)
    group_index = torch.tensor([g for g, _ in flat], dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_mask=response_mask.to(device),
        prompt_width=prompt_width,
        group_index=group_index.to(device),
        sampling_logp=sampling_logp.to(device),
    )


def autocast_context(device: torch.device | str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; nothing on CPU (float32 there)."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _last_hidden(out: object, with_hidden: bool) -> torch.Tensor | None:
    """The final (post-norm) hidden states of a forward run with output_hidden_states."""
    return out.hidden_states[-1] if with_hidden else None


def _logits_per_row(
    model: torch.nn.Module, batch: TrainBatch, with_hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits that predict each response token, [B, T, V], one forward over every full row; with
    ``with_hidden`` also the final hidden states at the same positions ([B, T, H])."""
    T = batch.response_mask.shape[1]
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        logits_to_keep=T + 1,
        use_cache=False,
        output_hidden_states=with_hidden,
    )
    hidden = _last_hidden(out, with_hidden)
    return out.logits[:, -(T + 1) : -1, :], None if hidden is None else hidden[:, -(T + 1) : -1, :]


def _logits_shared_prompts(
    model: torch.nn.Module, batch: TrainBatch, with_hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same logits (and hidden states) as :func:`_logits_per_row`, running each distinct prompt only once.

    Responses of one group share their prompt (same tokens, same left padding). The prompt pass runs
    on one row per group and keeps its key/value cache, which is gathered to the group's rows
    (differentiably, so gradients flow back into the shared prompt pass); the response pass then
    runs on the response tokens alone. The logit that predicts response token 0 is the prompt
    pass's last position.
    """
    P, T = batch.prompt_width, batch.response_mask.shape[1]
    groups, row_to_group = torch.unique(batch.group_index, return_inverse=True)
    rows = torch.arange(batch.size, device=batch.input_ids.device)
    first_row = torch.full((len(groups),), batch.size, device=rows.device).scatter_reduce(
        0, row_to_group, rows, reduce="amin"
    )
    prompt_mask = batch.attention_mask[first_row, :P]
    prompt_out = model(
        input_ids=batch.input_ids[first_row, :P],
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=1,
        use_cache=True,
        output_hidden_states=with_hidden,
    )
    first_logits = prompt_out.logits[row_to_group]  # [B, 1, V]
    prompt_hidden = _last_hidden(prompt_out, with_hidden)
    first_hidden = None if prompt_hidden is None else prompt_hidden[row_to_group, -1:, :]  # [B, 1, H]
    if T == 1:
        return first_logits, first_hidden
    # transformers >= 5.x names the cache `cache` (older releases: `past_key_values`)
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = getattr(prompt_out, cache_name)
    cache.reorder_cache(row_to_group)  # one cache row per response row
    full_mask = batch.attention_mask[:, : P + T - 1]
    response_out = model(
        input_ids=batch.input_ids[:, P : P + T - 1],
        attention_mask=full_mask,
        position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)[:, P:],
        use_cache=True,
        output_hidden_states=with_hidden,
        **{cache_name: cache},
    )
    logits = torch.cat([first_logits, response_out.logits], dim=1)
    response_hidden = _last_hidden(response_out, with_hidden)
    return logits, None if response_hidden is None else torch.cat([first_hidden, response_hidden], dim=1)


@dataclass
class TokenOutputs:
    """What one forward pass gives for every response token of a (sub-)batch."""

    logp: torch.Tensor  # [B, T] log pi(o_t | q, o_<t)
    entropy: torch.Tensor | None = None  # [B, T] entropy of pi(. | q, o_<t)
    values: torch.Tensor | None = None  # [B, T] critic values V(q, o_<t) (value head on the same state)
    log_probs: torch.Tensor | None = None  # [B, T, V] the whole distribution (trust-region KL)


def token_outputs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    share_prompts: bool = True,
    entropy_requires_grad: bool = True,
    value_head: torch.nn.Module | None = None,
    with_log_probs: bool = False,
) -> TokenOutputs:
    """log pi(o_t | q, o_<t) for every response token, and on request the entropy of
    pi(. | q, o_<t), the critic value ``value_head(h_t)`` of the hidden state that predicts o_t, and
    the full-vocabulary log-probs. Logits are divided by ``temperature`` (the sampling
    temperature), so that the ratio compares the distribution that was actually sampled from. With
    ``share_prompts`` each distinct prompt runs once (see :func:`_logits_shared_prompts`); the
    result is the same."""
    T = batch.response_mask.shape[1]
    shared = share_prompts and int(torch.unique(batch.group_index).numel()) < batch.size
    forward = _logits_shared_prompts if shared else _logits_per_row
    with autocast_context(batch.input_ids.device):
        logits, hidden = forward(model, batch, with_hidden=value_head is not None)
    logits = logits.float()
    if temperature and temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, batch.prompt_width : batch.prompt_width + T]
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        # Only an entropy bonus needs its gradient; for logging and entropy-aware pieces (which
        # detach it) skip the autograd graph over the [B, T, vocab] probabilities.
        with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
            entropy = -(log_probs.exp() * log_probs).sum(-1)
    values = value_head(hidden) if value_head is not None else None
    return TokenOutputs(logp, entropy, values, log_probs if with_log_probs else None)


def token_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies or None) of :func:`token_outputs`."""
    out = token_outputs(
        model, batch, temperature, with_entropy=with_entropy, share_prompts=share_prompts,
        entropy_requires_grad=entropy_requires_grad,
    )
    return out.logp, out.entropy


def micro_batches(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


@torch.no_grad()
def batch_outputs(
    model: torch.nn.Module,
    batch: TrainBatch,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool = False,
    value_head: torch.nn.Module | None = None,
) -> TokenOutputs:
    """Log-probs, and optionally entropies and critic values, of the whole batch without gradient
    ([B, T] each, zero on padding)."""
    def zeros() -> torch.Tensor:
        return torch.zeros_like(batch.response_mask)

    result = TokenOutputs(zeros(), zeros() if with_entropy else None, zeros() if value_head is not None else None)
    for rows in micro_batches(torch.arange(batch.size, device=batch.input_ids.device), micro_batch_size):
        sub = batch.select(rows)
        out = token_outputs(model, sub, temperature, with_entropy=with_entropy, value_head=value_head)
        for name in ("logp", "entropy", "values"):
            target, part = getattr(result, name), getattr(out, name)
            if target is not None:
                target[rows, : part.shape[1]] = part * sub.response_mask
    return result


def batch_logprobs(
    model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies or None) of :func:`batch_outputs`."""
    out = batch_outputs(model, batch, micro_batch_size, temperature, with_entropy)
    return out.logp, out.entropy


def batch_norms(batch: TrainBatch, rows: torch.Tensor, norm_length: int) -> dict[str, int]:
    """The optimizer batch's counts every aggregation normalises by (see aggregation.py)."""
    return {
        "batch_tokens": int(batch.response_mask[rows].sum().item()),
        "batch_sequences": len(rows),
        "norm_length": norm_length,
    }


def micro_batch_loss(
    model: torch.nn.Module,
    sub: TrainBatch,
    algorithm: Algorithm,
    norms: dict[str, int],
    temperature: float,
    *,
    track_entropy: bool = True,
    progress: float = 0.0,
    value_head: torch.nn.Module | None = None,
    proximal_model: torch.nn.Module | None = None,
    with_log_probs: bool = False,
) -> tuple[torch.Tensor, dict[str, float], TokenOutputs]:
    """The objective of one micro-batch (with gradient), its metrics and the forward's outputs.

    Without stored old log-probs (one on-policy update) pi_old is the detached current policy
    (ratio 1); likewise V_old for the value clip. ``proximal_model`` (decoupled PPO) supplies
    ``prox_logp`` from its own no-grad forward."""
    out = token_outputs(
        model, sub, temperature, with_entropy=track_entropy or algorithm.uses_entropy_bonus,
        entropy_requires_grad=algorithm.uses_entropy_bonus, value_head=value_head, with_log_probs=with_log_probs,
    )
    prox_logp = None
    if proximal_model is not None:
        with torch.no_grad():
            prox_logp, _ = token_logprobs(proximal_model, sub, temperature)
    old_values = sub.old_values
    if old_values is None and out.values is not None:
        old_values = out.values.detach()
    loss, metrics = algorithm.compute_loss(
        logp=out.logp,
        old_logp=sub.old_logp if sub.old_logp is not None else out.logp.detach(),
        advantages=sub.advantages,
        response_mask=sub.response_mask,
        norms=norms,
        ref_logp=sub.ref_logp,
        entropy=out.entropy,
        progress=progress,
        token_weights=sub.token_weights,
        values=out.values,
        old_values=old_values,
        returns=sub.returns,
        prox_logp=prox_logp,
        sampling_logp=sub.sampling_logp,
    )
    if out.entropy is not None:
        tokens = float(sub.response_mask.sum().item())
        metrics["entropy"] = float((out.entropy * sub.response_mask).sum().item() / max(tokens, 1.0))
    return loss, metrics, out


class UpdateMetrics:
    """Averages micro-batch metrics over an update: token means weighted by the micro-batch's
    tokens; losses already normalised by their optimizer batch (ADDITIVE_METRICS) summed per
    optimizer step and averaged over the steps."""

    def __init__(self) -> None:
        self.weighted: dict[str, float] = {}
        self.additive: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for key, value in metrics.items():
            if key in ADDITIVE_METRICS:
                self.additive[key] = self.additive.get(key, 0.0) + value
            else:
                self.weighted[key] = self.weighted.get(key, 0.0) + value * tokens
        self.tokens += tokens

    def result(self, optimizer_steps: int) -> dict[str, float]:
        out = {key: value / max(self.tokens, 1.0) for key, value in self.weighted.items()}
        out.update({key: value / max(optimizer_steps, 1) for key, value in self.additive.items()})
        return out


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    algorithm: Algorithm,
    *,
    micro_batch_size: int,
    max_grad_norm: float | None,
    temperature: float,
    norm_length: int,
    generator: torch.Generator | None = None,
    track_entropy: bool = True,
    progress: float = 0.0,
    value_head: torch.nn.Module | None = None,
    proximal: object | None = None,
) -> dict[str, float]:
    """One batch's worth of optimizer steps: ``epochs`` passes over ``minibatches`` splits.

    Each mini-batch is processed in micro-batches whose gradients accumulate; aggregation uses
    the mini-batch's token and sequence counts, so the accumulated gradient equals the gradient
    of the mini-batch loss computed in one pass. When the batch is used for exactly one on-policy
    update the old log-probs are the detached current ones (ratio 1), and no extra pass is run.
    ``value_head`` (PPO's critic) is trained by the same steps; ``proximal`` (decoupled PPO: has
    ``.model`` and ``.update(model)``) gives prox_logp and follows the weights after every step.
    """
    model.train()
    device = batch.input_ids.device
    parameters = [*model.parameters(), *(value_head.parameters() if value_head is not None else ())]
    metrics_total = UpdateMetrics()
    grad_norms: list[float] = []
    for _ in range(algorithm.epochs):
        order = (
            torch.randperm(batch.size, generator=generator).to(device)
            if algorithm.minibatches > 1
            else torch.arange(batch.size, device=device)
        )
        for minibatch in order.chunk(algorithm.minibatches):
            norms = batch_norms(batch, minibatch, norm_length)
            for rows in micro_batches(minibatch, micro_batch_size):
                sub = batch.select(rows)
                loss, metrics, _ = micro_batch_loss(
                    model, sub, algorithm, norms, temperature, track_entropy=track_entropy, progress=progress,
                    value_head=value_head, proximal_model=proximal.model if proximal is not None else None,
                )
                loss.backward()
                metrics_total.add(metrics, float(sub.response_mask.sum().item()))
            clip = max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else math.inf
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(parameters, clip)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if proximal is not None:
                proximal.update(model)
    result = metrics_total.result(len(grad_norms))
    result["grad_norm"] = sum(grad_norms) / len(grad_norms)
    result["optimizer_steps"] = float(len(grad_norms))
    return result
