"""Do our HF engine and transformers' ``generate`` (TRL's path) sample the same completion lengths?

``bench/compare_trl.py`` reports a mean completion length per side, and the sides' lengths differ
(ours 33.5 vs TRL 26.1 tokens in every run at seed 0): each side draws its own samples, and with one
seed each run draws the same ones. This script checks that the difference is chance, not a different
sampling distribution: on the compare_trl configuration (SmolLM2-135M-Instruct, float32, the same 4
arith prompts x 4 completions, at most 48 new tokens, temperature 1, top-p 1, no top-k, stop at EOS) it
draws ``--batches`` batches of 16 from each, alternating, from fresh seeds, and compares the mean length,
the truncated share and the generation seconds. ``generate`` gets TRL's settings (trl 1.x
``GRPOTrainer._generate`` without vLLM: left-padded prompts, ``do_sample``, ``top_k=0``, the tokenizer's
EOS and pad ids).

    HF_HUB_OFFLINE=1 python bench/sampling_lengths.py --batches 8

Writes ``results/bench/sampling_lengths.{json,md}`` (atomically). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import compare_trl as ct  # noqa: E402  (the benchmark configuration)


def mean_and_error(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=8, help="batches of 16 completions per side")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ct.RESULTS_DIR / "sampling_lengths.json")
    args = parser.parse_args()
    from transformers import GenerationConfig

    from rlbench.config.typed import typed_config
    from rlbench.dataset import load_problems
    from rlbench.prompting import encode_prompts
    from rlbench.rollout import GenerationRequest, SamplingParams, make_engine

    torch.set_num_threads(args.threads)
    cfg = ct.compose_config(tempfile.mkdtemp())
    problems = load_problems(cfg.dataset, seed=ct.SEED)[: ct.NUM_PROMPTS]
    model, tokenizer = ct.load_model(cfg)
    model.eval()
    prompts = [list(p) for p in encode_prompts(tokenizer, problems, cfg.dataset.prompt)]
    engine = make_engine(typed_config(cfg).rollout, model, tokenizer, torch.device("cpu"))
    engine.progress = False
    eos = set(engine.eos_ids)
    params = SamplingParams(temperature=ct.TEMPERATURE, top_p=ct.TOP_P, max_new_tokens=ct.MAX_NEW_TOKENS)
    generation_config = GenerationConfig(
        max_new_tokens=ct.MAX_NEW_TOKENS, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id], temperature=ct.TEMPERATURE,
        top_p=ct.TOP_P, top_k=0, min_p=None, repetition_penalty=1.0, disable_compile=True,
    )
    rows = [p for p in prompts for _ in range(ct.NUM_GENERATIONS)]
    width = max(len(p) for p in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])

    def ours(seed: int) -> list[int]:
        requests = [GenerationRequest(prompt_ids=tuple(p), n=ct.NUM_GENERATIONS) for p in prompts]
        out = engine.generate(requests, params, generator=torch.Generator().manual_seed(seed))
        return [len(c.response_ids) for cs in out for c in cs]

    def hf_generate(seed: int) -> list[int]:
        torch.manual_seed(seed)
        with torch.no_grad():
            sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
        lengths = []
        for row in sequences[:, width:].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            lengths.append(ends[0] + 1 if ends else len(row))
        return lengths

    sides = {"ours": ours, "hf_generate": hf_generate}
    lengths: dict[str, list[int]] = {name: [] for name in sides}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for b in range(args.batches):
        order = list(sides) if b % 2 == 0 else list(reversed(sides))
        for name in order:
            t0 = time.perf_counter()
            batch = sides[name](1000 * (1 + list(sides).index(name)) + b)  # a fresh seed per batch and side
            seconds[name].append(time.perf_counter() - t0)
            lengths[name].extend(batch)
        print(f"batch {b + 1}/{args.batches}: " + ", ".join(
            f"{n} mean {statistics.fmean(lengths[n][-len(rows):]):.1f} tokens in {seconds[n][-1]:.2f} s" for n in sides), flush=True)

    summary = {}
    for name in sides:
        mean, err = mean_and_error([float(x) for x in lengths[name]])
        summary[name] = {
            "completions": len(lengths[name]),
            "mean_length": mean,
            "mean_length_stderr": err,
            "truncated_share": sum(x >= ct.MAX_NEW_TOKENS for x in lengths[name]) / len(lengths[name]),
            "seconds_per_batch": statistics.fmean(seconds[name]),
            "seconds_per_token": sum(seconds[name]) / sum(lengths[name]),
        }
    gap = summary["ours"]["mean_length"] - summary["hf_generate"]["mean_length"]
    gap_err = math.hypot(summary["ours"]["mean_length_stderr"], summary["hf_generate"]["mean_length_stderr"])
    result = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "threads": args.threads,
        "batches": args.batches,
        "config": {"model": ct.MODEL, "prompts": [p.prompt for p in problems], "completions_per_prompt": ct.NUM_GENERATIONS,
                   "max_new_tokens": ct.MAX_NEW_TOKENS, "temperature": ct.TEMPERATURE, "top_p": ct.TOP_P},
        "sides": summary,
        "length_gap": gap,
        "length_gap_stderr": gap_err,
        "lengths": lengths,
    }
    lines = [
        "# Completion lengths: our HF engine vs transformers' generate (TRL's path)",
        "",
        f"Written by `bench/sampling_lengths.py` on {result['date']} ({args.threads} torch threads). "
        f"Configuration of bench/compare_trl.py; {args.batches} batches of 16 per side, fresh seeds, alternating.",
        "",
        "| side | completions | mean length ± s.e. | truncated at 48 | s per batch | ms per token |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['completions']} | {s['mean_length']:.2f} ± {s['mean_length_stderr']:.2f} | "
                     f"{s['truncated_share']:.3f} | {s['seconds_per_batch']:.2f} | {1000 * s['seconds_per_token']:.1f} |")
    lines += ["", f"Length gap ours - generate: {gap:+.2f} ± {gap_err:.2f} tokens (s.e.; completions of one prompt "
              "are not independent, so the true uncertainty is larger).", ""]
    print("\n".join(lines))
    ct.atomic_write(args.out, json.dumps(result, indent=1) + "\n")
    ct.atomic_write(args.out.with_suffix(".md"), "\n".join(lines))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
