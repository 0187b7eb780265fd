"""Training on your own JSONL data with the `dataset=jsonl` template (docs/running.md): the run is named
after `dataset.name`, not after a built-in dataset, and trains on the rows of the given file."""

import json

import pytest

from conftest import smoke_cli_steps


@pytest.mark.slow
def test_own_jsonl_dataset_names_the_run(tmp_path):
    rows = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(1, 9)]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    steps = smoke_cli_steps(out, "model=tiny", "dataset=jsonl", "dataset.name=mine",
                            f"dataset.files.train={tmp_path / 'train.jsonl'}",
                            f"dataset.files.test={tmp_path / 'test.jsonl'}")
    assert steps
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "mine"
    assert "-mine-" in summary["run_name"]
