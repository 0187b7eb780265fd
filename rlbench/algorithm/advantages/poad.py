"""POAD's boundary-aware token-level GAE (BAD) for multi-turn episodes (rollout=multi_turn).

Reads, per response token, the action (turn) it belongs to: ``step_index`` [B,T] long, the turn
(0, 1, ...) of every policy token, -1 on observation tokens and padding (rlbench/algorithm/step_inputs.py).
"""

from __future__ import annotations

import itertools

import torch

from rlbench.algorithm.advantages.common import (
    _backward_gae,
    _token_rewards,
    _tokens,
    _valid,
    _whiten,
)
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


def action_boundary_discounts(step_index: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-token discount of BAD (Wen et al. 2024, arXiv:2405.15821, section 4.2): 1 between two tokens of
    the same action (gamma_intra = 1), ``gamma`` after an action's last token (the next valid token starts
    another action, or the episode ends). [B,T] float64."""
    valid = _valid(response_mask) & (step_index >= 0)
    discounts = torch.full(step_index.shape, float(gamma), dtype=torch.float64, device=step_index.device)
    for row in range(step_index.shape[0]):
        positions = torch.nonzero(valid[row]).flatten().tolist()
        for here, after in itertools.pairwise(positions):
            if int(step_index[row, here]) == int(step_index[row, after]):
                discounts[row, here] = 1.0
    return discounts


def _bad(rewards, values, response_mask, step_index, token_rewards, gamma, lam) -> torch.Tensor:
    if not 0.0 <= float(gamma) <= 1.0:
        raise ConfigError(f"algorithm.advantage.gamma must lie in [0, 1], got {gamma}")
    valid = _valid(response_mask) & (step_index >= 0)
    per_token = _token_rewards(rewards, response_mask, token_rewards)
    return _backward_gae(per_token, values, valid, action_boundary_discounts(step_index, response_mask, gamma), lam)


@ADVANTAGES.register("poad", advantage_level="token")
def poad_advantage(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    step_index: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 0.95,
    lam: float = 0.95,
    whiten: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """Policy Optimization with Action Decomposition (Wen et al. 2024, "Reinforcing LLM Agents via Policy
    Optimization with Action Decomposition", arXiv:2405.15821, section 4.2, Bellman backup with Action
    Decomposition, BAD): token-level GAE whose discount and reward respect the action (turn) boundaries.

    For token j of action t with next valid token j' (observation tokens are skipped):

        inside the action (j' in action t):   delta_j = V_{j'} - V_j                 A_j = delta_j + lam A_{j'}
        action's last token (j' in t+1):      delta_j = r_t + gamma V_{j'} - V_j     A_j = delta_j + gamma lam A_{j'}

    i.e. gamma_intra = 1 and no reward inside an action; the environment reward r_t and the
    inter-action discount gamma apply at the action's last token (r = token_rewards, or the outcome on
    the last valid token). Every token its own action gives standard GAE; one action per episode gives
    GAE with gamma = 1. Optionally whitened over the valid tokens; the critic's target is ``poad_returns``.
    """
    advantages = _bad(rewards, values, response_mask, step_index, token_rewards, gamma, lam)
    if whiten:
        advantages = _whiten(advantages, _valid(response_mask) & (step_index >= 0), epsilon)
    return _tokens(advantages, response_mask)


def poad_returns(rewards, values, response_mask, step_index, token_rewards=None, gamma: float = 0.95,
                 lam: float = 0.95) -> torch.Tensor:
    """Value target of BAD (arXiv:2405.15821, section 4.2): R_j = A_j + V_j with the un-whitened
    boundary-aware advantage; 0 on padding and observation tokens."""
    advantages = _bad(rewards, values, response_mask, step_index, token_rewards, gamma, lam)
    return _tokens(advantages + values.to(torch.float64), response_mask)
