"""Generation speed of multi-turn episodes against single-turn responses of the same total length (issue 31:
"tokens per second of a 4-turn episode within 80% of a single-turn response of the same total length").

Three arms on one SmolLM2-135M-Instruct object, the same prompts (4 arith questions in the chat template) and
``--n`` samples per prompt, interleaved in one process at the same seed per repetition (the order rotates, so a
change of load on a shared machine hits every arm alike):

- ``single``: one engine call per step, ``max_new_tokens`` = the episodes' mean response length (policy and
  observation tokens) of the same repetition;
- ``multi_turn``: ``rollout=multi_turn`` with a fixed-answer environment (``--turns`` turns of ``--turn-tokens``
  policy tokens each; the environment answers every turn with the same short observation, which is tokenized and
  appended), the HF engine keeping the KV across turns (``rollout.prefix_cache_mb`` = ``--budget-mb``);
- ``multi_turn_no_cache``: the same episodes with ``prefix_cache_mb`` 0 (each turn prefills the episode so far).

EOS is masked out in every arm (a logits transform), so every response has its full length and the arms decode
the same number of tokens. Tokens per second = response tokens (observation tokens included: they are part of
the sequence decoded after) / wall seconds of the arm's whole call (tokenization and environment included).

    HF_HUB_OFFLINE=1 python bench/multi_turn_speed.py --reps 3 --write

Prints every repetition and the ratios of the median tokens per second; writes ``results/bench/multi_turn_speed.md``
and ``.json`` with ``--write``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 7 + 8?", "What is 17 + 25?", "What is 4 + 6?", "What is 36 + 19?"]
OBSERVATION = "\nObservation: noted.\n"
ARMS = ("single", "multi_turn", "multi_turn_no_cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (4 prompts)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--budget-mb", type=float, default=256.0)
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option (tiny: a quick check of the script)")
    parser.add_argument("--write", action="store_true", help="write results/bench/multi_turn_speed.{md,json}")
    args = parser.parse_args()
    import torch
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT))
    from rlbench.config.schema import EnvConfig
    from rlbench.config.typed import model_config
    from rlbench.dataset.base import Problem
    from rlbench.model import load_policy
    from rlbench.prompting import encode_prompts
    from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams
    from rlbench.rollout.engines.base import GenerationRequest
    from rlbench.rollout.env import EnvContext, EnvFactory
    from rlbench.rollout.env.base import Environment, Reset, StepResult, register_env
    from rlbench.rollout.strategies.multi_turn import MultiTurnRollout
    from rlbench.utils import atomic_write_json, atomic_write_text

    @register_env("bench_fixed_answer")
    class FixedAnswer(Environment):
        """Every turn ends at the turn's token budget (no stop marker); the answer is the same short text."""

        def reset(self, problem):
            self.turn = 0
            return Reset(problem.prompt, 0)

        def step(self, action_text):
            self.turn += 1
            return StepResult(OBSERVATION, 0.0, False, self.turn)

    @dataclass(frozen=True)
    class NoEos:
        eos_ids: tuple[int, ...]

        def __call__(self, logits, contexts):
            logits = logits.clone()
            logits[:, list(self.eos_ids)] = float("-inf")
            return logits

    torch.set_num_threads(1)
    model, tokenizer = load_policy(model_config(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")), seed=0)
    problems = [Problem(uid=f"p{i}", prompt=q, answer="0") for i, q in enumerate(PROMPTS)]
    template = {"system": None, "user": "{problem}"}
    engines = {"single": HFGenerateEngine(model, tokenizer, progress=False),
               "multi_turn": HFGenerateEngine(model, tokenizer, progress=False, prefix_cache_mb=args.budget_mb),
               "multi_turn_no_cache": HFGenerateEngine(model, tokenizer, progress=False)}
    no_eos = NoEos(tuple(engines["single"].eos_ids))
    env = EnvConfig(name="bench_fixed_answer", max_turns=args.turns, turn_tokens=args.turn_tokens, max_tokens=100_000,
                    max_observation_tokens=64, max_tool_calls=args.turns, workers=1)

    def multi_turn(engine, seed):
        engine.sync_weights(model)  # a new step: nothing kept from the last repetition
        sampler = GroupSampler(engine, None, tokenizer, template, lambda r, _: r)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens, logits_transform=no_eos)
        setup = RolloutSetup(sampler, args.n, params, torch.Generator().manual_seed(seed), env=EnvFactory(env, EnvContext()))
        start = time.perf_counter()
        groups, metrics = MultiTurnRollout(setup).rollout(problems)
        seconds = time.perf_counter() - start
        lengths = [len(c.response_ids) for g in groups.groups for c in g]
        return seconds, lengths, metrics

    def single(seed, max_new_tokens):
        engine = engines["single"]
        engine.sync_weights(model)
        prompt_ids = encode_prompts(tokenizer, problems, template)
        start = time.perf_counter()
        requests = [GenerationRequest(prompt_ids=tuple(ids), n=args.n) for ids in prompt_ids]
        completions = engine.generate(requests, SamplingParams(1.0, 1.0, max_new_tokens, logits_transform=no_eos),
                                      torch.Generator().manual_seed(seed))
        seconds = time.perf_counter() - start
        return seconds, [len(c.response_ids) for per_request in completions for c in per_request]

    per_arm: dict[str, list[float]] = {arm: [] for arm in ARMS}
    reps = []
    for rep in range(args.reps):
        order = ARMS[rep % 3:] + ARMS[:rep % 3]
        row: dict[str, float] = {}
        lengths: dict[str, list[int]] = {}
        turns = 0.0
        # the single arm needs the episodes' length: run a multi-turn arm first when it comes first
        for arm in order:
            if arm == "single":
                if not lengths:
                    s, lengths["multi_turn"], _ = multi_turn(engines["multi_turn"], rep)
                    row["multi_turn"] = sum(lengths["multi_turn"]) / s
                target = round(statistics.mean(next(iter(lengths.values()))))
                s, lengths["single"] = single(rep, target)
                row["single"] = sum(lengths["single"]) / s
            elif arm not in row:
                s, lengths[arm], metrics = multi_turn(engines[arm], rep)
                row[arm] = sum(lengths[arm]) / s
                turns = metrics.get("multi_turn_turns", turns)
        for arm in ARMS:
            per_arm[arm].append(row[arm])
        reps.append({"rep": rep, "tokens_per_s": row, "mean_length": {a: statistics.mean(v) for a, v in lengths.items()},
                     "turns": turns, "load": os.getloadavg()[0]})
        print(f"rep {rep}: " + ", ".join(f"{a} {row[a]:.1f} tok/s" for a in ARMS)
              + f"; lengths {', '.join(f'{a} {statistics.mean(v):.0f}' for a, v in lengths.items())}, turns {turns:.1f}, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    median = {arm: statistics.median(v) for arm, v in per_arm.items()}
    ratio, ratio_no_cache = median["multi_turn"] / median["single"], median["multi_turn_no_cache"] / median["single"]
    print(f"multi_turn / single tokens per second (median): {ratio:.3f}; without the KV kept: {ratio_no_cache:.3f}")
    if args.write:
        stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        setting = (f"{args.model}, 4 arith prompts x {args.n} samples, {args.turns} turns x {args.turn_tokens} policy tokens, "
                   f"observation {OBSERVATION!r}, temperature 1.0, EOS masked, 1 torch thread")
        out = ROOT / "results" / "bench" / "multi_turn_speed"
        atomic_write_json(out.with_suffix(".json"), {"date": stamp, "setting": setting, "reps": reps, "median_tokens_per_s": median,
                                                     "ratio": ratio, "ratio_no_cache": ratio_no_cache})
        lines = [
            "# Multi-turn generation speed: a 4-turn episode against a single-turn response of the same length",
            "",
            f"Written by `bench/multi_turn_speed.py --reps {args.reps}` on {stamp} (2 shared CPUs, load "
            f"{os.getloadavg()[0]:.1f} at the end: ratios, not seconds). {setting}. Arms interleaved in one process at the same seed "
            "per repetition; tokens per second = response tokens (observations included) / wall seconds of the whole call.",
            "",
            "| arm | tokens / s (median) | ratio to single |",
            "|---|---:|---:|",
        ]
        lines += [f"| {arm} | {median[arm]:.1f} | {median[arm] / median['single']:.2f} |" for arm in ARMS]
        lines += ["", "Per repetition (tokens / s): " + "; ".join(
            ", ".join(f"{a} {r['tokens_per_s'][a]:.1f}" for a in ARMS) for r in reps)]
        atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
        print(f"wrote {out}.md and .json")


if __name__ == "__main__":
    main()
