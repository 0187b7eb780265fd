"""AT-GRPO's advantage (arXiv:2510.11062, section 3): closed-form and equivalence checks, the team reward
mixing r = r_local + alpha * r_team included."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.algorithm.advantages.at_grpo import at_grpo_advantage, team_mixed_rewards
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


def test_one_role_one_turn_is_grpo_exactly():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 1.0], dtype=torch.float64)
    group_index = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1, 1, 1, 0]] * 6, dtype=torch.float64)
    step_index = torch.where(mask > 0, 0, -1).long()
    turn_rewards = rewards[:, None].expand(6, 4).clone()
    got = at_grpo_advantage(rewards, group_index, mask, step_index, turn_rewards, num_roles=1)
    assert torch.equal(got, grpo_advantage(rewards, group_index, mask).to(got.dtype))


def test_two_roles_two_turns_by_hand():
    # two episodes of one prompt; turn 0 = proposer, turn 1 = verifier; tokens: [t0, t0, obs, t1]
    step_index = torch.tensor([[0, 0, -1, 1], [0, 0, -1, 1]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 1]], dtype=torch.float64)
    turn_rewards = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    got = at_grpo_advantage(torch.zeros(2), torch.tensor([0, 0]), mask, step_index, turn_rewards)
    # proposer key: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5); verifier key: 1, 3 -> mean 2, std sqrt(2)
    a_prop = 0.5 / (math.sqrt(0.5) + 1e-6)
    a_ver = 1.0 / (math.sqrt(2.0) + 1e-6)
    want = torch.tensor([[a_prop, a_prop, 0.0, -a_ver], [-a_prop, -a_prop, 0.0, a_ver]], dtype=torch.float64)
    assert torch.allclose(got.to(torch.float64), want, atol=1e-9)


def test_keys_split_by_group_and_role():
    # two prompts, one episode each: every key holds one turn, so every advantage is 0
    step_index = torch.tensor([[0, 1], [0, 1]])
    mask = torch.ones(2, 2, dtype=torch.float64)
    turn_rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    got = at_grpo_advantage(torch.zeros(2), torch.tensor([0, 1]), mask, step_index, turn_rewards)
    assert torch.equal(got, torch.zeros_like(got))


# two episodes of one prompt, 2 roles: tokens [t0, t0, obs, t1]; turn 0 = proposer, turn 1 = verifier
STEPS = torch.tensor([[0, 0, -1, 1], [0, 0, -1, 1]])
MASK = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 1]], dtype=torch.float64)
LOCAL = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)


def test_team_reward_mixing_by_hand():
    # episode 0: proposer right (1), verifier wrong (0), team solved; episode 1: proposer wrong (0), verifier
    # right (1), team failed. alpha = 0.5: r = r_local + 0.5 r_team
    team = torch.tensor([True, False])
    assert torch.equal(team_mixed_rewards(LOCAL, team, 0.5)[:, [0, 3]],
                       torch.tensor([[1.5, 0.5], [0.0, 1.0]], dtype=torch.float64))
    got = at_grpo_advantage(torch.zeros(2), torch.tensor([0, 0]), MASK, STEPS, LOCAL, correct=team, alpha=0.5)
    # proposer key: 1.5, 0 -> mean 0.75, unbiased std 1.5 / sqrt(2); verifier key: 0.5, 1 -> mean 0.75, std 0.5 / sqrt(2)
    a_prop = 0.75 / (1.5 / math.sqrt(2) + 1e-6)
    a_ver = 0.25 / (0.5 / math.sqrt(2) + 1e-6)
    want = torch.tensor([[a_prop, a_prop, 0.0, -a_ver], [-a_prop, -a_prop, 0.0, a_ver]], dtype=torch.float64)
    assert torch.allclose(got.to(torch.float64), want, atol=1e-9)
    # alpha = 3 turns the verifier's key around: the team's outcome outweighs its own verdict (3 vs 1)
    got = at_grpo_advantage(torch.zeros(2), torch.tensor([0, 0]), MASK, STEPS, LOCAL, correct=team, alpha=3.0)
    assert got[0, 3] > 0 > got[1, 3]


def test_alpha_zero_is_the_advantage_without_mixing_exactly():
    generator = torch.Generator().manual_seed(0)
    local = torch.rand(6, 4, generator=generator, dtype=torch.float64)
    steps = torch.tensor([[0, 0, -1, 1]] * 6)
    mask = (steps >= 0).to(torch.float64)
    team = torch.tensor([True, False, True, True, False, False])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    plain = at_grpo_advantage(torch.zeros(6), groups, mask, steps, local)
    assert torch.equal(at_grpo_advantage(torch.zeros(6), groups, mask, steps, local, correct=team, alpha=0.0), plain)
    assert not torch.equal(at_grpo_advantage(torch.zeros(6), groups, mask, steps, local, correct=team, alpha=1.0), plain)


def test_one_role_one_turn_with_mixing_is_grpo_of_the_mixed_reward():
    local = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 0.0], dtype=torch.float64)
    team = torch.tensor([False, True, True, False, False, True])
    group_index = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1, 1, 1, 0]] * 6, dtype=torch.float64)
    step_index = torch.where(mask > 0, 0, -1).long()
    turn_rewards = local[:, None].expand(6, 4).clone()
    got = at_grpo_advantage(local, group_index, mask, step_index, turn_rewards, correct=team, num_roles=1, alpha=0.7)
    mixed = local + 0.7 * team.to(torch.float64)
    assert torch.equal(got, grpo_advantage(mixed, group_index, mask).to(got.dtype))


def test_bad_alpha_is_refused_before_anything_loads():
    for alpha in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="alpha"):
            ADVANTAGES.validate_params("at_grpo", {"alpha": alpha})
    with pytest.raises(ConfigError, match="num_roles"):
        ADVANTAGES.validate_params("at_grpo", {"num_roles": 0})
    ADVANTAGES.validate_params("at_grpo", {"alpha": 0.0, "num_roles": 1})
