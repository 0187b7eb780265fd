"""Helpers shared by the advantage estimators. Conventions every estimator follows:

  * group statistics come from ``group_mean_std`` (mean, unbiased std, 0 for singleton groups);
  * "whitening" is (x - mean) / (std + epsilon) over the valid entries of the whole batch, with
    the unbiased std; a batch whose entries are all equal whitens to 0 (never 0/0);
  * an all-zero mask row (zero-length response) still counts as a response in group statistics
    (it has a reward) but receives no advantage, and it carries no tokens into token statistics;
  * a sequence-level advantage is broadcast with ``_broadcast``; a token-level one goes through
    ``_tokens``. Arithmetic is float64, the output dtype is that of ``_broadcast``.
"""

from __future__ import annotations

import math

import torch



def group_mean_std(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element group statistics.

    For element i in group g with n_g members: mean_g = (1/n_g) sum_j v_j and the unbiased
    std_g = sqrt( sum_j (v_j - mean_g)^2 / (n_g - 1) ) (0 for singleton groups). Returns
    (mean, std, count), each gathered back to shape [B]. Variance is computed from centred
    values, so near-equal rewards (e.g. [1, 1.00001]) keep their exact std.
    """
    group_index = group_index.long()
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    values = values.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, group_index, torch.ones_like(values)
    )
    total = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, group_index, values)
    mean = (total / count.clamp(min=1))[group_index]
    centred_sq = (values - mean) ** 2
    sq_total = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, group_index, centred_sq
    )
    var = sq_total / (count - 1).clamp(min=1)
    std = var.sqrt()[group_index]
    return mean, std, count[group_index]


def group_softmax(logits: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """softmax of ``logits`` within each group, gathered back to shape [B] (float64). The group's
    maximum is subtracted before exp (small temperatures do not overflow); a -inf logit gets weight 0,
    and a group whose logits are all -inf gets 0 everywhere."""
    index = group_index.long()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    logits = logits.to(torch.float64)
    peak = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=logits.device).scatter_reduce(
        0, index, logits, reduce="amax"
    )
    finite = logits > -math.inf
    shifted = torch.where(finite, torch.exp(logits - peak[index]), 0.0)
    total = torch.zeros(num_groups, dtype=torch.float64, device=logits.device).index_add_(0, index, shifted)
    return torch.where(finite, shifted / total[index].clamp(min=1e-300), 0.0)


def _broadcast(sequence_advantage: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return sequence_advantage.to(response_mask.dtype if response_mask.is_floating_point() else torch.float32)[
        :, None
    ] * response_mask


def _valid(response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask > 0


def _tokens(token_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A [B,T] advantage in the output dtype, exactly 0 on padding (also where the input is NaN)."""
    dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    cleaned = torch.where(_valid(response_mask), token_values.to(torch.float64), 0.0)
    return cleaned.to(dtype) * response_mask


def _whiten(values: torch.Tensor, valid: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(x - mean) / (std + epsilon) over the entries where ``valid`` (unbiased std); 0 elsewhere.

    All-equal (or single) valid entries give 0. Works for [B] (responses) and [B,T] (tokens).
    """
    values = values.to(torch.float64).contiguous()
    out = torch.zeros_like(values)
    flat = values[valid]
    if flat.numel() == 0:
        return out
    mean, std, _ = group_mean_std(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))
    out[valid] = torch.where(std > 0, (flat - mean) / (std + epsilon), torch.zeros_like(flat))
    return out


def _last_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] float64 token rewards with r_i on the last valid token of response i (none if empty)."""
    valid = _valid(response_mask)
    batch, length = valid.shape
    positions = torch.arange(length, device=valid.device).expand(batch, length)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(batch, length, dtype=torch.float64, device=valid.device)
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    out[rows, last[rows]] = rewards.to(torch.float64)[rows]
    return out


def _backward_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float | torch.Tensor, lam: float
) -> torch.Tensor:
    """delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1}, backwards over valid tokens.

    ``gamma`` is a number or a [B,T] tensor of per-token discounts (POAD's action-boundary discount).

    Invalid positions (padding, or tool-output tokens inside a multi-turn response) are skipped:
    V_{t+1} and A_{t+1} belong to the next *valid* token, the value after the last valid token is 0
    (terminal), and invalid positions get 0. With V = 0 and lam = 1 this is the discounted
    return-to-go G_t = r_t + gamma G_{t+1}.
    """
    rewards = token_rewards.to(torch.float64)
    values = values.to(torch.float64)
    batch, length = valid.shape
    advantages = torch.zeros(batch, length, dtype=torch.float64, device=valid.device)
    next_value = torch.zeros(batch, dtype=torch.float64, device=valid.device)
    next_advantage = torch.zeros_like(next_value)
    for t in range(length - 1, -1, -1):
        here = valid[:, t]
        discount = gamma[:, t] if isinstance(gamma, torch.Tensor) else gamma
        advantage = rewards[:, t] + discount * next_value - values[:, t] + discount * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_advantage = torch.where(here, advantage, next_advantage)
        next_value = torch.where(here, values[:, t], next_value)
    return advantages


def _token_rewards(
    rewards: torch.Tensor, response_mask: torch.Tensor, token_rewards: torch.Tensor | None
) -> torch.Tensor:
    """The trainer's per-token rewards if given (padding ignored), else the outcome on the last token."""
    if token_rewards is None:
        return _last_token_rewards(rewards, response_mask)
    return torch.where(_valid(response_mask), token_rewards.to(torch.float64), 0.0)


def _return_to_go(
    rewards: torch.Tensor, response_mask: torch.Tensor, token_rewards: torch.Tensor | None, gamma: float
) -> torch.Tensor:
    valid = _valid(response_mask)
    per_token = _token_rewards(rewards, response_mask, token_rewards)
    return _backward_gae(per_token, torch.zeros_like(per_token), valid, gamma, 1.0)
