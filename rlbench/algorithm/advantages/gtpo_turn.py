"""GTPO's return-based turn advantage for multi-turn tool-integrated episodes (rollout=multi_turn).

Not the entropy-shaped GTPO of arXiv:2508.04349 (``algorithm/advantage=gtpo``): this is Group *Turn* Policy
Optimization. Reads the per-token turn index and turn reward that rollout=multi_turn records
(rlbench/algorithm/step_inputs.py):

    step_index    [B,T] long     the turn (0, 1, ...) of every policy token, -1 on observation tokens and padding
    turn_rewards  [B,T] float64  the environment's reward of the token's turn
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _tokens
from rlbench.algorithm.advantages.gigpo import (
    anchor_advantages,
    discounted_returns,
    spread_over_turns,
    turn_table,
)
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError

#: Which returns a turn's return is normalised against: all turns of its group, or the group's turns of its index.
NORMALIZE = ("group", "turn")


@ADVANTAGES.register("gtpo_turn", advantage_level="token")
def gtpo_turn_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    step_index: torch.Tensor,
    turn_rewards: torch.Tensor,
    gamma: float = 0.95,
    normalize: str = "group",
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Group Turn Policy Optimization (Ding et al. 2025, "Empowering Multi-Turn Tool-Integrated Reasoning
    with Group Turn Policy Optimization", arXiv:2511.14846, section 3): turn-level rewards, discounted
    returns, and the returns normalised within the group as advantages.

    Turn rewards r_{i,k}: the environment's reward of turn k of episode i (``turn_rewards``; python_tool:
    the final answer's correctness on the last turn, 0 on tool turns). Reward shaping (GTPO's code
    similarity, ``gtpo_code_similarity``) changes the episode reward ``rewards``; the difference
    ``rewards_i - sum_k r_{i,k}`` is credited to the episode's last turn, so with gamma = 1 the return of the
    first turn is the shaped episode reward.

        G_{i,k} = sum_{k' >= k} gamma^(k' - k) r_{i,k'}                   (discounted return of turn k)
        A_{i,k} = (G_{i,k} - mean G) / (std G + epsilon)                 (GRPO's normalisation)

    the mean and the unbiased std over the returns of every turn of the group's episodes
    (``normalize="group"``, pooled) or over the group's turns with the same index k (``"turn"``); which of
    the two the paper uses, and its gamma, are unverified here (the default is pooled, gamma 0.95 as GiGPO's).
    Every token of turn k gets A_{i,k}; observation tokens (step_index -1) get 0. ``scale_by_std`` False:
    the mean only. One turn per episode with gamma = 1 is GRPO exactly (the same normalisation code:
    gigpo's :func:`anchor_advantages`, i.e. :func:`grpo_advantage`).
    """
    if not 0.0 <= float(gamma) <= 1.0:
        raise ConfigError(f"algorithm.advantage.gamma must lie in [0, 1], got {gamma}")
    if normalize not in NORMALIZE:
        raise ConfigError(f"algorithm.advantage.normalize must be one of {NORMALIZE}, got {normalize!r}")
    table = turn_table(step_index.cpu(), step_index.cpu(), turn_rewards.cpu(), response_mask.cpu())
    keys, returns, places = [], [], []
    groups, totals = group_index.tolist(), rewards.tolist()
    for row, turns in enumerate(table):
        if not turns:
            continue
        turn_reward = [r for _, _, r in turns]
        turn_reward[-1] = totals[row] - sum(turn_reward[:-1])  # the last turn's reward plus the shaping's part
        for (turn, _, _), value in zip(turns, discounted_returns(turn_reward, float(gamma))):
            keys.append((groups[row], turn if normalize == "turn" else -1))
            returns.append(value)
            places.append((row, turn))
    out = spread_over_turns(places, anchor_advantages(keys, returns, epsilon, scale_by_std), step_index.cpu())
    return _tokens(out.to(response_mask.device), response_mask)
