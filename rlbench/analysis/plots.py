"""Figures of a comparison (matplotlib, Agg canvas, no display needed): pass@k against k per group,
and training curves per group over seeds."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from rlbench.analysis.runs import Run
from rlbench.utils import atomic_write_bytes

TRAINING_METRICS = ("reward_mean", "response_length", "entropy")


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


def training_curve_stats(runs: Sequence[Run], metric: str) -> pd.DataFrame:
    """step -> mean, min and max of ``metric`` over the runs that logged it at that step."""
    frames = [run.metrics[["step", metric]] for run in runs if not run.metrics.empty and metric in run.metrics]
    if not frames:
        return pd.DataFrame(columns=["step", "mean", "min", "max"])
    values = pd.concat(frames).groupby("step")[metric]
    return pd.DataFrame({"mean": values.mean(), "min": values.min(), "max": values.max()}).reset_index()


def plot_training_curves(groups: Mapping[str, Sequence[Run]], path: Path, metrics: Sequence[str] = TRAINING_METRICS) -> bool:
    """One panel per training metric: the mean over seeds per step for each group, with the min-max
    range over seeds as a band. Returns False (and draws nothing) when no run logged training steps."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    stats = {(label, m): training_curve_stats(runs, m) for label, runs in groups.items() for m in metrics}
    if all(s.empty for s in stats.values()):
        return False
    fig = Figure(figsize=(4.2 * len(metrics), 3.6), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics):
        for label in groups:
            s = stats[(label, metric)]
            if s.empty:
                continue
            line = ax.plot(s["step"], s["mean"], label=f"{label} ({len(groups[label])} seeds)")
            ax.fill_between(s["step"], s["min"], s["max"], color=line[0].get_color(), alpha=0.2)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("training: mean over seeds, band = min-max over seeds", fontsize=9)
    _save_figure(fig, path)
    return True
