"""experiment=smoke through the real CLI: every result file, the offline wandb table, determinism."""

import csv
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlbench.runner import run

from conftest import ROOT

pytestmark = pytest.mark.slow  # integration tier: runs the runner or the CLI

from rlbench.training.step import TIMING_METRICS as TIMING_KEYS


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "experiment=smoke", f"hydra.run.dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_smoke_writes_every_result_file(smoke_run):
    out, proc = smoke_run
    assert "pass@k" in proc.stdout and "arith" in proc.stdout  # the printed table
    config = (out / "config.yaml").read_text()
    assert "name: tiny" in config and "${" not in config  # resolved

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for key in ("reward_mean", "reward_std", "accuracy", "advantage_mean", "advantage_std", "clip_fraction",
                "entropy", "response_length", "tokens_per_s", "step_s", "grad_norm", "policy_loss"):
        assert key in steps[0], key

    with open(out / "eval" / "passk.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["phase"] for r in rows} == {"before", "after"}
    for column in ("benchmark", "k", "pass_at_k", "ci_low", "ci_high", "maj_at_k", "mean_accuracy", "n", "problems"):
        assert column in rows[0], column
    after = [r for r in rows if r["phase"] == "after"]
    assert sorted(int(r["k"]) for r in after) == [1, 2, 4]
    assert all(int(r["n"]) == 4 and int(r["problems"]) == 4 for r in after)
    for r in rows:
        assert float(r["ci_low"]) <= float(r["pass_at_k"]) <= float(r["ci_high"])

    samples = [json.loads(line) for line in (out / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 4  # problems x n, final evaluation
    assert {"prompt_id", "completion", "extracted", "correct"} <= set(samples[0])
    # pass@1 in the table is the mean of per-problem correct fractions
    assert float(after[0]["pass_at_k"]) == pytest.approx(sum(s["correct"] for s in samples) / len(samples))

    with open(out / "eval" / "problems.csv") as f:
        problem_rows = list(csv.DictReader(f))
    assert {r["phase"] for r in problem_rows} == {"before", "after"}
    final = [r for r in problem_rows if r["phase"] == "after"]
    assert len(final) == 4 and all(int(r["n"]) == 4 for r in final)
    by_prompt = {}
    for s in samples:
        by_prompt[s["prompt_id"]] = by_prompt.get(s["prompt_id"], 0) + int(s["correct"])
    assert {r["uid"]: int(r["correct"]) for r in final} == by_prompt  # per-problem counts match the samples

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["pass_at_1_before"]) == {"arith"} and set(summary["pass_at_1_after"]) == {"arith"}
    assert summary["wall_seconds"] > 0 and "torch" in summary["versions"] and summary["git_commit"]
    assert (out / "policy" / "config.json").exists() and (out / "policy" / "model.safetensors").exists()


def test_smoke_offline_wandb_run_holds_the_passk_table(smoke_run):
    out, _ = smoke_run
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = list(runs[0].glob("files/media/table/eval/passk*.table.json"))
    assert tables, "the pass@k table was not logged to wandb"
    table = json.loads(tables[0].read_text())
    assert "pass_at_k" in table["columns"] and len(table["data"]) == 6  # 2 phases x 3 k
    with open(out / "eval" / "passk.csv") as f:
        csv_rows = list(csv.DictReader(f))
    col = table["columns"].index("pass_at_k")
    assert [round(r[col], 9) for r in table["data"]] == [round(float(r["pass_at_k"]), 9) for r in csv_rows]


def test_saved_policy_loads_for_evaluation(smoke_run, make_cfg):
    out, _ = smoke_run
    # reward=even_tokens: the smoke run's grader (it grades its evaluation too)
    summary = run(make_cfg("mode=eval", "model=checkpoint", f"model.path={out / 'policy'}", "logger=files", "reward=even_tokens",
                           "eval.n=4", "eval.k=[1,2,4]", "eval.limit=4", "rollout.max_new_tokens=8",
                           "dataset.arith.test_size=16"))
    assert summary["pass_at_1_before"] is None and set(summary["pass_at_1_after"]) == {"arith"}
    # named by the checkpoint it evaluated, not by the preset (rlbench/config/identity.py)
    assert summary["model"] == f"ckpt_{out.name}" and summary["model_source"] == str((out / "policy").resolve())
    assert summary["mode"] == "eval" and summary["algorithm"] is None and summary["dataset"] is None
    # the same problems and sampler as the run's own final evaluation: the same score
    assert summary["pass_at_1_after"] == json.loads((out / "summary.json").read_text())["pass_at_1_after"]


def _metrics_without_timing(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_same_seed_gives_identical_metrics_twice(tmp_path):
    from conftest import compose_config

    results = []
    for i in range(2):
        out = tmp_path / f"r{i}"
        run(compose_config(["experiment=smoke", "logger=files", "trainer.save_model=false", "seed=3"], out))
        results.append((_metrics_without_timing(out / "metrics.jsonl"), (out / "eval" / "passk.csv").read_text(),
                        (out / "eval" / "samples.jsonl").read_text()))
    assert results[0] == results[1]
    other = tmp_path / "other"
    run(compose_config(["experiment=smoke", "logger=files", "trainer.save_model=false", "seed=4"], other))
    assert (other / "eval" / "samples.jsonl").read_text() != results[0][2]


def test_a_run_whose_steps_learn_nothing_says_so(make_cfg, tmp_path, caplog):
    """DAPO with its overlong filter on the smoke setup (which turns the filter off): the tiny model never
    stops before max_new_tokens, so the filter masks every response. Each step is counted, the run warns once, and the statistics of the empty
    update are NaN, not 0."""
    cfg = make_cfg("experiment=smoke", "algorithm=dapo", "algorithm.overlong_filter=true",
                   "rollout.dynamic_sampling.max_rounds=1", "logger=files",
                   "trainer.save_model=false", "eval.before_training=false", "eval.n=2", "eval.k=[1]", "eval.limit=2")
    with caplog.at_level(logging.WARNING):
        summary = run(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["truncated_rate"] for s in steps] == [1.0, 1.0]
    assert [s["trainable_tokens"] for s in steps] == [0.0, 0.0]
    assert [s["steps_without_trainable_tokens"] for s in steps] == [1.0, 2.0]
    for key in ("entropy", "ratio_mean", "clip_fraction"):
        assert all(math.isnan(s[key]) for s in steps), key
    assert summary["steps_without_trainable_tokens"] == 2
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["steps_without_trainable_tokens"] == 2
    assert sum("no trainable token" in r.getMessage() for r in caplog.records) == 1


def test_a_run_that_learns_counts_no_untrained_step(smoke_run):
    out, _ = smoke_run
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(s["trainable_tokens"] > 0 and s["steps_without_trainable_tokens"] == 0 for s in steps)
    assert json.loads((out / "summary.json").read_text())["steps_without_trainable_tokens"] == 0
