"""Advantage estimators: rewards of a batch of responses -> per-token advantages.

Inputs offered by the trainer (a function declares the ones it needs):
    rewards        [B]    scalar outcome reward of each response
    group_index    [B]    long, responses sharing a prompt share an index (0..G-1)
    response_mask  [B,T]  1 on response tokens, 0 on padding
Every estimator returns advantages of shape [B,T], zero on padding.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.registry import ADVANTAGES


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


def _broadcast(sequence_advantage: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return sequence_advantage.to(response_mask.dtype if response_mask.is_floating_point() else torch.float32)[
        :, None
    ] * response_mask


@ADVANTAGES.register("grpo")
def grpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Group-relative advantage of GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3).

        A_i = (r_i - mean_g(r)) / (std_g(r) + epsilon)      (scale_by_std=True)
        A_i =  r_i - mean_g(r)                               (scale_by_std=False: Dr.GRPO)

    std is the unbiased group std. Groups of one response, and groups whose rewards are all equal,
    carry no relative information and get A = 0. The advantage is broadcast to every response token.
    """
    mean, std, count = group_mean_std(rewards, group_index)
    centred = rewards.to(torch.float64) - mean
    if scale_by_std:  # all-equal groups have centred == 0: keep them 0 even when epsilon == 0
        advantage = torch.where(std > 0, centred / (std + epsilon), torch.zeros_like(centred))
    else:
        advantage = centred
    advantage = torch.where(count > 1, advantage, torch.zeros_like(advantage))
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantage(rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

        A_i = r_i - mean_g(r)

    The std division of GRPO is dropped because it up-weights prompts that are too easy or too hard
    (question-level difficulty bias). Singleton groups get A = 0.
    """
    return grpo_advantage(rewards, group_index, response_mask, scale_by_std=False)
