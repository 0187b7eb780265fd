"""env=proposer_verifier (rlbench/rollout/env/proposer_verifier.py): a scripted shared policy plays both roles;
per-role turn rewards (proposal right; verdict right about the proposal), role prompts loss-masked, and
algorithm=at_grpo's advantage groups the turns by role (num_roles=2)."""

from __future__ import annotations

import pytest
import torch
from test_env_multi_turn import ScriptedEngine, Tokens

from rlbench.algorithm.advantages.at_grpo import at_grpo_advantage
from rlbench.config.schema import EnvConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import MathReward
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.env import EnvContext, EnvFactory
from rlbench.rollout.env.proposer_verifier import PROPOSER, RETRY, VERIFIER
from rlbench.rollout.strategies.multi_turn import MultiTurnRollout
from rlbench.training.batch import collate

PROBLEM = Problem("p1", "What is 6 times 7?", "42")


def factory(rounds=2):
    config = EnvConfig(name="proposer_verifier", max_turns=2 * rounds, turn_tokens=64, max_tokens=400, max_tool_calls=0,
                       max_observation_tokens=100, settings={"proposer_verifier": {}})
    return EnvFactory(config, EnvContext(grader=MathReward()))


def rollout(script, n, rounds=2):
    sampler = GroupSampler(ScriptedEngine(script), MathReward(), Tokens(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 64), None, env=factory(rounds))
    return MultiTurnRollout(setup).rollout([PROBLEM])


def turn_rewards(episode):
    """The reward of each turn, read off the tokens (observation tokens have turn -1)."""
    turns = {}
    for turn, reward in zip(episode.extras["step_index"], episode.extras["turn_rewards"]):
        if turn >= 0:
            turns.setdefault(turn, reward)
    return [turns[t] for t in sorted(turns)]


def test_scripted_roles_get_their_rewards():
    # right + ACCEPT: both rewarded; wrong + ACCEPT: verifier 0; wrong + REJECT: verifier 1, then a corrected
    # proposal accepted
    script = [["\\boxed{42} trailing", "\\boxed{41}", "\\boxed{41}"],
              ["ACCEPT", "ACCEPT", "REJECT because"],
              ["\\boxed{42}"],
              ["ACCEPT"]]
    groups, metrics = rollout(script, 3)
    right, fooled, caught = groups.groups[0]
    assert turn_rewards(right) == [1.0, 1.0]
    assert turn_rewards(fooled) == [0.0, 0.0]
    assert turn_rewards(caught) == [0.0, 1.0, 1.0, 1.0]
    assert [g.correct for g in groups.grades] == [True, False, True]  # the team's last proposal
    assert metrics["multi_turn_ended_accepted"] == 3
    observation = VERIFIER.format(answer="42")
    assert right.text == "\\boxed{42}" + observation + "ACCEPT"
    assert right.loss_mask == [1] * len("\\boxed{42}") + [0] * len(observation) + [1] * len("ACCEPT")
    retry_at = caught.text.index(RETRY)
    assert caught.text[retry_at - len("REJECT"):retry_at] == "REJECT"
    assert caught.loss_mask[retry_at:retry_at + len(RETRY)] == [0] * len(RETRY)


def test_reject_of_a_right_proposal_and_no_verdict_and_the_round_cap():
    script = [["\\boxed{42}", "\\boxed{42}", "\\boxed{7}"], ["REJECT", "maybe", "REJECT"]]
    groups, metrics = rollout(script, 3, rounds=1)
    wrongly_rejected, silent, capped = groups.groups[0]
    assert turn_rewards(wrongly_rejected) == [1.0, 0.0] and turn_rewards(silent) == [1.0, 0.0]
    assert turn_rewards(capped) == [0.0, 1.0]
    assert metrics["multi_turn_ended_rejected"] == 2 and metrics["multi_turn_ended_no_verdict"] == 1


def test_at_grpo_groups_the_turns_by_role():
    script = [["\\boxed{42}", "\\boxed{41}", "\\boxed{41}"], ["ACCEPT", "ACCEPT", "REJECT"]]
    groups, _ = rollout(script, 3, rounds=1)
    batch = collate(groups.groups, pad_token_id=0)
    adv = at_grpo_advantage(groups.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                            batch.extras["turn_rewards"], num_roles=2, epsilon=0.0)
    proposer = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    verifier = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    for row, episode in enumerate(groups.groups[0]):
        first_verifier_token = episode.extras["step_index"].index(1)
        expected_p = ((proposer - proposer.mean()) / proposer.std())[row].item()
        expected_v = ((verifier - verifier.mean()) / verifier.std())[row].item()
        assert adv[row, 0].item() == pytest.approx(expected_p, rel=1e-6)
        assert adv[row, first_verifier_token].item() == pytest.approx(expected_v, rel=1e-6)
        assert adv[row, len(episode.text) - 1].item() == pytest.approx(expected_v, rel=1e-6)
        assert adv[row, first_verifier_token - 1].item() == 0.0  # the verifier's prompt: an observation


def test_team_reward_mixing_on_scripted_episodes():
    # right + ACCEPT (team solved), wrong + ACCEPT (failed), wrong + REJECT then right + ACCEPT (solved):
    # r = r_local + alpha r_team with r_team the team's last proposal (grades' correct), alpha = 1
    script = [["\\boxed{42}", "\\boxed{41}", "\\boxed{41}"], ["ACCEPT", "ACCEPT", "REJECT"],
              ["\\boxed{42}"], ["ACCEPT"]]
    groups, _ = rollout(script, 3)
    batch = collate(groups.groups, pad_token_id=0)
    team = groups.correct
    assert team.tolist() == [True, False, True]
    adv = at_grpo_advantage(groups.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                            batch.extras["turn_rewards"], correct=team, num_roles=2, alpha=1.0, epsilon=0.0)
    proposer = torch.tensor([1.0 + 1, 0.0 + 0, 0.0 + 1], dtype=torch.float64)  # the first proposal's key (turn 0)
    verifier = torch.tensor([1.0 + 1, 0.0 + 0, 1.0 + 1], dtype=torch.float64)  # turn 1's key
    for row, episode in enumerate(groups.groups[0]):
        first_verifier_token = episode.extras["step_index"].index(1)
        assert adv[row, 0].item() == pytest.approx(((proposer - proposer.mean()) / proposer.std())[row].item(), rel=1e-6)
        assert adv[row, first_verifier_token].item() == pytest.approx(
            ((verifier - verifier.mean()) / verifier.std())[row].item(), rel=1e-6)
    corrected = groups.groups[0][2].extras["step_index"].index(2)
    assert adv[2, corrected].item() == 0.0  # turns 2 and 3 are alone in their keys


def test_the_prompt_and_bad_options():
    env = factory()()
    assert env.reset(PROBLEM).observation == PROBLEM.prompt + PROPOSER
    with pytest.raises(ConfigError, match="rounds"):  # the rounds are env.max_turns / 2: no second setting
        EnvFactory(EnvConfig(name="proposer_verifier", settings={"proposer_verifier": {"rounds": 2}}), EnvContext())
