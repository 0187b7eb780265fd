"""Checkpoints and exact resume under torchrun (trainer.parallelism=ddp|fsdp, 2 ranks, gloo on CPU,
the tiny model): a run killed with SIGKILL mid-update or mid-checkpoint, or stopped by a signal that
reached one rank only, and resumed gives the metrics and evaluation files of the 2-rank run that was
never interrupted, bit for bit; a checkpoint resumes only on the world size and strategy that wrote
it, and a folder without one is refused (docs/scaling.md, "Checkpoints and resume")."""

import json
import shutil

import pytest

from rlbench.training import checkpoint
from test_resume import assert_same_results, metrics_without_timing, run_cli

TWO_RANKS = ["experiment=smoke", "logger=files", "trainer.steps=3", "trainer.checkpoint_every=2",
             "trainer.save_model=false"]
# ddp's runs also draw prompts by their statistics (gathered over the ranks) and enter a stage at step 3,
# so the resumed run must restore the statistics and the stage as well
EXTRA = {"ddp": ["prompt_sampler=weighted", "trainer.stages=[{at:3,rollout.n:4}]"], "fsdp": []}


def run_two_ranks(run_dir, strategy=None, kill_at=None):
    """A new 2-rank run with ``strategy``, or (no strategy) the run in ``run_dir`` resumed on 2 ranks."""
    args = [*TWO_RANKS, f"trainer.parallelism={strategy}", *EXTRA[strategy]] if strategy else [f"resume={run_dir}"]
    return run_cli(args, run_dir, kill_at=kill_at, processes=2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """strategy -> the folder of its uninterrupted 2-rank run (made once per module)."""
    runs = {}

    def run_of(strategy):
        if strategy not in runs:
            out = tmp_path_factory.mktemp(strategy) / "uninterrupted"
            proc = run_two_ranks(out, strategy)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[strategy] = out
        return runs[strategy]

    return run_of


def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def resume_to_the_end(run_dir, resumed_from):
    resumed = run_two_ranks(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = summary_of(run_dir)
    assert summary["status"] == "finished" and summary["resumed_from_step"] == resumed_from
    assert (summary["parallelism"], summary["world_size"]) == (checkpoint.latest_checkpoint(run_dir).manifest["parallelism"], 2)


@pytest.mark.slow
def test_ddp_ranks_killed_mid_update_and_resumed_give_the_uninterrupted_run(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    killed = run_two_ranks(run_dir, "ddp", kill_at="update:3")  # every rank SIGKILLs itself in step 3's update
    assert killed.returncode != 0
    assert json.loads((run_dir / "status.json").read_text())["status"] == "running"
    saved = checkpoint.latest_checkpoint(run_dir)
    assert saved.step == 2 and {"model.pt", "optimizer.pt", "state.pt", "state.rank1.pt"} <= set(saved.manifest["files"])
    resume_to_the_end(run_dir, resumed_from=2)
    assert_same_results(uninterrupted("ddp"), run_dir)


@pytest.mark.slow
def test_fsdp_stopped_by_a_signal_on_one_rank_then_killed_mid_checkpoint_resumes_exactly(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    stopped = run_two_ranks(run_dir, "fsdp", kill_at="generate:1:INT:1")  # SIGINT reaches rank 1 alone, in step 1
    assert stopped.returncode != 0
    summary = summary_of(run_dir)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT" and summary["exit_code"] == 130
    assert summary["steps_completed"] == 1 and summary["checkpoint"].endswith("step_000001")
    assert [m["step"] for m in metrics_without_timing(run_dir)] == [1]  # rank 0 stopped after the same step
    saved = checkpoint.latest_checkpoint(run_dir)
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "state.rank1.pt"} <= set(saved.manifest["files"])
    assert "model.pt" not in saved.manifest["files"]  # no rank gathered the whole model
    killed = run_two_ranks(run_dir, kill_at="checkpoint:3")  # resumed, then killed writing step 3's checkpoint
    assert killed.returncode != 0
    assert checkpoint.latest_checkpoint(run_dir).step == 2 and list((run_dir / "checkpoints").glob(".step_000003.tmp-*"))
    resume_to_the_end(run_dir, resumed_from=2)
    assert_same_results(uninterrupted("fsdp"), run_dir)


@pytest.mark.slow
def test_resume_refuses_another_world_size_and_a_folder_without_checkpoint(uninterrupted, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(uninterrupted("ddp"), run_dir)
    one = run_cli([f"resume={run_dir}"], run_dir)  # one process: trainer.parallelism=ddp on a world of one rank
    assert one.returncode == 2 and "by 2 process(es)" in one.stderr and "--nproc_per_node 2" in one.stderr
    assert "[train]" not in one.stderr  # refused before any training
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run_cli([f"resume={empty}"], empty, processes=2)
    assert missing.returncode != 0 and "no valid checkpoint" in missing.stderr
    assert not (empty / "metrics.jsonl").exists()
