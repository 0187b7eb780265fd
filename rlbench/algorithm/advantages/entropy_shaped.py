"""Estimators that shape the advantage with the sampling policy's token entropies: EDGE-GRPO,
GTPO and GRPO-S.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _broadcast, _tokens, _valid, group_mean_std
from rlbench.algorithm.advantages.group_relative import _sequence_grpo
from rlbench.algorithm.registry import ADVANTAGES


def _mean_entropy(entropy: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked mean token entropy [B] float64, non-empty [B] bool); the entropy is detached."""
    valid = _valid(response_mask)
    lengths = valid.sum(dim=1)
    total = torch.where(valid, entropy.detach().to(torch.float64), 0.0).sum(dim=1)
    return total / lengths.clamp(min=1), lengths > 0


@ADVANTAGES.register("edge_grpo")
def edge_grpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    epsilon: float = 1e-4,
    entropy_floor: float = 1e-6,
) -> torch.Tensor:
    """EDGE-GRPO entropy-driven advantage (Zhang et al. 2025, "EDGE-GRPO: Entropy-Driven GRPO with
    Guided Error Correction for Advantage Diversity", arXiv:2507.21848).

        A_i = [(r_i - mean_g(r)) / (std_g(r) + epsilon)] / (H_i / H_batch)

    H_i is the masked mean token entropy of response i (detached; floored at entropy_floor) and
    H_batch the mean of H_i over the non-empty responses of the batch. Confident (low-entropy)
    responses get larger |A|: confident-correct gain, confident-wrong are punished harder. Equal
    entropies give ``grpo``. Empty responses get 0. (The Guided Error Correction half of the paper
    is a rollout change, not an advantage.)
    """
    base = _sequence_grpo(rewards, group_index, epsilon)
    mean_entropy, nonempty = _mean_entropy(entropy, response_mask)
    batch_entropy = mean_entropy[nonempty].mean() if bool(nonempty.any()) else mean_entropy.new_tensor(0.0)
    advantage = torch.where(nonempty, base * batch_entropy / mean_entropy.clamp(min=entropy_floor), 0.0)
    return _broadcast(advantage.float(), response_mask)


def _entropy_shaped_rewards(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    entropy: torch.Tensor,
    alive: torch.Tensor,
    outcome_weight: float,
    success_threshold: float,
    entropy_floor: float,
) -> torch.Tensor:
    """GTPO / GRPO-S shaped rewards over K columns (K = T tokens, or 1 mean entropy per response).

    For each group g and column k, O+ (r_i > success_threshold) and O- (the rest), restricted to
    entries alive at k, and d_k = the number of alive members of the same set:
        share+_{i,k} = H_{i,k} / sum_{j in O+} H_{j,k} * d_k
        share-_{i,k} = (1/H_{i,k}) / sum_{j in O-} (1/H_{j,k}) * d_k
        r~+ = w r_i + (1 - w) share+,      r~- = -w - (1 - w) share-          (w = outcome_weight)
    Entries not alive get share 1 (neutral). Uniform entropies give share 1 everywhere, i.e.
    r~+ = w r_i + 1 - w and r~- = -1.
    """
    index = group_index.long()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    entropy = entropy.detach().to(torch.float64).clamp(min=entropy_floor)
    values = rewards.to(torch.float64)[:, None].expand_as(entropy)
    success = values > success_threshold
    score = torch.where(success, entropy, 1.0 / entropy)
    shares = torch.ones_like(entropy)
    for members in (success & alive, ~success & alive):
        weight = members.to(torch.float64)
        zeros = torch.zeros(num_groups, entropy.shape[1], dtype=torch.float64, device=entropy.device)
        total = zeros.index_add(0, index, score * weight)[index]
        alive_count = zeros.index_add(0, index, weight)[index]
        share = score * alive_count / torch.where(total > 0, total, torch.ones_like(total))
        shares = torch.where(members, share, shares)
    bonus = (1.0 - outcome_weight) * shares
    return torch.where(success, outcome_weight * values + bonus, -outcome_weight - bonus)


@ADVANTAGES.register("gtpo", advantage_level="token")
def gtpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    outcome_weight: float = 0.5,
    success_threshold: float = 0.5,
    epsilon: float = 1e-6,
    entropy_floor: float = 1e-6,
) -> torch.Tensor:
    """GTPO token-level entropy-weighted rewards (Tan et al. 2025, "GTPO and GRPO-S: Token and
    Sequence-Level Reward Shaping with Policy Entropy", arXiv:2508.04349).

        correct i (r_i > success_threshold), token t:
            r~_{i,t} = a1 r_i + a2 * H_{i,t} / sum_{k in O+, alive at t} H_{k,t} * d_t
        wrong i:
            r~_{i,t} = -a1 - a2 * (1/H_{i,t}) / sum_{k in O-, alive at t} (1/H_{k,t}) * d_t
        A_{i,t} = (r~_{i,t} - mean_g(r~)) / (std_g(r~) + epsilon)

    a1 = outcome_weight, a2 = 1 - a1; d_t = the number of responses of the same set and group that
    are alive (valid) at position t; the entropy is detached and floored at entropy_floor. mean_g
    and std_g (unbiased) run over all valid tokens of the group's responses. High-entropy tokens of
    correct responses gain most; low-entropy tokens of wrong responses lose most. Uniform entropies
    give r~ = a1 r + a2 for correct and -1 for wrong tokens, hence GRPO's sign pattern. Empty
    responses have no tokens and so do not enter the statistics (unlike GRPO's, where they count).
    Needs a token-level policy loss (not GSPO).
    """
    valid = _valid(response_mask)
    shaped = _entropy_shaped_rewards(
        rewards, group_index, entropy, valid, outcome_weight, success_threshold, entropy_floor
    )
    token_groups = group_index.long()[:, None].expand(valid.shape)[valid]
    flat = shaped[valid]
    advantage = torch.zeros_like(shaped)
    if flat.numel():
        mean, std, _ = group_mean_std(flat, token_groups)
        advantage[valid] = torch.where(std > 0, (flat - mean) / (std + epsilon), torch.zeros_like(flat))
    return _tokens(advantage, response_mask)


@ADVANTAGES.register("grpo_s")
def grpo_s_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    outcome_weight: float = 0.5,
    success_threshold: float = 0.5,
    epsilon: float = 1e-6,
    entropy_floor: float = 1e-6,
) -> torch.Tensor:
    """GRPO-S sequence-level entropy-weighted rewards (Tan et al. 2025, "GTPO and GRPO-S: Token and
    Sequence-Level Reward Shaping with Policy Entropy", arXiv:2508.04349).

        correct i:  r^_i = b1 r_i + b2 * H_i / sum_{k in O+} H_k * |O+|
        wrong i:    r^_i = -b1 - b2 * (1/H_i) / sum_{k in O-} (1/H_k) * |O-|
        A_i = (r^_i - mean_g(r^)) / (std_g(r^) + epsilon)       (GRPO on r^)

    b1 = outcome_weight, b2 = 1 - b1; H_i is the masked mean token entropy (detached, floored);
    O+/O- are taken within the group, excluding empty responses (which get the neutral share 1).
    Uniform entropies with 0/1 rewards give r^ = 2r - 1, i.e. ``grpo`` (exactly when epsilon=0).
    """
    mean_entropy, nonempty = _mean_entropy(entropy, response_mask)
    shaped = _entropy_shaped_rewards(
        rewards, group_index, mean_entropy[:, None], nonempty[:, None], outcome_weight, success_threshold, entropy_floor
    )[:, 0]
    return _broadcast(_sequence_grpo(shaped, group_index, epsilon).float(), response_mask)
