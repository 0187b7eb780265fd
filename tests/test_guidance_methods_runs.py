"""edit_grpo, dagrpo and otr through the command line and the runner: each runs; edit_grpo, dagrpo and the
guided presets guide, scaf_grpo, g2rpo_a, dr_po and icpo without guidance are their base algorithm (the
same preset with rollout=iid) step for step (luffy's: tests/test_guidance_runs.py); otr without references
is refused before loading."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config  # noqa: E402

from rlbench.errors import ConfigError  # noqa: E402
from rlbench.runner import run  # noqa: E402
from rlbench.training.step import TIMING_METRICS  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset, guidance, key", [
    ("edit_grpo", ["guidance=even_tokens", "rollout.edit_injection.checker=even_tokens"], "responses_edited"),
    ("dagrpo", ["guidance=even_tokens"], "groups_anchored"),
    ("otr", ["guidance=even_tokens", "rollout.references.monitor_n=2"], "token_rollout_match"),
])
def test_preset_runs_from_the_command_line(tmp_path, preset, guidance, key):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "rlbench.cli", "experiment=toy_learning/grpo", f"algorithm={preset}", *guidance,
               "trainer.steps=2", "eval.limit=1", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = steps(tmp_path)
    assert len(metrics) == 2 and all(key in m for m in metrics)


@pytest.mark.parametrize("preset", ["edit_grpo", "dagrpo", "guide", "scaf_grpo", "g2rpo_a", "dr_po", "icpo"])
def test_without_guidance_the_preset_is_its_base_algorithm_step_for_step(tmp_path, preset):
    common = ["experiment=toy_learning/grpo", f"algorithm={preset}", "trainer.steps=2", "guidance=none"]
    run(compose_config(common, tmp_path / "guided"))
    run(compose_config([*common, "rollout=iid"], tmp_path / "base"))
    guided, base = steps(tmp_path / "guided"), steps(tmp_path / "base")
    for a, b in zip(guided, base):
        shared = (set(a) & set(b)) - TIMING_METRICS - {"rollout_outcome_mean"}
        assert {k: a[k] for k in shared} == {k: b[k] for k in shared}
        assert a.get("off_policy_fraction", 0.0) == 0.0  # nothing off-policy was trained
        assert a.get("rollout_outcome_mean", a["outcome_mean"]) == a["outcome_mean"]


def test_otr_without_references_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="rollout=references .* guidance=none gives none"):
        run(compose_config(["experiment=toy_learning/grpo", "algorithm=otr", "guidance=none"], tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()
