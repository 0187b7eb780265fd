"""REFUEL (arXiv:2410.04612; algorithm=refuel): rollout.multi_turn.branch=random_turn rolls in to a random turn h
with env=user_sim and branches a pair there; the REBEL loss (rlbench/algorithm/losses/relative_rewards.py) on the
batch regresses the turn-h log-ratio difference onto the future-return difference. The spec's checks: the pair
shares turns 1..h-1 exactly; the loss is 0 when the turn-h log-ratio difference equals eta * (Q - Q'); adding a
constant to every reward changes nothing; tokens of turns other than h get no gradient."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config, smoke_cli_steps
from test_env_multi_turn import EOS, ScriptedEngine, Tokens
from test_user_sim import PROBLEM, factory

from rlbench.algorithm.losses.common import sequence_sum
from rlbench.algorithm.losses.relative_rewards import rebel_loss
from rlbench.config.typed import typed_config
from rlbench.errors import ConfigError
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.strategies.multi_turn import MultiTurnOptions, MultiTurnRollout
from rlbench.training.batch import collate
from rlbench.validation import validate_config

# PROBLEM's dialogue: 8 + 9 = 17, subtract 4 -> 13, subtract 4 -> 9


def seed_for(h, turns=3):
    """A generator seed whose first draw of U{1..turns} is h."""
    return next(s for s in range(100) if 1 + int(torch.randint(turns, (1,), generator=torch.Generator().manual_seed(s))) == h)


def branched(h, script):
    """The group of PROBLEM with its branch at turn ``h``: ``script`` are the engine's calls (the roll-in's
    h - 1 calls answer one request, the later ones answer both branches)."""
    sampler = GroupSampler(ScriptedEngine(script), None, Tokens(), {"user": "{problem}"}, lambda rewards, inputs: rewards)
    setup = RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 16), torch.Generator().manual_seed(seed_for(h)), env=factory())
    return MultiTurnRollout(setup, MultiTurnOptions(branch="random_turn")).rollout([PROBLEM])


def test_the_pair_shares_the_roll_in_exactly_and_trains_turn_h_only():
    # h = 2: turn 1 rolled in once ("17", right); at turn 2 one branch answers 13 (right), the other 12 (wrong),
    # and the wrong one's last turn 9 is still right (the user builds on the true 13)
    groups, metrics = branched(2, [["17\n"], ["13\n", "12\n"], ["9\n", "5$"]])
    right, wrong = groups.groups[0]
    roll_in = len("17\n") + len("\nNow subtract 4.\n")
    assert right.response_ids[:roll_in] == wrong.response_ids[:roll_in] and right.logprobs[:roll_in] == wrong.logprobs[:roll_in]
    assert right.text.startswith("17\n\nNow subtract 4.\n13\n") and wrong.text.startswith("17\n\nNow subtract 4.\n12\n")
    # only turn 2's tokens (0-based step 1) keep loss mask 1
    for c in (right, wrong):
        turn_h = [s == 1 for s in c.extras["step_index"]]
        assert c.loss_mask == [int(t) for t in turn_h] and sum(c.loss_mask) == 3
    # rewards are the future returns from turn 2: 1 + 1 and 0 + 0 (turn 1's reward is left out)
    assert groups.outcome.tolist() == [2.0, 0.0]
    assert metrics["multi_turn_branch_turn"] == 2 and metrics["multi_turn_branch_missed"] == 0
    assert metrics["multi_turn_ended_dialogue_end"] == 2


def test_branching_at_turn_one_is_two_independent_dialogues():
    groups, metrics = branched(1, [["17\n", "3\n"], ["13\n", "13\n"], ["9\n", "9\n"]])
    assert groups.outcome.tolist() == [3.0, 2.0] and metrics["multi_turn_branch_turn"] == 1
    assert all(c.loss_mask == [int(s == 0) for s in c.extras["step_index"]] for c in groups.groups[0])


def loss_inputs(h=2):
    groups, _ = branched(h, [["17\n"], ["13\n", "12\n"], ["9\n", "5$"]])
    batch = collate(groups.groups, pad_token_id=EOS)
    return batch, groups.rewards


def test_loss_is_zero_at_eta_times_the_future_return_difference_and_ignores_reward_shifts():
    batch, q = loss_inputs()
    mask, eta = batch.response_mask, 0.5
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))
    # put a log-ratio change of eta * Q on the turn-h tokens of each branch (spread over them), anything elsewhere
    per_token = eta * q / mask.sum(-1)
    logp = old + per_token[:, None] * mask + 3.0 * (1 - mask)
    change = sequence_sum(logp - old, mask)
    assert (change[0] - change[1]).item() == pytest.approx(eta * (q[0] - q[1]).item())
    loss, _ = rebel_loss(logp, old, mask, q, batch.group_index, eta=eta)
    assert loss.abs().max().item() < 1e-10
    # any other policy: the same loss when a constant is added to every reward
    other = old + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    base, _ = rebel_loss(other, old, mask, q, batch.group_index, eta=eta)
    shifted, _ = rebel_loss(other, old, mask, q + 7.5, batch.group_index, eta=eta)
    assert base.sum().item() > 0 and torch.allclose(base, shifted)


def test_tokens_of_other_turns_get_no_gradient():
    batch, q = loss_inputs()
    mask = batch.response_mask
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))
    logp = (old + 0.2 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))).requires_grad_()
    loss, _ = rebel_loss(logp, old, mask, q, batch.group_index, eta=1.0)
    loss.sum().backward()
    # the response mask is the turn-h mask (the rollout test checks the completions' loss masks)
    trained = mask > 0
    assert int(trained.sum()) == 6 and (logp.grad[~trained] == 0).all() and (logp.grad[trained] != 0).all()


def test_configuration_is_checked(tmp_path):
    cfg = compose_config(["algorithm=refuel"], tmp_path)
    typed = typed_config(cfg)
    assert typed.env.name == "user_sim" and typed.rollout.settings["multi_turn"]["branch"] == "random_turn"
    assert typed.rollout.n == 2 and validate_config(cfg).loss.name == "rebel"
    with pytest.raises(ConfigError, match="branch must be one of"):
        validate_config(compose_config(["algorithm=refuel", "rollout.multi_turn.branch=sometimes"], tmp_path))
    with pytest.raises(ConfigError, match="needs rollout.n >= 2"):
        validate_config(compose_config(["algorithm=refuel", "rollout.n=1"], tmp_path))


@pytest.mark.slow
def test_refuel_runs_from_the_command_line(tmp_path):
    steps = smoke_cli_steps(tmp_path / "run", "algorithm=refuel")
    assert len(steps) == 2
    for step in steps:
        assert 1 <= step["multi_turn_branch_turn"] <= 3 and step["multi_turn_turns"] >= 1
