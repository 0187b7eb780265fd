"""Evaluation through an environment (rlbench/eval/evaluate.py with ``env``; ``rlbench mode=eval env=<name>``):
each sample is an episode run by rollout=multi_turn's own episode loop and graded as training grades an
episode; pass@k over the episodes of a problem, in the same tables; the samples file lists every turn;
evaluation without an environment is unchanged."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
from conftest import compose_config
from test_env_multi_turn import EOS, Tokens

from rlbench.config.schema import EnvConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.eval.evaluate import Benchmark, evaluate
from rlbench.reward.math import MathReward
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.env import EnvContext, EnvFactory, python_tool
from rlbench.sandbox import SandboxLimits
from rlbench.validation import validate_config

GRID = re.compile(r"^[.AG]{3}$", re.MULTILINE)
MOVE_TOWARDS = (("down", 0, 1), ("up", 0, -1), ("right", 1, 1), ("left", 1, -1))


class GridPolicy:
    """A scripted policy for env=gridworld (3 x 3): ``sighted`` reads the last grid in its context (the
    first observation or the latest one) and moves A one cell towards G; blind it always answers "right".
    Records every request (the evaluation seeds each) and reports its budget as an engine does."""

    def __init__(self, sighted: bool):
        self.sighted, self.requests = sighted, []

    def move(self, context: str) -> str:
        rows = GRID.findall(context)[-3:]
        cell = {ch: (r, row.index(ch)) for r, row in enumerate(rows) for ch in "AG" if ch in row}
        (ar, ac), (gr, gc) = cell["A"], cell["G"]
        for word, axis, sign in MOVE_TOWARDS:
            if ((gr - ar, gc - ac)[axis]) * sign > 0:
                return word
        raise AssertionError("A is on G: the episode should have ended")

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            self.requests.append(r)
            context = "".join(chr(t) for t in (*r.prompt_ids, *r.prefix_ids))
            new = [ord(ch) for ch in (self.move(context) if self.sighted else "right") + "\n"][: params.max_new_tokens]
            if params.on_budget is not None:
                params.on_budget(params.max_new_tokens)
            logprobs = [math.nan] * len(r.prefix_ids) + [-0.5] * len(new)
            out.append([Completion(i, r.prompt_ids, [*r.prefix_ids, *new], logprobs, False)])
        return out


def gridworld(**caps):
    config = EnvConfig(name="gridworld", **{"max_turns": 6, "turn_tokens": 8, "max_tokens": 128, "max_tool_calls": 0,
                                            "max_observation_tokens": 32, **caps}, settings={"gridworld": {"size": 3}})
    return EnvFactory(config, EnvContext())


def grid_benchmark():
    return Benchmark("grid", {"prompt": {"user": "{problem}"}}, [Problem(f"layout{i}", "", "0") for i in range(6)], MathReward())


def eval_grid(policy, env=None, **kwargs):
    return evaluate(policy, Tokens(), [grid_benchmark()], n=2, ks=[1, 2], params=SamplingParams(1.0, 1.0, 16), seed=3,
                    progress_interval=0.0, env=env or gridworld(**kwargs))


def test_pass_at_1_counts_episodes_that_use_the_observation():
    sighted, blind = GridPolicy(sighted=True), GridPolicy(sighted=False)
    seeing, guessing = eval_grid(sighted), eval_grid(blind)
    assert seeing.pass_at(1) == {"grid": 1.0}  # every episode reaches G by reading the grids it is shown
    assert guessing.pass_at(1)["grid"] < 1.0  # "right" every turn reaches G only when G is right of A
    assert [r["k"] for r in seeing.rows] == [1, 2] and seeing.rows[0]["problems"] == 6  # the usual table
    assert {p["n"] for p in seeing.problems} == {2} and len(seeing.samples) == 12
    # the pass@1 of the table is the share of episodes graded correct
    assert guessing.pass_at(1)["grid"] == pytest.approx(sum(s["correct"] for s in guessing.samples) / 12)
    # every turn request has its own stream: the same seed gives the same episodes, turn 1 and later
    assert all(r.seed is not None for r in sighted.requests)
    assert {s["ended_by"] for s in seeing.samples} == {"goal"}
    assert {s["ended_by"] for s in guessing.samples} <= {"goal", "turn_cap"}
    assert all(s["finished"] == (s["ended_by"] == "goal") for s in guessing.samples)  # a turn cap is a cut-off sample


def test_the_samples_file_lists_every_turn():
    result = eval_grid(GridPolicy(sighted=True))
    longest = max(result.samples, key=lambda s: len(s["turns"]))
    assert len(longest["turns"]) >= 2
    for sample in result.samples:
        turns = sample["turns"]
        assert [t["turn"] for t in turns] == list(range(1, len(turns) + 1))
        assert all(t["policy"] in ("up\n", "down\n", "left\n", "right\n") for t in turns)
        assert all(GRID.findall(t["observation"]) for t in turns[:-1]) and turns[-1]["observation"] == ""
        assert "".join(t["policy"] + t["observation"] for t in turns) == sample["completion"]
        # the token counts cover every turn: the policy's and the observations'
        assert sample["policy_tokens"] == sum(len(t["policy"]) for t in turns)
        assert sample["response_tokens"] == len(sample["completion"])
    json.dumps(result.samples)  # samples.jsonl stays plain JSON


def test_the_budget_counts_every_turn(monkeypatch):
    from rlbench.eval import evaluate as module

    budgets, used = [], []

    class Recorded(module.BudgetProgress):
        def __init__(self, problems, n, max_new_tokens, *args, **kwargs):
            budgets.append((problems, n, max_new_tokens))
            super().__init__(problems, n, max_new_tokens, *args, **kwargs)

        def used(self, slots):
            used.append(slots)
            super().used(slots)

    monkeypatch.setattr(module, "BudgetProgress", Recorded)
    result = eval_grid(GridPolicy(sighted=False))
    assert budgets == [(6, 2, 6 * 8)]  # per sample: env.max_turns turns of env.turn_tokens
    turns = sum(len(s["turns"]) for s in result.samples)
    assert sum(used) == 8 * turns > 8 * len(result.samples)  # every turn's engine call reported its budget


class SingleTurn:
    """A single-turn engine: each sample answers \\boxed{<k>} (k its index), EOS-terminated."""

    def generate(self, requests, params, generator=None):
        return [[Completion(i, r.prompt_ids, [ord(ch) for ch in f"\\boxed{{{k}}}"] + [EOS], [-0.5] * 10, True,
                            text=f"\\boxed{{{k}}}") for k in range(r.n)] for i, r in enumerate(requests)]


def test_evaluation_without_an_environment_is_unchanged():
    bench = Benchmark("plain", {"prompt": {"user": "{problem}"}}, [Problem("a", "q", "1"), Problem("b", "q", "0")], MathReward())
    kwargs = dict(n=2, ks=[1, 2], params=SamplingParams(1.0, 1.0, 16), seed=3, progress_interval=0.0)
    default = evaluate(SingleTurn(), Tokens(), [bench], **kwargs)
    explicit = evaluate(SingleTurn(), Tokens(), [bench], env=None, **kwargs)
    assert default.rows == explicit.rows and default.samples == explicit.samples
    assert set(default.samples[0]) == {"benchmark", "prompt_id", "completion", "extracted", "extraction", "reference",
                                       "correct", "finished", "response_tokens", "grader_error"}
    assert default.pass_at(1) == {"plain": 0.5}


def test_rounds_and_generate_do_not_combine_with_an_environment(tmp_path):
    with pytest.raises(ValueError, match="do not combine"):
        evaluate(GridPolicy(True), Tokens(), [grid_benchmark()], n=1, ks=[1], params=SamplingParams(), seed=0,
                 env=gridworld(), rounds=2)
    with pytest.raises(ConfigError, match="eval.rounds=2"):
        validate_config(compose_config(["mode=eval", "env=gridworld", "experiment=smoke", "eval.rounds=2"], tmp_path))
    with pytest.raises(ConfigError, match="mode=generate writes single-turn traces"):
        validate_config(compose_config(["mode=generate", "env=gridworld", "experiment=smoke", f"out={tmp_path}/t.jsonl"], tmp_path))
    with pytest.raises(ConfigError, match="only used by rollout=multi_turn"):
        validate_config(compose_config(["env=gridworld", "experiment=smoke"], tmp_path))
    validate_config(compose_config(["mode=eval", "env=gridworld", "experiment=smoke"], tmp_path))


@pytest.mark.slow  # runs the runner (tiny model)
def test_mode_eval_through_an_environment_writes_its_tables(tmp_path):
    from rlbench.runner import run

    out = tmp_path / "run"
    summary = run(compose_config(["mode=eval", "env=gridworld", "experiment=smoke", "logger=files"], out))
    assert summary["status"] == "finished" and summary["pass_at_1_after"]["arith"] is not None
    with open(out / "eval" / "passk.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["phase"] for r in rows} == {"eval"} and sorted(int(r["k"]) for r in rows) == [1, 2, 4]
    samples = [json.loads(line) for line in (out / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 4 and all(s["turns"] and s["turns"][0]["turn"] == 1 for s in samples)
    assert all(1 <= len(s["turns"]) <= 6 for s in samples)  # conf/env/gridworld.yaml: max_turns 6
    assert float(rows[0]["pass_at_k"]) == pytest.approx(sum(s["correct"] for s in samples) / len(samples))


class ToolPolicy:
    """A scripted policy for env=python_tool: its first turn runs ``print(6*7)``; once it has seen the
    tool's output it answers with it (``sighted``) or, blind, with its own guess 41."""

    def __init__(self, sighted: bool):
        self.sighted = sighted

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            context = "".join(chr(t) for t in r.prefix_ids)
            seen = re.search(r"```output\n(\d+)", context)
            if seen is None:
                text = "Let me compute.\n```python\nprint(6*7)\n```"
            else:
                text = f"So the answer is \\boxed{{{seen.group(1) if self.sighted else 41}}}"
            new = [ord(ch) for ch in text] + ([EOS] if seen else [])
            out.append([Completion(i, r.prompt_ids, [*r.prefix_ids, *new], [math.nan] * len(r.prefix_ids) + [-0.5] * len(new),
                                   bool(seen))])
        return out


