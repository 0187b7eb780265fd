"""The grader's probe battery on every shipped math benchmark: acceptance table per benchmark.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/grader_probe.py            # every reference (minutes)
    HF_HUB_OFFLINE=1 .venv/bin/python bench/grader_probe.py --every 10 # every 10th reference

Writes results/eval/grader_probe.md and .json (atomically): per benchmark the references, the
renderings accepted, the wrong answers rejected and every failure (the battery: rlbench/reward/probe.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlbench.reward.probe import BATTERY_SOURCES, battery_problems, run_battery  # noqa: E402
from rlbench.utils import atomic_write_json, atomic_write_text  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1, help="every N-th reference of each benchmark (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "eval" / "grader_probe")
    args = parser.parse_args(argv)
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    results = []
    for name in BATTERY_SOURCES:
        references, grader = battery_problems(name, ROOT / "conf", args.every)
        result = run_battery(name, references, grader)
        results.append(result)
        print(result.row(), flush=True)

    rows = [r.row() for r in results]
    lines = [
        "# Grader probe battery",
        "",
        f"`bench/grader_probe.py{' --every ' + str(args.every) if args.every > 1 else ''}`: every reference answer "
        "of each benchmark, rendered several ways (each must be accepted) and the canonical wrong answers (each must "
        "be rejected unless it equals the reference); the battery is described in `rlbench/reward/probe.py` and "
        "[docs/evaluation.md](../../docs/evaluation.md).",
        "",
        "| benchmark | references | renderings | accepted | rate | wrong answers | rejected | rate | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['benchmark']} | {row['references']} | {row['renderings']} | {row['renderings_accepted']} | "
            f"{row['acceptance_rate']:.4f} | {row['wrong_answers']} | {row['wrong_rejected']} | {row['rejection_rate']:.4f} | "
            f"{row['seconds']} |"
        )
    by_probe = Counter((r.benchmark, v[1], v[3]) for r in results for v in r.verdicts)
    lines += ["", "Probes asked, per benchmark and probe (`+` rendering, `-` wrong answer):", ""]
    for result in results:
        counts = ", ".join(f"{'+' if expected else '-'}{probe} {n}" for (bench, probe, expected), n in sorted(by_probe.items()) if bench == result.benchmark)
        lines.append(f"- {result.benchmark}: {counts}")
    failures = [(r.benchmark, *f) for r in results for f in r.failures]
    lines += ["", f"Failures: {len(failures)}", ""]
    lines += [f"- {bench}: reference `{ref}`, {probe} `{answer}` graded {'correct' if got else 'wrong'}" for bench, ref, probe, answer, got in failures]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    atomic_write_json(args.out.with_suffix(".json"), {"every": args.every, "rows": rows, "failures": failures})
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
