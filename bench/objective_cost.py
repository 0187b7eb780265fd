"""What each training objective costs per step beyond sampling: the forward passes it runs, counted.

For GRPO and every preference, regression and offline-style objective (issue 30), the same short run
through the real runner (``rlbench.runner.run``): the tiny random model (``model=tiny``, the SmolLM2
tokenizer), arith level 1, ``--steps`` steps of ``--prompts`` prompts x ``--n`` responses, one micro-batch
per optimizer batch. Every transformer forward pass is counted where it enters the model: a forward hook
on each token-embedding table (every pass of a causal LM goes through its embeddings once), keyed by the
table, so each distinct model is counted apart. Passes inside the engine (``HFGenerateEngine.generate``,
``score_prefixes``: sampling and evaluation) are not the objective's and are left out. What remains is
sorted by the model and the grad mode:

* ``train``: passes of a trainable model with grad enabled (forward + backward: the update itself);
* ``no-grad (trainable)``: passes of a trainable model without grad (old-policy log-probs recomputed
  before the update, a critic's values);
* ``frozen``: passes of frozen models (the reference pi_ref, INPO/REBEL's pi_t snapshot, SACPO's stage-1
  reference, RTO's pi_dpo), and how many frozen models are in memory.

Counts are token positions (rows x sequence length, padding included) per step, and the ratio of the
objective's extra positions (no-grad + frozen) to the training positions. Counts do not depend on the
machine's load; the seconds per step printed beside them do (the tiny model, ``--threads`` threads), and
are only a rough guide: seconds on SmolLM2-135M are in docs/performance.md.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python bench/objective_cost.py                 # ~2 min
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python bench/objective_cost.py --presets grpo,dpo

Writes ``results/bench/objective_cost.json`` and ``.md`` (atomically). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the offline environment, the conf folder and one Hydra composition, shared with the rollout-strategy bench
from rollout_strategies import CONF_DIR, RESULTS_DIR, compose  # noqa: E402

# GRPO (the baseline), PPO (a critic, for scale), SFT, then issue 30's objectives. A preset that is not
# there (not merged yet) or that validation refuses is listed with the reason.
PRESETS = ("grpo", "ppo", "sft", "dpo", "ipo", "simpo", "trpa", "p3o", "rebel", "copg", "inpo", "pro", "qrpo",
           "contrastive_scoring", "sacpo", "dr_preference", "direct_advantage_po", "rto", "refuel")


def run_overrides(preset: str, args: argparse.Namespace) -> list[str]:
    return [
        "model=tiny", "dataset=arith", f"algorithm={preset}", f"rollout.n={args.n}",
        f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}",
        f"trainer.micro_batch_size={args.prompts * args.n}", "trainer.save_model=false",
        "rollout.max_new_tokens=16", "eval.limit=1", "eval.n=1", "eval.k=[1]", "eval.before_training=false",
        "logger=files", "seed=0", *args.extra,
    ]


class PassCounter:
    """Counts token positions of forward passes per embedding table (one table = one model) and grad mode,
    outside the engine's sampling and scoring."""

    def __init__(self) -> None:
        self.in_engine = 0
        self.positions: dict[tuple[int, bool, bool], int] = defaultdict(int)  # (table, trainable, grad) -> positions
        self.passes: dict[tuple[int, bool, bool], int] = defaultdict(int)

    def hook(self, module, inputs, _output) -> None:
        import torch

        if self.in_engine or not inputs or not isinstance(inputs[0], torch.Tensor):
            return
        key = (id(module), bool(module.weight.requires_grad), torch.is_grad_enabled())
        self.positions[key] += int(inputs[0].numel())
        self.passes[key] += 1

    @contextlib.contextmanager
    def engine_calls(self):
        """Passes inside the engine's own methods (sampling, evaluation, prefix scoring) are not counted."""
        from rlbench.rollout.engines.hf import HFGenerateEngine

        originals = {name: getattr(HFGenerateEngine, name) for name in ("generate", "score_prefixes")}

        def uncounted(fn):
            def wrapper(*a, **k):
                self.in_engine += 1
                try:
                    return fn(*a, **k)
                finally:
                    self.in_engine -= 1
            return wrapper

        for name, fn in originals.items():
            setattr(HFGenerateEngine, name, uncounted(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(HFGenerateEngine, name, fn)

    def summary(self, steps: int) -> dict[str, Any]:
        train = sum(v for (_, trainable, grad), v in self.positions.items() if trainable and grad)
        nograd = sum(v for (_, trainable, grad), v in self.positions.items() if trainable and not grad)
        frozen = sum(v for (_, trainable, _), v in self.positions.items() if not trainable)
        frozen_models = len({table for (table, trainable, _) in self.positions if not trainable})
        trainable_models = len({table for (table, trainable, _) in self.positions if trainable})
        return {
            "train_positions": train / steps, "nograd_positions": nograd / steps, "frozen_positions": frozen / steps,
            "frozen_models": frozen_models, "trainable_models": trainable_models,
            "train_passes": sum(v for (_, t, g), v in self.passes.items() if t and g) / steps,
            "frozen_passes": sum(v for (_, t, _), v in self.passes.items() if not t) / steps,
            "extra_ratio": (nograd + frozen) / train if train else float("nan"),
        }


@contextlib.contextmanager
def counting_embeddings(counter: PassCounter):
    """A global forward hook on every ``nn.Embedding`` (the token tables; position tables do not exist in
    the Llama architecture the tiny model uses)."""
    import torch

    def hook(module, inputs, output):
        if isinstance(module, torch.nn.Embedding):
            counter.hook(module, inputs, output)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def one_run(preset: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from rlbench.runner import run

    out = scratch / preset
    cfg = compose(run_overrides(preset, args), out)
    counter = PassCounter()
    start = time.perf_counter()
    with counting_embeddings(counter), counter.engine_calls():
        run(cfg)
    wall = time.perf_counter() - start
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    row = counter.summary(len(steps))
    row["update_s"] = statistics.median(s.get("update_s", float("nan")) for s in steps)
    row["wall_s"] = wall
    return row


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"Forward passes per training step outside sampling (bench/objective_cost.py, {report['date']}, "
        f"{report['machine']}): model=tiny, arith, {s['steps']} steps of {s['prompts']} prompts x {s['n']} "
        "responses, one micro-batch. Token positions per step; `extra / train` = (no-grad + frozen) / train.",
        "",
        "| objective | trainable models | train positions (fwd+bwd) | no-grad positions (trainable) | frozen positions "
        "| frozen models | extra / train | median update s (tiny) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["presets"].items():
        if "refused" in row:
            lines.append(f"| {name} | not run: {row['refused']} | | | | | | |")
            continue
        lines.append(
            f"| {name} | {row['trainable_models']} | {row['train_positions']:.0f} | {row['nograd_positions']:.0f} | {row['frozen_positions']:.0f} "
            f"| {row['frozen_models']} | {row['extra_ratio']:.2f} | {row['update_s']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated algorithm presets")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "objective_cost.json")
    args = parser.parse_args()

    import torch

    from rlbench.errors import ConfigError
    from rlbench.utils import atomic_write_json, atomic_write_text
    from rlbench.validation import validate_config

    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    report: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, load {os.getloadavg()[0]:.1f}",
        "settings": {"steps": args.steps, "prompts": args.prompts, "n": args.n, "extra": args.extra},
        "presets": {},
    }
    with tempfile.TemporaryDirectory(prefix="rlbench-objective-cost-") as scratch_dir:
        scratch = Path(scratch_dir)
        for preset in args.presets.split(","):
            if not (CONF_DIR / "algorithm" / f"{preset}.yaml").is_file():
                report["presets"][preset] = {"refused": "no preset"}
                continue
            try:
                validate_config(compose(run_overrides(preset, args), scratch / "check"))
            except ConfigError as err:
                report["presets"][preset] = {"refused": str(err).split(". ")[0]}
                continue
            report["presets"][preset] = row = one_run(preset, args, scratch)
            print(f"[objective_cost] {preset}: train {row['train_positions']:.0f}, no-grad {row['nograd_positions']:.0f}, "
                  f"frozen {row['frozen_positions']:.0f} ({row['frozen_models']} models), "
                  f"extra/train {row['extra_ratio']:.2f}", flush=True)
    atomic_write_json(args.out, report)
    atomic_write_text(args.out.with_suffix(".md"), markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