@pytest.mark.slow  # runs the sandbox
def test_python_tool_evaluation_runs_the_code_in_the_sandbox(monkeypatch):
    runs = []
    real = python_tool.run_tests

    def counted(program, tests, limits):
        runs.append((program, limits))
        return real(program, tests, limits)

    monkeypatch.setattr(python_tool, "run_tests", counted)
    limits = SandboxLimits(timeout_s=10.0)
    config = EnvConfig(name="python_tool", max_turns=4, turn_tokens=64, max_tokens=400, max_tool_calls=3,
                       max_observation_tokens=100, settings={"python_tool": {"max_output_chars": 256}})
    env = EnvFactory(config, EnvContext(sandbox_limits=limits))  # the benchmark's grader is put in by the evaluation
    bench = Benchmark("math", {"prompt": {"user": "{problem}"}}, [Problem("p1", "What is 6 times 7?", "42")], MathReward())
    kwargs = dict(n=2, ks=[1], params=SamplingParams(1.0, 1.0, 16), seed=0, progress_interval=0.0, env=env)
    seeing = evaluate(ToolPolicy(sighted=True), Tokens(), [bench], **kwargs)
    guessing = evaluate(ToolPolicy(sighted=False), Tokens(), [bench], **kwargs)
    assert seeing.pass_at(1) == {"math": 1.0} and guessing.pass_at(1) == {"math": 0.0}
    assert [p for p, _ in runs] == ["print(6*7)\n"] * 4 and {id(lim) for _, lim in runs} == {id(limits)}
    sample = seeing.samples[0]
    assert [t["turn"] for t in sample["turns"]] == [1, 2] and sample["turns"][0]["observation"] == "```output\n42\n```\n"
    assert sample["tool_calls"] == 1 and sample["extracted"] == "42" and sample["ended_by"] == "answer"
