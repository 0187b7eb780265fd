"""Tree-OPO's Staged Advantage Estimation (SAE; Huang, Nguyen & Zimmer 2025, arXiv:2509.09284, section 4) for
the groups of ``rollout=mcts_prefix`` (rlbench/rollout/strategies/mcts_prefix.py), whose group holds a
prompt's completions of prefixes of one teacher solution revealed to several depths (stages).

Reads ``prefix_stage`` [B,T] long: the depth (revealed segments) of the prefix each response completes, on every
token of the response, -1 on padding (a step input of rollout=mcts_prefix; rlbench/algorithm/step_inputs.py).
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _broadcast, group_mean_std
from rlbench.algorithm.registry import ADVANTAGES


def ordered_means(means: list[float], weights: list[float]) -> list[float]:
    """The weighted L2 projection of ``means`` (stages in increasing depth) onto the non-decreasing sequences:
    argmin_b sum_d w_d (b_d - m_d)^2 subject to b_1 <= b_2 <= ... (pool-adjacent-violators: a pair of
    neighbours out of order is replaced by its weighted mean, repeatedly)."""
    blocks: list[list[float]] = []  # [weighted mean, weight, stages]
    for mean, weight in zip(means, weights):
        blocks.append([mean, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, c1), (m2, w2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(w1 * m1 + w2 * m2) / (w1 + w2), w1 + w2, c1 + c2]
    return [mean for mean, _, count in blocks for _ in range(count)]


def response_stages(prefix_stage: torch.Tensor) -> torch.Tensor:
    """[B] long: each response's stage, read from ``prefix_stage`` (the same on every token of a response; -1 for
    a row without tokens)."""
    stage = prefix_stage.long()
    rows = stage.max(dim=1).values
    if bool((torch.where(stage >= 0, stage, rows[:, None]) != rows[:, None]).any()):
        raise ValueError("prefix_stage varies along a response: a response completes one prefix")
    return rows


@ADVANTAGES.register("sae")
def sae_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    prefix_stage: torch.Tensor,
    response_mask: torch.Tensor,
    ordered: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Staged Advantage Estimation (Tree-OPO, Huang, Nguyen & Zimmer 2025, arXiv:2509.09284, section 4: "projecting
    rewards onto a constraint set that respects the tree's hierarchy"). A prompt g's group holds completions of
    the prefixes p_d of one teacher solution at stages (depths) d; S_{g,d} are those of stage d, n_{g,d} their
    number and m_{g,d} their mean reward. The baselines are the stage means projected onto the tree's order
    (a deeper prefix of the solution is not worth less than a shallower one: V(p_d) <= V(p_{d+1})):

        b_g = argmin_b sum_d n_{g,d} (b_d - m_{g,d})^2   s.t.  b_d <= b_{d'} for d < d'   (ordered=true;
                                                              ordered=false: b_{g,d} = m_{g,d})
        sigma_g^2 = sum_d sum_{i in S_{g,d}} (r_i - m_{g,d})^2 / (N_g - D_g)      (pooled within-stage variance)
        A_i = (r_i - b_{g,d(i)}) / (sigma_g + epsilon)

    N_g, D_g: the group's responses and stages. The baseline is keyed by (prompt, prefix), so a deep prefix's
    high success rate is not compared with the prompt alone's; the scale is pooled over the prompt's stages, so
    a stage whose rewards are all equal (a saturated deep prefix) still gets a finite advantage. A group with
    sigma_g = 0 (or N_g = D_g) gets A = 0. With one stage it is GRPO's advantage exactly (b = the group mean,
    sigma = its unbiased std). The ordered projection (pool-adjacent-violators, :func:`ordered_means`) stands
    in for the paper's quadratic program, whose constraint set was not read here (the abstract only); the
    pooled scale is this project's choice.
    """
    stages, groups = response_stages(prefix_stage), group_index.long()
    pairs, keys = torch.unique(torch.stack([groups, stages], 1), dim=0, return_inverse=True)  # one key per (prompt, prefix)
    mean, _, _ = group_mean_std(rewards, keys)
    values = rewards.to(torch.float64)
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    within = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, groups, (values - mean) ** 2)
    count = torch.bincount(groups, minlength=num_groups).to(torch.float64)
    stage_count = torch.bincount(pairs[:, 0], minlength=num_groups).to(torch.float64)
    sigma = (within / (count - stage_count).clamp(min=1)).sqrt()[groups]
    baseline = mean.clone()
    if ordered:  # pairs are sorted by (prompt, stage): each prompt's stages in increasing depth
        key_mean = torch.zeros(len(pairs), dtype=torch.float64, device=values.device).index_add_(0, keys, values)
        key_count = torch.bincount(keys, minlength=len(pairs)).to(torch.float64)
        projected = key_mean / key_count
        for g in pairs[:, 0].unique().tolist():
            of_g = (pairs[:, 0] == g).nonzero().flatten()
            projected[of_g] = torch.tensor(ordered_means((projected[of_g]).tolist(), key_count[of_g].tolist()), dtype=torch.float64)
        baseline = projected[keys]
    advantage = torch.where(sigma > 0, (values - baseline) / (sigma + epsilon), torch.zeros_like(values))
    return _broadcast(advantage.float(), response_mask)

