"""Closed-form tests of the advantage- and loss-side cores of HAPO, CAMPO, D-PPO and M2PO
(issue 33): each value below is computed by hand in the comment beside it."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.algorithm.registry import ADVANTAGES


def _mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])


# --------------------------------------------------------------------------- HAPO: token-level group average
def test_hapo_tlga_mean_weighs_rewards_by_length():
    """{r = 1 with 10 tokens, r = 0 with 30}: mu_tok = 10/40 = 0.25 (GRPO's mean: 0.5);
    sigma_tok = sqrt((10 * 0.75^2 + 30 * 0.25^2) / 40) = sqrt(0.1875); A = (r - 0.25) / sigma_tok."""
    rewards = torch.tensor([1.0, 0.0])
    mask = _mask([10, 30])
    adv = ADVANTAGES.get("hapo_tlga")(rewards, torch.tensor([0, 0]), mask, epsilon=0.0)
    sigma = math.sqrt(0.1875)
    assert adv[0, 0].item() == pytest.approx(0.75 / sigma, rel=1e-6)
    assert adv[1, 0].item() == pytest.approx(-0.25 / sigma, rel=1e-6)
    assert torch.all(adv[0, 10:] == 0)  # padding
    # the length-weighted mean is what sets the sign balance: sum over tokens of A is 0
    assert (adv * mask).sum().item() == pytest.approx(0.0, abs=1e-5)


def test_hapo_tlga_equal_lengths_is_grpo_with_population_std():
    """Equal lengths: token statistics are the responses' (population std), i.e. GRPO's advantage
    times std_unbiased / std_population = sqrt(n / (n - 1))."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = _mask([4] * 6)
    tlga = ADVANTAGES.get("hapo_tlga")(rewards, group, mask, epsilon=0.0)
    grpo = ADVANTAGES.get("grpo")(rewards, group, mask, epsilon=0.0)
    assert torch.allclose(tlga, grpo * math.sqrt(3 / 2), atol=1e-6)


def test_hapo_tlga_falls_back_to_grpo_when_some_advantage_reaches_the_threshold():
    """One correct response of 1 token among three wrong ones of 100: mu_tok = 1/301,
    sigma_tok = sqrt(300)/301, A_correct = (300/301) / (sqrt(300)/301) = sqrt(300) = 17.3 >= 5, so the
    group takes GRPO's advantage; the other group (equal lengths, |A| < 5) keeps the TLGA value."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = _mask([1, 100, 100, 100, 3, 3])
    tlga = ADVANTAGES.get("hapo_tlga")(rewards, group, mask, epsilon=0.0)
    grpo = ADVANTAGES.get("grpo")(rewards, group, mask, epsilon=0.0)
    assert torch.allclose(tlga[:4], grpo[:4])
    assert tlga[4, 0].item() == pytest.approx(1.0)  # (1 - 0.5) / 0.5, population std of {1, 0}
    unsmoothed = ADVANTAGES.get("hapo_tlga")(rewards, group, mask, epsilon=0.0, fallback_threshold=100.0)
    assert unsmoothed[0, 0].item() == pytest.approx(math.sqrt(300), rel=1e-5)


def test_hapo_tlga_degenerate_groups_get_zero():
    """A singleton group, an all-equal group and a group whose responses are all empty get A = 0."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    group = torch.tensor([0, 1, 1, 2, 2])
    mask = _mask([3, 2, 4, 0, 0], width=4)
    adv = ADVANTAGES.get("hapo_tlga")(rewards, group, mask)
    assert torch.all(adv == 0)
    assert not torch.isnan(adv).any()
