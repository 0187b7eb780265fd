"""Forward calls and engine seconds of the HF engine's in-engine refill (``generate_refilling``;
rollout.micro_groups.refill) against packed rounds (one ``generate`` call per round of ``--slots`` samples,
rows leaving as they finish but their slots left empty: rollout=micro_groups without refill), on the tiny
model, interleaved in one process.

The samples are ``--prompts`` prompts x ``--n`` responses, each on its own seed (as micro_groups sends them),
so every arm decodes the same tokens (checked). The lengths are made very unequal by declaring one token id in
``--eos-every`` an end of sequence (about a geometric length, cut at ``--max-new-tokens``). Four arms: rounds
and refill in queue order (the prompts' micro-groups round-robin), and both ordered by the samples' true
lengths (packed rounds longest together, run shortest first; the refill queue shortest first): the best each
could do with a perfect length prediction.

    HF_HUB_OFFLINE=1 python bench/refill_ab.py --reps 3

Prints per arm the forward calls (prefills + decoding steps), the rows they carried, the decoding steps and
the median seconds; writes ``results/bench/refill.md`` with ``--write``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 7 + 8?", "What is 17 + 25? Think step by step.", "4 + 6", "What is 36 + 19, and why?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--eos-every", type=int, default=16)
    parser.add_argument("--write", action="store_true", help="write results/bench/refill.md")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))

    from rlbench.model import load_policy
    from rlbench.config.typed import model_config
    from rlbench.rollout import GenerationRequest, HFGenerateEngine, SamplingParams
    from rlbench.rollout.engines.hf import ModelSteps
    from rlbench.rollout.engines.lean_decode import LeanSteps
    from rlbench.rollout.strategies.micro_groups import pack_by_length, shortest_first
    from omegaconf import OmegaConf

    model, tokenizer = load_policy(model_config(OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml")), seed=0)
    engine = HFGenerateEngine(model, tokenizer, progress=False)
    engine.eos_ids = list(range(2, len(tokenizer), args.eos_every))
    params = SamplingParams(1.0, 1.0, args.max_new_tokens)
    prompts = [tuple(tokenizer.encode(p)) for p in PROMPTS[: args.prompts]]
    queue = [GenerationRequest(prompts[p], seed=1000 * p + k) for k in range(args.n) for p in range(len(prompts))]

    calls = {"prefill": [], "step": []}
    for cls in (ModelSteps, LeanSteps):
        step = cls.step
        setattr(cls, "step", lambda self, tokens, positions, _f=step: calls["step"].append(len(tokens)) or _f(self, tokens, positions))
    prefill = HFGenerateEngine._prefill
    HFGenerateEngine._prefill = lambda self, seqs, keep, _f=prefill: calls["prefill"].append(len(seqs)) or _f(self, seqs, keep)

    def rounds(order):
        return [c for batch in order for (c,) in engine.generate([queue[s] for s in batch], params)]

    def refill(order):
        return [c for (c,) in engine.generate_refilling([queue[s] for s in order], params, args.slots)]

    reference = [c for (c,) in engine.generate(queue, params)]  # also the warm-up (kernel build)
    lengths = [len(c.response_ids) for c in reference]
    in_order = list(range(len(queue)))
    arms = {
        "rounds, queue order": (rounds, [in_order[s : s + args.slots] for s in range(0, len(queue), args.slots)]),
        "refill, queue order": (refill, in_order),
        "rounds, packed by true length": (rounds, pack_by_length([float(n) for n in lengths], args.slots)),
        "refill, shortest true length first": (refill, shortest_first([float(n) for n in lengths])),
    }
    seconds = {name: [] for name in arms}
    counts = {}
    for rep in range(args.reps):
        for name in arms if rep % 2 == 0 else list(arms)[::-1]:
            run, order = arms[name]
            calls["prefill"].clear(), calls["step"].clear()
            start = time.perf_counter()
            out = run(order)
            seconds[name].append(time.perf_counter() - start)
            flat = order if run is refill else [s for batch in order for s in batch]
            assert all(c.response_ids == reference[s].response_ids for c, s in zip(out, flat)), name
            counts[name] = (len(calls["prefill"]) + len(calls["step"]), sum(calls["prefill"]) + sum(calls["step"]), len(calls["step"]))
    lines = [
        f"# In-engine refill against packed rounds ({_dt.date.today().isoformat()}, bench/refill_ab.py)",
        "",
        f"Tiny model (conf/model/tiny.yaml), CPU, {os.environ.get('OMP_NUM_THREADS', 'default')} threads; {len(queue)} samples "
        f"({len(prompts)} prompts x {args.n}), {args.slots} slots, max_new_tokens {args.max_new_tokens}, one id in "
        f"{args.eos_every} ends a sequence: lengths {min(lengths)}-{max(lengths)}, mean {statistics.mean(lengths):.1f}. "
        f"Every arm decodes the same tokens (each sample on its own seed). Median of {args.reps} interleaved repetitions.",
        "",
        "| arm | forward calls | rows carried | decoding steps | seconds |",
        "|---|---|---|---|---|",
    ]
    for name in arms:
        total, rows, steps = counts[name]
        lines.append(f"| {name} | {total} | {rows} | {steps} | {statistics.median(seconds[name]):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        (ROOT / "results" / "bench" / "refill.md").write_text(text)


if __name__ == "__main__":
    main()
