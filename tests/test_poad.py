"""POAD's boundary-aware token GAE (BAD, arXiv:2405.15821 section 4.2): closed-form checks."""

import pytest
import torch

from rlbench.algorithm.advantages.poad import (
    action_boundary_discounts,
    poad_advantage,
    poad_returns,
)
from rlbench.algorithm.advantages.value_based import gae_advantage
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


def test_two_actions_of_three_tokens_match_hand_computation():
    # tokens 0-2 action 0, tokens 3-4 an observation, tokens 5-7 action 1; turn rewards 0.5 and 1.0
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5, 0.6]])
    mask = torch.tensor([[1.0, 1, 1, 0, 0, 1, 1, 1]])
    steps = torch.tensor([[0, 0, 0, -1, -1, 1, 1, 1]])
    token_rewards = torch.tensor([[0.0, 0, 0.5, 0, 0, 0, 0, 1.0]])
    gamma, lam = 0.9, 0.8
    # backwards by hand: the episode ends after token 7 (value 0)
    a7 = 1.0 + gamma * 0.0 - 0.6
    a6 = 0.6 - 0.5 + lam * a7
    a5 = 0.5 - 0.4 + lam * a6
    a2 = 0.5 + gamma * 0.4 - 0.3 + gamma * lam * a5
    a1 = 0.3 - 0.2 + lam * a2
    a0 = 0.2 - 0.1 + lam * a1
    expected = torch.tensor([[a0, a1, a2, 0, 0, a5, a6, a7]], dtype=torch.float64)
    got = poad_advantage(torch.tensor([1.5]), values, mask, steps, token_rewards=token_rewards,
                         gamma=gamma, lam=lam, whiten=False)
    torch.testing.assert_close(got.to(torch.float64), expected, rtol=0, atol=1e-6)
    returns = poad_returns(torch.tensor([1.5]), values, mask, steps, token_rewards=token_rewards, gamma=gamma, lam=lam)
    torch.testing.assert_close(returns.to(torch.float64), expected + values.to(torch.float64) * mask, rtol=0, atol=1e-6)


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(3, 7, generator=generator)
    mask = torch.tensor([[1.0] * 7, [1.0] * 5 + [0, 0], [1.0] * 3 + [0] * 4])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    return values, mask, rewards


def test_every_token_its_own_action_equals_standard_gae():
    values, mask, rewards = _batch()
    steps = torch.where(mask > 0, torch.arange(7).expand(3, 7), -1)
    for whiten in (False, True):
        got = poad_advantage(rewards, values, mask, steps, gamma=0.9, lam=0.7, whiten=whiten)
        want = gae_advantage(rewards, values, mask, gamma=0.9, lam=0.7, whiten=whiten)
        torch.testing.assert_close(got, want)


def test_one_action_per_episode_equals_gae_with_gamma_one():
    values, mask, rewards = _batch(1)
    steps = torch.where(mask > 0, 0, -1)
    got = poad_advantage(rewards, values, mask, steps, gamma=0.5, lam=0.7, whiten=False)
    torch.testing.assert_close(got, gae_advantage(rewards, values, mask, gamma=1.0, lam=0.7, whiten=False))


def test_discounts_are_one_inside_an_action_and_gamma_at_its_end():
    steps = torch.tensor([[0, 0, -1, 1, 1, -1]])
    mask = torch.tensor([[1.0, 1, 0, 1, 1, 0]])
    got = action_boundary_discounts(steps, mask, 0.9)
    assert got[0, [0, 1, 3, 4]].tolist() == [1.0, 0.9, 1.0, 0.9]


def test_registered_as_a_token_level_advantage_and_rejects_bad_gamma():
    assert "poad" in ADVANTAGES
    values, mask, rewards = _batch()
    with pytest.raises(ConfigError, match="gamma"):
        poad_advantage(rewards, values, mask, torch.zeros(3, 7, dtype=torch.long), gamma=1.5)


def test_poad_without_a_rollout_that_records_turns_is_refused_before_loading():
    from rlbench.config.schema import RolloutConfig
    from rlbench.training.advantage_inputs import check_strategy_inputs

    needs = set(ADVANTAGES.accepted_inputs("poad"))
    with pytest.raises(ConfigError, match="step_index.*multi_turn"):
        check_strategy_inputs(RolloutConfig(), "poad", needs)
    check_strategy_inputs(RolloutConfig(strategy="multi_turn"), "poad", needs)
