"""The command line: a misspelt key stops the CLI with exit code 2 before anything loads, and the
knobs the README documents are plain overrides (no ++)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # integration tier: runs the runner or the CLI


def run_cli(tmp_path, *overrides, timeout=900):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "experiment=smoke", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.parametrize("override", ["++trainer.lrr=1", "+trainer.lrr=1", "trainer.lrr=1"])
def test_a_misspelt_key_exits_2_within_30_seconds_naming_it(tmp_path, override):
    started = time.perf_counter()
    proc = run_cli(tmp_path, override, timeout=120)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'lrr'" in proc.stderr and "did you mean 'lr'?" in proc.stderr
    assert f"the command-line override '{override}'" in proc.stderr
    assert elapsed < 30
    assert not (tmp_path / "run" / "config.yaml").exists()  # stopped before the run wrote anything


def test_a_cross_field_refusal_exits_2_and_says_where_the_value_came_from(tmp_path):
    proc = run_cli(tmp_path, "rollout.n=1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs rollout.n >= 2" in proc.stderr
    assert "[rollout.n set by the command-line override 'rollout.n=1']" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["algorithm.kl.placement=reward", "algorithm.kl.coef=0.01"],
    ["algorithm.kl.coef=0.01", "algorithm.kl.adaptive={target: 6, horizon: 10000}",
     "algorithm.entropy_adaptive={target: 0.2}", "algorithm.token_mask={top_entropy_quantile: 0.2}"],
    ["algorithm/advantage=drpo"],
])
def test_documented_knobs_run_as_plain_overrides(tmp_path, overrides):
    proc = run_cli(tmp_path, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()


def test_help_names_the_app_and_gives_one_line_per_group_and_option_from_the_schemas():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "rlbench.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("rlbench: ") and "cli" not in lines[0]
    groups = {line.split()[0]: line for line in lines if line.startswith("  ") and not line.startswith("   ")}
    for group, help_text in [("algorithm", "the RL algorithm"), ("model", "the policy model"),
                             ("paper", "a paper's setting"), ("sweep", "the points of a sweep"),
                             ("experiment", "bundles of overrides")]:
        assert help_text in groups[group], group
    assert "dapo" in groups["algorithm"] and "clip_higher" in groups["sweep"] and "smoke" in groups["experiment"]
    assert "seeds python, numpy, torch" in groups["seed"] and "(default: 0)" in groups["seed"]
    assert not any(name.startswith(("paper/common", "experiment/toy_learning")) for name in groups)  # internal
    assert "--info defaults" in proc.stdout and "-sc install=bash" in proc.stdout and "-p KEY" in proc.stdout


def test_a_misspelt_option_names_the_nearest_options_not_all_of_them(tmp_path):
    proc = run_cli(tmp_path, "algorithm=grpoo", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "algorithm has no option 'grpoo'; did you mean grpo" in proc.stderr
    assert "Available options" not in proc.stderr and "rloo" not in proc.stderr  # not the list of every preset
    assert not (tmp_path / "run").exists()


def test_sweep_typos_get_did_you_mean_for_every_point_before_any_run(tmp_path):
    """A misspelt key with one value is refused at once (exit 2); swept, and a misspelt option, every
    point is listed invalid with the nearest spelling instead of Hydra's "use +key" hint."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}

    def sweep(*overrides):
        return subprocess.run([sys.executable, "-m", "rlbench.cli", "-m", "experiment=smoke", *overrides,
                               f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)

    single = sweep("algorithm=grpo,rloo", "trainer.stepz=1")
    assert single.returncode == 2 and "did you mean 'steps'?" in single.stderr and "+trainer.stepz" not in single.stderr
    swept = sweep("algorithm=grpoo,grpo", "trainer.stepz=1,2")
    assert swept.returncode == 1, swept.stderr[-3000:]
    assert "sweep: 4 points: 0 to run, 4 invalid" in swept.stderr
    plan = swept.stderr.partition("sweep: 0 finished")[0]  # the plan; the end report repeats it
    assert plan.count("did you mean 'steps'?") == 2 and plan.count("did you mean grpo") == 2
    assert "To append to your config use" not in swept.stderr and "Available options" not in swept.stderr


def test_the_results_path_is_the_last_line_with_the_policy_size_and_no_progress_bars(tmp_path):
    """wandb's footer comes before it (stdout and stderr in one stream, as a terminal shows them);
    transformers' weight-loading bar is quiet unless RLBENCH_VERBOSE=1."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    env.pop("RLBENCH_VERBOSE", None)
    proc = subprocess.run([sys.executable, "-m", "rlbench.cli", "experiment=smoke", "trainer.steps=1",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    size = sum(f.stat().st_size for f in (tmp_path / "run" / "policy").rglob("*") if f.is_file())
    assert lines[-1] == f"results: {tmp_path / 'run'} (policy/ {size / 1e6:.0f} MB; trainer.save_model=false skips it)"
    assert "wandb run" in proc.stdout  # wandb ran (and finished before the path was printed)
    assert "Loading weights" not in proc.stdout and "it/s]" not in proc.stdout


def test_quiet_console_silences_other_ranks_and_third_party_bars(monkeypatch):
    import logging
    import warnings

    import transformers

    from rlbench.cli import log, quiet_console

    root_level, rlbench_level = logging.getLogger().level, log.level
    with warnings.catch_warnings():
        monkeypatch.setattr(transformers.utils.logging, "_tqdm_active", True)
        quiet_console("1", verbose=False)
        try:
            assert logging.getLogger().level == logging.WARNING and not log.isEnabledFor(logging.INFO)
            assert not transformers.utils.logging.is_progress_bar_enabled()
            with warnings.catch_warnings(record=True) as caught:
                warnings.warn("old", DeprecationWarning, stacklevel=1)
            assert not caught
        finally:
            logging.getLogger().setLevel(root_level)
            log.setLevel(rlbench_level)
            transformers.utils.logging.enable_progress_bar()
