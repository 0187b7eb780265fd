"""The documentation stays true: generated tables match conf/, links resolve, the README stays short,
and no tracked file cites a document that is not in the repository.

Compose only (the table check): no model or data is loaded.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest
from conftest import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "docs"))
import gen_tables  # noqa: E402

README_LIMIT_BYTES = 12 * 1024  # "a README a newcomer reads in five minutes"
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Pointers into documents that were never part of the repository (reading notes with section numbers
# such as "methods-b M09", "anchors §2.2", and their provenance tags "[R]" for a recollection, "[C]" /
# "[S]" for a code or third-party reading, "(verify)"). A claim cites the paper (arXiv id and
# section) or a public source (a repository and file) instead; an unchecked number is marked
# unverified in words.
MISSING_DOCUMENT_PATTERNS = {
    "methods notes": re.compile(r"methods-[ab]\b|methods docs?\b"),
    "anchors notes": re.compile(r"\banchors §|style-anchors"),
    "'the reference docs'": re.compile(r"reference docs\b|not (?:given )?in the docs\b|[Rr]eading of the docs|the docs write"),
    "provenance tag": re.compile(r"\[R\]|\[[CS]:|\[S\d\]"),
    "'verify' marker": re.compile(r"\(verify\)|'verify'|; verify\)"),
}
# Files allowed to spell the patterns: this test, which defines them.
PATTERN_FILES = {"tests/test_docs.py"}


def tracked_text_files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".json", ".jsonl", ".csv", ""}
    return [path for path in listed.split("\0") if path and Path(path).suffix in suffixes]


def missing_document_references(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, line) for every line that cites a document not in the repository."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        for name, pattern in MISSING_DOCUMENT_PATTERNS.items():
            if pattern.search(line):
                hits.append((number, name, line.strip()))
    return hits


@pytest.mark.parametrize(
    "line, cites",
    [
        ("# arXiv:2503.14476 (methods-b M09). GRPO advantage", True),
        ("clip_cov_lb: 1.0  # verl default; anchors §2.2", True),
        ("delta: 4.0  # paper delta = 4 [R]", True),
        ("alpha: 0.001  # thinkless_alpha (methods-b M12 [C])", True),
        ("# Settings: [C: VainF/Thinkless scripts/rl/thinkless_1.5b_deepscaler.sh]", True),
        ("# third-party reimplementation (section 5 [S3])", True),
        ("tau: 1.0  # regulariser strength (not given in the docs: design default; verify)", True),
        ("# Settings: section 10 [S: Urheen/SFPO train-scripts/x.sh]", True),
        ("drop_threshold: 0.3  # suggestion (verify)", True),
        ("coef: 0.0  # the paper's KL setting is not in the reference docs", True),
        ("# arXiv:2503.14476, section 3.1. GRPO advantage", False),
        ("rewards  [B]  scalar outcome reward; logp [B,T]; values [G] -> [B]", False),
        ("math-verify's verify(gold=ref, target=pred) decides (see math-verify)", False),
        ("class ids [C] and scores [B,C]", False),
    ],
)
def test_missing_document_patterns(line, cites):
    assert bool(missing_document_references(line)) == cites


def test_no_tracked_file_cites_a_document_missing_from_the_repository():
    offenders = []
    for path in tracked_text_files():
        if path in PATTERN_FILES or not (ROOT / path).is_file():
            continue
        text = (ROOT / path).read_text(errors="replace")
        offenders += [f"{path}:{number}: [{name}] {line[:120]}" for number, name, line in missing_document_references(text)]
    assert not offenders, (
        "cite the paper by arXiv id and section (or a public file) instead of documents that are not in the "
        f"repository; {len(offenders)} line(s):\n" + "\n".join(offenders)
    )


def test_generated_tables_are_up_to_date(tmp_path):
    stale = gen_tables.stale_pages(gen_tables.generated_tables(tmp_path))
    assert not stale, f"out of date: {sorted(str(page.relative_to(ROOT)) for page in stale)}; run python docs/gen_tables.py"


def test_algorithm_table_has_one_row_per_preset(tmp_path):
    page = (ROOT / "docs" / "algorithms.md").read_text()
    columns = gen_tables.ALGORITHMS_HEADER.count("|") - 1
    for name in gen_tables.preset_names():
        rows = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, f"{name}: expected one row in docs/algorithms.md"
        cells = rows[0].strip("|").split(" | ")
        assert len(cells) == columns and all(cell.strip() for cell in cells), rows[0]
        assert cells[-1].strip() == f"`rlbench algorithm={name}`"


def test_paper_table_has_one_row_per_paper():
    page = (ROOT / "docs" / "papers.md").read_text()
    for name in gen_tables.paper_names():
        assert sum(line.endswith(f"| `rlbench paper={name}` |") for line in page.splitlines()) == 1, name


def test_replace_region_rewrites_only_between_its_markers():
    text = "before\n<!-- BEGIN GENERATED: t -->\nold\n<!-- END GENERATED: t -->\nafter\n"
    assert gen_tables.replace_region(text, "t", "new\n") == (
        "before\n<!-- BEGIN GENERATED: t -->\nnew\n<!-- END GENERATED: t -->\nafter\n"
    )
    with pytest.raises(ValueError, match="markers"):
        gen_tables.replace_region("no markers here\n", "t", "new\n")


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; move detail to docs/ (limit {README_LIMIT_BYTES})"


def _relative_links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [target.split("#")[0] for target in targets if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda page: page.name)
def test_relative_links_resolve(page):
    broken = [target for target in _relative_links(page.read_text()) if not (page.parent / target).exists()]
    assert not broken, f"{page.name}: links to missing files {broken}"


# A repository file named in prose: a top-level folder, then path characters, then a file suffix. Not
# preceded by a path character (owner/repo/docs/x.md cites another repository's file; write it that way)
# or a placeholder's bracket, and not followed by one (conf/paper/<name>.yaml, conf/paper/*.yaml and run
# outputs such as eval/passk.csv are not repository files, and do not match).
_NOT_BEFORE, _NOT_AFTER = r"(?<![\w/.<>*{}-])", r"(?![\w/*<>-])"
REPOSITORY_PATH = re.compile(
    _NOT_BEFORE + r"(?:rlbench|conf|docs|tests|bench|results|hydra_plugins)/[\w/.-]*\.(?:py|yaml|md|json|jsonl|sh|csv|cpp)"
    + _NOT_AFTER
)
# A module named from inside the package (algorithm/advantages.py): a subpackage of rlbench, then .py.
PACKAGE_MODULE = re.compile(
    _NOT_BEFORE + "(?:" + "|".join(sorted(p.name for p in (ROOT / "rlbench").iterdir() if (p / "__init__.py").is_file()))
    + r")/[\w/.-]*\.py" + _NOT_AFTER
)


def named_paths_missing(text: str) -> list[str]:
    """The repository paths named in ``text`` (REPOSITORY_PATH from the root, PACKAGE_MODULE from rlbench/)
    that do not exist."""
    missing = [path for path in REPOSITORY_PATH.findall(text) if not (ROOT / path).exists()]
    return missing + [path for path in PACKAGE_MODULE.findall(text) if not (ROOT / "rlbench" / path).exists()]


@pytest.mark.parametrize("text, missing", [
    ("see rlbench/training/step.py.", []),
    ("(rlbench/update.py trpo_update)", ["rlbench/update.py"]),
    ("`algorithm/advantages.py`", ["algorithm/advantages.py"]),
    ("`tests/test_tree_rollout.py` checks both", ["tests/test_tree_rollout.py"]),
    ("conf/paper/<name>.yaml, conf/paper/*.yaml, docs/", []),
    ("mirrored in volcengine/verl/docs/algo/entropy.md", []),
    ("a pass@k curve: eval/curve.csv", []),
])
def test_named_paths_missing(text, missing):
    assert named_paths_missing(text) == missing


def test_every_repository_path_named_in_docs_conf_and_code_exists():
    """Every file path that docs/ (and the README), conf/ and the docstrings and comments of rlbench/ name
    exists; a stale one sends a reader to a file that moved or never was."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "conf").rglob("*.yaml"),
             *(ROOT / "rlbench").rglob("*.py")]
    stale = [f"{path.relative_to(ROOT)}: {name}" for path in sorted(files) for name in named_paths_missing(path.read_text())]
    assert not stale, "paths to files that do not exist:\n" + "\n".join(stale)
