"""AT-GRPO's advantage (arXiv:2510.11062, section 3): closed-form and equivalence checks."""

from __future__ import annotations

import math

import torch

from rlbench.algorithm.advantages.at_grpo import at_grpo_advantage
from rlbench.algorithm.advantages.group_relative import grpo_advantage


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
