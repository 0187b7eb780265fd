"""The comparison table: per (group, benchmark, k) pass@k with bootstrap intervals and the paired
difference against a baseline group, and its Markdown, CSV and LaTeX renderings."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from rlbench.analysis.runs import Run, natural_key, phase_problems, shared_problem_sets
from rlbench.analysis.statistics import (
    hierarchical_bootstrap,
    paired_bootstrap_difference,
    paired_problem_differences,
    percentile_interval,
    sign_flip_test,
)
from rlbench.errors import ConfigError, DataError
from rlbench.eval.metrics import pass_at_k

MACRO = "macro"
TABLE_COLUMNS = [
    "group", "benchmark", "k", "pass_at_k", "ci_low", "ci_high", "seeds", "problems",
    "baseline", "diff", "diff_ci_low", "diff_ci_high", "p_value",
]

_pass_at_k = functools.lru_cache(maxsize=None)(pass_at_k)


def score_matrix(runs: Sequence[Run], phase: str, benchmark: str, uids: Sequence[str], k: int) -> np.ndarray:
    """(runs x problems) matrix of per-problem unbiased pass@k, columns in ``uids`` order."""
    matrix = np.empty((len(runs), len(uids)))
    for row, run in enumerate(runs):
        rows = phase_problems(run, phase)
        counts = rows[rows["benchmark"] == benchmark].set_index("uid").loc[list(uids)]
        smallest_n = int(counts["n"].min())
        if k > smallest_n:
            raise ConfigError(
                f"k={k} exceeds the {smallest_n} samples per problem of {benchmark} in run {run.name} "
                f"(its eval.n); choose --k values up to {smallest_n}"
            )
        matrix[row] = [_pass_at_k(int(n), int(c), k) for n, c in zip(counts["n"], counts["correct"])]
    return matrix


def default_ks(runs: Sequence[Run], phase: str) -> list[int]:
    """The k values that every run's passk.csv reports for ``phase``."""
    per_run = [set(run.passk.loc[run.passk["phase"] == phase, "k"].astype(int)) for run in runs]
    ks = sorted(set.intersection(*per_run))
    if not ks:
        raise DataError(f"the runs' eval/passk.csv files share no k for phase {phase}; pass --k")
    return ks


def table_row(label, benchmark, k, matrices, *, baseline_label, baseline_matrices, n_resamples, seed, alpha):
    """One table row from per-benchmark score matrices (several: the macro row)."""
    mean = float(np.mean([m.mean() for m in matrices]))
    ci_low, ci_high = percentile_interval(hierarchical_bootstrap(matrices, n_resamples=n_resamples, seed=seed), alpha)
    row = {
        "group": label, "benchmark": benchmark, "k": k, "pass_at_k": mean, "ci_low": ci_low, "ci_high": ci_high,
        "seeds": matrices[0].shape[0], "problems": sum(m.shape[1] for m in matrices),
        "baseline": baseline_label or "", "diff": math.nan, "diff_ci_low": math.nan, "diff_ci_high": math.nan,
        "p_value": math.nan,
    }
    if baseline_matrices is not None and label != baseline_label:
        differences, weights = paired_problem_differences(matrices, baseline_matrices)
        diff_low, diff_high = percentile_interval(
            paired_bootstrap_difference(matrices, baseline_matrices, n_resamples=n_resamples, seed=seed), alpha
        )
        row.update(
            diff=mean - float(np.mean([m.mean() for m in baseline_matrices])),
            diff_ci_low=diff_low,
            diff_ci_high=diff_high,
            p_value=sign_flip_test(differences, weights, n_resamples=n_resamples, seed=seed),
        )
    return row


