"""QRPO with a reference set of its own per response (arXiv:2507.08068, section 3): the ``reference_rewards``
[B, K] input of rlbench/algorithm/losses/quantile_reward.py, r_q = mid-rank of R(x, y) among the K rewards."""

from __future__ import annotations

import pytest
import torch

from rlbench.algorithm.aggregation import group_mean
from rlbench.algorithm.losses.quantile_reward import (
    log_uniform_partition,
    qrpo_loss,
    quantile_rewards,
)
from rlbench.algorithm.step_inputs import STEP_INPUTS


def test_mid_ranks_among_a_reference_set_with_ties_are_the_hand_counted_ones():
    reference = torch.tensor([[0.0, 0.5, 0.5, 1.0, 2.0]]).expand(5, -1)  # K = 5, a tie at 0.5
    rewards = torch.tensor([0.5, -1.0, 3.0, 1.0, 0.0])
    # 0.5: 1 below, 2 tied -> (1 + 1) / 5; -1: none; 3: all 5 below; 1.0: 3 below, 1 tied -> 3.5 / 5; 0.0: 0 + 0.5
    assert quantile_rewards(rewards, reference).tolist() == pytest.approx([0.4, 0.0, 1.0, 0.7, 0.1])
    assert quantile_rewards(rewards, reference, ties="at_most").tolist() == pytest.approx([0.6, 0.0, 1.0, 0.8, 0.2])


def _batch():
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(4, 3, generator=gen, dtype=torch.float64) - 2
    ref_logp = torch.randn(4, 3, generator=gen, dtype=torch.float64) - 2
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    return logp, ref_logp, mask, rewards, groups


def test_the_loss_with_a_reference_set_equals_its_closed_form():
    logp, ref_logp, mask, rewards, groups = _batch()
    reference = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    beta = 0.1
    matrix, metrics = qrpo_loss(logp, ref_logp, mask, rewards, groups, beta=beta, reference_rewards=reference)
    # 1 among (0, 0, 1): 2 below, 1 tied; 0 among (0, 1, 1): 1 tied; 0 among (1, 1, 1): none; 1 above (0, 0, 0)
    quantiles = [2.5 / 3, 0.5 / 3, 0.0, 1.0]
    delta = ((logp - ref_logp) * mask).sum(-1)
    residuals = torch.tensor(quantiles, dtype=torch.float64) - beta * log_uniform_partition(beta) - beta * delta
    expected = ((residuals[0] ** 2 + residuals[1] ** 2) / 2 + (residuals[2] ** 2 + residuals[3] ** 2) / 2) / 2
    assert group_mean(matrix, mask, batch_groups=2).item() == pytest.approx(expected.item(), rel=1e-10)
    assert metrics["quantile_reward"] == pytest.approx(sum(quantiles) / 4)


def test_the_group_as_reference_set_gives_the_old_loss():
    logp, ref_logp, mask, rewards, groups = _batch()
    own_group = torch.stack([rewards[groups == g] for g in groups.tolist()])  # [B, 2]: each row its group's rewards
    for ties in ("mid_rank", "at_most"):
        old, old_metrics = qrpo_loss(logp, ref_logp, mask, rewards, groups, beta=0.05, ties=ties)
        new, new_metrics = qrpo_loss(logp, ref_logp, mask, rewards, groups, beta=0.05, ties=ties, reference_rewards=own_group)
        torch.testing.assert_close(new, old)
        assert new_metrics == pytest.approx(old_metrics)


def test_a_reference_set_of_the_wrong_shape_is_refused():
    logp, ref_logp, mask, rewards, groups = _batch()
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        qrpo_loss(logp, ref_logp, mask, rewards, groups, reference_rewards=torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        qrpo_loss(logp, ref_logp, mask, rewards, groups, reference_rewards=torch.zeros(4, 0, dtype=torch.float64))


def test_the_reference_set_is_a_declared_loss_input_the_batch_provides_with_reference_samples():
    entry = STEP_INPUTS["reference_rewards"]
    assert "loss" in entry.readers and entry.producer == "batch"
