"""Code benchmarks and code RL through the real CLI with the tiny model (scores near zero are fine)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, needs_data

pytestmark = pytest.mark.slow  # integration tier: runs the runner or the CLI

SMALL = ["model=tiny", "logger=files", "eval.n=2", "eval.k=[1,2]", "eval.limit=3", "eval.max_new_tokens=16",
         "sandbox.timeout_s=3"]


def run_cli(out, *overrides):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlbench.cli", *overrides, f"hydra.run.dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@needs_data
def test_eval_mode_on_humaneval_and_mbpp_writes_the_result_files(tmp_path):
    out = tmp_path / "eval"
    proc = run_cli(out, "mode=eval", "eval=code", *SMALL)
    rows = read_csv(out / "eval" / "passk.csv")
    assert {r["benchmark"] for r in rows} == {"humaneval", "mbpp", "macro_avg"} and {r["phase"] for r in rows} == {"eval"}
    assert all(r["maj_at_k"] == "" for r in rows)  # programs do not vote: NaN, written empty
    problems = read_csv(out / "eval" / "problems.csv")
    assert len(problems) == 6 and all(int(r["n"]) == 2 for r in problems)
    samples = [json.loads(line) for line in (out / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * 2
    # every completion went through the sandbox: per-test outcomes are kept, or no code was found
    for s in samples:
        assert s["correct"] is False or s["grader_details"]["status"] == "passed"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["pass_at_1_after"]) == {"humaneval", "mbpp", "macro_avg"} and summary["pass_at_1_before"] is None
    assert "humaneval" in proc.stdout and "mbpp" in proc.stdout
    assert not (out / "policy").exists()  # nothing trained, nothing saved


@pytest.mark.slow
@needs_data
def test_code_rl_on_mbpp_train_runs_the_same_loop(tmp_path):
    out = tmp_path / "train"
    run_cli(out, "dataset=mbpp", "reward=code", "trainer.steps=2", "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=16", "eval.before_training=false",
            *SMALL)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(0.0 <= s["reward_mean"] <= 1.0 and s["grader_errors"] == 0 for s in steps)
    config = (out / "config.yaml").read_text()
    assert "name: mbpp" in config and "mode: all_pass" in config
    assert {r["benchmark"] for r in read_csv(out / "eval" / "passk.csv")} == {"humaneval", "mbpp", "macro_avg"}


class ScriptedEngine:
    """A rollout engine that answers with given texts (request i gets replies[i]); the rest of the
    evaluation (grading in the sandbox, pass@k, result rows) is the real one."""

    def __init__(self, replies):
        self.replies = replies

    def generate(self, requests, params, generator=None):
        from rlbench.rollout.engines.base import Completion

        groups = []
        for index, request in enumerate(requests):
            texts = self.replies.pop(0)
            assert len(texts) == request.n
            groups.append([Completion(index, request.prompt_ids, [1, 2], [0.0, 0.0], True, text=t) for t in texts])
        return groups

    def sync_weights(self, model):
        pass


@needs_data
def test_evaluation_grades_real_programs_into_pass_at_k(make_cfg):
    """Reference solutions pass and wrong ones fail through evaluate(): HumanEval's first two
    problems get (right, right) and (right, wrong); MBPP's first two get (wrong, wrong) and
    (right, crash). pass@1 must be 3/4 and 1/4, pass@2 1 and 1/2."""
    from rlbench.config.typed import typed_config
    from rlbench.eval.evaluate import evaluate
    from rlbench.model import load_policy
    from rlbench.rollout.engines.base import SamplingParams
    from rlbench.runner import load_benchmarks

    cfg = make_cfg("mode=eval", "eval=code", "eval.limit=2", "eval.n=2", "eval.k=[1,2]", "model=tiny")
    benchmarks = load_benchmarks(cfg, typed_config(cfg))
    _, tokenizer = load_policy(typed_config(cfg).model, device="cpu", seed=0)
    he, mb = benchmarks[0].problems, benchmarks[1].problems

    def fenced(code):
        return f"Here it is:\n```python\n{code}\n```"

    right_he = [fenced(p.prompt + p.answer) for p in he]
    right_mb = [fenced(p.answer) for p in mb]
    replies = [
        [right_he[0], right_he[0]], [right_he[1], fenced("def truncate_number(x):\n    return 0.0")],
        [fenced("def nothing():\n    pass"), "I cannot write code."], [right_mb[1], fenced("raise RuntimeError('boom')")],
    ]
    result = evaluate(ScriptedEngine(replies), tokenizer, benchmarks, n=2, ks=[1, 2],
                      params=SamplingParams(max_new_tokens=8), seed=0)
    table = {(r["benchmark"], r["k"]): r["pass_at_k"] for r in result.rows}
    assert table[("humaneval", 1)] == pytest.approx(0.75) and table[("humaneval", 2)] == pytest.approx(1.0)
    assert table[("mbpp", 1)] == pytest.approx(0.25) and table[("mbpp", 2)] == pytest.approx(0.5)
    assert table[("macro_avg", 1)] == pytest.approx(0.5)
    assert result.grader_errors == {"humaneval": 0, "mbpp": 0}
    statuses = [s.get("grader_details", {}).get("status") for s in result.samples]
    assert statuses == ["passed", "passed", "passed", "failed", "failed", None, "passed", "load_error"]
