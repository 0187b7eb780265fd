"""wandb for multi-seed work, read back from offline runs: group (the config without the seed),
job type, tags, namespaced step metrics, evaluation curves (eval.every), unique and quiet sweep runs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from rlbench.config.schema import LoggerConfig
from rlbench.logger import RunLogger
from rlbench.logger.run_logger import eval_keys, wandb_group, wandb_key, wandb_run_name, wandb_tags


def wandb_records(run_dir: Path):
    """The protobuf records of an offline run's ``.wandb`` file: a LevelDB-style log (a 7-byte file
    header, 32 KiB blocks, each record a 7-byte header: CRC, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, chunks = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # still being written
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        yield record


def read_offline_run(out_dir: Path) -> tuple[dict, list[dict]]:
    """(run record: name, group, job_type, tags; history rows) of the one offline run below out_dir.
    wandb's service may still be writing the file when ``finish`` returns, so this waits (up to a
    minute) for the run's exit record."""
    (run_dir,) = (out_dir / "wandb").glob("offline-run-*")
    for _ in range(600):
        records = list(wandb_records(run_dir))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    run, history = None, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"name": record.run.display_name, "group": record.run.run_group, "job_type": record.run.job_type,
                   "tags": list(record.run.tags)}
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    assert run is not None, f"no run record in {run_dir}"
    return run, history


CONFIG = {"algorithm": {"name": "grpo"}, "model": {"name": "tiny"}, "dataset": {"name": "arith"},
          "rollout": {"strategy": "iid", "n": 4}, "seed": 0, "run_name": "grpo-tiny-arith-s0", "output_dir": "/x"}


@pytest.mark.parametrize("metric, key", [
    ("policy_loss", "actor/policy_loss"), ("clip_fraction", "actor/clip_fraction"), ("approx_kl", "actor/approx_kl"),
    ("entropy", "actor/entropy"), ("grad_norm", "actor/grad_norm"),
    ("reward_mean", "reward/reward_mean"), ("outcome_mean", "reward/outcome_mean"), ("accuracy", "reward/accuracy"),
    ("advantage_std", "reward/advantage_std"),
    ("response_length", "rollout/response_length"), ("rollout_outcome_mean", "rollout/rollout_outcome_mean"),
    ("truncated_rate", "rollout/truncated_rate"),
    ("generate_s", "timing/generate_s"), ("step_s", "timing/step_s"), ("tokens_per_s", "timing/tokens_per_s"),
])
def test_step_metrics_go_to_their_wandb_section(metric, key):
    assert wandb_key(metric) == key


def test_group_is_the_config_without_the_seed_and_sweep_names_are_unique():
    seed1 = {**CONFIG, "seed": 1, "run_name": "grpo-tiny-arith-s1", "output_dir": "/y"}
    other = {**CONFIG, "rollout": {"strategy": "iid", "n": 8}}
    assert wandb_group(CONFIG) == wandb_group(seed1) and wandb_group(CONFIG).startswith("grpo-tiny-arith-")
    assert wandb_group(other) != wandb_group(CONFIG)
    assert wandb_run_name(CONFIG, in_sweep=False) == "grpo-tiny-arith-s0"
    assert wandb_run_name(CONFIG, in_sweep=True) != wandb_run_name(other, in_sweep=True)
    assert wandb_run_name(CONFIG, in_sweep=True).startswith("grpo-tiny-arith-s0-")
    assert wandb_tags(CONFIG) == ["mode:train", "algorithm:grpo", "model:tiny", "dataset:arith", "rollout:iid"]


def test_eval_keys_one_key_per_value_and_no_maj_where_answers_cannot_vote():
    rows = [{"benchmark": "gsm8k", "k": 1, "pass_at_k": 0.5, "maj_at_k": 0.5},
            {"benchmark": "gsm8k", "k": 4, "pass_at_k": 0.75, "maj_at_k": 0.6},
            {"benchmark": "humaneval", "k": 1, "pass_at_k": 0.2, "maj_at_k": float("nan")}]
    assert eval_keys(rows) == {"eval/gsm8k/pass@1": 0.5, "eval/gsm8k/maj@1": 0.5, "eval/gsm8k/pass@4": 0.75,
                               "eval/gsm8k/maj@4": 0.6, "eval/humaneval/pass@1": 0.2}


