"""AT-GRPO's agent- and turn-wise grouped advantage for multi-turn, multi-role episodes (rollout=multi_turn).

Reads the per-token turn index and turn reward that rollout=multi_turn records (rlbench/algorithm/step_inputs.py):

    step_index    [B,T] long     the turn (0, 1, ...) of every policy token, -1 on observation tokens and padding
    turn_rewards  [B,T] float64  the reward of the role that acted in the token's turn
    correct       [B] bool       the grader's verdict on each response: the team's outcome (the team reward)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlbench.algorithm.advantages.common import _tokens
from rlbench.algorithm.advantages.gigpo import (
    anchor_advantages,
    spread_over_turns,
    turn_table,
)
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


def team_mixed_rewards(turn_rewards: torch.Tensor, team_rewards: torch.Tensor, alpha: float) -> torch.Tensor:
    """AT-GRPO's reward mixing (Zhao et al. 2025, arXiv:2510.11062, section 3): the reward of the role that
    acted in turn t of episode i is its own (local) reward plus alpha times the team's:

        r_{i,t} = r^loc_{i,t} + alpha * r^team_i

    ``turn_rewards`` [B,T] are the local rewards r^loc (per token, the turn's), ``team_rewards`` [B] the team's
    outcome r^team of each episode; every token of row i gets alpha * r^team_i added. alpha = 0 returns
    ``turn_rewards`` unchanged (the same tensor)."""
    if alpha == 0:
        return turn_rewards
    return turn_rewards + float(alpha) * team_rewards.to(turn_rewards.dtype).to(turn_rewards.device)[:, None]


def _check_params(params: dict[str, Any]) -> None:
    if int(params["num_roles"]) < 1:
        raise ConfigError(f"algorithm.advantage.num_roles must be >= 1, got {params['num_roles']}")
    alpha = float(params["alpha"])
    if not math.isfinite(alpha) or alpha < 0:
        raise ConfigError(f"algorithm.advantage.alpha (the team reward's weight) must be a finite number >= 0, got {alpha}")


@ADVANTAGES.register("at_grpo", advantage_level="token", check_params=_check_params)
def at_grpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    step_index: torch.Tensor,
    turn_rewards: torch.Tensor,
    correct: torch.Tensor | None = None,
    num_roles: int = 2,
    alpha: float = 0.0,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Agent- and Turn-wise GRPO (Zhao et al. 2025, "Stronger Together: On-Policy RL for Collaborative
    LLMs", arXiv:2510.11062, section 3): GRPO's normalisation applied within each group key
    (prompt group, turn, agent role):

        A_{i,t} = (r_{i,t} - mean_{j in K(g,t,role)} r_{j,t}) / std_{j in K(g,t,role)} r_{j,t}

    with r_{i,t} = r^loc_{i,t} + alpha * r^team_i (:func:`team_mixed_rewards`): r^loc the reward of the role
    that acted in turn t of episode i (``turn_rewards``), r^team_i the team's outcome, the grader's verdict on
    the episode (``correct``, 1 or 0; env=proposer_verifier: the last proposal is right). alpha = 0 (the
    function's default) is each role's own reward alone. The same unbiased std and epsilon as
    :func:`grpo_advantage` (``scale_by_std`` False: the mean only). Roles take turns in a fixed order,
    role(t) = t mod ``num_roles`` (proposer on even turns, verifier on odd ones in env=proposer_verifier), so
    the key is written out in full even though the turn fixes the role. Every token of turn t gets A_{i,t};
    observation tokens (step_index -1) get 0. With one role and one turn this is GRPO on the mixed reward
    (GRPO exactly when alpha = 0 and the turn's reward is the episode's).

    The candidates of a key share a state under the paper's greedy tree rollout (rollout.multi_turn.branch=
    greedy_tree, the preset's): each turn's K candidates fork from the best of the turn before, and each
    candidate's ``correct`` is the team's outcome after its own turn. Per-role policies: model.lora.per_role
    (an adapter per role, rlbench/model/lora.py); per-role full models are not built.
    """
    _check_params({"num_roles": num_roles, "alpha": alpha})
    if alpha != 0 and correct is None:
        raise ValueError("at_grpo with alpha != 0 reads the team's outcome (correct), which was not given")
    mixed = team_mixed_rewards(turn_rewards, correct, alpha)
    table = turn_table(step_index.cpu(), step_index.cpu(), mixed.cpu(), response_mask.cpu())
    keys, values, places = [], [], []
    groups = group_index.tolist()
    for row, turns in enumerate(table):
        for turn, _, reward in turns:
            keys.append((groups[row], turn, turn % int(num_roles)))
            values.append(reward)
            places.append((row, turn))
    out = spread_over_turns(places, anchor_advantages(keys, values, epsilon, scale_by_std), step_index.cpu())
    return _tokens(out.to(response_mask.device), response_mask)
