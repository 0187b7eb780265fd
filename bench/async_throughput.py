"""Asynchronous training on CPU: steps per minute, the share of wall time in which generation and update
overlap, and the reward curve, at trainer.max_staleness = null (synchronous), 0, 1, 2; written to
results/bench/async.md and async.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/async_throughput.py                 # SmolLM2-135M, arith level 1
    OMP_NUM_THREADS=1 .venv/bin/python bench/async_throughput.py --steps 4 --toy # the tiny model (seconds)
    OMP_NUM_THREADS=1 .venv/bin/python bench/async_throughput.py --m2po          # + m2po vs grpo on stale toy data

Each run is the default job (GRPO, 8 prompts x 4 responses, 16 new tokens) shortened to --steps steps,
without evaluation before training. The learner keeps the process's torch threads, the generator thread
gets --generator-threads. ``--m2po`` adds the toy comparison the M2PO preset is for: m2po's second-moment
mask against grpo's PPO clipping, both on data 2 versions stale, three seeds, the toy check's criterion
(tests/learning/toy_check.py: median peak rise of the per-step outcome).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "learning")]
OUT = ROOT / "results" / "bench"
STALENESS = ("null", "0", "1", "2")


def run_once(out: Path, overrides: list[str]) -> tuple[list[dict], dict, float]:
    from conftest import compose_config
    from rlbench.runner import run

    start = time.perf_counter()
    run(compose_config(overrides, out))
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "summary.json").read_text()), wall


def throughput(steps: int, toy: bool, generator_threads: int, scratch: Path) -> list[dict]:
    base = ["eval.before_training=false", "logger=files", f"trainer.steps={steps}", "eval.limit=4", "eval.n=2", "eval.k=[1]",
            "trainer.save_model=false"]
    if toy:
        base = ["experiment=toy_learning/grpo", *base]
    table = []
    for k in STALENESS:
        extra = [f"trainer.max_staleness={k}"] + ([f"trainer.generator_threads={generator_threads}"] if k != "null" else [])
        rows, summary, _ = run_once(scratch / f"k{k}", base + extra)
        train_s = sum(r["step_s"] for r in rows) if k == "null" else summary["async_wall_s"]
        table.append({
            "max_staleness": k,
            "steps": len(rows),
            "train_s": train_s,
            "steps_per_min": 60 * len(rows) / train_s,
            "overlap_share": summary.get("async_overlap_share", 0.0),
            "generate_s": summary.get("async_generate_s", sum(r["generate_s"] for r in rows)),
            "update_s": summary.get("async_update_s", sum(r["update_s"] for r in rows)),
            "staleness": [r.get("staleness", 0.0) for r in rows],
            "outcome": [r["outcome_mean"] for r in rows],
        })
    return table


def m2po_on_stale_data(scratch: Path) -> list[dict]:
    from toy_check import end_rise, peak_rise, step_rewards, toy_run

    rows = []
    for preset in ("grpo", "m2po"):
        runs = [step_rewards(toy_run(scratch / f"{preset}{seed}", preset, f"seed={seed}", "trainer.max_staleness=2"))
                for seed in (0, 1, 2)]
        rows.append({"preset": preset, "peak_rise": [peak_rise(r) for r in runs], "end_rise": [end_rise(r) for r in runs],
                     "median_peak_rise": statistics.median(peak_rise(r) for r in runs)})
    return rows


def markdown(table: list[dict], m2po: list[dict] | None, args: argparse.Namespace) -> str:
    import torch

    model = "the tiny toy model" if args.toy else "SmolLM2-135M-Instruct"
    lines = [
        "# Asynchronous training with bounded staleness on CPU",
        "",
        f"`python bench/async_throughput.py --steps {args.steps}{' --toy' if args.toy else ''}"
        f"{' --m2po' if args.m2po else ''}`: {model}, GRPO, the default job's batch (8 prompts x 4 responses, "
        f"16 new tokens), {args.steps} steps per run, learner torch threads {torch.get_num_threads()}, "
        f"generator thread {args.generator_threads} (trainer.generator_threads). Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        "on this project's shared 2-core machine (other jobs ran beside it: the absolute times are noisy, the "
        "comparison between rows is the point).",
        "",
        "| max_staleness | steps/min | overlap share | generation s | update s | staleness per step | outcome per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['max_staleness']} | {row['steps_per_min']:.2f} | {row['overlap_share']:.2f} | {row['generate_s']:.1f} | "
            f"{row['update_s']:.1f} | {', '.join(f'{s:.0f}' for s in row['staleness'])} | "
            f"{', '.join(f'{r:.2f}' for r in row['outcome'])} |"
        )
    lines += [
        "",
        "Overlap share: the wall time during which the generator thread was sampling and the learner was "
        "updating at once, over the run's training wall time (null: the synchronous loop, nothing overlaps; 0: "
        "the pipeline with batch s waiting for version s-1, so only the end of one step's bookkeeping overlaps).",
    ]
    if m2po:
        lines += ["", "## m2po vs grpo on data 2 versions stale (toy task, seeds 0-2)", "",
                  "| preset | peak rise per seed | end rise per seed | median peak rise |", "|---|---|---|---|"]
        for row in m2po:
            lines.append(f"| {row['preset']} | {', '.join(f'{x:+.3f}' for x in row['peak_rise'])} | "
                         f"{', '.join(f'{x:+.3f}' for x in row['end_rise'])} | {row['median_peak_rise']:+.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--toy", action="store_true", help="the tiny toy model instead of SmolLM2-135M")
    parser.add_argument("--m2po", action="store_true", help="also m2po vs grpo on stale toy data")
    parser.add_argument("--generator-threads", type=int, default=1)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    from rlbench.utils import atomic_write_json, atomic_write_text

    with tempfile.TemporaryDirectory() as scratch:
        table = throughput(args.steps, args.toy, args.generator_threads, Path(scratch))
        m2po = m2po_on_stale_data(Path(scratch)) if args.m2po else None
    name = "async_toy" if args.toy else "async"
    atomic_write_json(OUT / f"{name}.json", {"throughput": table, "m2po_stale": m2po})
    atomic_write_text(OUT / f"{name}.md", markdown(table, m2po, args))
    print(markdown(table, m2po, args))


if __name__ == "__main__":
    main()
