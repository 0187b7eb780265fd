"""The comparison tables. The long table (:func:`build_table`): per (group, benchmark, k) pass@k
with bootstrap intervals and the paired difference against a baseline group (CSV, Markdown). The
wide table (:func:`wide_cells`): methods × benchmarks with pass@1, its Δ with its interval and p, pass@k
and maj@k at the largest k, mean ± CI, a Δ whose interval excludes 0 in bold, columns that are 0 for
every method left out (Markdown, booktabs LaTeX, CSV)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from rlbench.analysis.runs import Run, effective_phase, natural_key, phase_problems, shared_problem_sets
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


def runs_table(groups: Mapping[str, Sequence[Run]]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"group": label, "seed": run.config.get("seed"), "run": run.name} for label, runs in groups.items() for run in runs]
    )


# --------------------------------------------------------------------------- the wide (paper) table

CELL_COLUMNS = ["group", "benchmark", "metric", "mean", "ci_low", "ci_high", "seeds",
                "baseline", "diff", "diff_ci_low", "diff_ci_high", "p_value", "significant"]


def run_maj_at_k(run: Run, phase: str, benchmark: str, k: int) -> float:
    """The run's own maj@k of ``benchmark`` (its passk.csv; NaN when its answers cannot vote). The
    macro benchmark is the mean over the run's benchmarks."""
    rows = run.passk[(run.passk["phase"] == effective_phase(run, phase)) & (run.passk["k"] == k)]
    if "maj_at_k" not in rows:
        return math.nan
    values = rows.set_index("benchmark")["maj_at_k"].astype(float)
    if benchmark == MACRO:
        values = values.drop(index=["macro_avg"], errors="ignore")
        return float(values.mean()) if len(values) else math.nan
    return float(values.get(benchmark, math.nan))


def wide_cells(table: pd.DataFrame, groups: Mapping[str, Sequence[Run]], *, phase: str = "after",
               n_resamples: int = 1000, seed: int = 0, alpha: float = 0.05) -> pd.DataFrame:
    """The cells of the wide table, one row per (group, benchmark, metric), for the metrics pass@k
    at the smallest and the largest k of ``table`` (the long table of :func:`build_table`) and maj@k
    at the largest k. pass@k cells are the long table's rows (mean, bootstrap interval, Δ and p);
    a maj@k cell is the mean over seeds of the runs' own maj@k (per-sample votes are not kept, so
    its interval resamples seeds only, and it has no paired test). ``significant`` marks a Δ whose
    95% interval excludes 0 (the only cells the tables set in bold: a best mean that is not
    distinguishable from the baseline is not marked)."""
    ks = sorted(table["k"].unique())
    k_low, k_high = int(ks[0]), int(ks[-1])
    cells = []
    for r in table.itertuples(index=False):
        if r.k in (k_low, k_high):
            cells.append({"group": r.group, "benchmark": r.benchmark, "metric": f"pass@{r.k}", "mean": r.pass_at_k,
                          "ci_low": r.ci_low, "ci_high": r.ci_high, "seeds": r.seeds, "baseline": r.baseline,
                          "diff": r.diff, "diff_ci_low": r.diff_ci_low, "diff_ci_high": r.diff_ci_high,
                          "p_value": r.p_value})
    for bench in dict.fromkeys(table["benchmark"]):
        for label in dict.fromkeys(table["group"]):
            values = np.array([run_maj_at_k(run, phase, bench, k_high) for run in groups[label]])
            mean, low, high = math.nan, math.nan, math.nan
            if not np.isnan(values).any():
                mean = float(values.mean())
                low, high = percentile_interval(
                    hierarchical_bootstrap([values[:, None]], n_resamples=n_resamples, seed=seed), alpha)
            cells.append({"group": label, "benchmark": bench, "metric": f"maj@{k_high}", "mean": mean,
                          "ci_low": low, "ci_high": high, "seeds": len(values), "baseline": table["baseline"].iloc[0],
                          "diff": math.nan, "diff_ci_low": math.nan, "diff_ci_high": math.nan, "p_value": math.nan})
    frame = pd.DataFrame(cells)
    frame["significant"] = (frame["diff_ci_low"] > 0) | (frame["diff_ci_high"] < 0)  # NaN compares False
    metrics = list(dict.fromkeys([f"pass@{k_low}", f"pass@{k_high}", f"maj@{k_high}"]))
    frame["_metric"] = frame["metric"].map({m: i for i, m in enumerate(metrics)})
    frame["_bench"] = frame["benchmark"].map({b: i for i, b in enumerate(dict.fromkeys(table["benchmark"]))})
    frame["_group"] = frame["group"].map({g: i for i, g in enumerate(dict.fromkeys(table["group"]))})
    frame = frame.sort_values(["_group", "_bench", "_metric"], kind="stable")
    return frame.drop(columns=["_metric", "_bench", "_group"]).reset_index(drop=True)[CELL_COLUMNS]


