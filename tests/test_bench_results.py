"""results/bench/: a canonical file holds its benchmark's latest measurement; superseded ones live in
results/bench/history/ (its README lists them) and are never newer than the file that replaced them."""

import json
import re
from datetime import datetime, timezone
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "results" / "bench"
HISTORY = BENCH / "history"


def measured(path: Path) -> datetime:
    stamp = datetime.fromisoformat(json.loads(path.read_text())["date"])
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)


def canonical_of(name: str) -> Path | None:
    """The canonical json whose benchmark a history file measured (the longest stem its name starts with)."""
    stems = sorted((p.stem for p in BENCH.glob("*.json")), key=len, reverse=True)
    return next((BENCH / f"{stem}.json" for stem in stems if name.startswith(f"{stem}_")), None)


def test_every_superseded_measurement_is_older_than_its_canonical_file_and_listed():
    listed = (HISTORY / "README.md").read_text()
    old = sorted(HISTORY.glob("*.json"))
    assert old
    for path in old:
        canonical = canonical_of(path.name)
        assert canonical is not None, f"{path.name}: no canonical results/bench/<benchmark>.json it belongs to"
        assert measured(path) <= measured(canonical), f"{path.name} is newer than {canonical.name}"
        assert f"`{path.stem}`" in listed, f"{path.name} has no row in history/README.md"
        assert path.with_suffix(".md").is_file()


def test_compare_trl_has_no_variant_beside_it_and_the_docs_cite_its_ratio():
    """docs/performance.md's "Where it stands" gives the ratio of the canonical file, which is the newest."""
    assert sorted(p.name for p in BENCH.glob("compare_trl*")) == ["compare_trl.json", "compare_trl.md"]
    performance = (BENCH.parents[1] / "docs" / "performance.md").read_text()
    cited = re.search(r"\*\*Where it stands[^*]*\*\* ours/TRL \*\*(\d\.\d\d) per step", performance)
    assert cited, "docs/performance.md: no 'Where it stands' ratio"
    assert float(cited.group(1)) == round(json.loads((BENCH / "compare_trl.json").read_text())["ratio"], 2)
