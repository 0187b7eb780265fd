"""Figures of a comparison (matplotlib, Agg canvas, no display needed): pass@k against k per group,
and training curves per group over seeds, against steps or a compute budget. Sized for one column of a
two-column paper (:data:`COLUMN_WIDTH_IN`), one colour per group in every figure of a comparison
(:func:`group_colours`), and a training panel whose curves are all constant is left out (named in
the caption) rather than drawn flat."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from rlbench.analysis.runs import Run
from rlbench.utils import atomic_write_bytes

# Panels of the training curves: (title, the step metrics it shows, the first one a run logged).
# Accuracy is the graders' outcome before reward shaping (with dynamic sampling, over every response
# generated), so a length penalty or a mode bonus does not read as poor accuracy.
TRAINING_PANELS = (
    ("accuracy (outcome)", ("rollout_outcome_mean", "outcome_mean")),
    ("KL", ("kl", "approx_kl")),
    ("entropy", ("entropy",)),
    ("clip fraction", ("clip_fraction",)),
    ("response length", ("response_length",)),
)
BUDGETS = ("step", "generated_tokens", "wall_seconds")
CURVE_POINTS = 50  # grid points of a budget axis (seeds spend the budget at different rates)
COLUMN_WIDTH_IN = 3.4  # one column of a two-column paper (ICML/NeurIPS/ACL: 3.25-3.35 in)
PANEL_HEIGHT_IN = 1.9
PANELS_PER_ROW = 2
FONT_SIZE = 7
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000")  # Okabe-Ito


def group_colours(labels) -> dict[str, str]:
    """One colour per group, the same in every figure of a comparison: by the groups' sorted order
    (natural sort), whatever order a figure draws them in (cycles after 8 groups)."""
    from rlbench.analysis.runs import natural_key

    ordered = sorted(dict.fromkeys(str(label) for label in labels), key=natural_key)
    return {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(ordered)}


def _panel_grid(count: int):
    """A figure one paper column wide with ``count`` panels, ``PANELS_PER_ROW`` to a row."""
    from matplotlib.figure import Figure

    columns = min(count, PANELS_PER_ROW)
    rows = -(-count // columns)
    fig = Figure(figsize=(COLUMN_WIDTH_IN, PANEL_HEIGHT_IN * rows + 0.5), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def _style(ax) -> None:
    ax.tick_params(labelsize=FONT_SIZE - 1)
    ax.grid(alpha=0.3)


def _legend(fig, axes) -> None:
    """One legend for the figure, under the panels, its entries in the groups' sorted order (as their
    colours are), whatever order they were drawn in."""
    from rlbench.analysis.runs import natural_key

    handles, labels = axes[0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: natural_key(labels[i].rsplit(" (", 1)[0]))
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 3), fontsize=FONT_SIZE - 1, frameon=False)


def _save_figure(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=200, bbox_inches="tight")
    atomic_write_bytes(path, buffer.getvalue())


def plot_passk_curves(table: pd.DataFrame, path: Path) -> None:
    """One panel per benchmark (and the macro average): mean pass@k against k per group, with the
    bootstrap interval as a band."""
    benchmarks = list(dict.fromkeys(table["benchmark"]))
    colours = group_colours(table["group"])
    fig, axes = _panel_grid(len(benchmarks))
    for ax, bench in zip(axes, benchmarks):
        rows = table[table["benchmark"] == bench]
        for label, curve in rows.groupby("group", sort=False):
            curve = curve.sort_values("k")
            colour = colours[str(label)]
            ax.plot(curve["k"], curve["pass_at_k"], marker="o", markersize=3, color=colour,
                    label=f"{label} ({curve['seeds'].iloc[0]} seeds)")
            ax.fill_between(curve["k"], curve["ci_low"], curve["ci_high"], color=colour, alpha=0.2)
        ks = sorted(rows["k"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(bench, fontsize=FONT_SIZE)
        ax.set_xlabel("k", fontsize=FONT_SIZE)
        ax.set_ylabel("pass@k", fontsize=FONT_SIZE)
        _style(ax)
    _legend(fig, axes)
    fig.suptitle("pass@k, mean over seeds; band: 95% bootstrap interval", fontsize=FONT_SIZE)
    _save_figure(fig, path)


def budget_axis(metrics: pd.DataFrame, budget: str) -> pd.Series:
    """The x value of each logged step: the step, or the cumulative generated tokens (the step's
    ``generated_tokens`` when logged, else ``tokens_per_s`` x ``step_s``) or wall seconds (``step_s``)."""
    if budget == "step":
        return metrics["step"].astype(float)
    if budget == "wall_seconds":
        return metrics["step_s"].cumsum()
    if "generated_tokens" in metrics:
        return metrics["generated_tokens"].cumsum()
    return (metrics["tokens_per_s"] * metrics["step_s"]).cumsum()


def training_curve_stats(runs: Sequence[Run], metric: str, budget: str = "step") -> pd.DataFrame:
    """x -> mean, min and max of ``metric`` over the runs that logged it. On the step axis x is every
    logged step; on a budget axis each run's curve is interpolated onto a common grid up to the
    smallest budget any of the runs reached, so every point averages the same runs."""
    frames = [run.metrics for run in runs if not run.metrics.empty and metric in run.metrics]
    if not frames:
        return pd.DataFrame(columns=["x", "mean", "min", "max"])
    if budget == "step":
        values = pd.concat(frame[["step", metric]] for frame in frames).groupby("step")[metric]
        stats = pd.DataFrame({"mean": values.mean(), "min": values.min(), "max": values.max()}).reset_index()
        return stats.rename(columns={"step": "x"})
    curves = [(budget_axis(frame, budget).to_numpy(), frame[metric].to_numpy(dtype=float)) for frame in frames]
    start = max(x[0] for x, _ in curves)
    end = min(x[-1] for x, _ in curves)
    grid = np.linspace(start, end, CURVE_POINTS) if end > start else np.array([end])
    stacked = np.stack([np.interp(grid, x, y) for x, y in curves])
    return pd.DataFrame({"x": grid, "mean": stacked.mean(axis=0), "min": stacked.min(axis=0), "max": stacked.max(axis=0)})


def panel_metric(groups: Mapping[str, Sequence[Run]], candidates: Sequence[str]) -> str | None:
    """The first of ``candidates`` that some run logged."""
    logged = {column for runs in groups.values() for run in runs for column in run.metrics.columns}
    return next((metric for metric in candidates if metric in logged), None)


def is_flat(curves: Sequence[pd.DataFrame]) -> bool:
    """Whether every curve of a panel is one constant value, to 1 part in 10⁴ of its magnitude (e.g.
    KL without a KL term, the clip fraction of a single update per batch, the entropy of a random
    model a few steps in): such a panel says nothing a caption cannot."""
    values = np.concatenate([c[["mean", "min", "max"]].to_numpy(dtype=float).ravel() for c in curves])
    values = values[~np.isnan(values)]
    return values.size == 0 or bool(np.ptp(values) <= 1e-4 * float(np.abs(values).max()))


def plot_training_curves(groups: Mapping[str, Sequence[Run]], path: Path, budget: str = "step") -> bool:
    """One panel per entry of ``TRAINING_PANELS`` whose curves are not all constant (those are named
    with their value in the caption): the mean over seeds for each group against ``budget`` (step,
    generated_tokens or wall_seconds), with the min-max range over seeds as a band. Returns False (and
    draws nothing) when no run logged training steps or every panel is constant."""
    from matplotlib.ticker import MaxNLocator

    panels, flat = [], []
    for title, candidates in TRAINING_PANELS:
        metric = panel_metric(groups, candidates)
        if metric is None:
            continue
        curves = {label: s for label, runs in groups.items() if not (s := training_curve_stats(runs, metric, budget)).empty}
        if not curves:
            continue
        if is_flat(list(curves.values())):
            flat.append(f"{title} {float(next(iter(curves.values()))['mean'].iloc[0]):.4g}")
        else:
            panels.append((title, metric, curves))
    if not panels:
        return False
    colours = group_colours(groups)
    fig, axes = _panel_grid(len(panels))
    for ax, (title, metric, curves) in zip(axes, panels):
        for label, s in curves.items():
            colour = colours[str(label)]
            ax.plot(s["x"], s["mean"], color=colour, linewidth=1.2, label=f"{label} ({len(groups[label])} seeds)")
            ax.fill_between(s["x"], s["min"], s["max"], color=colour, alpha=0.2)
        ax.set_title(f"{title}: {metric}", fontsize=FONT_SIZE)
        ax.set_xlabel(budget.replace("_", " "), fontsize=FONT_SIZE)
        if budget == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)
        _style(ax)
    _legend(fig, axes)
    caption = "training, mean over seeds; band: min-max over seeds"
    if flat:
        caption += "\nconstant, not drawn: " + ", ".join(flat)
    fig.suptitle(caption, fontsize=FONT_SIZE)
    _save_figure(fig, path)
    return True
