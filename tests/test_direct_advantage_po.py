"""Direct Advantage Policy Optimization (rlbench/algorithm/losses/step_advantage.py, arXiv:2412.18279): with a
perfect critic on a tabular chain the actor regresses to pi_ref exp(A / beta); the loss sums log-ratios over
vine's steps; the preset composes with rollout=vine."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import algorithm_from, compose_config

from rlbench.algorithm.advantages.vine import vine_advantage
from rlbench.algorithm.aggregation import seq_mean_token_sum
from rlbench.algorithm.losses.step_advantage import direct_advantage_po_loss
from rlbench.errors import ConfigError
from rlbench.rollout.strategies.vine import token_steps
from rlbench.validation import validate_config

# A chain of DEPTH steps, ACTIONS actions each, one token per step; the reward is the sum of the steps' values.
DEPTH, ACTIONS, BETA = 3, 3, 0.5
STEP_VALUES = torch.tensor([[0.2, 1.0, -0.4], [0.0, -0.6, 0.9], [0.5, 0.1, -0.3]], dtype=torch.float64)
REF = torch.softmax(torch.tensor([[0.3, -0.2, 0.1], [-0.5, 0.4, 0.0], [0.2, 0.2, -0.6]], dtype=torch.float64), -1)
PATHS = torch.tensor(list(itertools.product(range(ACTIONS), repeat=DEPTH)))  # [27, DEPTH] every response


def perfect_critic_inputs():
    """Rewards [27], step_index and the perfect critic's values V(s_k) [27, DEPTH] under pi_ref: the reward collected
    so far plus the expected rest, V(s_k) = sum_{j<k} v_j(a_j) + sum_{j>=k} E_{pi_ref} v_j."""
    collected = STEP_VALUES[torch.arange(DEPTH), PATHS]  # [27, DEPTH]
    expected = (REF * STEP_VALUES).sum(-1)  # [DEPTH]
    before = torch.cumsum(collected, 1) - collected
    rest = torch.flip(torch.cumsum(torch.flip(expected, [0]), 0), [0])
    step_index = torch.arange(DEPTH).expand(len(PATHS), DEPTH)
    return collected.sum(1), step_index, before + rest


def test_actor_regresses_to_the_reference_tilted_by_the_advantage_with_a_perfect_critic():
    rewards, step_index, values = perfect_critic_inputs()
    mask = torch.ones(len(PATHS), DEPTH, dtype=torch.float64)
    advantages = vine_advantage(rewards, mask, step_index, values)  # A(s_k, a) = v_k(a) - E_ref v_k
    assert torch.allclose(advantages, STEP_VALUES[torch.arange(DEPTH), PATHS] - (REF * STEP_VALUES).sum(-1))
    logits = torch.zeros(DEPTH, ACTIONS, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.05)
    ref_logp = REF.log()[torch.arange(DEPTH), PATHS]
    for _ in range(3000):
        policy = torch.log_softmax(logits, -1)
        logp = policy[torch.arange(DEPTH), PATHS]
        matrix, _ = direct_advantage_po_loss(logp, ref_logp, advantages, mask, step_index, beta=BETA)
        on_policy = logp.detach().sum(1).exp()  # each response weighted by its probability under the actor
        loss = (matrix.sum(1) * on_policy).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    target = REF * torch.exp((STEP_VALUES - (REF * STEP_VALUES).sum(-1, keepdim=True)) / BETA)
    target = target / target.sum(-1, keepdim=True)
    reached = torch.softmax(logits.detach(), -1)
    assert torch.allclose(reached, target, atol=1e-4), (reached, target)
    assert not torch.allclose(target, REF, atol=0.05)  # the tilt is far from pi_ref


def test_loss_sums_the_log_ratio_over_vines_steps():
    """Two responses of 5 and 3 tokens cut by vine's token_steps: each step's squared error uses the log-ratio
    summed over its tokens and the step's advantage, and the row sum is the sum over steps."""
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 5, generator=gen)).requires_grad_()
    ref = -torch.rand(2, 5, generator=gen)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    first, _ = token_steps([(0, 0.5), (2, 0.25)], 5)       # steps of tokens 0-1 and 2-4
    second, _ = token_steps([(0, 0.5), (1, 0.75)], 3)      # steps of token 0 and tokens 1-2
    step_index = torch.tensor([first, second + [-1, -1]])
    values = torch.tensor([[0.5, 0.5, 0.25, 0.25, 0.25], [0.5, 0.75, 0.75, 0.0, 0.0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0])
    advantages = vine_advantage(rewards, mask, step_index, values).float()
    beta = 0.2
    matrix, metrics = direct_advantage_po_loss(logp, ref, advantages, mask, step_index, beta=beta)
    d = logp - ref
    steps = [(0, [0, 1], 0.25 - 0.5), (0, [2, 3, 4], 1.0 - 0.25), (1, [0], 0.75 - 0.5), (1, [1, 2], 0.0 - 0.75)]
    expected = sum((beta * d[row, tokens].sum() - advantage) ** 2 for row, tokens, advantage in steps) / 2
    assert seq_mean_token_sum(matrix, mask, batch_sequences=2).item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["steps_per_response"] == 2.0
    assert torch.all(matrix[1, 3:] == 0)


def test_without_steps_or_with_a_bad_beta_it_is_refused():
    logp = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="rollout=vine"):
        direct_advantage_po_loss(logp, logp, logp, torch.ones(1, 2), None)
    with pytest.raises(ConfigError, match="beta must be > 0"):
        direct_advantage_po_loss(logp, logp, logp, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), beta=0)


def test_preset_composes_with_vine_and_loads_a_reference(tmp_path):
    cfg = compose_config(["algorithm=direct_advantage_po"], tmp_path)
    assert cfg.rollout.strategy == "vine"
    algorithm = algorithm_from(cfg.algorithm)
    assert algorithm.needs_reference


def test_a_rollout_without_steps_is_refused_before_anything_loads(make_cfg):
    """The loss's own strategy input is checked as the advantage's are: with rollout=iid and an advantage that
    reads no steps, the loss still needs vine's step_index."""
    validate_config(make_cfg("experiment=smoke", "algorithm=direct_advantage_po"))
    with pytest.raises(ConfigError, match="loss 'direct_advantage_po' reads step_index.*rollout=vine"):
        validate_config(make_cfg("experiment=smoke", "algorithm=direct_advantage_po", "rollout=iid", "algorithm/advantage=grpo"))


def test_a_bad_beta_is_refused_before_anything_loads(make_cfg):
    with pytest.raises(ConfigError, match="beta must be > 0"):
        validate_config(make_cfg("experiment=smoke", "algorithm=direct_advantage_po", "algorithm.loss.beta=0"))
