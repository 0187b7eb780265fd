"""Sweeps that finish: the run status file and its config keys, the sweep presets as a config group,
and (slow) a real sweep with one invalid point and one failing run, relaunched."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import CONF_DIR, ROOT
from hydra_plugins.rlbench_sweeper.sweeper import next_job_number
from rlbench.analysis.runs import find_run_dirs, load_run
from rlbench.logger.run_status import (
    FAILED,
    FINISHED,
    config_key,
    finished_runs,
    group_key,
    read_status,
    write_status,
)


def test_config_key_ignores_where_a_run_writes_and_group_key_ignores_the_seed():
    base = {"algorithm": {"name": "grpo"}, "seed": 0, "run_name": "grpo-s0", "output_dir": "/a"}
    moved = {**base, "output_dir": "/b"}
    other_seed = {**base, "seed": 1, "run_name": "grpo-s1"}
    other_algorithm = {**base, "algorithm": {"name": "rloo"}}
    assert config_key(base) == config_key(moved)
    assert config_key(base) != config_key(other_seed) and group_key(base) == group_key(other_seed)
    assert group_key(base) != group_key(other_algorithm)
    assert len(config_key(base)) == 40 and int(config_key(base), 16) >= 0


def test_finished_runs_finds_finished_runs_below_sweep_folders_only(tmp_path):
    write_status(tmp_path / "a" / "0_x", FINISHED, "k1")
    write_status(tmp_path / "a" / "1_y", FAILED, "k2", error="boom")
    write_status(tmp_path / "b" / "0_z", FINISHED, "k3")
    (tmp_path / "a" / "2_broken").mkdir()
    (tmp_path / "a" / "2_broken" / "status.json").write_text("{not json")
    assert read_status(tmp_path / "a" / "2_broken") is None
    assert read_status(tmp_path / "a" / "1_y")["error"] == "boom"
    assert finished_runs([tmp_path / "a"]) == {"k1": tmp_path / "a" / "0_x"}
    assert set(finished_runs([tmp_path / "a", tmp_path / "b"])) == {"k1", "k3"}


def test_next_job_number_follows_the_largest_run_folder(tmp_path):
    assert next_job_number(tmp_path) == 0
    for name in ("0_grpo-s0", "7_rloo-s1", "notes", ".submitit"):
        (tmp_path / name).mkdir()
    assert next_job_number(tmp_path) == 8


@pytest.mark.parametrize("name, params", [
    ("algorithms", {"algorithm": "grpo,dr_grpo", "seed": "0,1,2"}),
    ("clip_higher", {"algorithm.loss.clip_high": "0.2,0.24,0.28,0.32", "seed": "0,1,2"}),
])
def test_sweep_presets_are_a_config_group_with_the_rlbench_sweeper(name, params):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"sweep={name}", "output_dir=/tmp/unused"], return_hydra_config=True)
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.rlbench_sweeper.sweeper.RlbenchSweeper"
    assert cfg.hydra.sweeper.skip_done is True
    assert dict(cfg.hydra.sweeper.params) == params


def test_the_sweep_group_is_the_yaml_files_of_the_top_level_sweeps_folder():
    """sweeps/ is the one home of sweep definitions: its YAML files are the options of the group (the
    README and the cluster launch files beside them are not), and conf/ has no sweep folder."""
    from rlbench.config.origin import SWEEPS_DIR, option_file
    from rlbench.listing import group_options

    names = sorted(path.stem for path in SWEEPS_DIR.glob("*.yaml"))
    assert SWEEPS_DIR == ROOT / "sweeps" and {"algorithms", "clip_higher"} <= set(names)
    readme = (SWEEPS_DIR / "README.md").read_text()
    assert all(f"| `{name}.yaml` |" in readme for name in names), "every sweep has a row in sweeps/README.md"
    assert group_options()["sweep"] == names and not (ROOT / "conf" / "sweep").exists()
    assert option_file("sweep", "algorithms") == SWEEPS_DIR / "algorithms.yaml"
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"), \
            pytest.raises(Exception, match="Could not find 'sweep/README'"):
        compose("config", overrides=["sweep=README"])


@pytest.mark.slow
def test_sweep_presets_compose_from_any_working_directory(tmp_path):
    """``rlbench sweep=<name> ... --cfg hydra`` run from a folder outside the repository shows the
    preset's points and its config changes (the launch files of sweeps/README.md rely on this)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "rlbench.cli", "sweep=clip_higher", "experiment=smoke", "--cfg", "all"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(proc.stdout)
    assert dict(cfg.hydra.sweeper.params) == {"algorithm.loss.clip_high": "0.2,0.24,0.28,0.32", "seed": "0,1,2"}
    assert cfg.hydra.runtime.choices["sweep"] == "clip_higher" and cfg.hydra.runtime.choices["algorithm"] == "dapo"
    assert cfg.model.name == "tiny"


