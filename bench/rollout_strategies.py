"""Every registered rollout strategy on the same prompts and seeds: what generation cost and what the
short run reached, each against ``iid`` in the same invocation.

For each dataset (arith level 1, GSM8K) and each strategy registered in ``rlbench.rollout.STRATEGIES``
that has a ``conf/rollout/<name>.yaml`` (discovered: a strategy merged later is measured without editing
this file), the same short GRPO run of SmolLM2-135M-Instruct (``model=smollm2_135m``) through the real
runner, on the same seeds: ``rollout.n`` leaves (responses) per prompt, the same prompts per step, the same
sampling parameters. A strategy that needs more than ``algorithm=grpo`` (the tree strategies read the tree
in their advantage, vine reads its Monte-Carlo values) gets it from :data:`COMPANIONS`; one that the run's validation still refuses is listed
with the refusal, not measured.

Per run it reads the runner's own metrics (``metrics.jsonl``) and evaluation (``eval/``):

* generated tokens, reused tokens (prefixes the engine only scored), engine seconds, summed over steps;
* the mean outcome (grader reward before shaping) over every training response, with a 95% interval
  over the responses (normal approximation with the pooled per-step std; responses taken as independent);
* pass@1 after training on the first ``--eval-limit`` test problems (``eval.n`` samples each).

Each strategy is compared with ``iid`` of the same dataset: generated tokens per response relative to
iid's (the issue's goal for ``tree``: at least 30% fewer at the same leaves per prompt, with an outcome
interval that overlaps iid's).

    HF_HUB_OFFLINE=1 python bench/rollout_strategies.py                 # ~10-15 min on 2 loaded cores
    HF_HUB_OFFLINE=1 python bench/rollout_strategies.py --strategies iid,tree --datasets arith --quick

Writes ``results/bench/rollout_strategies.json`` and ``.md`` (atomically). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# nothing may download; set before transformers is imported
os.environ.update({key: os.environ.get(key, value) for key, value in (
    ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("WANDB_MODE", "disabled"),
    ("TOKENIZERS_PARALLELISM", "false"))})

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
RESULTS_DIR = ROOT / "results" / "bench"

# What a strategy needs beside algorithm=grpo to run at all.
COMPANIONS = {
    "tree": ["algorithm/advantage=tree"],
    "treerpo": ["algorithm/advantage=treerpo"],
    "vine": ["algorithm/advantage=vine"],
}
# Per dataset: the response budget and a segment length that lets a tree of 8 leaves branch three times
# (2 -> 4 -> 8) within it, then finish in one last segment.
DATASETS = {
    "arith": {"overrides": ["dataset=arith", "dataset.arith.level=1", "eval=arith"], "max_new_tokens": 16, "segment": 4},
    "gsm8k": {"overrides": ["dataset=gsm8k", "eval=gsm8k", "eval.temperature=1.0", "eval.top_p=1.0"], "max_new_tokens": 48, "segment": 12},
}


def discover_strategies() -> list[str]:
    from rlbench.rollout import STRATEGIES

    return sorted(name for name in STRATEGIES if (CONF_DIR / "rollout" / f"{name}.yaml").is_file())


def compose(overrides: list[str], output_dir: Path):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, f"output_dir={output_dir}"])


def run_overrides(strategy: str, dataset: str, seed: int, args: argparse.Namespace) -> list[str]:
    spec = DATASETS[dataset]
    segment = [f"rollout.{strategy}.segment_tokens={spec['segment']}"] if strategy in ("tree", "treerpo") else []
    if strategy == "mcts_prefix":  # the search tree branches like rollout=tree's
        segment = [f"rollout.mcts_prefix.search.segment_tokens={spec['segment']}"]
    return [
        "model=smollm2_135m",
        "algorithm=grpo",
        f"rollout={strategy}",
        *COMPANIONS.get(strategy, []),
        *spec["overrides"],
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={spec['max_new_tokens']}",
        f"eval.max_new_tokens={spec['max_new_tokens']}",
        *segment,
        f"trainer.steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}",
        "trainer.micro_batch_size=8",
        "trainer.save_model=false",
        f"eval.limit={args.eval_limit}",
        f"eval.n={args.eval_n}",
        "eval.k=[1]",
        "eval.before_training=false",
        "logger=files",
        f"seed={seed}",
    ]


def pass_at_1(out: Path) -> float | None:
    """pass@1 of the run's first benchmark after training (eval/passk.csv)."""
    import csv

    path = out / "eval" / "passk.csv"
    if not path.is_file():
        return None
    with path.open() as f:
        rows = [row for row in csv.DictReader(f) if row["k"] == "1" and row["phase"] == "after"]
    return float(rows[0]["pass_at_k"]) if rows else None


def one_run(strategy: str, dataset: str, seed: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from rlbench.runner import run

    out = scratch / f"{dataset}-{strategy}-{seed}"
    cfg = compose(run_overrides(strategy, dataset, seed, args), out)
    start = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - start
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "seed": seed,
        "wall_s": wall,
        "generated_tokens": sum(s.get("generated_tokens", 0.0) for s in steps),
        "reused_tokens": sum(s.get("reused_tokens", 0.0) for s in steps),
        "generated_responses": sum(s.get("generated_responses", 0.0) for s in steps),
        "engine_s": sum(s.get("engine_s", 0.0) for s in steps),
        "step_outcomes": [s.get("rollout_outcome_mean", s["outcome_mean"]) for s in steps],
        "step_reward_stds": [s.get("reward_std", float("nan")) for s in steps],
        "pass_at_1": pass_at_1(out),
    }


