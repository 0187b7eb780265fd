"""Checkpoints and exact resume (docs/resume.md): atomic checkpoints that fall back to the previous
valid one, the config check of a resumed run, stop signals, and runs killed (SIGKILL, SIGINT) at
deterministic points (RLBENCH_KILL_AT, rlbench/faults.py) and resumed, which must give the metrics
and evaluation files of the run that was never interrupted, bit for bit."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, compose_config
from rlbench import faults
from rlbench.cli import resume_arguments
from rlbench.config.schema import LoggerConfig
from rlbench.errors import ConfigError
from rlbench.training import checkpoint
from rlbench.training.checkpoint import CheckpointError
from rlbench.training.interrupt import Interrupted, StopSignals
from rlbench.training.curricula import PromptSampler
from rlbench.training.step import TIMING_METRICS

RESULT_FILES = ("eval/passk.csv", "eval/problems.csv", "eval/samples.jsonl", "eval/curve.csv")


# ------------------------------------------------------------------------------ checkpoints on disk


def save(run_dir, step, payload, keep=None):
    return checkpoint.save_checkpoint(run_dir, step, {"state.pt": payload}, {"config": {"seed": 0}}, keep=keep)


def test_checkpoint_round_trip_and_keep(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, {"step": step, "weights": torch.full((3,), float(step))}, keep=2)
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step_000002", "step_000003"]
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest.step == 3
    assert torch.equal(latest.load("state.pt")["weights"], torch.full((3,), 3.0))


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    save(tmp_path, 2, {"w": torch.zeros(100)})
    newest = save(tmp_path, 4, {"w": torch.ones(100)})
    data = (newest.path / "state.pt").read_bytes()
    (newest.path / "state.pt").write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING):
        assert checkpoint.latest_checkpoint(tmp_path).step == 2
    assert "step_000004" in caplog.text and "previous valid checkpoint" in caplog.text


def test_a_checkpoint_killed_mid_write_is_invisible(tmp_path):
    """What a writer killed before the rename leaves: a hidden temporary folder, never step_<N>."""
    save(tmp_path, 2, {"w": torch.zeros(1)})
    leftover = tmp_path / "checkpoints" / ".step_000004.tmp-abc"
    leftover.mkdir()
    (leftover / "model.pt").write_bytes(b"half")
    assert checkpoint.latest_checkpoint(tmp_path).step == 2
    save(tmp_path, 4, {"w": torch.zeros(1)})  # the next save removes the leftover
    assert not leftover.exists()


def test_a_folder_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        checkpoint.latest_checkpoint(tmp_path)
    broken = tmp_path / "checkpoints" / "step_000001"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="invalid: .*manifest"):
        checkpoint.latest_checkpoint(tmp_path)


def test_unreadable_checkpoint_file_names_it(tmp_path):
    save(tmp_path, 1, {"w": torch.zeros(1)})
    saved = save(tmp_path, 2, {"w": torch.zeros(1)})
    (saved.path / "state.pt").write_bytes(b"x" * saved.manifest["files"]["state.pt"])  # right size, garbage
    with pytest.raises(CheckpointError, match="state.pt cannot be read"):
        checkpoint.latest_checkpoint(tmp_path).load("state.pt")
    assert checkpoint.latest_checkpoint(tmp_path, before_step=2).step == 1  # where a resumed run goes instead
    with pytest.raises(CheckpointError, match="older than step 1"):
        checkpoint.latest_checkpoint(tmp_path, before_step=1)


def test_resume_auto_takes_the_run_with_the_newest_checkpoint(tmp_path):
    older, newer = tmp_path / "b_older", tmp_path / "a_newer"
    save(older, 5, {})
    save(newer, 1, {})
    os.utime(older / "checkpoints" / "step_000005", (1, 1))
    assert checkpoint.find_latest_run(tmp_path) == newer
    with pytest.raises(CheckpointError, match="no run folder"):
        checkpoint.find_latest_run(tmp_path / "empty")


# ------------------------------------------------------------------------------ the config of a resumed run


def test_changed_keys_are_listed_and_allowed_ones_pass(tmp_path):
    saved = {"seed": 0, "trainer": {"steps": 4, "lr": 0.1}, "eval": {"n": 4}, "output_dir": "a", "resume": None}
    current = {"seed": 1, "trainer": {"steps": 8, "lr": 0.1}, "eval": {"n": 8}, "output_dir": "b", "resume": "a"}
    assert checkpoint.changed_keys(saved, current) == {"eval.n": (4, 8), "seed": (0, 1), "trainer.steps": (4, 8)}
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_resume_config(saved, current, ["trainer.steps"], tmp_path)
    message = str(refused.value)
    assert "seed: 0 -> 1" in message and "eval.n: 4 -> 8" in message and "trainer.steps" not in message.split("allow")[0]
    assert "resume_allow=[eval.n,seed]" in message
    assert checkpoint.check_resume_config(saved, current, ["trainer.steps", "eval", "seed"], tmp_path)


def test_resume_arguments_replay_the_runs_overrides(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 2, {}, {"overrides": ["experiment=smoke", "trainer.steps=4", "resume_allow=[x]"]})
    args = resume_arguments([f"resume={tmp_path}", "trainer.steps=8", "resume_allow=[trainer.steps]"])
    folder = tmp_path.resolve()
    assert args == ["experiment=smoke", "trainer.steps=8", "resume_allow=[trainer.steps]", f"resume={folder}",
                    f"hydra.run.dir={folder}"]
    assert resume_arguments(["seed=1"]) == ["seed=1"]


# ------------------------------------------------------------------------------ stateful parts


def test_prompt_sampler_continues_its_order():
    problems = list(range(7))
    first, second = PromptSampler(problems, 3), PromptSampler(problems, 3)
    first.next(5)
    second.load_state_dict(first.state_dict())
    assert second.next(12) == first.next(12)


def test_global_random_state_round_trip():
    state = checkpoint.global_random_state()
    import random

    import numpy as np

    drawn = (random.random(), np.random.rand(), torch.rand(2))
    checkpoint.load_global_random_state(state)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def test_kill_points_do_nothing_without_the_variable(monkeypatch):
    monkeypatch.delenv(faults.KILL_ENV, raising=False)
    faults.at_step(3)
    faults.kill_point("update")  # returns
    monkeypatch.setenv(faults.KILL_ENV, "update:4")
    faults.kill_point("update")  # another step: returns
    assert os.environ[faults.KILL_ENV] == "update:4"


def test_a_kill_point_for_one_rank_signals_that_rank_only(monkeypatch):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        faults.at_step(2)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv(faults.KILL_ENV, "generate:2:USR1:1")
        faults.kill_point("generate")  # rank 0: returns
        assert received == [] and os.environ[faults.KILL_ENV] == "generate:2:USR1:1"
        monkeypatch.setenv("RANK", "1")
        faults.kill_point("generate")
        assert received == [signal.SIGUSR1] and faults.KILL_ENV not in os.environ
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_checkpoint_resumes_only_on_its_strategy_and_world_size(tmp_path):
    saved = checkpoint.save_checkpoint(tmp_path, 2, {}, {})  # a single process: strategy single, 1 rank
    assert (saved.manifest["parallelism"], saved.manifest["world_size"]) == ("single", 1)
    checkpoint.check_resume_world(saved, "single", 1)
    with pytest.raises(ConfigError, match=r"trainer.parallelism=single by 1 process\(es\), but this run has trainer.parallelism=ddp and 2"):
        checkpoint.check_resume_world(saved, "ddp", 2)
    two_ranks = checkpoint.Checkpoint(saved.path, {**saved.manifest, "parallelism": "fsdp", "world_size": 2})
    checkpoint.check_resume_world(two_ranks, "fsdp", 2)
    for strategy, size in (("fsdp", 4), ("ddp", 2), ("fsdp", 1)):
        with pytest.raises(ConfigError, match="torchrun --nproc_per_node 2"):
            checkpoint.check_resume_world(two_ranks, strategy, size)


def test_a_signal_inside_a_step_waits_for_its_end():
    before = signal.getsignal(signal.SIGINT)  # pytest's or, in an xdist worker, SIG_IGN
    with StopSignals() as stop:
        with stop.step():
            os.kill(os.getpid(), signal.SIGTERM)  # deferred: the step goes on
            finished = True
        assert finished
        with pytest.raises(Interrupted) as stopped:
            stop.raise_if_requested()
    assert stopped.value.exit_code == 143 and not stopped.value.mid_step
    with StopSignals() as stop, pytest.raises(Interrupted) as again:
        with stop.step():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # a second signal stops at once
    assert again.value.mid_step and again.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is before  # the handlers in place before are restored


def test_logger_resumes_its_wandb_run_and_marks_an_interrupted_one(tmp_path, monkeypatch):
    """The resumed logger continues the run id and metrics.jsonl as checkpointed; finish(130) is the
    wandb run's exit code (wandb shows the run failed)."""
    from test_wandb_logging import CONFIG, wandb_records

    from rlbench.logger import RunLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    first = RunLogger(tmp_path, CONFIG, "{}", LoggerConfig(name="wandb", mode="auto"))
    first.log_step(1, {"reward_mean": 0.5})
    state = first.state_dict()
    first.log_step(2, {"reward_mean": 0.7})  # after the checkpoint: dropped on resume
    first.finish(exit_code=130)
    (first_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    exits = []
    for _ in range(600):
        exits = [r.exit.exit_code for r in wandb_records(first_dir) if r.WhichOneof("record_type") == "exit"]
        if exits:
            break
        time.sleep(0.1)
    assert exits == [130]
    second = RunLogger(tmp_path, CONFIG, "{}", LoggerConfig(name="wandb", mode="auto"), resume_id=state["run_id"])
    second.load_state_dict(state)
    assert second.run_id == state["run_id"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    second.finish()


def test_comparisons_leave_out_runs_that_did_not_finish(tmp_path, caplog):
    from rlbench.analysis.runs import find_run_dirs
    from rlbench.logger.run_status import write_status

    for name, status in (("done", "finished"), ("stopped", "interrupted"), ("killed", "running"), ("bare", None)):
        (tmp_path / name / "eval").mkdir(parents=True)
        (tmp_path / name / "eval" / "problems.csv").write_text("phase,benchmark,uid,n,correct\n")
        if status:
            write_status(tmp_path / name, status, "key")
    with caplog.at_level(logging.WARNING):
        assert [p.name for p in find_run_dirs([tmp_path])] == ["bare", "done"]
    assert "stopped is left out" in caplog.text and "resume=" in caplog.text


# ------------------------------------------------------------------------------ runs: resumed == uninterrupted


def metrics_without_timing(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_METRICS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_results(reference: Path, resumed: Path) -> None:
    assert metrics_without_timing(resumed) == metrics_without_timing(reference)
    for name in RESULT_FILES:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name


SMOKE = ["experiment=smoke", "trainer.steps=4", "trainer.checkpoint_every=2", "eval.every=2", "trainer.save_model=false"]

# Presets whose state across steps is not trivial: the critic (ppo; its separate model), the EWMA proximal policy
# (ppo_ewma), SPO's tracker and stored responses, SFPO's entropy switch, dynamic sampling (dapo),
# ReMax's greedy stream, PVPO's cached anchors, and adaptive KL and entropy coefficients. Each setting
# makes the state matter within 4 steps (a resume that dropped it was measured to fail, except ReMax's
# greedy stream, which greedy decoding never draws from).
STATEFUL_PRESETS = {
    "ppo": ["algorithm=ppo"],
    # the separate critic's weights and AdamW moments (algorithm.critic.model=separate; its lr high enough to matter)
    "ppo_separate_critic": ["algorithm=ppo", "algorithm.critic.model=separate", "algorithm.critic.lr=1e-3"],
    "ppo_ewma": ["algorithm=ppo_ewma"],
    "spo": ["algorithm=spo", "dataset.arith.train_size=2"],  # every step revisits both prompts: the tracker matters
    # the switch reads 3 entropies, so at step 4 it fires only with steps 1-3 in its history
    "sfpo": ["algorithm=sfpo", "algorithm.update.sfpo.entropy_window=3", "algorithm.update.sfpo.entropy_z=-100"],
    "dapo": ["algorithm=dapo"],
    "remax": ["algorithm=remax"],
    "pvpo": ["algorithm=pvpo"],
    "adaptive": ["algorithm=grpo", "algorithm.kl.coef=0.05", "algorithm.kl.adaptive={target:0.001,horizon:10}",
                 "algorithm.entropy_adaptive={target:5.0,delta:0.01}"],
    # SALSA's soup takes its snapshots at updates 1 and 2, before the checkpoint; the experience library
    "salsa": ["algorithm=salsa", "algorithm.reference_soup.every=1", "algorithm.reference_soup.models=3"],
    "training_free_grpo": ["algorithm=training_free_grpo"],
    # a pairwise loss: the reference model, mini-batches of whole groups drawn from the mini-batch stream
    "dpo": ["algorithm=dpo", "algorithm.loss.pairing=all", "algorithm.update.minibatches=2"],
    # INPO's rounds: step 2's checkpoint is inside the first 3-step round, so it holds pi_t (a later round's pi_t,
    # which differs from the initial policy, is restored in tests/test_rounds.py)
    "inpo_rounds": ["algorithm=inpo", "algorithm.update.round_steps=3"],
    # trainer.aux_tasks (SPARK): step 3 draws from the task buffer built at steps 1-2 (measured to fail without it)
    "aux_tasks": ["+trainer.aux_tasks.share=0.5", "trainer.prompts_per_step=4"],
    # CLPO's rewrite pool (rlbench's earlier next-steps mix): steps 1-2 fill it (every well-formed rewrite kept), steps
    # 3-4 draw half their prompts from it
    "clpo": ["prompt_sampler=clpo", "trainer.prompt_sampler.clpo.mixing=next_steps",
             "trainer.prompt_sampler.clpo.acceptance=agreement", "trainer.prompt_sampler.clpo.agreement=0",
             "trainer.prompt_sampler.clpo.share=0.5"],
    # the release's same-step mix with the dynamic KL: the rewriting stream and the attempts are in the checkpoint
    "clpo_same_step": ["prompt_sampler=clpo", "trainer.prompt_sampler.clpo.acceptance=agreement",
                       "trainer.prompt_sampler.clpo.agreement=0", "trainer.prompt_sampler.clpo.rewrite_tokens=16",
                       "algorithm.kl.coef=0.001", "+algorithm.kl.difficulty_scale.hard=0.5"],
    # QRPO's K pi_ref samples per prompt: the cache file in the run folder is read back, never the policy's stream
    "qrpo_reference": ["algorithm=qrpo", "algorithm.qrpo.reference_samples=3"],
    # Clip-Cov's random pick: the loss's generator derives from (seed, step, micro-batch), nothing checkpointed; the
    # wide band makes half the tokens candidates, so the pick changes the update
    "clip_cov": ["algorithm=clip_cov", "algorithm.loss.clip_cov_ratio=0.5", "algorithm.loss.clip_cov_lb=-1e9",
                 "algorithm.loss.clip_cov_ub=1e9"],
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(STATEFUL_PRESETS))
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(preset, tmp_path):
    """Step 2's checkpoint of a 4-step run, resumed in a copy of the run folder, gives steps 3-4 and
    the final evaluation of the run itself."""
    reference, resumed = run_and_resume_from_step_2([*SMOKE, *STATEFUL_PRESETS[preset], "logger=files"], tmp_path)
    assert_same_results(reference, resumed)


def run_and_resume_from_step_2(overrides: list[str], tmp_path: Path) -> tuple[Path, Path]:
    """(the run folder of a 4-step run checkpointed every 2 steps, the folder of its step-2 checkpoint resumed
    in a copy of it)."""
    from rlbench.runner import run

    reference = tmp_path / "reference"
    run(compose_config(overrides, reference))
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed, ignore=shutil.ignore_patterns("step_000004"))
    summary = run(compose_config([*overrides, f"resume={resumed}"], resumed))
    assert summary["resumed_from_step"] == 2
    return reference, resumed


def run_cli(args, run_dir, kill_at=None, processes=None):
    """``python -m rlbench.cli`` (or, with ``processes``, ``torchrun --nproc_per_node <processes>``)."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_API_KEY", None)
    # this test process's own wandb service (started by an in-process test) would hold the killed run's id
    env.pop("WANDB_SERVICE", None)
    env.pop(faults.KILL_ENV, None)
    if kill_at:
        env[faults.KILL_ENV] = kill_at
    launcher = [sys.executable] if processes is None else [
        str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(processes)]
    return subprocess.run([*launcher, "-m", "rlbench.cli", *args, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "uninterrupted"
    proc = run_cli(SMOKE, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "evaluating (before)" in proc.stdout + proc.stderr  # what a resumed run must not say
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_at, resumed_from", [
    ("generate:3", 2),     # during step 3's rollout
    ("update:3", 2),       # weights and optimizer changed, the step not finished
    ("checkpoint:4", 2),   # step 4's checkpoint half written: step 2's stays valid
])
def test_a_run_killed_and_resumed_gives_the_uninterrupted_results(uninterrupted, tmp_path, kill_at, resumed_from):
    run_dir = tmp_path / "run"
    killed = run_cli(SMOKE, run_dir, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL
    assert json.loads((run_dir / "status.json").read_text())["status"] == "running"  # it never got to say more
    resumed = run_cli([f"resume={run_dir}"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from_step"] == resumed_from
    assert "evaluating (before)" not in resumed.stdout + resumed.stderr  # the phase done is not run again
    assert_same_results(uninterrupted, run_dir)
    wandb_runs = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(wandb_runs) == 1  # the resumed process continued the same wandb run id


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_step_and_marks_the_run_interrupted(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    stopped = run_cli(SMOKE, run_dir, kill_at="generate:3:INT")  # SIGINT in the middle of step 3
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    status = json.loads((run_dir / "status.json").read_text())
    assert summary["status"] == status["status"] == "interrupted"
    assert summary["exit_code"] == status["exit_code"] == 130 and summary["signal"] == "SIGINT"
    assert summary["steps_completed"] == 3 and summary["checkpoint"].endswith("step_000003")  # step 3 finished
    assert summary["pass_at_1_before"] is not None
    assert "before" in (run_dir / "eval" / "passk.csv").read_text()  # the before-evaluation is kept
    assert [m["step"] for m in metrics_without_timing(run_dir)] == [1, 2, 3]
    assert not list((run_dir / "checkpoints").glob(".*"))  # nothing half-written
    resumed = run_cli(["resume=" + str(run_dir)], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_results(uninterrupted, run_dir)


@pytest.mark.slow
def test_sigterm_in_the_final_evaluation_resumes_without_training_again(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    stopped = run_cli(SMOKE, run_dir, kill_at="eval:4:TERM")  # the evaluation after step 4, before its files
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 143 and summary["signal"] == "SIGTERM"
    assert summary["steps_completed"] == 4 and summary["checkpoint"] is None  # step 4's checkpoint was already written
    assert "after" not in (run_dir / "eval" / "passk.csv").read_text()
    resumed = run_cli([f"resume={run_dir}"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[train]" not in resumed.stderr  # nothing left to train
    assert_same_results(uninterrupted, run_dir)


@pytest.mark.slow
def test_resume_refuses_bad_input_before_training(uninterrupted, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli([f"resume={empty}"], empty)
    assert proc.returncode == 2 and "no valid checkpoint" in proc.stderr
    run_dir = tmp_path / "copy"
    shutil.copytree(uninterrupted, run_dir)
    proc = run_cli([f"resume={run_dir}", "trainer.lr=0.5", "seed=1"], run_dir)
    assert proc.returncode == 2 and "seed: 0 -> 1" in proc.stderr and "trainer.lr" in proc.stderr
    assert "[train]" not in proc.stderr  # refused before any training
    proc = run_cli([f"resume={run_dir}", "trainer.steps=3", "resume_allow=[trainer.steps]"], run_dir)
    assert proc.returncode == 2 and "trainer.steps >= 4" in proc.stderr
    newest = checkpoint.latest_checkpoint(run_dir)
    size = newest.manifest["files"]["optimizer.pt"]
    (newest.path / "optimizer.pt").write_bytes(b"x" * size)  # corrupted, same size: found when loaded
    proc = run_cli([f"resume={run_dir}", "trainer.steps=5", "resume_allow=[trainer.steps]"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr  # the run's log lines go to stdout
    assert "optimizer.pt cannot be read" in said and "previous valid checkpoint" in said
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from_step"] == 2
    steps = metrics_without_timing(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_evaluates_again_only_when_asked(uninterrupted, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(uninterrupted, run_dir)
    files = {p: p.read_bytes() for p in (run_dir / "summary.json", run_dir / "status.json", run_dir / "eval" / "passk.csv")}
    proc = run_cli([f"resume={run_dir}"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished (4 steps" in proc.stderr and "resume_evaluate_again=true" in proc.stderr
    said = proc.stdout + proc.stderr
    assert "evaluating" not in said and "[train]" not in said  # nothing ran
    assert all(p.read_bytes() == data for p, data in files.items())  # status stays finished, results untouched
    again = run_cli([f"resume={run_dir}", "resume_evaluate_again=true"], run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished" not in again.stderr and "evaluating (after)" in again.stdout + again.stderr
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert_same_results(uninterrupted, run_dir)  # the evaluation again gives the same files
