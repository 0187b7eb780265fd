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


ADDITIVE_METRICS = {"policy_loss", "kl"}


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
    for row, (_, c) in enumerate(flat):
        p, r = len(c.prompt_ids), len(c.response_ids)
        input_ids[row, prompt_width - p : prompt_width] = torch.tensor(c.prompt_ids, dtype=torch.long)
        attention_mask[row, prompt_width - p : prompt_width] = 1
        if r:
            input_ids[row, prompt_width : prompt_width + r] = torch.tensor(c.response_ids, dtype=torch.long)
            attention_mask[row, prompt_width : prompt_width + r] = 1
            response_mask[row, :r] = 1
    group_index = torch.tensor([g for g, _ in flat], dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_mask=response_mask.to(device),
        prompt_width=prompt_width,
        group_index=group_index.to(device),
    )


def autocast_context(device: torch.device | str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; nothing on CPU (float32 there)."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _logits_per_row(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Logits that predict each response token, [B, T, V], one forward over every full row."""
    T = batch.response_mask.shape[1]
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        logits_to_keep=T + 1,
        use_cache=False,
    )
    return out.logits[:, -(T + 1) : -1, :]


def _logits_shared_prompts(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Same logits as :func:`_logits_per_row`, running each distinct prompt only once.

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
    )
    first_logits = prompt_out.logits[row_to_group]  # [B, 1, V]
    if T == 1:
        return first_logits
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
        **{cache_name: cache},
    )
    return torch.cat([first_logits, response_out.logits], dim=1)


def token_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every response token ([B, T]), and optionally the entropy of
    pi(. | q, o_<t). Logits are divided by ``temperature`` (the sampling temperature) so that the
    ratio compares the distribution that was actually sampled from. With ``share_prompts`` each
    distinct prompt is run once (see :func:`_logits_shared_prompts`); the result is the same."""
    T = batch.response_mask.shape[1]
    shared = share_prompts and int(torch.unique(batch.group_index).numel()) < batch.size
    with autocast_context(batch.input_ids.device):
        logits = _logits_shared_prompts(model, batch) if shared else _logits_per_row(model, batch)
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
    return logp, entropy


def _micro_batches(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


@torch.no_grad()
def batch_logprobs(
    model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of the whole batch without gradient ([B, T], zero on padding)."""
    logp_out = torch.zeros_like(batch.response_mask)
    entropy_out = torch.zeros_like(batch.response_mask) if with_entropy else None
    for rows in _micro_batches(torch.arange(batch.size, device=batch.input_ids.device), micro_batch_size):
        sub = batch.select(rows)
        logp, entropy = token_logprobs(model, sub, temperature, with_entropy=with_entropy)
        logp_out[rows, : logp.shape[1]] = logp * sub.response_mask
        if entropy_out is not None:
            entropy_out[rows, : entropy.shape[1]] = entropy * sub.response_mask
    return logp_out, entropy_out


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
) -> dict[str, float]:
    """One batch's worth of optimizer steps: ``epochs`` passes over ``minibatches`` splits.

    Each mini-batch is processed in micro-batches whose gradients accumulate; aggregation uses
    the mini-batch's token and sequence counts, so the accumulated gradient equals the gradient
    of the mini-batch loss computed in one pass. When the batch is used for exactly one on-policy
    update the old log-probs are the detached current ones (ratio 1), and no extra pass is run.
    """
    model.train()
    device = batch.input_ids.device
    sums: dict[str, float] = {}
    additive: dict[str, float] = {}
    weight_total = 0.0
    grad_norms: list[float] = []
    for _ in range(algorithm.epochs):
        order = (
            torch.randperm(batch.size, generator=generator).to(device)
            if algorithm.minibatches > 1
            else torch.arange(batch.size, device=device)
        )
        for minibatch in order.chunk(algorithm.minibatches):
            norms = {
                "batch_tokens": int(batch.response_mask[minibatch].sum().item()),
                "batch_sequences": len(minibatch),
                "norm_length": norm_length,
            }
            for rows in _micro_batches(minibatch, micro_batch_size):
                sub = batch.select(rows)
                want_entropy = track_entropy or algorithm.uses_entropy_bonus
                logp, entropy = token_logprobs(
                    model, sub, temperature, with_entropy=want_entropy,
                    entropy_requires_grad=algorithm.uses_entropy_bonus,
                )
                old_logp = sub.old_logp if sub.old_logp is not None else logp.detach()
                loss, metrics = algorithm.compute_loss(
                    logp=logp,
                    old_logp=old_logp,
                    advantages=sub.advantages,
                    response_mask=sub.response_mask,
                    norms=norms,
                    ref_logp=sub.ref_logp,
                    entropy=entropy,
                    progress=progress,
                    token_weights=sub.token_weights,
                )
                loss.backward()
                tokens = float(sub.response_mask.sum().item())
                if entropy is not None:
                    metrics["entropy"] = float((entropy * sub.response_mask).sum().item() / max(tokens, 1.0))
                for key, value in metrics.items():
                    if key in ADDITIVE_METRICS:  # already normalised by the mini-batch: add up
                        additive[key] = additive.get(key, 0.0) + value
                    else:  # token means of this micro-batch: weight by its tokens
                        sums[key] = sums.get(key, 0.0) + value * tokens
                weight_total += tokens
            if max_grad_norm is not None and max_grad_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            grad_norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result = {key: value / max(weight_total, 1.0) for key, value in sums.items()}
    result.update({key: value / len(grad_norms) for key, value in additive.items()})
    result["grad_norm"] = sum(grad_norms) / len(grad_norms)
    result["optimizer_steps"] = float(len(grad_norms))
    return result