def summarise(runs: list[dict[str, Any]], responses_per_step: int) -> dict[str, Any]:
    """Means over the seeds' runs; the outcome's 95% interval is a normal approximation over all training
    responses, with the per-step reward std pooled (responses taken as independent: a tree's leaves share
    prefixes, so for tree strategies the interval is narrower than it should be)."""
    outcomes = [x for r in runs for x in r["step_outcomes"]]
    mean = statistics.fmean(outcomes)
    pooled_std = math.sqrt(statistics.fmean(x * x for r in runs for x in r["step_reward_stds"]))
    half = 1.96 * pooled_std / math.sqrt(responses_per_step * len(outcomes))
    passes = [r["pass_at_1"] for r in runs if r["pass_at_1"] is not None]
    return {
        "runs": runs,
        "generated_tokens": statistics.fmean(r["generated_tokens"] for r in runs),
        "reused_tokens": statistics.fmean(r["reused_tokens"] for r in runs),
        "engine_s": statistics.fmean(r["engine_s"] for r in runs),
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "responses_per_step": responses_per_step,
        "outcome_mean": mean,
        "outcome_ci": [mean - half, mean + half],
        "pass_at_1": statistics.fmean(passes) if passes else None,
    }


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Rollout strategies: generation cost and reward, each against iid",
        "",
        f"Written by `bench/rollout_strategies.py` on {report['date']} ({report['machine']}). Settings: "
        f"SmolLM2-135M-Instruct, GRPO, {s['steps']} steps of {s['prompts']} prompts x {s['n']} responses (leaves), "
        f"seeds {s['seeds']}, temperature 1.0; pass@1 after training on the first {s['eval_limit']} test problems "
        f"x {s['eval_n']} samples. Outcome: the grader's mean reward over the training responses, 95% interval over "
        "the responses (normal approximation, responses taken as independent). Token columns: per run, summed over steps.",
        "",
    ]
    for dataset, rows in report["datasets"].items():
        base = rows.get("iid")
        lines += [f"## {dataset} (max_new_tokens {DATASETS[dataset]['max_new_tokens']})", "",
                  "| strategy | generated tokens | vs iid | reused tokens | engine s | vs iid | outcome (95% CI) | overlaps iid | pass@1 |",
                  "|---|---:|---:|---:|---:|---:|---|---|---:|"]
        for name, row in rows.items():
            if "refused" in row:
                lines.append(f"| {name} | refused: {row['refused']} | | | | | | | |")
                continue
            rel_tok = f"{row['generated_tokens'] / base['generated_tokens'] - 1:+.0%}" if base else ""
            rel_s = f"{row['engine_s'] / base['engine_s'] - 1:+.0%}" if base else ""
            lo, hi = row["outcome_ci"]
            overlap = "" if not base or name == "iid" else ("yes" if lo <= base["outcome_ci"][1] and base["outcome_ci"][0] <= hi else "no")
            p1 = "" if row["pass_at_1"] is None else f"{row['pass_at_1']:.3f}"
            lines.append(
                f"| {name} | {row['generated_tokens']:.0f} | {rel_tok} | {row['reused_tokens']:.0f} | {row['engine_s']:.1f} | "
                f"{rel_s} | {row['outcome_mean']:.3f} [{lo:.3f}, {hi:.3f}] | {overlap} | {p1} |"
            )
        lines.append("")
    lines += [
        "Generated tokens count every token the engine sampled (a tree's shared prefix once); reused tokens are "
        "prefixes it was given and only scored (a tree node's path when its children are sampled). Engine seconds "
        "are wall seconds inside the engine on a shared machine: compare rows of one table only.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered strategy)")
    parser.add_argument("--datasets", default="arith,gsm8k")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses (leaves) per prompt")
    parser.add_argument("--eval-limit", type=int, default=8)
    parser.add_argument("--eval-n", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared machine more threads spin)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 1 step, 4 eval problems (smoke check)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "rollout_strategies.json")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.eval_limit = "0", 1, 4
    seeds = [int(s) for s in args.seeds.split(",")]
    strategies = args.strategies.split(",") if args.strategies else discover_strategies()
    strategies = ["iid"] + [s for s in strategies if s != "iid"]

    import torch

    from rlbench.validation import validate_config
    from rlbench.errors import ConfigError
    from rlbench.utils import atomic_write_json, atomic_write_text

    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    report: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, load {os.getloadavg()[0]:.1f} at start",
        "settings": {"steps": args.steps, "prompts": args.prompts, "n": args.n, "seeds": seeds,
                     "eval_limit": args.eval_limit, "eval_n": args.eval_n},
        "datasets": {},
    }
    with tempfile.TemporaryDirectory(prefix="rlbench-rollout-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        for dataset in args.datasets.split(","):
            rows: dict[str, Any] = {}
            for strategy in strategies:
                try:
                    validate_config(compose(run_overrides(strategy, dataset, seeds[0], args), scratch / "check"))
                except ConfigError as err:
                    rows[strategy] = {"refused": str(err).split(". ")[0]}
                    print(f"[rollout_strategies] {dataset} {strategy}: refused ({err})", flush=True)
                    continue
                runs = []
                for seed in seeds:
                    runs.append(one_run(strategy, dataset, seed, args, scratch))
                    r = runs[-1]
                    print(f"[rollout_strategies] {dataset} {strategy} seed {seed}: {r['generated_tokens']:.0f} generated, "
                          f"{r['reused_tokens']:.0f} reused, engine {r['engine_s']:.1f}s, pass@1 {r['pass_at_1']}, "
                          f"wall {r['wall_s']:.0f}s, load {os.getloadavg()[0]:.1f}", flush=True)
                rows[strategy] = summarise(runs, args.prompts * args.n)
            report["datasets"][dataset] = rows
    report["machine"] += f", {os.getloadavg()[0]:.1f} at the end"
    atomic_write_json(args.out, report)
    atomic_write_text(args.out.with_suffix(".md"), markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