def test_run_names_say_what_ran(make_cfg):
    """Trained runs: algorithm, model, training set, seed; evaluation-only runs: the model and the
    suite, not an algorithm and a training set they never used."""
    assert make_cfg("experiment=smoke", "seed=3").run_name == "grpo-tiny-arith-s3"
    assert make_cfg("mode=eval", "eval=math", "model=tiny").run_name == "eval-tiny-math-s0"


def _sweep(tmp_path, cwd, *overrides, folder="sweep"):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "-m", "experiment=smoke", "logger=files", "trainer.save_model=false",
         "trainer.steps=1", "eval.before_training=false", *overrides, f"hydra.sweep.dir={tmp_path / folder}"],
        cwd=cwd, capture_output=True, text=True, timeout=900, env=env,
    )


def _sweep_status(tmp_path):
    with open(tmp_path / "sweep" / "sweep_status.csv") as f:
        return {row["overrides"].split("eval=")[-1]: row for row in csv.DictReader(f)}


@pytest.mark.slow
def test_a_sweep_lists_invalid_points_first_goes_past_a_failure_and_a_relaunch_skips_finished_runs(tmp_path):
    """Three points, run from a folder outside the repository: eval=arith runs; eval=gsm8k with a
    data folder whose gsm8k file is not JSON passes validation (the file exists) and fails while
    loading; eval=math has no file there and is refused before any run starts."""
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text("not json\n")
    args = ("eval=gsm8k,arith,math", f"data_dir={data}", "data_source=local")
    proc = _sweep(tmp_path, tmp_path, *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    plan, _, end = proc.stderr.partition("Launching")
    assert "sweep: 3 points: 2 to run, 1 invalid, 0 already finished" in plan
    assert "invalid:" in plan and "eval=math" in plan and "MATH-500" in plan  # listed before any job
    status = _sweep_status(tmp_path)
    assert {point: row["status"] for point, row in status.items()} == {
        "gsm8k data_dir=" + str(data) + " data_source=local": FAILED,
        "arith data_dir=" + str(data) + " data_source=local": FINISHED,
        "math data_dir=" + str(data) + " data_source=local": "invalid",
    }
    failed = next(row for row in status.values() if row["status"] == FAILED)
    record = json.loads((tmp_path / "sweep" / os.path.basename(failed["output_dir"]) / "status.json").read_text())
    assert record["status"] == FAILED and "invalid JSON" in record["error"] and "Traceback" in record["traceback"]
    assert "eval=gsm8k" in record["overrides"]
    finished = next(row for row in status.values() if row["status"] == FINISHED)
    assert (tmp_path / "sweep" / os.path.basename(finished["output_dir"]) / "summary.json").is_file()

    relaunch = _sweep(tmp_path, tmp_path, *args)
    assert relaunch.returncode == 1
    assert "sweep: 3 points: 1 to run, 1 invalid, 1 already finished" in relaunch.stderr
    again = _sweep_status(tmp_path)
    assert [row["status"] for row in again.values()] == [FAILED, "skipped", "invalid"]
    assert again[next(iter(again))]["job"] == "2"  # the failed point ran again, in a new folder


@pytest.mark.slow
def test_a_relaunch_into_a_new_folder_reads_only_the_named_earlier_sweep_and_links_its_runs(tmp_path):
    """Finished points are looked for only in the sweep's own folder and in the earlier sweeps that
    ``hydra.sweeper.skip_finished_in`` names, never in a sibling folder; a point skipped because it
    finished elsewhere is linked into the new folder, so rlbench-compare of that folder sees every point."""
    assert _sweep(tmp_path, tmp_path, "seed=0", folder="first").returncode == 0
    (earlier,) = find_run_dirs([tmp_path / "first"])

    sibling = _sweep(tmp_path, tmp_path, "seed=0", folder="sibling")  # "first" beside it is not read
    assert sibling.returncode == 0 and "sweep: 1 points: 1 to run, 0 invalid, 0 already finished" in sibling.stderr

    refused = _sweep(tmp_path, tmp_path, "seed=0", f"hydra.sweeper.skip_finished_in=[{earlier}]", folder="refused")
    assert refused.returncode != 0 and "is not a sweep folder" in refused.stderr  # a run folder, not a sweep's
    assert not any(p.is_dir() for p in (tmp_path / "refused").glob("*"))  # refused before any point ran

    second = _sweep(tmp_path, tmp_path, "seed=0,1", f"hydra.sweeper.skip_finished_in=[{tmp_path / 'first'}]",
                    folder="second")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "sweep: 2 points: 1 to run, 0 invalid, 1 already finished" in second.stderr
    links = [p for p in (tmp_path / "second").iterdir() if p.is_symlink()]
    assert [(p.name.split("_")[0], p.resolve()) for p in links] == [("0", earlier)]
    assert not os.path.isabs(os.readlink(links[0]))  # relative: moving results/ keeps it valid
    runs = find_run_dirs([tmp_path / "second"])
    assert sorted(load_run(run).config["seed"] for run in runs) == [0, 1] and earlier in runs

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    compare = subprocess.run([sys.executable, "-m", "rlbench.analysis", str(tmp_path / "second"), "--by", "seed",
                              "--out", str(tmp_path / "compare"), "--resamples", "50"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert compare.returncode == 0, compare.stderr[-3000:]
    with open(tmp_path / "compare" / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 2


def test_the_slurm_launch_file_drives_a_named_sweep_into_its_fixed_folder(tmp_path):
    """sweeps/slurm_sweep.sh (run here with a stand-in ``rlbench`` that prints its arguments): the named
    sweep, the Slurm launcher with the partition, the fixed folder results/multirun/<name> (so a
    resubmission skips what finished), then the extra overrides; without PARTITION it refuses."""
    (tmp_path / "rlbench").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (tmp_path / "rlbench").chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "PARTITION": "gpu"}
    script = str(ROOT / "sweeps" / "slurm_sweep.sh")
    proc = subprocess.run(["bash", script, "clip_higher", "seed=0,1"], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["-m", "sweep=clip_higher", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                        "hydra.sweep.dir=results/multirun/clip_higher", "seed=0,1"]
    env.pop("PARTITION")
    refused = subprocess.run(["bash", script, "clip_higher"], env=env, capture_output=True, text=True, check=False)
    assert refused.returncode != 0 and "set PARTITION" in refused.stderr


@pytest.mark.slow
def test_a_sweep_without_its_data_folder_refuses_every_point_before_any_run(tmp_path):
    proc = _sweep(tmp_path, tmp_path, "eval=gsm8k", "seed=0,1", f"data_dir={tmp_path / 'nonexistent'}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "sweep: 2 points: 0 to run, 2 invalid, 0 already finished" in proc.stderr
    plan = proc.stderr.partition("sweep: 0 finished")[0]  # the plan; the end report repeats it
    assert plan.count("nonexistent is not a folder") == 2
    assert "Launching" not in proc.stderr and not find_run_dirs([tmp_path / "sweep"])
