"""env=python_tool (rlbench/rollout/env/python_tool.py): each closed code block runs once in the code
sandbox, its output (cut to the set length) comes back as an observation with loss mask 0, the final
answer is graded by the math grader; an unclosed block ends the episode."""

from __future__ import annotations

import pytest
from test_env_multi_turn import ScriptedEngine, Tokens

from rlbench.config.schema import EnvConfig
from rlbench.dataset.base import Problem
from rlbench.reward.math import MathReward
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.env import EnvContext, EnvFactory, python_tool
from rlbench.rollout.env.python_tool import INSTRUCTIONS, tool_output
from rlbench.rollout.strategies.multi_turn import MultiTurnRollout
from rlbench.sandbox import SandboxLimits

PROBLEM = Problem("p1", "What is 6 times 7?", "42")
CODE = "```python\nprint(6*7)\n```"


@pytest.fixture
def sandbox_runs(monkeypatch):
    """The programs the environment sends to the sandbox, in order (each still runs there)."""
    runs = []
    real = python_tool.run_tests

    def counted(program, tests, limits):
        runs.append(program)
        return real(program, tests, limits)

    monkeypatch.setattr(python_tool, "run_tests", counted)
    return runs


def factory(max_output_chars=256, **caps):
    config = EnvConfig(name="python_tool", **{"max_turns": 4, "turn_tokens": 64, "max_tokens": 400, "max_tool_calls": 3,
                                              "max_observation_tokens": 100, **caps},
                       settings={"python_tool": {"max_output_chars": max_output_chars}})
    return EnvFactory(config, EnvContext(grader=MathReward(), sandbox_limits=SandboxLimits(timeout_s=10.0)))


def rollout(script, n, env_factory):
    sampler = GroupSampler(ScriptedEngine(script), MathReward(), Tokens(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 64), None, env=env_factory)
    return MultiTurnRollout(setup).rollout([PROBLEM])


@pytest.mark.slow  # runs the sandbox
def test_a_scripted_tool_episode(sandbox_runs):
    script = [["Let me compute. " + CODE + " trailing text", "The answer is \\boxed{41}$"],
              ["So \\boxed{42}$"]]
    groups, metrics = rollout(script, 2, factory())
    tool, _ = groups.groups[0]
    observation = "```output\n42\n```\n"
    assert tool.text == "Let me compute. " + CODE + observation + "So \\boxed{42}"
    policy = len("Let me compute. " + CODE)
    assert tool.loss_mask == [1] * policy + [0] * len(observation) + [1] * (len("So \\boxed{42}") + 1)
    assert sandbox_runs == ["print(6*7)\n"]  # the closed block ran exactly once; the turn was cut after it
    assert groups.outcome.tolist() == [1.0, 0.0] and [g.correct for g in groups.grades] == [True, False]
    assert metrics["multi_turn_tool_calls"] == 0.5 and metrics["multi_turn_tool_errors"] == 0.0
    assert metrics["multi_turn_ended_answer"] == 2


@pytest.mark.slow  # runs the sandbox
def test_the_reward_does_not_depend_on_the_number_of_calls(sandbox_runs):
    script = [[CODE, "\\boxed{42}$"], [CODE], ["\\boxed{42}$"]]
    groups, _ = rollout(script, 2, factory())
    assert groups.outcome.tolist() == [1.0, 1.0] and len(sandbox_runs) == 2
    assert groups.groups[0][0].text.count("```output") == 2


@pytest.mark.slow  # runs the sandbox
def test_errors_truncation_and_caps(sandbox_runs):
    long_print = "```python\nprint('x' * 500)\n```"
    crash = "```python\n1/0\n```"
    script = [[long_print, crash, "```python\nprint(1)\n"]]
    groups, metrics = rollout(script, 3, factory(max_output_chars=20, max_turns=1))
    cut, crashed, unclosed = groups.groups[0]
    assert metrics["multi_turn_ended_turn_cap"] == 2 and metrics["multi_turn_ended_unclosed_tool_tag"] == 1
    assert metrics["multi_turn_tool_errors"] == pytest.approx(1 / 3)
    assert cut.text == long_print and crashed.text == crash and unclosed.text == "```python\nprint(1)\n"
    assert len(sandbox_runs) == 2  # the unclosed block never ran
    text, failed = tool_output("x" * 500 + "\n", "passed", None, 20)
    assert text == "```output\n" + "x" * 20 + "...[truncated]\n```\n" and not failed
    text, failed = tool_output("", "load_error", "ZeroDivisionError: division by zero", 256)
    assert failed and "ZeroDivisionError" in text


@pytest.mark.slow  # runs the sandbox
def test_tool_call_cap_and_observation_cap(sandbox_runs):
    # after the last allowed call the policy sees its output and answers; a call past the cap is not run
    script = [[CODE, CODE], [CODE, "So \\boxed{42}$"]]
    groups, metrics = rollout(script, 2, factory(max_tool_calls=1))
    over, answered = groups.groups[0]
    assert metrics["multi_turn_ended_tool_call_cap"] == 1 and metrics["multi_turn_ended_answer"] == 1
    assert len(sandbox_runs) == 2  # one call per episode; the second episode's second block never ran
    assert over.text == CODE + "```output\n42\n```\n" + CODE and answered.text.endswith("So \\boxed{42}")
    assert groups.outcome.tolist() == [0.0, 1.0]
    _, metrics = rollout([[CODE]], 1, factory(max_observation_tokens=5))
    assert metrics["multi_turn_ended_observation_too_long"] == 1


def test_the_prompt_holds_the_instructions():
    env = factory()()
    start = env.reset(PROBLEM)
    assert start.observation == PROBLEM.prompt + INSTRUCTIONS and start.state_key == ()
