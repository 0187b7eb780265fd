"""Offline preference training through the runner: a file of graded responses written by
``rlbench mode=generate`` trains DPO and SFT with ``rollout=offline``: nothing is sampled, each group is
the file's responses of its prompt, and a prompt without responses is replaced and counted."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config  # noqa: E402

from rlbench.errors import DataError  # noqa: E402
from rlbench.runner import run  # noqa: E402

pytestmark = pytest.mark.slow

def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def offline_run(tmp_path, traces, algorithm, *extra):
    overrides = [f"experiment=toy_learning/{algorithm}", "rollout=offline", "guidance=jsonl", f"guidance.path={traces}",
                 "guidance.keep_incorrect=true", "rollout.n=4", "trainer.steps=3", "trainer.prompts_per_step=2",
                 "eval.before_training=false", *extra]
    run(compose_config(overrides, tmp_path))
    return steps(tmp_path)


def test_offline_dpo_trains_on_the_files_responses_without_sampling(tmp_path, toy_traces):
    records = [json.loads(line) for line in toy_traces.read_text().splitlines()]
    # the same two prompts every step (the file's other 4 are left out, counted: guidance.on_bad=skip)
    rows = offline_run(tmp_path / "dpo", toy_traces, "dpo", "dataset.arith.train_size=2", "guidance.on_bad=skip")
    for row in rows:
        assert row["generated_tokens"] == 0 and row["generated_responses"] == 0  # no sampling
        assert row["offline_groups"] == 2 and row["offline_skipped_prompts"] == 0
        assert row["responses_teacher"] == 8  # 2 groups of the file's 4 responses
    assert rows[0]["policy_loss"] == pytest.approx(0.6931, abs=1e-3)  # -log sigma(0): pi_theta = pi_ref at the start
    assert rows[-1]["policy_loss"] < rows[0]["policy_loss"]  # the same pairs move apart
    assert rows[-1]["preference_accuracy"] > 0.5
    assert len(records) == 24


def test_prompts_without_responses_are_replaced_and_counted(tmp_path, toy_traces):
    # 64 training problems, 6 of them in the file: most drawn prompts are replaced by later draws
    rows = offline_run(tmp_path / "sft", toy_traces, "sft", "dataset.arith.train_size=64")
    assert all(row["offline_groups"] == 2 for row in rows)
    assert sum(row["offline_skipped_prompts"] for row in rows) > 0


def test_an_empty_library_is_refused_before_training(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="rollout=offline trains on the responses"):
        offline_run(tmp_path / "run", empty, "dpo")
