"""The ``rlbench-compare`` command (also ``python -m rlbench.analysis``): read runs, build the table,
write it and the figures to a folder, and optionally log them to a wandb run."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlbench.analysis.paper import paper_comparison, paper_reference
from rlbench.analysis.plots import BUDGETS, plot_passk_curves, plot_training_curves
from rlbench.analysis.runs import find_run_dirs, group_runs, group_warnings, load_run, select_runs
from rlbench.analysis.tables import (
    build_table,
    cost_markdown,
    cost_table,
    markdown_table,
    metric_curves,
    metric_curves_markdown,
    runs_table,
    wide_cells,
    wide_csv,
    wide_latex,
    wide_markdown,
)
from rlbench.errors import ConfigError, DataError
from rlbench.utils import atomic_write_text, plural


def parse_wandb_run(reference: str) -> dict[str, str | None]:
    """``entity/project/run_id``, ``project/run_id`` or ``run_id`` -> wandb.init arguments."""
    parts = [p for p in reference.strip().split("/") if p]
    if not 1 <= len(parts) <= 3:
        raise ConfigError(f"--wandb-run {reference!r}: write entity/project/run_id, project/run_id or run_id")
    parts = [None] * (3 - len(parts)) + parts
    return {"entity": parts[0], "project": parts[1] or "rlbench", "id": parts[2]}


def log_to_wandb(reference: str, tables: Mapping[str, pd.DataFrame], images: Mapping[str, Path], out_dir: Path) -> str:
    """Log the tables as ``compare/<name>`` (wandb.Tables) and the figures as images to the run
    ``reference`` (resumed if it exists, created otherwise; offline without an API key). Returns the
    local wandb run folder."""
    import wandb

    from rlbench.logger.run_logger import wandb_mode

    run = wandb.init(**parse_wandb_run(reference), resume="allow", dir=str(out_dir), mode=wandb_mode("auto"),
                     job_type="compare", reinit="finish_previous")
    try:
        payload: dict[str, Any] = {f"compare/{name}": wandb.Table(dataframe=t) for name, t in tables.items()}
        payload.update({f"compare/{name}": wandb.Image(str(p)) for name, p in images.items()})
        run.log(payload)
        return str(Path(run.dir).parent)
    finally:
        run.finish()



def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlbench-compare",
        description="Compare groups of rlbench runs: pass@k table over seeds with bootstrap intervals and a "
        "paired test against a baseline group, plus pass@k and training-curve plots.",
    )
    parser.add_argument("results", nargs="+", help="run folders or folders containing them (e.g. a multirun folder)")
    parser.add_argument("--by", nargs="+", default=["algorithm"],
                        help="dotted config keys that define the groups (default: algorithm, i.e. algorithm.name)")
    parser.add_argument("--baseline", default=None, help="the group the paired test compares against (e.g. grpo)")
    parser.add_argument("--phase", default="after", help="evaluation phase: after (default), before or eval")
    parser.add_argument("--filter", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="keep runs whose config matches (key=a,b matches either value)")
    parser.add_argument("--k", nargs="+", type=int, default=None, help="k values (default: those in every passk.csv)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: a new results/compare/<time>); an existing non-empty folder is "
                        "refused unless --overwrite")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into --out even when it already holds files (e.g. a committed example)")
    parser.add_argument("--wandb-run", default=None, metavar="RUN_PATH",
                        help="also log the table to this wandb run: entity/project/run_id, project/run_id or run_id")
    parser.add_argument("--budget", choices=BUDGETS, default="step",
                        help="x axis of the training curves: step (default), generated_tokens or wall_seconds "
                        "(cumulative, for equal-compute comparisons)")
    parser.add_argument("--paper", default=None, metavar="NAME",
                        help="also print the reference numbers of paper preset NAME (conf/paper/<NAME>.yaml) beside "
                        "the runs', each marked verified or not (written to paper.md)")
    parser.add_argument("--metrics", nargs="+", default=[], metavar="NAME",
                        help="also tabulate these step metrics per step and group, mean over seeds (metrics.csv, "
                             "metrics.md), e.g. multi_turn_tool_calls")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap and permutation resamples (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the resampling (default 0)")
    return parser.parse_args(argv)


def output_folder(out: str | None, overwrite: bool = False) -> Path:
    """The folder a comparison writes to: ``out`` when it is empty, absent or ``overwrite`` is set (an
    existing non-empty folder is refused otherwise, so committed results are never replaced by
    accident); without ``out`` a new ``results/compare/<time>`` that no earlier comparison used."""
    if out:
        folder = Path(out)
        if folder.is_dir() and any(folder.iterdir()) and not overwrite:
            raise ConfigError(f"--out {out} already holds files; pass --overwrite to replace them, or choose "
                              "another folder (without --out a new results/compare/<time> is used)")
        return folder
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    folder, n = Path("results") / "compare" / stamp, 1
    while folder.exists():
        n += 1
        folder = Path("results") / "compare" / f"{stamp}_{n}"
    return folder


def compare(args: argparse.Namespace) -> Path:
    """Run the comparison described by parsed arguments; returns the output folder."""
    out = output_folder(args.out, args.overwrite)  # refused before any run is read
    if args.paper:
        paper_reference(args.paper)  # an unknown paper is refused before any run is read
    run_dirs = find_run_dirs(args.results)
    if not run_dirs:
        raise DataError(f"no runs found under {', '.join(args.results)} (a run folder holds eval/problems.csv)")
    runs = select_runs([load_run(d) for d in run_dirs], args.filter)
    if not runs:
        raise DataError(f"none of the {len(run_dirs)} runs found matches --filter {' '.join(args.filter)}")
    groups = group_runs(runs, args.by)
    curves = metric_curves(groups, args.metrics) if args.metrics else None  # an unknown name refused before writing
    for warning in group_warnings(groups):
        print(f"rlbench-compare: warning: {warning}", file=sys.stderr)
    table = build_table(groups, phase=args.phase, ks=args.k, baseline=args.baseline,
                        n_resamples=args.resamples, seed=args.seed)

    cells = wide_cells(table, groups, phase=args.phase, n_resamples=args.resamples, seed=args.seed)
    wide = wide_csv(cells)

    markdown = wide_markdown(cells)
    atomic_write_text(out / "table.md", markdown)
    atomic_write_text(out / "table.tex", wide_latex(cells))
    atomic_write_text(out / "table_wide.csv", wide.to_csv(index=False))
    atomic_write_text(out / "table.csv", table.to_csv(index=False))
    atomic_write_text(out / "table_long.md", markdown_table(table))
    atomic_write_text(out / "runs.csv", runs_table(groups).to_csv(index=False))
    costs = cost_table(groups, phase=args.phase)
    if not costs.empty:
        atomic_write_text(out / "cost.csv", costs.to_csv(index=False))
        atomic_write_text(out / "cost.md", cost_markdown(costs))
    if curves is not None:
        atomic_write_text(out / "metrics.csv", curves.to_csv(index=False))
        atomic_write_text(out / "metrics.md", metric_curves_markdown(curves))
    images = {"passk_curves": out / "passk_curves.png"}
    plot_passk_curves(table, images["passk_curves"])
    if plot_training_curves(groups, out / "training_curves.png", budget=args.budget):
        images["training_curves"] = out / "training_curves.png"
    print(markdown)
    if not costs.empty:
        print(cost_markdown(costs))
    if args.paper:
        beside = paper_comparison(args.paper, table)
        atomic_write_text(out / "paper.md", beside)
        print(beside)
    if args.wandb_run:
        print(f"wandb: {log_to_wandb(args.wandb_run, {'table': table, 'wide': wide}, images, out)}")
    print(f"comparison of {plural(len(runs), 'run')} in {plural(len(groups), 'group')}: {out}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rlbench-compare`` and ``python -m rlbench.analysis``; returns the exit status."""
    args = parse_args(argv)
    try:
        compare(args)
    except (ConfigError, DataError) as err:
        print(f"rlbench-compare: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0
