"""GiGPO's two-level advantage for multi-turn episodes (rollout=multi_turn, rlbench/rollout/strategies/multi_turn.py).

Reads, per response token, the turn it belongs to, the state that turn's action was taken in and the
turn's reward (the step inputs rollout=multi_turn puts in Completion.extras; rlbench/algorithm/step_inputs.py):

    step_index    [B,T] long     the turn (0, 1, ...) of every policy token, -1 on observation tokens and padding
    turn_states   [B,T] long     an id of the state the token's turn acted in (equal ids: the same state)
    turn_rewards  [B,T] float64  the environment's reward of the token's turn
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _tokens
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


def turn_table(step_index: torch.Tensor, turn_states: torch.Tensor, turn_rewards: torch.Tensor,
               response_mask: torch.Tensor) -> list[list[tuple[int, int, float]]]:
    """Per response, its turns in order: (turn, state id, reward), read at each turn's first trained token."""
    table = []
    valid = (response_mask > 0) & (step_index >= 0)
    for row in range(step_index.shape[0]):
        turns: dict[int, tuple[int, int, float]] = {}
        for position in valid[row].nonzero(as_tuple=True)[0].tolist():
            turn = int(step_index[row, position])
            turns.setdefault(turn, (turn, int(turn_states[row, position]), float(turn_rewards[row, position])))
        table.append([turns[t] for t in sorted(turns)])
    return table


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """R_t = sum_{k >= t} gamma^(k - t) r_k for each turn t."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def anchor_advantages(keys: list[tuple[int, int]], returns: list[float], epsilon: float, scale_by_std: bool) -> torch.Tensor:
    """A^S of each step: GRPO's normalisation (:func:`grpo_advantage`) of the step returns within anchor
    groups, the steps with the same key (group, state): its return minus their mean, divided by their
    unbiased std (``scale_by_std``); an all-equal anchor group gives 0, and so does a step alone in its own."""
    if not keys:
        return torch.zeros(0, dtype=torch.float64)
    anchors: dict[tuple[int, int], int] = {}
    anchor_index = torch.tensor([anchors.setdefault(key, len(anchors)) for key in keys], dtype=torch.long)
    values = torch.tensor(returns, dtype=torch.float64)
    one_token = torch.ones(len(keys), 1, dtype=torch.float64)
    return grpo_advantage(values, anchor_index, one_token, epsilon=epsilon, scale_by_std=scale_by_std)[:, 0]


def spread_over_turns(places: list[tuple[int, int]], values: torch.Tensor, step_index: torch.Tensor) -> torch.Tensor:
    """[B,T] float64: every token of turn ``turn`` of response ``row`` gets the value of its (row, turn) place."""
    out = torch.zeros(step_index.shape, dtype=torch.float64)
    for (row, turn), value in zip(places, values.tolist()):
        out[row][step_index[row] == turn] = value
    return out


@ADVANTAGES.register("gigpo", advantage_level="token")
def gigpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    step_index: torch.Tensor,
    turn_states: torch.Tensor,
    turn_rewards: torch.Tensor,
    omega: float = 1.0,
    gamma: float = 0.95,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Group-in-Group Policy Optimization (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM
    Agent Training", arXiv:2505.10978, section 3): an episode-level and a step-level group advantage.

    Episode level (section 3.1): GRPO over the group's episodes, A^E(tau_i) = (R(tau_i) - mean_j R(tau_j))
    / std_j R(tau_j) (``scale_by_std``; without it the mean only), with R the episode's reward
    (``rewards``, after reward shaping) -- exactly :func:`grpo_advantage`.

    Step level (section 3.2): the turns of all episodes of a group are grouped by the exact state their
    action was taken in (anchor states, ``turn_states``); each turn's discounted return
    R_t = sum_{k >= t} gamma^(k - t) r_k (``turn_rewards``; the paper's gamma 0.95) is normalised within
    its anchor group the same way, A^S = (R_t - mean) / std; a turn alone in its anchor group has A^S = 0.

    Every token of turn t of episode i gets A = A^E(tau_i) + omega * A^S(turn t) (eq. 7, omega = 1).
    omega = 0 is GRPO; with no state repeated within a group every A^S is 0 and GiGPO is GRPO too.
    Observation tokens (step_index -1) are masked out of the loss and get 0.
    """
    if not 0.0 <= float(gamma) <= 1.0:
        raise ConfigError(f"algorithm.advantage.gamma must lie in [0, 1], got {gamma}")
    episode = grpo_advantage(rewards, group_index, response_mask, epsilon=epsilon, scale_by_std=scale_by_std)
    table = turn_table(step_index.cpu(), turn_states.cpu(), turn_rewards.cpu(), response_mask.cpu())
    keys, returns, places = [], [], []
    groups = group_index.tolist()
    for row, turns in enumerate(table):
        for (turn, state, _), value in zip(turns, discounted_returns([r for _, _, r in turns], float(gamma))):
            keys.append((groups[row], state))
            returns.append(value)
            places.append((row, turn))
    step = spread_over_turns(places, anchor_advantages(keys, returns, epsilon, scale_by_std), step_index.cpu())
    out = episode.to(torch.float64) + float(omega) * step.to(response_mask.device)
    return _tokens(out, response_mask)
