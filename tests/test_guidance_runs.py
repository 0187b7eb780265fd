"""Guided methods through the runner: the trace-writing command end to end, a trace file read back into
training, and LUFFY without traces as its base algorithm, step for step."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config  # noqa: E402

from rlbench.errors import DataError  # noqa: E402
from rlbench.runner import run  # noqa: E402
from rlbench.training.step import TIMING_METRICS  # noqa: E402

pytestmark = pytest.mark.slow


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_generate_writes_graded_traces_that_a_run_reads_back(tmp_path):
    out = tmp_path / "traces.jsonl"
    # the toy's tokenizer (its first 512 ids): traces are kept only for a run with the same tokenizer
    summary = run(compose_config(["mode=generate", "model=tiny", "model.tiny.vocab_size=512", "dataset.limit=3", "rollout.n=2",
                                  "rollout.max_new_tokens=6", "guidance.keep_incorrect=true", f"out={out}"], tmp_path / "gen"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["written"] == len(records) == 6 and summary["responses"] == 6
    assert {r["uid"] for r in records} == {"arith/train/0", "arith/train/1", "arith/train/2"}
    assert all(set(r) >= {"text", "response_ids", "tokenizer", "correct", "reward", "extracted"} for r in records)
    # only correct traces by default: the random tiny model answers none
    run(compose_config(["mode=generate", "model=tiny", "model.tiny.vocab_size=512", "dataset.limit=3", "rollout.n=2",
                        "rollout.max_new_tokens=6", f"out={tmp_path / 'correct.jsonl'}"], tmp_path / "gen2"))
    assert (tmp_path / "correct.jsonl").read_text() == ""
    common = ["experiment=toy_learning/luffy", "trainer.steps=1", "guidance=jsonl", f"guidance.path={out}", "dataset.arith.train_size=3"]
    trained = run(compose_config([*common, "guidance.keep_incorrect=true"], tmp_path / "train"))
    assert trained["guidance_traces"]["kept"] == 6  # the toy grader (even tokens) marks some wrong: kept when asked
    # traces of the full 49152-id tokenizer are left out, counted, in a run of the 512-id toy
    full = tmp_path / "full_vocab.jsonl"
    run(compose_config(["mode=generate", "model=tiny", "dataset.limit=3", "rollout.n=2", "rollout.max_new_tokens=6",
                        "guidance.keep_incorrect=true", f"out={full}"], tmp_path / "gen3"))
    other = run(compose_config([*common[:3], f"guidance.path={full}", common[4], "guidance.keep_incorrect=true"], tmp_path / "other"))
    assert (other["guidance_traces"]["kept"], other["guidance_traces"]["tokenizer_mismatch"]) == (0, 6)
    assert steps(tmp_path / "train")[0]["responses_teacher"] >= 1
    with pytest.raises(DataError, match="guidance=jsonl: incorrect"):
        run(compose_config([*common, "reward.threshold=1.01", "guidance.on_bad=stop"], tmp_path / "stop"))
    metrics = tmp_path / "stop" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # refused before training


def test_luffy_without_traces_is_its_base_algorithm_step_for_step(tmp_path):
    common = ["experiment=toy_learning/luffy", "trainer.steps=2", "guidance=none"]
    run(compose_config(common, tmp_path / "luffy"))
    run(compose_config([*common, "rollout=iid"], tmp_path / "base"))
    guided, base = steps(tmp_path / "luffy"), steps(tmp_path / "base")
    for a, b in zip(guided, base):
        shared = (set(a) & set(b)) - TIMING_METRICS
        assert {k: a[k] for k in shared} == {k: b[k] for k in shared}
        assert a["off_policy_fraction"] == 0.0 and "responses_dataset" not in a
