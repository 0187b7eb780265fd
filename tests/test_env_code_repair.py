"""env=code_repair (rlbench/rollout/env/code_repair.py) and dataset=toy_repos (rlbench/dataset/toy_repos.py):
scripted-policy episodes through rollout=multi_turn. Writing the fix and running the tests gets reward 1 on the
final turn's tokens; running the tests without fixing gets 0; a path-traversal edit, the test file and an
unknown file are refused; a turn without an action or with an unclosed edit block ends the episode; the tests
run in the code sandbox (never in this process); every generated repository fails its tests and its fix passes."""

from __future__ import annotations

import sys

import pytest
from test_env_multi_turn import ScriptedEngine, Tokens

from rlbench.config.schema import EnvConfig
from rlbench.dataset.base import Problem
from rlbench.dataset.sources import load_problems
from rlbench.dataset.toy_repos import BUGS, generate_toy_repos, toy_repo
from rlbench.errors import ConfigError
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.env import EnvContext, EnvFactory, code_repair, validate_env
from rlbench.rollout.env.code_repair import RUN_MARKER, first_action
from rlbench.rollout.strategies.multi_turn import MultiTurnRollout
from rlbench.sandbox import SandboxLimits

REPO = generate_toy_repos(1, 0, "train")[0]
MODULE = REPO.meta["module"] + ".py"


def edit(path, text):
    return f"```edit path={path}\n{text}```"


FIX = "I will fix it.\n" + edit(MODULE, REPO.answer)


@pytest.fixture
def sandbox_runs(monkeypatch):
    """The sandbox results of the environment's test runs, in order (each still runs in the sandbox)."""
    runs = []
    real = code_repair.run_tests

    def counted(program, tests, limits):
        result = real(program, tests, limits)
        runs.append(result)
        return result

    monkeypatch.setattr(code_repair, "run_tests", counted)
    return runs


def factory(**caps):
    config = EnvConfig(name="code_repair", **{"max_turns": 4, "turn_tokens": 600, "max_tokens": 4000, "max_tool_calls": 4,
                                              "max_observation_tokens": 600, "step_timeout_s": 60.0, **caps},
                       settings={"code_repair": {"max_output_chars": 400}})
    return EnvFactory(config, EnvContext(sandbox_limits=SandboxLimits(timeout_s=10.0)))


def rollout(script, n, env_factory=None, problem=REPO):
    sampler = GroupSampler(ScriptedEngine(script), None, Tokens(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 64), None, env=env_factory or factory())
    return MultiTurnRollout(setup).rollout([problem])


@pytest.mark.slow  # runs the sandbox
def test_the_fix_then_the_tests_gets_reward_one_at_the_final_token_and_no_fix_gets_zero(sandbox_runs):
    script = [[FIX, RUN_MARKER], [RUN_MARKER, "I do not know.$"]]
    groups, metrics = rollout(script, 2)
    fixed, unfixed = groups.groups[0]
    assert groups.outcome.tolist() == [1.0, 0.0] and [g.correct for g in groups.grades] == [True, False]
    edited = f"```output\nedited {MODULE} ({REPO.answer.count(chr(10))} lines)\n```\n"
    assert fixed.text == FIX + edited + RUN_MARKER  # the turn is cut just after the action
    assert fixed.loss_mask == [1] * len(FIX) + [0] * len(edited) + [1] * len(RUN_MARKER)
    # the reward sits on the last turn (the final token); the edit turn and the observation carry 0
    assert fixed.extras["turn_rewards"][-1] == 1.0 and set(fixed.extras["turn_rewards"][:-len(RUN_MARKER)]) == {0.0}
    # the unfixed episode: its test run reports the two failing asserts, then a turn without an action ends it
    report = unfixed.text[len(RUN_MARKER):-len("I do not know.")]
    assert report.startswith("```output\n1 passed, 2 failed\nFAILED assert ")
    assert unfixed.extras["turn_rewards"] == [0.0] * len(unfixed.response_ids)
    assert metrics["multi_turn_ended_tests_passed"] == 1 and metrics["multi_turn_ended_no_action"] == 1
    # both test runs went through the sandbox, with the verdict computed outside the program's process
    assert [r.status for r in sandbox_runs] == ["failed", "passed"]  # turn 1: the unfixed run; turn 2: the fixed one
    assert all("verdict_outside" in r.isolation for r in sandbox_runs)
    assert REPO.meta["module"] not in sys.modules  # the trainer's process never imported the model's code