@pytest.mark.slow
def test_an_offline_eval_run_has_its_job_type_tags_and_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = {**CONFIG, "mode": "eval", "eval": {"name": "gsm8k"}}
    logger = RunLogger(tmp_path, config, "{}", LoggerConfig(name="wandb", mode="auto", tags=["mine"]), job_type="eval")
    logger.log_evaluation(0, [{"benchmark": "arith", "k": 1, "pass_at_k": 0.25, "maj_at_k": 0.25, "phase": "eval"}])
    logger.finish()
    run, history = read_offline_run(tmp_path)
    assert run["job_type"] == "eval" and run["group"] == wandb_group(config)
    assert run["group"].startswith("eval-tiny-gsm8k-")  # what ran: no algorithm nor training set
    assert run["tags"] == ["mine", "mode:eval", "model:tiny", "benchmark:gsm8k", "rollout:iid"]
    assert [h["eval/arith/pass@1"] for h in history if "eval/arith/pass@1" in h] == [0.25]


def _cli(tmp_path, *args, multirun=False):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_SILENT", None)
    flags = ["-m"] if multirun else []
    proc = subprocess.run([sys.executable, "-m", "rlbench.cli", *flags, "experiment=smoke", "trainer.save_model=false", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_training_run_logs_namespaced_metrics_and_a_pass_at_k_curve(tmp_path):
    out = tmp_path / "run"
    _cli(tmp_path, "trainer.steps=4", "eval.every=2", f"hydra.run.dir={out}")
    run, history = read_offline_run(out)
    assert run["job_type"] == "train" and run["name"] == "grpo-tiny-arith-s0"
    assert run["group"].startswith("grpo-tiny-arith-") and "algorithm:grpo" in run["tags"]

    logged = {key for row in history for key in row if not key.startswith("_")}
    local = {key for line in (out / "metrics.jsonl").read_text().splitlines() for key in json.loads(line)} - {"step"}
    assert {wandb_key(key) for key in local} <= logged  # every step metric, under its section
    assert all(key.split("/")[0] in {"actor", "reward", "rollout", "timing", "eval"} for key in logged)
    assert not any(key.startswith("train/") for key in logged)

    with open(out / "eval" / "curve.csv") as f:
        curve = [row for row in csv.DictReader(f) if row["k"] == "1"]
    assert [(row["step"], row["phase"]) for row in curve] == [("0", "before"), ("2", "during"), ("4", "after")]
    wandb_curve = [(h["_step"], h["eval/arith/pass@1"]) for h in history if "eval/arith/pass@1" in h]
    assert wandb_curve == [(int(row["step"]), pytest.approx(float(row["pass_at_k"]))) for row in curve]
    with open(out / "eval" / "passk.csv") as f:
        after = {row["k"]: float(row["pass_at_k"]) for row in csv.DictReader(f) if row["phase"] == "after"}
    assert after["1"] == pytest.approx(float(curve[-1]["pass_at_k"]))


@pytest.mark.slow
def test_sweep_runs_get_unique_names_and_a_quiet_console(tmp_path):
    """A sweep over a key that the run name does not show."""
    sweep = tmp_path / "sweep"
    proc = _cli(tmp_path, "trainer.steps=1", "eval.before_training=false", "algorithm.loss.clip_high=0.2,0.3",
                f"hydra.sweep.dir={sweep}", multirun=True)
    assert "wandb:" not in proc.stdout + proc.stderr  # no banner or footer per job
    runs = [read_offline_run(d)[0] for d in sorted(sweep.glob("*_grpo-*"))]
    assert len(runs) == 2 and runs[0]["name"] != runs[1]["name"]
    assert runs[0]["group"] != runs[1]["group"]  # the configurations differ in more than the seed