def zero_columns(cells: pd.DataFrame) -> list[tuple[str, str]]:
    """(benchmark, metric) of the columns that are 0 (or undefined) for every group, e.g. maj@k
    when no response has an answer to vote on: the wide table leaves them out and says so."""
    zero = cells.groupby(["benchmark", "metric"], sort=False)["mean"].agg(lambda m: bool((m.fillna(0) == 0).all()))
    return [key for key, is_zero in zero.items() if is_zero]


def wide_columns(cells: pd.DataFrame) -> list[tuple[str, str, bool]]:
    """(benchmark, metric, is_delta) per column of the wide table, in order: per benchmark each
    metric that is not 0 for every group, and after the first pass@k the Δ vs the baseline when
    there is one."""
    has_baseline = bool(cells["baseline"].iloc[0])
    first_pass = next(m for m in cells["metric"] if m.startswith("pass@"))
    left_out = set(zero_columns(cells))
    columns = []
    for bench in dict.fromkeys(cells["benchmark"]):
        for metric in dict.fromkeys(cells["metric"]):
            if (bench, metric) in left_out:
                continue
            columns.append((bench, metric, False))
            if has_baseline and metric == first_pass:
                columns.append((bench, metric, True))
    return columns


def _mean_pm(mean: float, low: float, high: float) -> str:
    if math.isnan(mean):
        return "—"
    return f"{mean:.3f} ± {(high - low) / 2:.3f}"


def _delta_text(cell: Mapping) -> str:
    """Δ [95% interval], p: the interval beside the p-value, as docs/compare.md tells readers to read them."""
    if not cell["baseline"] or cell["group"] == cell["baseline"]:
        return "(baseline)" if cell["baseline"] else ""
    if math.isnan(cell["diff"]):
        return "—"
    return f"{_interval_text(cell['diff'], cell['diff_ci_low'], cell['diff_ci_high'], True)}, p {_p_text(cell['p_value'])}"


def wide_display(cells: pd.DataFrame) -> tuple[list[tuple[str, str, bool]], list[tuple[str, list[tuple[str, bool]]]]]:
    """The wide table's columns and, per group, its cells as (text, bold): bold is a Δ whose
    interval excludes 0."""
    columns = wide_columns(cells)
    index = cells.set_index(["group", "benchmark", "metric"])
    rows = []
    for label in dict.fromkeys(cells["group"]):
        line = []
        for bench, metric, is_delta in columns:
            cell = {**index.loc[(label, bench, metric)].to_dict(), "group": label}
            if is_delta:
                line.append((_delta_text(cell), bool(cell["significant"]) and cell["group"] != cell["baseline"]))
            else:
                line.append((_mean_pm(cell["mean"], cell["ci_low"], cell["ci_high"]), False))
        rows.append((str(label), line))
    return columns, rows


def _column_title(metric: str, is_delta: bool, baseline: str) -> str:
    return f"Δ {metric} vs {baseline}" if is_delta else metric


def left_out_note(cells: pd.DataFrame) -> str:
    """The sentence under a wide table naming the columns left out as 0 for every group ('' if none)."""
    zero = zero_columns(cells)
    if not zero:
        return ""
    return "Left out, 0 (or undefined) for every method: " + ", ".join(f"{bench} {metric}" for bench, metric in zero) + ".\n"


def wide_markdown(cells: pd.DataFrame) -> str:
    """Methods × benchmarks: per benchmark pass@1, its Δ vs the baseline [95% interval] with the paired
    sign-flip p, pass@k and maj@k at the largest k; mean ± half the 95% interval; a Δ whose interval
    excludes 0 in bold; columns that are 0 for every method left out, named under the table."""
    columns, rows = wide_display(cells)
    baseline = cells["baseline"].iloc[0]
    header = ["method"] + [f"{bench} {_column_title(metric, delta, baseline)}" for bench, metric, delta in columns]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(columns) + "|"]
    for label, line in rows:
        texts = [f"**{text}**" if bold else text for text, bold in line]
        lines.append("| " + " | ".join([label, *texts]) + " |")
    note = left_out_note(cells)
    return "\n".join(lines) + "\n" + (f"\n{note}" if note else "")


