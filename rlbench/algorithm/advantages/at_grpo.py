"""AT-GRPO's agent- and turn-wise grouped advantage for multi-turn, multi-role episodes (rollout=multi_turn).

Reads the per-token turn index and turn reward that rollout=multi_turn records (rlbench/algorithm/step_inputs.py):

    step_index    [B,T] long     the turn (0, 1, ...) of every policy token, -1 on observation tokens and padding
    turn_rewards  [B,T] float64  the reward of the role that acted in the token's turn
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _tokens
from rlbench.algorithm.advantages.gigpo import (
    anchor_advantages,
    spread_over_turns,
    turn_table,
)
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


@ADVANTAGES.register("at_grpo", advantage_level="token")
def at_grpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    step_index: torch.Tensor,
    turn_rewards: torch.Tensor,
    num_roles: int = 2,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Agent- and Turn-wise GRPO (Zhao et al. 2025, "Stronger Together: On-Policy RL for Collaborative
    LLMs", arXiv:2510.11062, section 3): GRPO's normalisation applied within each group key
    (prompt group, turn, agent role):

        A_{i,t} = (r^{role(t)}_{i,t} - mean_{j in K(g,t,role)} r_{j,t}) / std_{j in K(g,t,role)} r_{j,t}

    with r_{i,t} the reward of the role that acted in turn t of episode i (``turn_rewards``) and the same
    unbiased std and epsilon as :func:`grpo_advantage` (``scale_by_std`` False: the mean only). Roles take
    turns in a fixed order, role(t) = t mod ``num_roles`` (proposer on even turns, verifier on odd ones in
    env=proposer_verifier), so the key is written out in full even though the turn fixes the role.
    Every token of turn t gets A_{i,t}; observation tokens (step_index -1) get 0. With one role and one
    turn whose reward is the episode reward this is GRPO exactly.

    The candidates of a key share a state under the paper's greedy tree rollout (rollout.multi_turn.branch=
    greedy_tree, the preset's): each turn's K candidates fork from the best of the turn before. Not built
    (see conf/paper/at_grpo.yaml): per-role LoRA adapters and the team reward mixing.
    """
    if int(num_roles) < 1:
        raise ConfigError(f"algorithm.advantage.num_roles must be >= 1, got {num_roles}")
    table = turn_table(step_index.cpu(), step_index.cpu(), turn_rewards.cpu(), response_mask.cpu())
    keys, values, places = [], [], []
    groups = group_index.tolist()
    for row, turns in enumerate(table):
        for turn, _, reward in turns:
            keys.append((groups[row], turn, turn % int(num_roles)))
            values.append(reward)
            places.append((row, turn))
    out = spread_over_turns(places, anchor_advantages(keys, values, epsilon, scale_by_std), step_index.cpu())
    return _tokens(out.to(response_mask.device), response_mask)
