"""GiGPO's advantage (rlbench/algorithm/advantages/gigpo.py; arXiv:2505.10978, section 3): closed-form checks."""

from __future__ import annotations

import pytest
import torch

from rlbench.algorithm.advantages.gigpo import discounted_returns, gigpo_advantage
from rlbench.algorithm.advantages.group_relative import grpo_advantage

MODEL, OBSERVATION = 1, 0


def episodes(specs, width):
    """Tensors of a batch of episodes. ``specs``: per response a list of turns (state, reward, policy tokens,
    observation tokens after the turn); returns (response_mask, step_index, turn_states, turn_rewards)."""
    mask = torch.zeros(len(specs), width)
    step = torch.full((len(specs), width), -1, dtype=torch.long)
    states = torch.full((len(specs), width), -1, dtype=torch.long)
    rewards = torch.zeros(len(specs), width, dtype=torch.float64)
    for row, turns in enumerate(specs):
        at = 0
        for turn, (state, reward, policy, observed) in enumerate(turns):
            mask[row, at : at + policy] = 1
            step[row, at : at + policy] = turn
            states[row, at : at + policy] = state
            rewards[row, at : at + policy] = reward
            at += policy + observed
    return mask, step, states, rewards


def test_discounted_returns():
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([1.0, 2.0], 1.0) == [3.0, 2.0]


def test_hand_computed_anchor_example():
    # one group of 3 episodes; all start in state 7; episodes 0 and 1 both pass through state 8 at turn 1
    specs = [
        [(7, 0.0, 2, 1), (8, 0.0, 1, 1), (9, 1.0, 1, 0)],   # return 1
        [(7, 0.0, 1, 1), (8, 0.0, 2, 0)],                   # return 0 (ran out of turns)
        [(7, 0.0, 1, 1), (5, 0.0, 1, 0)],                   # return 0
    ]
    mask, step, states, turn_rewards = episodes(specs, 9)
    rewards = torch.tensor([1.0, 0.0, 0.0])
    group = torch.tensor([0, 0, 0])
    gamma, eps = 0.5, 0.0
    adv = gigpo_advantage(rewards, group, mask, step, states, turn_rewards, omega=1.0, gamma=gamma, epsilon=eps)
    # episode level: GRPO, mean 1/3, unbiased std sqrt(1/3)
    std = (1 / 3) ** 0.5
    a_e = [(1 - 1 / 3) / std, -(1 / 3) / std, -(1 / 3) / std]
    # step level: state 7 holds the three first turns with returns 0.25, 0, 0 -> GRPO-normalised within them
    r7 = torch.tensor([0.25, 0.0, 0.0], dtype=torch.float64)
    a7 = ((r7 - r7.mean()) / r7.std()).tolist()
    # state 8 holds episode 0's turn 1 (return 0.5) and episode 1's turn 1 (return 0): +-1/sqrt(2)
    a8 = 2 ** -0.5  # (0.5 - 0.25) / std([0.5, 0]) = 0.25 / (0.5 / sqrt(2))
    expected = torch.zeros(3, 9, dtype=torch.float64)
    expected[0, 0:2] = a_e[0] + a7[0]
    expected[0, 3:4] = a_e[0] + a8
    expected[0, 5:6] = a_e[0] + 0.0  # state 9 only once: A^S = 0
    expected[1, 0:1] = a_e[1] + a7[1]
    expected[1, 2:4] = a_e[1] - a8
    expected[2, 0:1] = a_e[2] + a7[2]
    expected[2, 2:3] = a_e[2] + 0.0  # state 5 only once
    assert torch.allclose(adv.double(), expected, atol=1e-6)
    assert (adv[mask == 0] == 0).all()  # observation tokens and padding get nothing


def test_omega_zero_is_grpo():
    torch.manual_seed(0)
    specs = [[(s % 3, float(r), 2, 1) for s, r in zip(range(k, k + 3), (0, 0, k % 2))] for k in range(6)]
    mask, step, states, turn_rewards = episodes(specs, 9)
    rewards = torch.rand(6)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    got = gigpo_advantage(rewards, group, mask, step, states, turn_rewards, omega=0.0)
    assert torch.equal(got, grpo_advantage(rewards, group, mask))
    with_steps = gigpo_advantage(rewards, group, mask, step, states, turn_rewards, omega=1.0)
    assert not torch.equal(with_steps, got)  # the same batch with omega = 1 has step-level terms


def test_no_repeated_state_is_grpo():
    specs = [[(10 * row + turn, float(turn == 2 and row % 2), 1, 2) for turn in range(3)] for row in range(4)]
    mask, step, states, turn_rewards = episodes(specs, 9)
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    got = gigpo_advantage(rewards, group, mask, step, states, turn_rewards, omega=1.0)
    assert torch.equal(got, grpo_advantage(rewards, group, mask))


def test_anchor_groups_do_not_cross_prompt_groups():
    # the same state id in two prompt groups is two anchor groups (each a singleton here): A^S = 0
    specs = [[(4, 1.0, 1, 0)], [(4, 0.0, 1, 0)]]
    mask, step, states, turn_rewards = episodes(specs, 1)
    got = gigpo_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask, step, states, turn_rewards)
    assert torch.equal(got, torch.zeros(2, 1))


def test_identical_trajectories_give_zero():
    specs = [[(1, 0.0, 2, 1), (2, 1.0, 1, 0)]] * 3
    mask, step, states, turn_rewards = episodes(specs, 4)
    got = gigpo_advantage(torch.ones(3), torch.zeros(3, dtype=torch.long), mask, step, states, turn_rewards)
    assert torch.allclose(got, torch.zeros(3, 4), atol=1e-8)  # equal returns: no advantage (up to float rounding)


def test_gamma_outside_unit_interval_is_refused():
    from rlbench.errors import ConfigError

    mask, step, states, turn_rewards = episodes([[(1, 0.0, 1, 0)]], 1)
    with pytest.raises(ConfigError, match="gamma"):
        gigpo_advantage(torch.ones(1), torch.zeros(1, dtype=torch.long), mask, step, states, turn_rewards, gamma=1.5)
