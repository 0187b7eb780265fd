"""env=user_sim (rlbench/rollout/env/user_sim.py): the scripted user's dialogue (deterministic from the
problem's uid), per-turn rewards from the math grader, the reveal option, the option checks, and episodes
through rollout=multi_turn where EOS ends a turn, not the dialogue."""

from __future__ import annotations

import pytest
from test_env_multi_turn import EOS, ScriptedEngine, Tokens

from rlbench.config.schema import EnvConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.env import EnvContext, EnvFactory, validate_env
from rlbench.rollout.env.user_sim import INTRO
from rlbench.rollout.strategies.multi_turn import MultiTurnRollout

PROBLEM = Problem("a", "ignored", "0")  # its dialogue: 8 + 9 = 17, subtract 4 -> 13, subtract 4 -> 9


def factory(max_turns=3, **options):
    return EnvFactory(EnvConfig(name="user_sim", max_turns=max_turns, turn_tokens=8, max_observation_tokens=32,
                                settings={"user_sim": options}), EnvContext())


def apply_ops(lines):
    """The running totals the questions' text asks for, computed from the text alone."""
    first = lines[0][0].removeprefix("What is ").removesuffix("?").split(" + ")
    total, totals = int(first[0]) + int(first[1]), []
    totals.append(total)
    for question, _ in lines[1:]:
        verb, number = question.removeprefix("Now ").removesuffix(".").split(" ")
        total = total + int(number) if verb == "add" else total - int(number)
        totals.append(total)
    return totals


def test_the_script_is_the_uids_and_its_results_are_true():
    env = factory(max_turns=5, max_operand=20)()  # the dialogue lasts env.max_turns turns
    lines = env.script(Problem("seed-7", "any text", "1"))
    assert lines == env.script(Problem("seed-7", "other text", "2"))  # the uid decides, not the text
    assert len(lines) == 5 and [truth for _, truth in lines] == apply_ops(lines)
    assert lines != env.script(Problem("seed-8", "any text", "1"))
    assert factory()().reset(PROBLEM).observation == INTRO + "What is 8 + 9?"


def test_rewards_per_turn_and_a_wrong_answer_is_not_corrected():
    env = factory(turn_reward=2.0)()
    env.reset(PROBLEM)
    first = env.step("17\n")
    assert (first.reward, first.done, first.observation, first.state_key) == (2.0, False, "\nNow subtract 4.\n", (1, 17))
    second = env.step("It is 12.")  # wrong: the next question still builds on the true 13
    assert (second.reward, second.done, second.observation) == (0.0, False, "\nNow subtract 4.\n")
    last = env.step("\\boxed{9}")
    assert (last.reward, last.done, last.ended_by, last.state_key) == (2.0, True, "dialogue_end", (3, 9))
    assert env.grade(4.0).correct is False and env.grade(6.0).correct is True


def test_reveal_says_the_true_result():
    env = factory(reveal=True)()
    env.reset(PROBLEM)
    assert env.step("5").observation == "\nIt is 17. Now subtract 4.\n"


@pytest.mark.parametrize("options, message", [({"turns": 3}, "turns"),  # the length is env.max_turns: no second setting
                                              ({"max_operand": 0}, "max_operand must be >= 1"),
                                              ({"turn_reward": 0.0}, "turn_reward must be > 0"),
                                              ({"turnz": 2}, "turnz")])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        validate_env(EnvConfig(name="user_sim", settings={"user_sim": options}), "multi_turn")


def test_dialogues_through_multi_turn_eos_ends_the_turn_only():
    sampler = GroupSampler(ScriptedEngine([["17$", "17\n"], ["13$", "1\n"], ["9$", "9\n"]]), None, Tokens(),
                           {"user": "{problem}"}, lambda rewards, inputs: rewards)
    setup = RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 16), None, env=factory())
    groups, metrics, = MultiTurnRollout(setup).rollout([PROBLEM])
    right, once_wrong = groups.groups[0]
    assert groups.outcome.tolist() == [3.0, 2.0] and [g.correct for g in groups.grades] == [True, False]
    assert metrics["multi_turn_turns"] == 3 and metrics["multi_turn_ended_dialogue_end"] == 2
    # EOS stays in the response, the user's next line follows it (loss mask 0)
    assert right.response_ids[:3] == [ord("1"), ord("7"), EOS] and right.text.startswith("17\nNow subtract 4.\n13")
    assert right.loss_mask[:3] == [1, 1, 1] and right.loss_mask[3] == 0
    assert once_wrong.extras["turn_rewards"][-1] == 1.0 and 0.0 in once_wrong.extras["turn_rewards"]