def build_table(
    groups: Mapping[str, Sequence[Run]],
    *,
    phase: str = "after",
    ks: Sequence[int] | None = None,
    baseline: str | None = None,
    n_resamples: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """One row per (group, benchmark, k), plus a ``macro`` row per (group, k) with several benchmarks.

    Columns: see the module docstring (``TABLE_COLUMNS``). Rows are ordered by benchmark, k, then
    group (the baseline first). Raises ConfigError for an unknown baseline, DataError when runs
    disagree on their problems.
    """
    if not groups:
        raise DataError("no runs to compare")
    if baseline is not None and baseline not in groups:
        raise ConfigError(f"--baseline {baseline!r} is not a group; the groups are: {', '.join(groups)}")
    if n_resamples < 1:
        raise ConfigError(f"--resamples must be >= 1, got {n_resamples}")
    all_runs = [run for runs in groups.values() for run in runs]
    problem_sets = shared_problem_sets(all_runs, phase)
    ks = sorted({int(k) for k in ks}) if ks else default_ks(all_runs, phase)
    if ks[0] < 1:
        raise ConfigError(f"--k values must be >= 1, got {ks}")
    labels = sorted(groups, key=lambda g: (g != baseline, natural_key(g)))
    benchmarks = list(problem_sets)
    resampling = {"n_resamples": n_resamples, "seed": seed, "alpha": alpha}
    rows = []
    for k in ks:
        matrices = {
            label: [score_matrix(groups[label], phase, bench, problem_sets[bench], k) for bench in benchmarks]
            for label in labels
        }
        base = matrices.get(baseline) if baseline is not None else None
        for index, bench in enumerate(benchmarks):
            for label in labels:
                rows.append(table_row(label, bench, k, [matrices[label][index]], baseline_label=baseline,
                                      baseline_matrices=None if base is None else [base[index]], **resampling))
        if len(benchmarks) > 1:
            for label in labels:
                rows.append(table_row(label, MACRO, k, matrices[label], baseline_label=baseline,
                                      baseline_matrices=base, **resampling))
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    order = {bench: i for i, bench in enumerate([*benchmarks, MACRO])}
    table["_bench"] = table["benchmark"].map(order)
    table["_group"] = table["group"].map({label: i for i, label in enumerate(labels)})
    return table.sort_values(["_bench", "k", "_group"], kind="stable").drop(columns=["_bench", "_group"]).reset_index(drop=True)


def _interval_text(value: float, low: float, high: float, signed: bool = False) -> str:
    if math.isnan(value):
        return "—"
    number = f"{value:+.3f}" if signed else f"{value:.3f}"
    return f"{number} [{low:.3f}, {high:.3f}]"


def _p_text(p: float) -> str:
    if math.isnan(p):
        return "—"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def display_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Header and text cells shared by the Markdown and LaTeX tables."""
    baseline = next((b for b in table["baseline"] if b), "")
    header = ["group", "benchmark", "k", "pass@k [95% CI]", "seeds", "problems"]
    if baseline:
        header += [f"Δ vs {baseline} [95% CI]", "p (sign-flip)"]
    cells = []
    for r in table.itertuples(index=False):
        line = [str(r.group), str(r.benchmark), str(r.k), _interval_text(r.pass_at_k, r.ci_low, r.ci_high),
                str(r.seeds), str(r.problems)]
        if baseline:
            is_baseline = r.group == baseline
            line += ["(baseline)" if is_baseline else _interval_text(r.diff, r.diff_ci_low, r.diff_ci_high, True),
                     "" if is_baseline else _p_text(r.p_value)]
        cells.append(line)
    return header, cells


def markdown_table(table: pd.DataFrame) -> str:
    header, cells = display_rows(table)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(line) + " |" for line in cells]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "Δ": r"$\Delta$",
                  "—": "---"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex_table(table: pd.DataFrame) -> str:
    """A LaTeX ``tabular`` (no packages needed) with the Markdown table's cells."""
    header, cells = display_rows(table)
    spec = "lll" + "l" + "rr" + ("lr" if len(header) > 6 else "")
    lines = [f"\\begin{{tabular}}{{{spec}}}", "\\hline", " & ".join(map(latex_escape, header)) + " \\\\", "\\hline"]
    lines += [" & ".join(map(latex_escape, line)) + " \\\\" for line in cells]
    lines += ["\\hline", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def runs_table(groups: Mapping[str, Sequence[Run]]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"group": label, "seed": run.config.get("seed"), "run": run.name} for label, runs in groups.items() for run in runs]
    )
