"""DRPO's decoupled length reward (advantage ``drpo``): closed forms, edge cases, and the contrast with
GRPO on a length-penalised reward that motivates it."""

import math

import pytest
import torch

from rlbench.algorithm import ADVANTAGES
from conftest import algorithm_from
from rlbench.algorithm.advantages import drpo_advantage, drpo_length_weights, grpo_advantage


def _mask(lengths, width=None):
    width = width or max(max(lengths), 1)
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_weights_are_a_softmax_of_the_length_reward_among_correct_answers():
    correct = torch.tensor([True, True, False, True, False])
    groups = torch.tensor([0, 0, 0, 1, 1])
    lengths = torch.tensor([2, 4, 1, 3, 3])
    weights = drpo_length_weights(correct, groups, lengths, max_length=10, temperature=0.1)
    # group 0: exp(-2/1), exp(-4/1) normalised; the wrong answer gets 0; group 1: a single positive
    a, b = math.exp(-2.0), math.exp(-4.0)
    assert weights.tolist() == pytest.approx([a / (a + b), b / (a + b), 0.0, 1.0, 0.0])
    # weights sum to 1 over each group's positives; lambda -> inf gives uniform weights
    uniform = drpo_length_weights(correct, groups, lengths, max_length=10, temperature=1e9)
    assert uniform.tolist() == pytest.approx([0.5, 0.5, 0.0, 1.0, 0.0])


def test_drpo_advantage_closed_form_and_edge_cases():
    correct = torch.tensor([True, True, False, False, False, True])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])  # group 1 all wrong; group 2 a singleton
    lengths = [2, 4, 1, 3, 0, 0]  # the last two: zero-length responses
    mask = _mask(lengths, 4)
    adv = drpo_advantage(groups, mask, correct, max_length=10, temperature=0.1, negative_advantage=0.5)
    a, b = math.exp(-2.0), math.exp(-4.0)
    per_response = [2 * a / (a + b), 2 * b / (a + b), -0.5, -0.5, -0.5, 1.0]
    expected = torch.tensor(per_response)[:, None] * mask
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.all(adv[4:] == 0)  # zero-length rows carry no advantage
    with pytest.raises(ValueError):
        drpo_advantage(groups, mask, correct, max_length=10, temperature=0.0)


def test_a_correct_but_longest_answer_never_gets_a_negative_advantage():
    # 3 correct (lengths 2, 4, 9) and 3 wrong; GRPO on R = correct - 0.1 |y| pushes the long correct one down
    correct = torch.tensor([True, True, True, False, False, False])
    lengths = torch.tensor([2, 4, 9, 2, 2, 2])
    groups = torch.zeros(6, dtype=torch.long)
    mask = _mask(lengths.tolist())
    penalised = correct.float() - 0.1 * lengths
    assert grpo_advantage(penalised, groups, mask)[2, 0] < 0
    adv = drpo_advantage(groups, mask, correct, max_length=9, temperature=0.5)
    assert torch.all(adv[:3, 0] > 0) and torch.all(adv[3:, 0] < 0)
    assert adv[0, 0] > adv[1, 0] > adv[2, 0]  # shorter correct answers get more credit
    assert adv[:3, 0].sum().item() == pytest.approx(3.0)  # |P| w_i averages 1 over the positives


def test_drpo_is_wired_as_a_group_relative_estimator_reading_correctness():
    algo = algorithm_from({
        "name": "t", "advantage": {"name": "drpo", "temperature": 0.2}, "loss": {"name": "ppo_clip"},
        "aggregation": {"name": "token_mean"},
    })
    assert algo.group_relative and {"correct", "max_length"} <= algo.advantage_inputs
    mask = _mask([1, 1])
    adv = algo.compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask,
                                  correct=torch.tensor([True, False]), max_length=4)
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0])
    assert "drpo" in ADVANTAGES
