"""REINFORCE++'s per-token KL penalty in the token rewards (Hu 2025, arXiv:2501.03262, section 2), through the
algorithm=reinforce_pp preset as the trainer uses it (Algorithm.kl_reward_terms, then compute_advantages):

    r_t = 1[t = last token] r - beta KL_t,   KL_t = log pi_old(y_t) - log pi_ref(y_t)   (k1)
    G_t = sum_{s >= t} gamma^(s-t) r_s,      A_t = (G_t - mean(G)) / (std(G) + eps)   over the batch's valid tokens

Hand-computed values on a 2-response batch whose second response is padded (the padding's log-probs are
garbage that must not reach the statistics).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import algorithm_from
from rlbench.algorithm.advantages import reinforce_pp_advantage, reinforce_pp_returns
from rlbench.algorithm.kl import kl_penalised_rewards
from rlbench.algorithm.step_inputs import STEP_INPUTS

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
REWARDS = torch.tensor([1.0, 0.0])
GROUPS = torch.tensor([0, 1])
REF = torch.tensor([[-2.0, -3.0, -1.0], [-4.0, -2.0, -10.0]])
KL = torch.tensor([[0.5, 1.0, -0.5], [2.0, 1.0, 9.0]])  # k1 per token; 9 sits on padding
OLD = REF + KL


def preset(make_cfg, *overrides):
    return algorithm_from(make_cfg("algorithm=reinforce_pp", *overrides).algorithm)


def advantages(algorithm, old=OLD, rewards=REWARDS):
    """What the trainer does (rlbench/training/step.py compute_advantages): the KL-penalised rewards, then the
    estimator on them."""
    sequence, token_rewards, _ = algorithm.kl_reward_terms(rewards, MASK, old, REF)
    return algorithm.compute_advantages(sequence, GROUPS, MASK, token_rewards=token_rewards), token_rewards


def whitened(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / std for v in values]


def test_the_preset_puts_a_k1_kl_in_the_token_rewards_and_none_in_the_loss(make_cfg):
    algorithm = preset(make_cfg)
    assert algorithm.kl_in_reward and not algorithm.kl_in_loss and algorithm.needs_reference
    assert algorithm.kl_estimator == "k1" and algorithm.kl_coef == pytest.approx(0.01)
    assert "token_rewards" in algorithm.advantage_inputs and "token_rewards" in STEP_INPUTS.provided("advantage", algorithm)


def test_hand_computed_returns_and_whitened_advantages_with_padding(make_cfg):
    algorithm = preset(make_cfg, "algorithm.kl.coef=0.1")
    adv, token_rewards = advantages(algorithm)
    # r = [-0.05, -0.1, 1 + 0.05] and [-0.2, -0.1, pad 0]
    assert torch.allclose(token_rewards, torch.tensor([[-0.05, -0.1, 1.05], [-0.2, -0.1, 0.0]], dtype=torch.float64))
    # G = [0.9, 0.95, 1.05] and [-0.3, -0.1]: mean 0.5, unbiased var 1.665 / 4 over the 5 valid tokens
    returns = reinforce_pp_returns(REWARDS, MASK, token_rewards)
    assert torch.allclose(returns, torch.tensor([[0.9, 0.95, 1.05], [-0.3, -0.1, 0.0]]), atol=1e-6)
    expected = whitened([0.9, 0.95, 1.05, -0.3, -0.1])
    assert expected[0] == pytest.approx(0.4 / math.sqrt(0.41625))
    assert torch.allclose(adv[0], torch.tensor(expected[:3]), atol=1e-5)
    assert torch.allclose(adv[1, :2], torch.tensor(expected[3:]), atol=1e-5)
    assert adv[1, 2].item() == 0.0  # padding: zero advantage


def test_beta_zero_is_the_outcome_only_advantage_exactly(make_cfg):
    outcome_only = reinforce_pp_advantage(REWARDS, MASK)
    # r_i on every token of its response, whitened over the 5 tokens: [1, 1, 1, 0, 0] -> mean 0.6, var 1.2 / 4
    assert torch.allclose(outcome_only[0], torch.full((3,), 0.4 / math.sqrt(0.3)), atol=1e-6)
    # the KL machinery with beta = 0 on a non-zero KL gives the same tensor, bit for bit
    _, token_rewards = kl_penalised_rewards(REWARDS, KL, MASK, coef=0.0)
    assert torch.equal(reinforce_pp_advantage(REWARDS, MASK, token_rewards=token_rewards), outcome_only)
    # and the preset at kl.coef=0 is the outcome-only REINFORCE++ (no token rewards, no reference model)
    algorithm = preset(make_cfg, "algorithm.kl.coef=0.0")
    adv, token_rewards = advantages(algorithm)
    assert token_rewards is None and not algorithm.needs_reference and torch.equal(adv, outcome_only)


def test_gamma_below_one_discounts_the_later_rewards(make_cfg):
    algorithm = preset(make_cfg, "algorithm.kl.coef=0.1", "algorithm.advantage.gamma=0.5")
    adv, token_rewards = advantages(algorithm)
    # G_2 = 1.05, G_1 = -0.1 + 0.5 * 1.05 = 0.425, G_0 = -0.05 + 0.5 * 0.425 = 0.1625; G_1 = -0.1, G_0 = -0.25
    returns = reinforce_pp_returns(REWARDS, MASK, token_rewards, gamma=0.5)
    assert torch.allclose(returns, torch.tensor([[0.1625, 0.425, 1.05], [-0.25, -0.1, 0.0]]), atol=1e-6)
    expected = whitened([0.1625, 0.425, 1.05, -0.25, -0.1])
    assert torch.allclose(adv[MASK > 0], torch.tensor(expected), atol=1e-5) and adv[1, 2].item() == 0.0


def test_raising_pi_old_over_pi_ref_on_a_token_lowers_it_and_the_earlier_tokens(make_cfg):
    """d/d log pi_old(y_t): the return of every token s <= t of that response falls by beta; tokens after t and
    the other response keep theirs; after whitening, token t and the earlier ones still fall."""
    beta, token = 0.1, (0, 1)
    algorithm = preset(make_cfg, f"algorithm.kl.coef={beta}")
    old = OLD.clone().double().requires_grad_(True)
    sequence, token_rewards, _ = algorithm.kl_reward_terms(REWARDS.double(), MASK.double(), old, REF.double())
    returns = reinforce_pp_returns(sequence, MASK.double(), token_rewards)
    rows = [torch.autograd.grad(returns[s], old, retain_graph=True)[0][token] for s in [(0, 0), (0, 1), (0, 2), (1, 0)]]
    assert torch.tensor(rows).tolist() == pytest.approx([-beta, -beta, 0.0, 0.0])
    adv = algorithm.compute_advantages(sequence, GROUPS, MASK.double(), token_rewards=token_rewards)
    for earlier in [(0, 0), (0, 1)]:
        (grad,) = torch.autograd.grad(adv[earlier], old, retain_graph=True)
        assert grad[token].item() < 0, earlier
    # a finite step says the same: log pi_old up by 0.5 on the token
    raised = OLD.clone()
    raised[token] += 0.5
    before, after = advantages(algorithm)[0], advantages(algorithm, old=raised)[0]
    assert after[0, 0] < before[0, 0] and after[0, 1] < before[0, 1]
