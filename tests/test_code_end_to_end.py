"""Code benchmarks and code RL through the real CLI with the tiny model (scores near zero are fine)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

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
