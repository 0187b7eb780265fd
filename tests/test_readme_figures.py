"""The README's generated sections (issue 28): they equal what bench/readme_figures.py renders from the
committed result files (so a hand edit or a table left behind by new measurements fails), their stamps
name real commits, and the prose claims follow the numbers. No runs: `make readme-figures` measures."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess

import pytest
from conftest import ROOT


def _load_script():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "bench" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _load_script()
HINT = "run `python bench/readme_figures.py --render` (the committed numbers) or `make readme-figures` (remeasure)"


def test_readme_sections_are_what_the_result_files_render():
    text = figures.README.read_text()
    assert figures.render_readme(text) == text, f"README.md's generated sections are stale or edited by hand: {HINT}"


def test_default_job_markdown_is_rendered_from_its_json():
    data = json.loads(figures.DEFAULT_JOB_JSON.read_text())
    assert figures.DEFAULT_JOB_MD.read_text() == figures.default_job_markdown(data), HINT


def test_a_hand_edit_of_a_generated_table_fails():
    text = figures.README.read_text()
    for name in figures.SECTIONS:
        start = text.index(f"<!-- BEGIN GENERATED: {name} -->")
        table = text.index("\n| ", start) + 1  # the first table row of the section
        edited = text[:table] + text[table:].replace("| ", "|  ", 1)
        assert figures.render_readme(edited) != edited, name


def _git(*args):
    return subprocess.run(["git", *args], check=False, cwd=ROOT, capture_output=True, text=True)


def test_stamps_name_real_commits():
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a full git checkout: the stamped commits cannot be looked up")
    stamps = {"results/default_job.json": json.loads(figures.DEFAULT_JOB_JSON.read_text()),
              "results/compare/example/stamp.json": json.loads((figures.EXAMPLE / figures.STAMP_FILE).read_text())}
    for path, stamp in stamps.items():
        assert len(stamp["commit"]) == 40, path
        assert _git("cat-file", "-e", f"{stamp['commit']}^{{commit}}").returncode == 0, f"{path}: no commit {stamp['commit']}"
        assert figures.short(stamp["commit"]) in figures.README.read_text(), path


def _phase(pass_at_1, finished_share, finished_accuracy):
    return {"benchmark": "arith", "pass_at_1": pass_at_1, "finished_share": finished_share,
            "finished_accuracy": finished_accuracy}


def test_gain_split_into_finishing_and_answering_by_hand():
    """Half the samples cut off (never right) and finished ones right 60% of the time: pass@1 0.3. All
    finishing at the same 60%: the whole gain of 0.3 is finishing. Same finished share, accuracy of
    finished answers 0.6 -> 0.9: the whole gain is answering."""
    before = _phase(0.3, 0.5, 0.6)
    assert figures.gain_parts(before, _phase(0.6, 1.0, 0.6)) == pytest.approx((0.3, 0.3))
    assert figures.gain_parts(before, _phase(0.45, 0.5, 0.9)) == pytest.approx((0.15, 0.0))
    # cut-off samples right 20% of the time (answer before the cut): finishing gains only 0.6 - 0.2 per sample
    assert figures.gain_parts(_phase(0.4, 0.5, 0.6), _phase(0.6, 1.0, 0.6)) == pytest.approx((0.2, 0.2))


def test_claims_follow_the_numbers():
    """Half the samples cut off and never right before training, all finishing after: the gain is
    finishing; the same finished share with better finished answers: the gain is answering."""
    improving = {"setting": {"max_new_tokens": 16}, "seeds": [
        {"seed": seed, "before": _phase(b, 0.5, 2 * b), "after": _phase(a, 1.0, a)}
        for seed, (b, a) in enumerate(((0.3, 0.8), (0.35, 0.9), (0.4, 0.7)))]}
    assert figures.improvement_claim(improving) == "Every seed improves pass@1, by 0.30 to 0.55."
    assert "the gain is mostly learning to finish within the budget" in figures.what_the_gain_is(improving)
    worse = copy.deepcopy(improving)
    worse["seeds"][1]["after"] = _phase(0.3, 0.5, 0.6)
    assert figures.improvement_claim(worse) == "Not every seed improves pass@1: seed 1 (-0.050) does not."
    answering = copy.deepcopy(improving)
    for seed in answering["seeds"]:
        seed["after"] = _phase(seed["before"]["pass_at_1"] + 0.2, 0.5, seed["before"]["finished_accuracy"] + 0.4)
    assert "the gain is mostly answering right more often" in figures.what_the_gain_is(answering)


def test_a_missing_section_marker_is_refused():
    text = figures.README.read_text().replace("<!-- BEGIN GENERATED: comparison -->", "", 1)
    with pytest.raises(ValueError, match="GENERATED: comparison"):
        figures.render_readme(text)
