"""Figures of a comparison (matplotlib, Agg canvas, no display needed): pass@k against k per group,
and training curves per group over seeds, against steps or a compute budget."""

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


def _save_figure(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(path, buffer.getvalue())


def plot_passk_curves(table: pd.DataFrame, path: Path) -> None:
    """One panel per benchmark (and the macro average): mean pass@k against k per group, with the
    bootstrap interval as a band."""
    from matplotlib.figure import Figure

    benchmarks = list(dict.fromkeys(table["benchmark"]))
    fig = Figure(figsize=(4.2 * len(benchmarks), 3.6), layout="constrained")
    axes = fig.subplots(1, len(benchmarks), squeeze=False)[0]
    for ax, bench in zip(axes, benchmarks):
        rows = table[table["benchmark"] == bench]
        for label, curve in rows.groupby("group", sort=False):
            curve = curve.sort_values("k")
            line = ax.plot(curve["k"], curve["pass_at_k"], marker="o", label=f"{label} ({curve['seeds'].iloc[0]} seeds)")
            ax.fill_between(curve["k"], curve["ci_low"], curve["ci_high"], color=line[0].get_color(), alpha=0.2)
        ks = sorted(rows["k"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(bench)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("pass@k: mean over seeds, band = 95% bootstrap interval (seeds x problems)", fontsize=9)
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


def plot_training_curves(groups: Mapping[str, Sequence[Run]], path: Path, budget: str = "step") -> bool:
    """One panel per entry of ``TRAINING_PANELS``: the mean over seeds for each group against
    ``budget`` (step, generated_tokens or wall_seconds), with the min-max range over seeds as a
    band. Returns False (and draws nothing) when no run logged training steps."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [(title, metric) for title, candidates in TRAINING_PANELS
              if (metric := panel_metric(groups, candidates)) is not None]
    if not panels:
        return False
    fig = Figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, metric) in zip(axes, panels):
        for label, runs in groups.items():
            s = training_curve_stats(runs, metric, budget)
            if s.empty:
                continue
            line = ax.plot(s["x"], s["mean"], label=f"{label} ({len(runs)} seeds)")
            ax.fill_between(s["x"], s["min"], s["max"], color=line[0].get_color(), alpha=0.2)
        ax.set_title(f"{title}: {metric}", fontsize=9)
        ax.set_xlabel(budget.replace("_", " "))
        if budget == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("training: mean over seeds, band = min-max over seeds", fontsize=9)
    _save_figure(fig, path)
    return True
