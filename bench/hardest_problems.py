"""pass@k after training on the problems a sweep's runs never solved before training (docs/guidance.md).

    python bench/hardest_problems.py <sweep dir> [--k 1 8] [--out table.md]

Reads each run's eval/problems.csv (phase, benchmark, uid, n, correct) and config.yaml. The hard set is the
problems with 0 correct of n in the "before" phase (the same for every run of one model and eval seed, the
evaluation's per-problem random streams), and, as a fallback when there are none, the decile with the
fewest correct. Prints one row per run: method, seed, problems in the set, unbiased pass@k after training.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import yaml


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def hard_set(rows: list[dict]) -> set[tuple[str, str]]:
    before = [r for r in rows if r["phase"] == "before"]
    never = {(r["benchmark"], r["uid"]) for r in before if int(r["correct"]) == 0}
    if never:
        return never
    ranked = sorted(before, key=lambda r: (int(r["correct"]), r["uid"]))
    return {(r["benchmark"], r["uid"]) for r in ranked[: max(1, len(ranked) // 10)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("sweep")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = ["| method | seed | hard problems | " + " | ".join(f"pass@{k} after" for k in args.k) + " |",
             "|---|---:|---:|" + "---:|" * len(args.k)]
    for run in sorted(p for p in Path(args.sweep).iterdir() if (p / "eval" / "problems.csv").is_file()):
        rows = list(csv.DictReader((run / "eval" / "problems.csv").open()))
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        hard = hard_set(rows)
        after = [r for r in rows if r["phase"] == "after" and (r["benchmark"], r["uid"]) in hard]
        cells = [sum(pass_at_k(int(r["n"]), int(r["correct"]), k) for r in after) / max(len(after), 1) for k in args.k]
        lines.append(f"| {cfg['algorithm']['name']} | {cfg['seed']} | {len(hard)} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
