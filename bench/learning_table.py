"""The learning tier's per-preset table (results/learning/README.md) from recorded verdicts.

Record a configuration by running the tier with RLBENCH_LEARNING_RECORD set, e.g.

    RLBENCH_LEARNING_RECORD=results/learning/records/threads1 make test-learning
    RLBENCH_LEARNING_THREADS=2 RLBENCH_LEARNING_RECORD=results/learning/records/threads2 make test-learning
    RLBENCH_LEARNING_SEEDS=10,11,12 RLBENCH_LEARNING_RECORD=results/learning/records/seeds10-12 make test-learning
    ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 RLBENCH_LEARNING_RECORD=... make test-learning

(the last forces torch's and MKL's scalar kernels: another summation order, as on another CPU), then

    python bench/learning_table.py results/learning/records/* > results/learning/README.md

Each record holds the per-step rewards, so the table is recomputed with the criterion of
tests/learning/toy_check.py, not copied from the test's output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "learning"))
from toy_check import END_FLOOR, PEAK_MARGIN, judge  # noqa: E402


def load(record_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(record_dir.glob("*.json"))}


def main(dirs: list[str]) -> None:
    configs = {Path(d).name: load(Path(d)) for d in dirs}
    presets = sorted({p for records in configs.values() for p in records})
    print("# The learning tier, per preset\n")
    print(f"Criterion (tests/learning/toy_check.py): over the seeds, median peak rise > the negative control's median "
          f"peak rise + {PEAK_MARGIN} and median end rise >= {END_FLOOR}. Peak rise: best 4-step window minus the first 4 steps; end rise: last 4 minus first 4.\n")
    for name, records in configs.items():
        any_record = next(iter(records.values()))
        print(f"## {name}: seeds {any_record['seeds']}, torch threads {any_record['threads']}, "
              f"kernels {any_record.get('aten_cpu_capability', 'native')}\n")
        verdicts = {p: judge(p, r["seeds"], r["runs"], r["controls"]) for p, r in records.items()}
        margins = {p: v.median_peak - v.median_control_peak - PEAK_MARGIN for p, v in verdicts.items()}
        tightest = min(margins, key=margins.get)
        print(f"{sum(v.learns for v in verdicts.values())} of {len(verdicts)} recorded presets learn; control runs per "
              f"preset: {'/'.join(str(n) for n in sorted({len(r['controls']) for r in records.values()}))}; smallest margin left {margins[tightest]:+.3f} ({tightest}).\n")
        print("| preset | median peak rise | worst seed (peak) | median end rise | control median peak | margin left | learns |")
        print("|---|---|---|---|---|---|---|")
        for preset in presets:
            row = records.get(preset)
            if row is None:
                print(f"| {preset} | not recorded | | | | | |")
                continue
            v = judge(preset, row["seeds"], row["runs"], row["controls"])
            margin = v.median_peak - v.median_control_peak - PEAK_MARGIN
            print(f"| {preset} | {v.median_peak:+.3f} | {min(v.peak):+.3f} | {v.median_end:+.3f} | "
                  f"{v.median_control_peak:+.3f} | {margin:+.3f} | {'yes' if v.learns else 'NO'} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