def wide_latex(cells: pd.DataFrame) -> str:
    """The wide table as a booktabs ``tabular`` (``\\usepackage{booktabs}``): one column block per
    benchmark under a ``\\cmidrule``, a Δ whose interval excludes 0 in ``\\textbf``."""
    columns, rows = wide_display(cells)
    baseline = cells["baseline"].iloc[0]
    benchmarks = list(dict.fromkeys(bench for bench, _, _ in columns))
    widths = [sum(1 for bench, _, _ in columns if bench == b) for b in benchmarks]
    lines = ["% needs \\usepackage{booktabs}", f"\\begin{{tabular}}{{l{'r' * len(columns)}}}", "\\toprule",
             " & " + " & ".join(f"\\multicolumn{{{w}}}{{c}}{{{latex_escape(b)}}}" for b, w in zip(benchmarks, widths))
             + " \\\\"]
    start, rules = 2, []
    for width in widths:
        rules.append(f"\\cmidrule(lr){{{start}-{start + width - 1}}}")
        start += width
    lines.append(" ".join(rules))
    lines.append(" & ".join(["method"] + [latex_escape(_column_title(m, d, baseline)) for _, m, d in columns]) + " \\\\")
    lines.append("\\midrule")
    for label, line in rows:
        texts = [latex_escape(text).replace("±", "$\\pm$") for text, _ in line]
        texts = [f"\\textbf{{{t}}}" if bold else t for t, (_, bold) in zip(texts, line)]
        lines.append(" & ".join([latex_escape(label), *texts]) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def wide_csv(cells: pd.DataFrame) -> pd.DataFrame:
    """The wide table with numbers: one row per group, per benchmark and metric the columns
    ``<benchmark> <metric>`` (the mean), ``... ci_low``, ``... ci_high`` and, for pass@k with a
    baseline, ``... diff``, ``... diff_ci_low``, ``... diff_ci_high``, ``... p_value``."""
    has_baseline = bool(cells["baseline"].iloc[0])
    rows = {}
    for cell in cells.itertuples(index=False):
        row = rows.setdefault(cell.group, {"group": cell.group})
        prefix = f"{cell.benchmark} {cell.metric}"
        row[prefix], row[f"{prefix} ci_low"], row[f"{prefix} ci_high"] = cell.mean, cell.ci_low, cell.ci_high
        if has_baseline and cell.metric.startswith("pass@"):
            for name in ("diff", "diff_ci_low", "diff_ci_high", "p_value"):
                row[f"{prefix} {name}"] = getattr(cell, name)
    return pd.DataFrame(list(rows.values()))


# What a run's training cost, summed over its steps: (column, metrics.jsonl key).
COST_COLUMNS = (("generated_tokens", "generated_tokens"), ("reused_tokens", "reused_tokens"),
                ("engine_seconds", "engine_s"), ("wall_seconds", "step_s"))
EQUAL_COST_BUDGETS = ("generated_tokens", "wall_seconds")
REWARD_METRICS = ("rollout_outcome_mean", "outcome_mean")


def cost_table(groups: Mapping[str, Sequence[Run]], phase: str = "after") -> pd.DataFrame:
    """Per group, means over its runs: what training cost (generated and reused tokens, engine and wall
    seconds, summed over steps), the training reward at the end and **at equal cost** (each run's reward
    curve read, by linear interpolation, at the smallest total every run of every group reached, in
    generated tokens and in wall seconds), and pass@1 after training (mean over benchmarks). Empty when
    no run logged training metrics."""
    from rlbench.analysis.plots import budget_axis

    frames = {label: [run.metrics for run in runs if not run.metrics.empty] for label, runs in groups.items()}
    logged = [frame for group in frames.values() for frame in group]
    metric = next((m for m in REWARD_METRICS if logged and all(m in frame for frame in logged)), None)
    if metric is None:
        return pd.DataFrame()
    ends = {budget: min(float(budget_axis(frame, budget).iloc[-1]) for frame in logged) for budget in EQUAL_COST_BUDGETS}
    rows = []
    for label, runs in groups.items():
        group = frames[label]
        if not group:
            continue
        row: dict = {"group": label, "runs": len(group)}
        for column, key in COST_COLUMNS:
            row[column] = float(np.mean([frame[key].sum() for frame in group])) if all(key in f for f in group) else float("nan")
        row["reward_final"] = float(np.mean([frame[metric].iloc[-1] for frame in group]))
        for budget, end in ends.items():
            row[f"reward_at_{budget}"] = float(np.mean([
                np.interp(end, budget_axis(frame, budget).to_numpy(dtype=float), frame[metric].to_numpy(dtype=float))
                for frame in group
            ]))
        passes = [float(r.passk[(r.passk["phase"] == effective_phase(r, phase)) & (r.passk["k"] == 1)]["pass_at_k"].mean())
                  for r in runs if not r.passk.empty]
        row["pass_at_1"] = float(np.nanmean(passes)) if passes else float("nan")
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs.update(reward_metric=metric, **{f"equal_{b}": e for b, e in ends.items()})
    return table


def cost_markdown(table: pd.DataFrame) -> str:
    """The cost table as markdown, with the budgets the equal-cost columns are read at."""
    if table.empty:
        return ""
    attrs = table.attrs
    lines = [
        f"Training cost per run (mean over seeds) and the training reward ({attrs['reward_metric']}) at equal cost: "
        f"at {attrs['equal_generated_tokens']:.0f} generated tokens and at {attrs['equal_wall_seconds']:.1f} wall "
        "seconds, the least any run reached.",
        "",
        "| group | runs | generated tokens | reused tokens | engine s | wall s | reward at equal tokens | reward at equal seconds | final reward | pass@1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table.to_dict("records"):
        lines.append(
            f"| {row['group']} | {row['runs']} | {row['generated_tokens']:.0f} | {row['reused_tokens']:.0f} | "
            f"{row['engine_seconds']:.1f} | {row['wall_seconds']:.1f} | {row['reward_at_generated_tokens']:.3f} | "
            f"{row['reward_at_wall_seconds']:.3f} | {row['reward_final']:.3f} | {row['pass_at_1']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def metric_curves(groups: Mapping[str, Sequence[Run]], names: Sequence[str]) -> pd.DataFrame:
    """Per group, step and metric: the mean over the group's runs of a step metric (``metrics.jsonl``), with
    its smallest and largest run value and how many runs logged that step (a run that stopped early counts
    only for its steps). ``rlbench-compare --metrics``: e.g. the tool-call rate of each step. A name that no
    run logged is refused (DataError), before anything is written."""
    missing = [name for name in names
               if not any(name in run.metrics for runs in groups.values() for run in runs)]
    if missing:
        logged = sorted({column for runs in groups.values() for run in runs for column in run.metrics.columns} - {"step"})
        raise DataError(f"--metrics {' '.join(missing)}: no run logged {'it' if len(missing) == 1 else 'them'} "
                        f"(logged: {', '.join(logged) or 'nothing'})")
    rows = []
    for label, runs in groups.items():
        for name in names:
            series = [run.metrics.set_index("step")[name].dropna() for run in runs if name in run.metrics]
            for step in sorted({int(s) for values in series for s in values.index}):
                values = [float(values.loc[step]) for values in series if step in values.index]
                rows.append({"group": label, "metric": name, "step": step, "mean": float(np.mean(values)),
                             "min": float(np.min(values)), "max": float(np.max(values)), "runs": len(values)})
    return pd.DataFrame(rows, columns=["group", "metric", "step", "mean", "min", "max", "runs"])


def metric_curves_markdown(curves: pd.DataFrame) -> str:
    """One table per metric: a row per step, a column per group with the mean over its runs."""
    parts = []
    for name, table in curves.groupby("metric", sort=False):
        wide = table.pivot(index="step", columns="group", values="mean")
        groups = list(dict.fromkeys(table["group"]))
        lines = [f"{name} per step (mean over runs)", "", "| step | " + " | ".join(groups) + " |",
                 "|---:|" + "---:|" * len(groups)]
        for step, row in wide.iterrows():
            lines.append(f"| {step} | " + " | ".join("" if pd.isna(row[g]) else f"{row[g]:.3f}" for g in groups) + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)
