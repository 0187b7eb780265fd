"""algorithm=retool (conf/algorithm/retool.yaml; ReTool, Feng et al. 2025, arXiv:2504.11536, section 3.1):
the preset composes to rollout=multi_turn with env=python_tool, and its spec's CPU checks on its own env
caps: execution exactly once per closed code block (k blocks, k sandbox runs; an unclosed block none), a
reward that does not depend on the number of calls (0, 1 or 3 calls, the same final answer, the same
reward), interpreter output masked from the loss."""

from __future__ import annotations

import pytest
from conftest import compose_config
from test_env_python_tool import PROBLEM, rollout, sandbox_runs  # noqa: F401  (sandbox_runs: a fixture)

from rlbench.config.schema import EnvConfig
from rlbench.reward.math import MathReward
from rlbench.rollout.env import EnvContext, EnvFactory
from rlbench.sandbox import SandboxLimits


def block(i):
    return f"```python\nprint({i}+1)\n```"


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return compose_config(["algorithm=retool"], tmp_path_factory.mktemp("retool"))


def preset_env(cfg):
    """The environment factory of the preset's composed env node (its caps and its python_tool block), with
    room for three calls and an answer (the preset's cap ends an episode at its third call)."""
    env = {**cfg.env, "max_tool_calls": 4}
    settings = {"python_tool": dict(env.pop("python_tool"))}
    return EnvFactory(EnvConfig(**env, settings=settings), EnvContext(grader=MathReward(), sandbox_limits=SandboxLimits(timeout_s=10.0)))


def test_the_preset_composes_a_tool_episode_run(preset):
    assert preset.algorithm.name == "retool" and preset.rollout.strategy == "multi_turn" and preset.env.name == "python_tool"
    assert preset.algorithm.kl.coef == 0.0 and preset.algorithm.fidelity.status == "partial"
    assert preset.env.max_turns >= 4  # room for the three-call episode below


@pytest.mark.slow  # runs the sandbox
def test_each_closed_block_runs_once_and_an_unclosed_one_never(preset, sandbox_runs):  # noqa: F811
    k = 3
    script = [[block(0), "```python\nprint(5)\n"], [block(1)], [block(2)], ["\\boxed{42}$"]]
    groups, metrics = rollout(script, 2, preset_env(preset))
    assert sandbox_runs == [f"print({i}+1)\n" for i in range(k)]  # k closed blocks, k runs; the unclosed one none
    written, unclosed = groups.groups[0]
    assert written.text.count("```output") == k and unclosed.text == "```python\nprint(5)\n"
    assert metrics["multi_turn_ended_unclosed_tool_tag"] == 1


@pytest.mark.slow  # runs the sandbox
def test_the_reward_is_the_same_with_zero_one_or_three_calls(preset, sandbox_runs):  # noqa: F811
    answer = "so \\boxed{42}$"
    script = [[answer, block(0), block(0)], [answer, block(1)], [block(2)], [answer]]
    groups, _ = rollout(script, 3, preset_env(preset))
    calls = [episode.text.count("```output") for episode in groups.groups[0]]
    assert calls == [0, 1, 3] and groups.outcome.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.slow  # runs the sandbox
def test_interpreter_output_is_masked_from_the_loss(preset, sandbox_runs):  # noqa: F811
    groups, _ = rollout([[block(41)], ["\\boxed{42}$"]], 1, preset_env(preset))
    (episode,) = groups.groups[0]
    observation = "```output\n42\n```\n"
    assert episode.text == block(41) + observation + "\\boxed{42}"
    assert episode.loss_mask == [1] * len(block(41)) + [0] * len(observation) + [1] * (len("\\boxed{42}") + 1)
