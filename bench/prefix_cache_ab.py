"""Engine seconds of prefix-resending rollout strategies with and without the HF engine's KV cache across
calls (``rollout.prefix_cache_mb``), interleaved in one process (A/B).

Both arms run the same strategy on the same SmolLM2-135M-Instruct object, the same prompts (4 arith
questions in the chat template) and ``--n`` leaves per prompt, at the same generator seed per repetition;
only the engine's ``prefix_cache_mb`` differs (0 against ``--budget-mb``). The order alternates
(off-on, on-off, ...) so that a change of load on a shared machine hits both alike. Every repetition
compares what the arms drew: the leaves drawn the same, and the largest log-prob difference over the tokens
both drew before a leaf's first different token (the kept KV was computed by one-token decoding steps, the
uncached prefill computes it in one pass: float rounding, so a token whose uniform draw falls within that
difference of a CDF boundary can differ, and the rest of its path with it). The settings per budget follow bench/rollout_strategies.py:
``max_new_tokens`` 16 with 4-token segments and 48 with 12-token segments (tree: 2 -> 4 -> 8 leaves).

    HF_HUB_OFFLINE=1 python bench/prefix_cache_ab.py --reps 4 --strategies tree

Prints per-call seconds and the on/off ratio of the median engine seconds; writes
``results/bench/prefix_cache.md`` with ``--write``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 7 + 8?", "What is 17 + 25?", "What is 4 + 6?", "What is 36 + 19?"]
SEGMENTS = {16: 4, 48: 12}  # max_new_tokens -> segment tokens


def strategy_config(strategy: str, n: int, segment: int) -> dict:
    if strategy in ("tree", "treerpo"):
        return {"strategy": strategy, "n": n, strategy: {"segment_tokens": segment, "root_branching": 2, "branching": 2}}
    return {"strategy": strategy, "n": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="tree")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--budget-mb", type=float, default=256.0)
    parser.add_argument("--max-new-tokens", default="16,48", help=f"comma-separated, of {sorted(SEGMENTS)}")
    parser.add_argument("--write", action="store_true", help="write results/bench/prefix_cache.md")
    args = parser.parse_args()
    import torch
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT))
    from rlbench.dataset.base import Problem
    from rlbench.config.typed import model_config
    from rlbench.model import load_policy
    from rlbench.reward.toy import EvenTokenReward
    from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams, make_strategy

    torch.set_num_threads(1)
    model, tokenizer = load_policy(model_config(OmegaConf.load(ROOT / "conf" / "model" / "smollm2_135m.yaml")), seed=0)
    problems = [Problem(uid=f"p{i}", prompt=q, answer="0") for i, q in enumerate(PROMPTS)]
    rows = []
    for strategy in args.strategies.split(","):
        for max_new_tokens in map(int, args.max_new_tokens.split(",")):
            segment = SEGMENTS[max_new_tokens]
            engines = {arm: HFGenerateEngine(model, tokenizer, progress=False, prefix_cache_mb=mb) for arm, mb in (("off", 0.0), ("on", args.budget_mb))}
            seconds: dict[str, list[float]] = {arm: [] for arm in engines}
            reused, same_leaves, all_leaves, lp_diff = 0, 0, 0, 0.0
            for rep in range(args.reps):
                leaves = {}
                for arm in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    engine = engines[arm]
                    engine.sync_weights(model)  # a new step: nothing kept from the last repetition
                    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"system": None, "user": "{problem}"}, lambda r, i: r)
                    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
                    cfg = OmegaConf.create(strategy_config(strategy, args.n, segment))
                    chosen = make_strategy(cfg, RolloutSetup(sampler, args.n, params, torch.Generator().manual_seed(rep), seed=rep))
                    before = engine.prefix_cache.stats.reused_tokens
                    graded, _ = chosen.rollout(problems)
                    seconds[arm].append(sampler.cost.take()["engine_s"])
                    if arm == "on":
                        reused += engine.prefix_cache.stats.reused_tokens - before
                    leaves[arm] = [(c.response_ids, c.logprobs) for g in graded.groups for c in g]
                for (tokens_off, lp_off), (tokens_on, lp_on) in zip(leaves["off"], leaves["on"]):
                    common = next((k for k, (a, b) in enumerate(zip(tokens_off, tokens_on)) if a != b), min(len(tokens_off), len(tokens_on)))
                    lp_diff = max([lp_diff] + [abs(a - b) for a, b in zip(lp_off[:common], lp_on[:common])])
                    same_leaves += tokens_off == tokens_on
                    all_leaves += 1
                print(f"{strategy} max_new_tokens={max_new_tokens} rep {rep}: off {seconds['off'][-1]:.2f}s, "
                      f"on {seconds['on'][-1]:.2f}s, load {os.getloadavg()[0]:.1f}", flush=True)
            ratio = statistics.median(seconds["on"]) / statistics.median(seconds["off"])
            total_ratio = sum(seconds["on"]) / sum(seconds["off"])
            rows.append((strategy, max_new_tokens, segment, args.reps, ratio, total_ratio, reused / args.reps,
                         f"{same_leaves}/{all_leaves}", lp_diff))
            print(f"{strategy} max_new_tokens={max_new_tokens}: on/off median engine s {ratio:.3f}, summed {total_ratio:.3f}, "
                  f"KV tokens reused per rollout {reused / args.reps:.0f}, same leaves {same_leaves}/{all_leaves}, "
                  f"largest log-prob difference {lp_diff:.1e}", flush=True)
    if args.write:
        lines = [
            "# Prefix KV reuse across engine calls (rollout.prefix_cache_mb): engine seconds with / without",
            "",
            f"Written by `bench/prefix_cache_ab.py` on {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} "
            f"(2 shared CPUs, 1 torch thread, load {os.getloadavg()[0]:.1f} at the end). SmolLM2-135M-Instruct, 4 arith "
            f"prompts x {args.n} leaves, temperature 1.0, budget {args.budget_mb:g} MiB; the arms interleaved in one process "
            "at the same seeds. Ratios, not seconds: the machine is shared. Same leaves: leaves whose tokens both arms "
            "drew alike; log-prob difference: the largest over the tokens both drew before a leaf's first different "
            "token (float rounding: the kept KV comes from one-token decoding steps, the uncached prefill computes it "
            "in one pass).",
            "",
            "| strategy | max_new_tokens | segment | reps | engine s on/off (median) | on/off (sum) | KV tokens reused per rollout "
            "| same leaves | log-prob difference |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [f"| {s} | {m} | {g} | {r} | {a:.2f} | {b:.2f} | {u:.0f} | {same} | {d:.1e} |" for s, m, g, r, a, b, u, same, d in rows]
        out = ROOT / "results" / "bench" / "prefix_cache.md"
        out.write_text("\n".join(lines) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