@pytest.mark.slow  # runs the sandbox
def test_refused_edits_leave_the_repository_unchanged(sandbox_runs):
    traversal = edit("../" + MODULE, REPO.answer)
    script = [[traversal, edit(REPO.meta["test_path"], "assert True\n"), edit("new.py", "x = 1\n"), "```edit\nx\n```"],
              [RUN_MARKER] * 4, ["done$"] * 4]
    groups, metrics = rollout(script, 4)
    observations = [c.text.split("```output\n")[1].split("\n```")[0] for c in groups.groups[0]]
    assert observations[0] == f"edit refused: '../{MODULE}' is not a plain path inside the repository"
    assert observations[1] == f"edit refused: {REPO.meta['test_path']} holds the tests and is read-only"
    assert observations[2].startswith("edit refused: there is no file 'new.py'")
    assert observations[3] == "edit refused: the block's first line must be ```edit path=<file>"
    assert metrics["multi_turn_tool_errors"] == 1.0  # each refusal is a failed tool call
    assert groups.outcome.tolist() == [0.0] * 4 and [r.status for r in sandbox_runs] == ["failed"] * 4


def test_bad_turns_end_the_episode():
    groups, metrics = rollout([["just text$", "```edit path=" + MODULE + "\nunfinished"]], 2, factory(turn_tokens=40))
    assert metrics["multi_turn_ended_no_action"] == 1 and metrics["multi_turn_ended_unclosed_block"] == 1
    assert groups.outcome.tolist() == [0.0, 0.0]


def test_the_first_action_decides_the_turn():
    assert first_action("go RUN_TESTS ```edit path=a.py\nx\n```") == ("run", 12, None)
    kind, end, match = first_action("```edit path=a.py\nx = 1\n```\nRUN_TESTS")
    assert (kind, end, match.group(2)) == ("edit", len("```edit path=a.py\nx = 1\n```"), "x = 1\n")
    assert first_action("```edit path=a.py\nx = 1\n")[0] == "unclosed" and first_action("nothing")[0] == "none"
    env = factory()()
    start = env.reset(REPO)
    assert start.observation.startswith(REPO.prompt) and f"```file path={MODULE}\n" in start.observation
    assert env.turn_end("RUN_TESTS and more") == len("RUN_TESTS") and env.turn_end("thinking") is None


def test_any_problem_gets_a_repository_from_its_uid():
    env = factory()()
    env.reset(Problem("arith/train/3", "1 + 2", "3"))
    assert env.repo == toy_repo("arith/train/3") and env.files == toy_repo("arith/train/3").files


def test_every_bug_fails_its_tests_and_every_fix_passes():
    """The generator's own repositories (trusted code, run here): two asserts fail on the bug, all pass on the fix."""
    problems = generate_toy_repos(64, 1, "train")
    assert {p.meta["bug"] for p in problems} == set(BUGS)
    for p in problems:
        for text, failures in ((p.meta["files"][p.meta["module"] + ".py"], 2), (p.answer, 0)):
            namespace: dict = {}
            exec(text, namespace)  # noqa: S102 - generated by the test's own generator
            failed = 0
            for test in p.meta["tests"]:
                try:
                    exec(test, dict(namespace))  # noqa: S102
                except AssertionError:
                    failed += 1
            assert failed == failures, (p.uid, text)


def test_the_dataset_is_deterministic_and_its_splits_disjoint():
    spec = {"name": "toy_repos", "loader": "toy_repos", "toy_repos": {"train_size": 40, "test_size": 10, "seed": None},
            "prompt": {"system": None, "user": "{problem}"}}
    train, again = load_problems(spec, "train", seed=3), load_problems(spec, "train", seed=3)
    test = load_problems(spec, "test", seed=3)
    assert [p.meta for p in train] == [p.meta for p in again] and len(train) == 40 and len(test) == 10
    assert train[0].uid == "toy_repos/train/0"
    texts = {split: {"".join(p.meta["files"].values()) for p in problems} for split, problems in (("train", train), ("test", test))}
    assert not texts["train"] & texts["test"]
    with pytest.raises(ConfigError, match="toy_repos.train_size"):
        load_problems({**spec, "toy_repos": {"train_size": -1}}, "train")
    with pytest.raises(ConfigError, match="max_output_chars must be >= 1"):
        validate_env(EnvConfig(name="code_repair", settings={"code_repair": {"max_output_chars": 0}}), "multi_turn")
