"""``rlbench-compare --paper NAME``: a paper's reported numbers (``paper.reference`` of
conf/paper/<NAME>.yaml) beside the runs' own on the same benchmark, each marked verified or not."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from rlbench.errors import ConfigError

PAPER_DIR = Path(__file__).resolve().parents[2] / "conf" / "paper"


def paper_reference(name: str) -> list[dict]:
    """The ``paper.reference`` entries of conf/paper/<name>.yaml."""
    path = PAPER_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PAPER_DIR.glob("*.yaml")))
        raise ConfigError(f"--paper {name!r}: no conf/paper/{name}.yaml; the paper presets are: {known}")
    paper = OmegaConf.to_container(OmegaConf.load(path)).get("paper") or {}
    return list(paper.get("reference") or [])


def _ours(table: pd.DataFrame, group: str, benchmark: str, percent: bool) -> str:
    rows = table[(table["group"] == group) & (table["benchmark"] == benchmark) & (table["k"] == table["k"].min())]
    if rows.empty:
        return "—"
    row = rows.iloc[0]
    scale = 100.0 if percent else 1.0
    digits = 1 if percent else 3
    return (f"{row.pass_at_k * scale:.{digits}f} [{row.ci_low * scale:.{digits}f}, {row.ci_high * scale:.{digits}f}]"
            f" (pass@{row.k}, {row.seeds} seeds)")


def paper_comparison(name: str, table: pd.DataFrame) -> str:
    """Markdown: one row per reference entry of the paper, its value and whether it was verified in
    a primary source, then each group's pass@k at the table's smallest k on the entry's rlbench
    benchmark (in % when the paper reports %; "—" when the runs did not score that benchmark)."""
    groups = list(dict.fromkeys(table["group"]))
    header = ["paper's benchmark", "metric", "paper's value", "verified", "paper's model", *groups]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in paper_reference(name):
        value = entry.get("value")
        shown = "—" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
        percent = "%" in str(entry.get("metric", ""))
        benchmark = entry.get("rlbench_benchmark")
        ours = [_ours(table, g, benchmark, percent) if benchmark else "—" for g in groups]
        verified = "verified" if entry.get("verified") else "not verified"
        lines.append("| " + " | ".join([str(entry.get("benchmark")), str(entry.get("metric")), shown, verified,
                                          str(entry.get("model")), *ours]) + " |")
    note = (f"\nReference numbers of paper={name} (conf/paper/{name}.yaml, with their sources); the runs' columns "
            "are this comparison's, on rlbench's version of the benchmark. A model, data or budget that differs "
            "from the paper's (see its deviations) makes the numbers differ.\n")
    return "\n".join(lines) + "\n" + note
