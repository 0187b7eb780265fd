"""DMPO (arXiv:2510.08233): the distribution-matching weights, the objective they give with the reinforce
loss (value and gradient in closed form on hand-made tensors), the paper's special cases, and the preset
from the command line."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import smoke_cli_steps  # noqa: E402

from rlbench.algorithm.registry import ADVANTAGES, AGGREGATIONS, POLICY_LOSSES  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 2.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)


def dmpo(rewards=REWARDS, groups=GROUPS, mask=MASK, **params):
    return ADVANTAGES.call("dmpo", {"rewards": rewards, "group_index": groups, "response_mask": mask}, params)


def test_weights_are_the_group_softmax_minus_the_baseline():
    alpha = 0.5
    advantage = dmpo(alpha=alpha)[:, 0]
    first = [math.exp(r / alpha) for r in (1.0, 0.0, 0.5)]
    second = [math.exp(r / alpha) for r in (0.0, 2.0, 2.0)]
    expected = [3 * e / sum(first) - 1 for e in first] + [3 * e / sum(second) - 1 for e in second]
    assert advantage.tolist() == pytest.approx(expected, rel=1e-6)
    # the weights of a group sum to 1, so the advantages (G w - 1) sum to 0
    assert advantage[:3].sum().item() == pytest.approx(0.0, abs=1e-6)
    assert advantage[3:].sum().item() == pytest.approx(0.0, abs=1e-6)
    # broadcast to the response's tokens, zero on padding
    assert torch.equal(dmpo(alpha=alpha) == 0, (MASK == 0) | (dmpo(alpha=alpha) == 0))


def test_special_cases_of_the_paper():
    equal = torch.tensor([0.7, 0.7, 0.7, 0.7])
    groups = torch.zeros(4, dtype=torch.long)
    mask = torch.ones(4, 2)
    # equal rewards: no gradient (the weight baseline's purpose); without the baseline each weight is 1/G
    assert torch.equal(dmpo(equal, groups, mask, alpha=0.1), torch.zeros(4, 2))
    assert dmpo(equal, groups, mask, alpha=0.1, baseline=False)[:, 0].tolist() == pytest.approx([1.0] * 4)
    # alpha -> 0 without the baseline: all the weight on the best response (cross-entropy on it: SFT)
    rewards = torch.tensor([0.2, 0.9, 0.1, 0.4])
    assert dmpo(rewards, groups, mask, alpha=1e-4, baseline=False)[:, 0].tolist() == [0.0, 4.0, 0.0, 0.0]
    # alpha -> inf: the tilt vanishes, no gradient
    assert dmpo(rewards, groups, mask, alpha=1e9)[:, 0].abs().max().item() < 1e-6
    # a tiny alpha does not overflow (the group maximum is subtracted before exp)
    assert torch.isfinite(dmpo(torch.tensor([1000.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1), alpha=1e-3)).all()
    with pytest.raises(ConfigError, match="alpha"):
        dmpo(alpha=0.0)


def test_objective_value_and_gradient_in_closed_form():
    """advantage=dmpo + loss=reinforce + seq_mean_token_mean is
    L = (1/P) sum_prompts -sum_i (w_i - 1/G) (1/|y_i|) sum_t logp_it, with dL/dlogp_it = -(w_i - 1/G) / (P |y_i|)."""
    alpha = 0.5
    logp = torch.tensor([[-0.1, -2.0, -9.0], [-0.7, -9.0, -9.0], [-1.0, -0.2, -0.3],
                         [-0.4, -1.1, -9.0], [-0.5, -0.6, -0.9], [-1.5, -9.0, -9.0]], requires_grad=True)
    advantages = dmpo(alpha=alpha)
    matrix, _ = POLICY_LOSSES.call("reinforce", {"logp": logp, "advantages": advantages, "response_mask": MASK}, {})
    loss = AGGREGATIONS.call("seq_mean_token_mean", {"loss_matrix": matrix, "response_mask": MASK,
                                                     "batch_tokens": int(MASK.sum()), "batch_sequences": 6}, {})
    loss.backward()
    weights = []
    for members in ([1.0, 0.0, 0.5], [0.0, 2.0, 2.0]):
        exps = [math.exp(r / alpha) for r in members]
        weights += [e / sum(exps) for e in exps]
    lengths = MASK.sum(1).tolist()
    values = logp.detach()
    expected = sum(-(w - 1 / 3) * float((values[i] * MASK[i]).sum()) / lengths[i] for i, w in enumerate(weights)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    expected_grad = torch.tensor([[-(w - 1 / 3) / (2 * lengths[i])] for i, w in enumerate(weights)]) * MASK
    assert torch.allclose(logp.grad, expected_grad, atol=1e-7)


@pytest.mark.slow
def test_dmpo_preset_runs_from_the_command_line(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "algorithm=dmpo", "trainer.steps=2")
    assert len(steps) == 2 and all(math.isfinite(s["policy_loss"]) and s["grad_norm"] > 0 for s in steps)
