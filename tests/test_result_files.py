"""Result files are created like a normal write: mode 0666 with the umask applied (0644 under umask 022,
0600 under 077), so colleagues can read a run folder and a comparison; atomic writes leave no temp file.
Folders built atomically (the GGUF conversion cache) get 0777 minus the umask, as any new folder."""

from __future__ import annotations

import os
import stat

import pytest
from omegaconf import OmegaConf

from rlbench.analysis.cli import main as compare_main
from rlbench.eval.metrics import ProblemResult, summarize
from rlbench.config.schema import LoggerConfig
from rlbench.logger.run_logger import RunLogger
from rlbench.model.loading import _atomic_build
from rlbench.utils import atomic_write_bytes, atomic_write_json, atomic_write_text

UMASKS = [0o022, 0o077]


@pytest.fixture(params=UMASKS, ids=lambda u: f"umask{u:03o}")
def umask(request):
    """Run the test under the given process umask and restore the previous one afterwards."""
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def files_below(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_atomic_writes_apply_the_umask(tmp_path, umask):
    atomic_write_bytes(tmp_path / "a.bin", b"\x00\x01")
    atomic_write_text(tmp_path / "sub" / "b.txt", "b")
    atomic_write_json(tmp_path / "c.json", {"c": 1})
    for name in ("a.bin", "sub/b.txt", "c.json"):
        assert mode(tmp_path / name) == 0o666 & ~umask, name
    assert mode(tmp_path / "a.bin") == {0o022: 0o644, 0o077: 0o600}[umask]
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01" and (tmp_path / "c.json").read_text() == '{\n  "c": 1\n}\n'
    assert [p.name for p in files_below(tmp_path)] == ["a.bin", "c.json", "b.txt"]  # no temporary files left


def test_atomic_write_replaces_and_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # fails inside the write, after the temp file exists
    assert target.read_text() == "new" and files_below(tmp_path) == [target]


def test_run_folder_and_comparison_files_apply_the_umask(tmp_path, umask):
    run = tmp_path / "run"
    config = {"algorithm": {"name": "grpo"}, "seed": 0, "run_name": "run", "mode": "train"}
    logger = RunLogger(run, config, OmegaConf.to_yaml(OmegaConf.create(config)), LoggerConfig(name="files"))
    logger.log_step(1, {"reward_mean": 0.5, "response_length": 3.0, "entropy": 1.0})
    logger.log_step(2, {"reward_mean": 0.75, "response_length": 4.0, "entropy": 0.9})  # curves that change: a figure
    results = [ProblemResult("arith", f"arith/{i}", [True, i == 0], ["x", "y"]) for i in range(2)]
    rows = [{**row, "phase": "after"} for row in summarize(results, [1, 2])]
    problems = [{"phase": "after", "benchmark": "arith", "uid": r.uid, "n": 2, "correct": sum(r.correct)} for r in results]
    logger.log_eval(rows, problems, [{"uid": "arith/0", "response": "x"}], {"pass_at_1_after": {"arith": 0.75}}, step=1)
    logger.finish()
    out = tmp_path / "compare"
    assert compare_main([str(run), "--out", str(out), "--resamples", "20"]) == 0

    run_files = {p.relative_to(run).as_posix() for p in files_below(run)}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "eval/passk.csv", "eval/problems.csv",
            "eval/samples.jsonl"} <= run_files
    compare_files = {p.name for p in files_below(out)}
    assert compare_files == {"table.md", "table.csv", "table.tex", "table_wide.csv", "table_long.md", "runs.csv",
                             "passk_curves.png", "training_curves.png"}
    for path in [*files_below(run), *files_below(out)]:
        assert mode(path) == 0o666 & ~umask, path


def test_atomically_built_folders_apply_the_umask(tmp_path, umask):
    target = _atomic_build(tmp_path / "ckpt", lambda folder: atomic_write_text(folder / "config.json", "{}"))
    assert mode(target) == 0o777 & ~umask and mode(target / "config.json") == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock", "ckpt"]  # no temporary folder left
