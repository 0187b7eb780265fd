"""Fingerprints of the seed-0 toy run of every preset and rollout strategy, to show that a change left
every numerical result as it was (a refactor's check: the metrics of each run identical, bit for bit).

Each learning check (tests/learning/toy_check.py: every algorithm preset and every rollout strategy with a
toy file in conf/experiment/toy_learning/) and each preset or strategy without one (run as
``toy_learning/grpo`` with that algorithm or rollout) is run once at seed 0, for ``--steps`` steps, through
the real runner in this process. A run's fingerprint is the SHA-256 of its metrics.jsonl without the keys
that measure time or memory (``timing/*``, ``*_s``, ``*_seconds``, ``peak_memory*``, ...), which differ between
runs of the same computation.

    python bench/toy_fingerprint.py --out results/refactor/toy_fingerprint_BEFORE.json
    python bench/toy_fingerprint.py --out after.json --against results/refactor/toy_fingerprint_BEFORE.json
    python bench/toy_fingerprint.py --out /dev/null --against before.json --compare after.json   # stored files

With ``--against`` the script prints, per run, ``same`` or ``DIFFERENT`` (the first differing step and
key), and exits 1 when any differs. Compare fingerprints taken on one machine with one thread count:
float summation order differs between machines and thread counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "learning"))

# Keys that measure the machine rather than the computation.
VOLATILE_MARKERS = ("timing", "seconds", "time", "memory", "_mb", "throughput", "per_second")


def volatile(key: str) -> bool:
    return key.endswith("_s") or any(marker in key for marker in VOLATILE_MARKERS)


def stable(steps: list[dict]) -> list[dict]:
    return [{k: v for k, v in step.items() if not volatile(k)} for step in steps]


def digest(steps: list[dict]) -> str:
    return hashlib.sha256(json.dumps(stable(steps), sort_keys=True).encode()).hexdigest()


def stable_metrics(metrics_file: Path) -> list[dict]:
    return stable([json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()])


def runs_to_fingerprint() -> dict[str, list[str]]:
    """run name -> overrides: every toy check, then the presets and strategies without one."""
    from toy_check import ALGORITHM_PRESETS_WITHOUT_TOY_CHECK, ROLLOUT_STRATEGIES_WITHOUT_TOY_CHECK, TOY_DIR

    runs = {path.stem: [f"experiment=toy_learning/{path.stem}"] for path in sorted(TOY_DIR.glob("*.yaml"))}
    for name in sorted(ALGORITHM_PRESETS_WITHOUT_TOY_CHECK):
        runs[f"algorithm={name}"] = ["experiment=toy_learning/grpo", f"algorithm={name}"]
    for name in sorted(ROLLOUT_STRATEGIES_WITHOUT_TOY_CHECK):
        runs[f"rollout={name}"] = ["experiment=toy_learning/grpo", f"rollout={name}"]
    return runs


def fingerprint(name: str, overrides: list[str], steps: int, workdir: Path) -> dict:
    from conftest import compose_config
    from rlbench.runner import run

    out = workdir / name.replace("=", "_")
    cfg = compose_config([*overrides, "seed=0", f"trainer.steps={steps}"], out)
    try:
        run(cfg)
    except Exception as err:  # a run that fails is part of the fingerprint: it must fail the same way after
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    metrics = stable_metrics(out / "metrics.jsonl")
    return {"sha256": digest(metrics), "steps": len(metrics), "metrics": metrics}


def outcome(run: dict) -> str:
    """The run's error, or the digest of its metrics under today's list of volatile keys (so that a
    fingerprint file written before a key was recognised as volatile still compares)."""
    return run["error"] if "error" in run else digest(run["metrics"])


def first_difference(before: dict, after: dict) -> str:
    if "error" in before or "error" in after:
        return f"error before: {before.get('error')!r}; after: {after.get('error')!r}"
    for step, (a, b) in enumerate(zip(stable(before["metrics"]), stable(after["metrics"]))):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f"step {step}, {key}: {a.get(key)!r} -> {b.get(key)!r}"
    return f"{before['steps']} steps -> {after['steps']} steps"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write the fingerprints (JSON)")
    parser.add_argument("--against", type=Path, help="fingerprints to compare with; exit 1 on any difference")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the toy files say 16)")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--compare", type=Path, help="compare this stored fingerprint file with --against; run nothing")
    args = parser.parse_args()

    import logging

    logging.disable(logging.WARNING)
    if args.compare is not None:
        return compare(json.loads(args.against.read_text())["runs"], json.loads(args.compare.read_text())["runs"])
    runs = runs_to_fingerprint()
    if args.only:
        runs = {k: v for k, v in runs.items() if k in set(args.only.split(","))}
    results: dict[str, dict] = {}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(runs.items(), 1):
            results[name] = fingerprint(name, overrides, args.steps, Path(tmp))
            elapsed = time.time() - started
            eta = elapsed / i * (len(runs) - i)
            status = results[name].get("sha256", "error")[:12]
            print(f"[{i}/{len(runs)}] {name}: {status}  ({elapsed:.0f} s, ETA {eta:.0f} s)", flush=True)
    payload = {"steps": args.steps, "threads": os.environ.get("OMP_NUM_THREADS", "default"), "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".tmp")
    partial.write_text(json.dumps(payload, indent=1, sort_keys=True))
    partial.replace(args.out)
    if args.against is None:
        return 0
    return compare(json.loads(args.against.read_text())["runs"], results)


def compare(before: dict[str, dict], results: dict[str, dict]) -> int:
    """Print same / DIFFERENT per run; 1 when any differs."""
    differing = 0
    for name in sorted(set(before) | set(results)):
        if name not in before or name not in results:
            print(f"{name}: only {'after' if name in results else 'before'}")
            differing += 1
            continue
        same = outcome(before[name]) == outcome(results[name])
        print(f"{name}: {'same' if same else 'DIFFERENT: ' + first_difference(before[name], results[name])}")
        differing += not same
    print(f"{len(results) - differing} of {len(results)} runs identical")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
