"""Seconds per GRPO step: rlbench's ``train_step`` against TRL's ``GRPOTrainer``, measured.

Both sides run in this process on the identical configuration:

* model: SmolLM2-135M-Instruct (``conf/model/smollm2_135m.yaml``, float32, CPU), a fresh copy per side;
* data: the first 4 problems of ``conf/dataset/arith.yaml`` (seed 0), chat-formatted with
  ``rlbench.dataset.build_messages`` and the tokenizer's chat template; the same 4 prompts every step;
* rollout: 4 completions per prompt (16 sequences in one ``generate`` call), at most 48 new tokens,
  temperature 1.0, top-p 1.0, no top-k, stop at EOS;
* reward: ``rlbench.reward.MathReward(extraction="last_number")`` (TRL calls it through a reward function);
* update: one fused AdamW step per batch (lr 1e-5, betas (0.9, 0.999), weight decay 0, constant schedule),
  gradient clipping 1.0, no KL (beta 0), PPO-clip epsilon 0.2, group-std scaled advantages,
  per-sequence token-mean aggregation (TRL ``loss_type="grpo"``), one micro-batch of 16, float32,
  no gradient checkpointing, no reference model, no old-log-prob pass;
* the same seed, the same number of torch threads (the CPU count unless ``--threads``).

Each side runs ``--warmup`` untimed steps (default 1) and then ``--steps`` timed steps (default 3;
``--quick``: 1). Model loading and trainer construction are not timed. By default the sides are
interleaved step by step (``O T | T O | O T | ...``: TRL's training loop drives and our steps run in its
callback hooks, outside TRL's timed region), so that a change of load on a shared machine hits both sides
alike; ``--schedule sequential`` runs one side after the other. A step is timed by the wall
clock: ours around ``rlbench.training.step.train_step``; TRL from ``on_step_begin`` to ``on_step_end`` (a
``TrainerCallback``), which covers generation, reward, advantages, the forward/backward pass, gradient
clipping and the optimizer step. The split into generation and update is measured on both sides (for TRL
by wrapping ``_generate`` and ``_generate_and_score_completions`` on the trainer instance).

Sampling is stochastic, so the two sides do not produce completions of the same length: the mean
completion length is reported next to the times, together with a per-token ratio. With one seed every run
draws the same samples on each side (at seed 0 ours average 33.5 tokens, TRL's 26.1, in every run), so a
length gap by chance persists across runs; ``--seeds`` runs one session per seed and pools the timed steps.
``bench/sampling_lengths.py`` checks that the two samplers' lengths agree in distribution.

Usage::

    HF_HUB_OFFLINE=1 python bench/compare_trl.py            # 1 warm-up + 3 timed steps per side
    HF_HUB_OFFLINE=1 python bench/compare_trl.py --quick    # 1 warm-up + 1 timed step (smoke check)
    HF_HUB_OFFLINE=1 python bench/compare_trl.py --profile  # also profile one extra step of ours
    HF_HUB_OFFLINE=1 python bench/compare_trl.py --steps 5 --seeds 0,1,2  # 3 sessions, timed steps pooled
    HF_HUB_OFFLINE=1 python bench/compare_trl.py --threads 1 --out results/bench/compare_trl_threads1.json

Writes ``results/bench/compare_trl.json`` and ``results/bench/compare_trl.md`` (atomically).
This script is not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# Nothing may download: set before transformers / datasets / trl are imported.
for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_key, "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
RESULTS_DIR = ROOT / "results" / "bench"
# issue 11's targets: the whole step at most 0.4x TRL's, generation at most 0.6x
TARGET_RATIO = 0.40
TARGET_GENERATE_RATIO = 0.60

# The benchmark configuration (shared by both sides).
MODEL = "smollm2_135m"
NUM_PROMPTS = 4
NUM_GENERATIONS = 4
MAX_NEW_TOKENS = 48
LR = 1e-5
MAX_GRAD_NORM = 1.0
TEMPERATURE = 1.0
TOP_P = 1.0
CLIP_EPSILON = 0.2
SEED = 0


def overrides(tmp_dir: str, seed: int = SEED) -> list[str]:
    """Hydra overrides that give our side the benchmark configuration (``seed``: sampling, model, order)."""
    return [
        f"model={MODEL}",
        "dataset=arith",
        "algorithm=grpo",
        "reward=math",
        "rollout=iid",
        "rollout.engine=hf",
        f"rollout.n={NUM_GENERATIONS}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"rollout.temperature={TEMPERATURE}",
        f"rollout.top_p={TOP_P}",
        "rollout.batch_size=64",  # >= 16: all sequences in one generate call, as TRL does
        f"trainer.prompts_per_step={NUM_PROMPTS}",
        f"trainer.micro_batch_size={NUM_PROMPTS * NUM_GENERATIONS}",
        f"trainer.lr={LR}",
        f"trainer.max_grad_norm={MAX_GRAD_NORM}",
        "trainer.weight_decay=0.0",
        "trainer.warmup_steps=0",
        "algorithm.kl.coef=0.0",
        "algorithm.entropy_coef=0.0",
        "algorithm.update.epochs=1",
        "algorithm.update.minibatches=1",
        f"algorithm.loss.clip_low={CLIP_EPSILON}",
        f"algorithm.loss.clip_high={CLIP_EPSILON}",
        "logger=files",
        "device=cpu",
        f"seed={seed}",
        f"output_dir={tmp_dir}",
    ]


def compose_config(tmp_dir: str, seed: int = SEED) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides(tmp_dir, seed))
    return cfg


def load_model(cfg: DictConfig):
    from rlbench.config.typed import typed_config
    from rlbench.model import load_policy

    config = typed_config(cfg)
    return load_policy(config.model, device="cpu", dtype=torch.float32, seed=config.seed, cache_dir=config.cache_dir)


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {k: float("nan") for k in ("mean", "median", "std", "min", "max")}
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def log(msg: str) -> None:
    print(f"[compare_trl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------- ours


class OursSide:
    """rlbench: ``train_step(make_step_context(...), problems)``, one call per step."""

    name = "ours"

    def __init__(self, cfg: DictConfig, problems: list, warmup: int):
        from rlbench.algorithm import Algorithm
        from rlbench.config.typed import algorithm_settings, typed_config
        from rlbench.prompting import encode_prompts
        from rlbench.reward.graders import training_grader
        from rlbench.rollout import make_engine
        from rlbench.training.step import make_step_context
        from rlbench.utils import seed_everything

        seed_everything(int(cfg.seed))
        device = torch.device("cpu")
        self.problems = problems
        self.warmup = warmup
        self.model, self.tokenizer = load_model(cfg)
        config = typed_config(cfg)
        algorithm = Algorithm.from_config(algorithm_settings(config.algorithm))
        self.engine = make_engine(config.rollout, self.model, self.tokenizer, device)
        if hasattr(self.engine, "progress"):
            self.engine.progress = False  # no progress lines inside the timed region
        self.ctx = make_step_context(config, algorithm, self.model, self.tokenizer, self.engine, device, training_grader(config))
        self.prompt_ids = [list(p) for p in encode_prompts(self.tokenizer, problems, cfg.dataset.prompt)]
        self.records: list[dict[str, float]] = []

    def step(self) -> dict[str, float]:
        from rlbench.training.step import train_step

        load = load_average()
        c0, t0 = time.process_time(), time.perf_counter()
        metrics = train_step(self.ctx, self.problems)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rec = {
            "step_s": wall,
            "cpu_s": cpu,
            "generate_s": metrics["generate_s"],
            "update_s": metrics["update_s"],
            "other_s": wall - metrics["generate_s"] - metrics["update_s"],
            "completion_tokens": metrics["response_length"],
            "truncated_rate": metrics["truncated_rate"],
            "reward_mean": metrics["reward_mean"],
            "grad_norm": metrics.get("grad_norm", float("nan")),
            "load_average_1m": load[0] if load else None,
        }
        self.records.append(rec)
        report_step(self.name, len(self.records), self.warmup, rec)
        return rec

    def profile(self, path: Path) -> dict[str, Any]:
        """One extra step under torch.profiler (CPU); the operator table goes to a text file."""
        from torch.profiler import ProfilerActivity, profile

        from rlbench.training.step import train_step

        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            metrics = train_step(self.ctx, self.problems)
        averages = prof.key_averages()
        table = averages.table(sort_by="self_cpu_time_total", row_limit=40)
        text = (
            f"one profiled step of ours (profiler overhead included): step_s={metrics['step_s']:.2f} "
            f"generate_s={metrics['generate_s']:.2f} update_s={metrics['update_s']:.2f} "
            f"completion tokens={metrics['response_length']:.1f}\n\n{table}\n"
        )
        atomic_write(path, text)
        log(f"profile written to {path}")
        top = [
            {"name": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count}
            for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:15]
        ]
        return {"file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path), "step_s": metrics["step_s"], "top_self_cpu": top}

    def close(self) -> None:
        for name in ("ctx", "engine", "model"):
            self.__dict__.pop(name, None)
        gc.collect()


# ------------------------------------------------------------------------------------------ TRL


def make_trl_reward(extraction: str) -> Callable[..., list[float]]:
    from rlbench.reward import MathReward

    grader = MathReward(extraction=extraction)

    def math_reward(prompts, completions, answer, **kwargs) -> list[float]:
        rewards = []
        for completion, reference in zip(completions, answer):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            rewards.append(grader(text, reference).reward)
        return rewards

    return math_reward


class TRLSide:
    """TRL's ``GRPOTrainer`` driven by ``trainer.train()`` over ``warmup + steps`` optimizer steps.

    ``before_step(i)`` / ``after_step(i)`` hooks (1-based step index) run outside the timed region;
    the interleaved schedule runs our steps there."""

    name = "trl"

    def __init__(self, cfg: DictConfig, problems: list, warmup: int, steps: int, threads: int, optim: str, tmp_dir: str):
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from rlbench.dataset import build_messages

        torch.manual_seed(int(cfg.seed))
        self.warmup = warmup
        self.threads = threads
        self.optim = optim
        self.model, tokenizer = load_model(cfg)
        extraction = cfg.reward.get("extraction") or cfg.dataset.get("reward_extraction") or "auto"
        dataset = Dataset.from_list(
            [{"prompt": build_messages(p, cfg.dataset.prompt), "answer": p.answer} for p in problems]
        )
        args = GRPOConfig(
            output_dir=os.path.join(tmp_dir, "trl"),
            use_cpu=True,
            bf16=False,
            fp16=False,
            seed=int(cfg.seed),
            data_seed=int(cfg.seed),
            # batch: 4 prompts x 4 generations, one optimizer update per generated batch
            per_device_train_batch_size=NUM_PROMPTS * NUM_GENERATIONS,
            num_generations=NUM_GENERATIONS,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            max_steps=warmup + steps,
            shuffle_dataset=False,
            # sampling
            max_completion_length=MAX_NEW_TOKENS,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            top_k=0,
            min_p=None,
            repetition_penalty=1.0,
            use_vllm=False,
            # objective
            beta=0.0,
            epsilon=CLIP_EPSILON,
            loss_type="grpo",
            scale_rewards="group",
            mask_truncated_completions=False,
            # optimizer
            learning_rate=LR,
            optim=optim,
            adam_beta1=0.9,
            adam_beta2=0.999,
            weight_decay=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=MAX_GRAD_NORM,
            gradient_checkpointing=False,
            # no logging, no checkpoints, no evaluation
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            eval_strategy="no",
            log_completions=False,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        t_build = time.perf_counter()
        self.trainer = trainer = GRPOTrainer(
            model=self.model,
            reward_funcs=make_trl_reward(extraction),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        self.build_s = time.perf_counter() - t_build
        torch.set_num_threads(threads)  # in case trainer construction changed it

        # The prompt ids TRL feeds generate, for the identical-input check.
        prompt_ids, _, _ = trainer._tokenize_prompts([row["prompt"] for row in dataset])
        self.prompt_ids = [list(map(int, p)) for p in prompt_ids]

        self.records: list[dict[str, float]] = []
        self.before_step: Callable[[int], None] = lambda i: None
        self.after_step: Callable[[int], None] = lambda i: None
        current: dict[str, float] = {}
        gen_fn = trainer._generate
        score_fn = trainer._generate_and_score_completions

        def timed_generate(prompts):
            t0 = time.perf_counter()
            out = gen_fn(prompts)
            current["generate_s"] = current.get("generate_s", 0.0) + time.perf_counter() - t0
            return out

        def timed_generate_and_score(inputs):
            t0 = time.perf_counter()
            out = score_fn(inputs)
            current["generate_and_score_s"] = current.get("generate_and_score_s", 0.0) + time.perf_counter() - t0
            lengths = out["completion_mask"].sum(-1).float()
            current["completion_tokens"] = float(lengths.mean().item())
            current["truncated_rate"] = float((lengths >= MAX_NEW_TOKENS).float().mean().item())
            return out

        trainer._generate = timed_generate
        trainer._generate_and_score_completions = timed_generate_and_score
        side = self

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                side.before_step(len(side.records) + 1)
                torch.set_num_threads(side.threads)
                current.clear()
                current["load"] = (load_average() or [None])[0]
                current["c0"] = time.process_time()
                current["t0"] = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                wall = time.perf_counter() - current.pop("t0")
                cpu = time.process_time() - current.pop("c0")
                gen = current.get("generate_s", 0.0)
                gas = current.get("generate_and_score_s", 0.0)
                rec = {
                    "step_s": wall,
                    "cpu_s": cpu,
                    "generate_s": gen,
                    "update_s": wall - gas,
                    "other_s": gas - gen,
                    "completion_tokens": current.get("completion_tokens", float("nan")),
                    "truncated_rate": current.get("truncated_rate", float("nan")),
                    "load_average_1m": current.get("load"),
                }
                side.records.append(rec)
                report_step(side.name, len(side.records), side.warmup, rec)
                side.after_step(len(side.records))

        trainer.add_callback(StepTimer())

    def run(self) -> None:
        self.trainer.train()

    def close(self) -> None:
        for name in ("trainer", "model"):
            self.__dict__.pop(name, None)
        gc.collect()


def report_step(name: str, index: int, warmup: int, rec: dict[str, float]) -> None:
    log(
        f"{name:<4} {'warm-up' if index <= warmup else 'timed'} step {index}: {rec['step_s']:.2f}s "
        f"(generate {rec['generate_s']:.2f}s, update {rec['update_s']:.2f}s, "
        f"{rec['completion_tokens']:.1f} tokens/completion, load {rec.get('load_average_1m')})"
    )


# ------------------------------------------------------------------------------------- reporting


def finish_side(records: list[dict[str, float]], warmup: int, sessions: int = 1) -> dict[str, Any]:
    """Summary of ``sessions`` consecutive sessions' records, each ``warmup`` warm-up steps then timed ones."""
    per = len(records) // sessions
    chunks = [records[i * per : (i + 1) * per] for i in range(sessions)]
    timed = [r for chunk in chunks for r in chunk[warmup:]]
    keys = ("step_s", "cpu_s", "generate_s", "update_s", "other_s", "completion_tokens")
    out: dict[str, Any] = {
        "warmup_steps": [r for chunk in chunks for r in chunk[:warmup]],
        "timed_steps": timed,
        "summary": {k: summarize([r[k] for r in timed]) for k in keys},
    }
    tokens = sum(r["completion_tokens"] for r in timed) * NUM_PROMPTS * NUM_GENERATIONS
    seconds = sum(r["step_s"] for r in timed)
    out["completion_tokens_per_s"] = tokens / seconds if seconds > 0 else float("nan")
    return out


def versions() -> dict[str, str]:
    import accelerate
    import transformers
    import trl

    import rlbench

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "rlbench": getattr(rlbench, "__version__", "unknown"),
    }


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def fmt_side(name: str, side: dict[str, Any]) -> tuple[str, str, str, str, str]:
    s = side["summary"]
    return (
        name,
        f"{s['step_s']['mean']:.2f} ± {s['step_s']['std']:.2f}",
        f"{s['generate_s']['mean']:.2f}",
        f"{s['update_s']['mean']:.2f}",
        f"{s['completion_tokens']['mean']:.1f}",
    )


HEADER = ("side", "s/step (mean ± std)", "generate s", "update s", "mean completion tokens")


def text_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(HEADER), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def markdown(result: dict[str, Any]) -> str:
    rows = [fmt_side(n, result["sides"][n]) for n in ("ours", "trl") if n in result["sides"]]
    out = [
        "# rlbench vs TRL GRPOTrainer: seconds per step",
        "",
        f"Written by `bench/compare_trl.py` on {result['date']} ({result['cpu_count']} CPUs, "
        f"{result['threads']} torch threads; torch {result['versions']['torch']}, "
        f"transformers {result['versions']['transformers']}, trl {result['versions']['trl']}).",
        f"Configuration: {MODEL}, {NUM_PROMPTS} prompts x {NUM_GENERATIONS} completions, "
        f"max {MAX_NEW_TOKENS} new tokens, float32 CPU, {result['config']['warmup']} warm-up + "
        f"{result['config']['steps']} timed steps per side and seed, seeds {result['config']['seeds']}, "
        f"schedule {result['config']['schedule']}.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]
    if result.get("ratio") is not None:
        out.append(
            f"ratio ours/TRL = {result['ratio']:.2f} (target <= {TARGET_RATIO:.2f}); "
            f"generate ours/TRL = {result['ratio_generate']:.2f} (target <= {TARGET_GENERATE_RATIO:.2f})  "
        )
        out.append(
            f"per completion token: ours/TRL = {result['ratio_per_token']:.2f} "
            "(s/step divided by completion tokens generated in the step)  "
        )
        out.append(
            f"median ours/TRL = {result['ratio_median']:.2f}; process CPU time per step ours/TRL = {result['ratio_cpu']:.2f}; "
            f"generate ours/TRL = {result['ratio_generate']:.2f}; update ours/TRL = {result['ratio_update']:.2f}"
        )
        out.append("")
    out.append("Per timed step (wall s/step, process CPU s, generate s, update s, completion tokens, 1-min load average):")
    out.append("")
    out.append("| side | seed | step | s/step | CPU s | generate s | update s | completion tokens | load |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for n in ("ours", "trl"):
        for i, r in enumerate(result["sides"].get(n, {}).get("timed_steps", []), 1):
            out.append(
                f"| {n} | {r.get('seed', '')} | {i} | {r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['generate_s']:.2f} | "
                f"{r['update_s']:.2f} | {r['completion_tokens']:.1f} | {r.get('load_average_1m')} |"
            )
    out.append("")
    if result.get("contention_warning"):
        out.append(f"**Warning:** {result['contention_warning']}.")
        out.append("")
    out.append("'generate' is tokenize + generate + decode; 'update' is the log-prob forward, backward, "
               "clipping and optimizer step; the rest of a step is reward, padding and advantages.")
    out.append("The machine may be shared with other jobs: compare figures from the same run only.")
    return "\n".join(out) + "\n"


def run_session(cfg: DictConfig, problems: list, sides: list[str], args: argparse.Namespace, threads: int,
                tmp_dir: str) -> dict[str, Any]:
    """One seed's warm-up + timed steps per side; returns the runners (their ``records``). The last side
    run stays open (for ``--profile``); closing a runner twice is harmless."""
    steps_total = args.warmup + args.steps
    if args.schedule == "interleaved" and len(sides) == 2:
        # Both models live side by side; TRL's training loop drives, our steps run in its callback
        # hooks (outside TRL's timed region) in the order O T | T O | O T | ... so that load changes
        # on a shared machine hit both sides alike.
        log(f"interleaved: {args.warmup} warm-up + {args.steps} timed steps per side")
        ours = OursSide(cfg, problems, args.warmup)
        trl_side = TRLSide(cfg, problems, args.warmup, args.steps, threads, args.trl_optim, tmp_dir)
        trl_side.before_step = lambda i: ours.step() if i % 2 == 1 else None
        trl_side.after_step = lambda i: ours.step() if i % 2 == 0 else None
        trl_side.run()
        while len(ours.records) < steps_total:  # TRL stopped early (should not happen)
            ours.step()
        return {"ours": ours, "trl": trl_side}
    runners: dict[str, Any] = {}
    for side in sides:
        torch.set_num_threads(threads)
        log(f"running {side}: {args.warmup} warm-up + {args.steps} timed steps")
        if side == "ours":
            runner = OursSide(cfg, problems, args.warmup)
            for _ in range(steps_total):
                runner.step()
        else:
            runner = TRLSide(cfg, problems, args.warmup, args.steps, threads, args.trl_optim, tmp_dir)
            runner.run()
        runners[side] = runner
        if side != sides[-1]:
            runner.close()
    return runners


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per side (default 1)")
    parser.add_argument("--quick", action="store_true", help="1 timed step per side (smoke check)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: CPU count)")
    parser.add_argument("--sides", default="ours,trl", help="which sides to run, in order (default ours,trl)")
    parser.add_argument(
        "--trl-optim", default="adamw_torch_fused",
        help="TRL optimizer name (default adamw_torch_fused: fused torch.optim.AdamW, as ours and as TRL's own default)",
    )
    parser.add_argument(
        "--schedule", choices=("interleaved", "sequential"), default="interleaved",
        help="interleaved (default): alternate the sides step by step (O T | T O | ...); sequential: one side, then the other",
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="profile one extra step of ours (torch.profiler); the table goes to <out stem>_profile.txt",
    )
    parser.add_argument(
        "--seeds", default=str(SEED),
        help="comma-separated seeds (default 0); each seed is one session of warm-up + timed steps per side, the "
        "timed steps are pooled. The sides draw different samples, so one seed's completion lengths can favour a "
        "side by chance; several seeds average that out",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "compare_trl.json", help="JSON output path")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 1
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    sides = [s.strip().lower() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in ("ours", "trl") for s in sides):
        parser.error("--sides takes a comma-separated list of 'ours' and 'trl'")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds needs at least one seed")

    cpu_count = os.cpu_count() or 1
    threads = args.threads or cpu_count
    torch.set_num_threads(threads)

    from rlbench.dataset import load_problems

    out_path = args.out if args.out.is_absolute() else Path.cwd() / args.out
    tmp_dir = tempfile.mkdtemp(prefix="compare_trl_")
    cfg = compose_config(tmp_dir)
    problems = load_problems(cfg.dataset, seed=SEED)[:NUM_PROMPTS]
    log(f"{threads} torch threads on {cpu_count} CPUs; prompts: " + "; ".join(p.prompt for p in problems))

    result: dict[str, Any] = {
        "config": {
            "model": MODEL,
            "prompts": [{"prompt": p.prompt, "answer": p.answer} for p in problems],
            "num_prompts": NUM_PROMPTS,
            "num_generations": NUM_GENERATIONS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "top_k": 0,
            "lr": LR,
            "optimizer": "AdamW betas (0.9, 0.999) wd 0, constant lr",
            "trl_optim": args.trl_optim,
            "max_grad_norm": MAX_GRAD_NORM,
            "beta_kl": 0.0,
            "clip_epsilon": CLIP_EPSILON,
            "loss_aggregation": "seq_mean_token_mean (TRL loss_type=grpo)",
            "scale_rewards": "group",
            "micro_batch_size": NUM_PROMPTS * NUM_GENERATIONS,
            "dtype": "float32",
            "device": "cpu",
            "seeds": seeds,
            "problems_seed": SEED,
            "warmup": args.warmup,
            "steps": args.steps,
            "sides_order": sides,
            "schedule": args.schedule,
            "our_overrides": [o for o in overrides(tmp_dir) if not o.startswith("output_dir=")],
            "deterministic_algorithms": "torch.use_deterministic_algorithms(True, warn_only=True) (set by rlbench seed_everything, in effect for both sides)",
        },
        "sides": {},
        "cpu_count": cpu_count,
        "threads": threads,
        "platform": platform.platform(),
        "versions": versions(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "note": "wall-clock on a possibly shared machine; see load_average_1m per step and contention_warning",
    }
    # seed_everything's deterministic flag is process-global: set it up front so both sides run under it.
    torch.use_deterministic_algorithms(True, warn_only=True)

    records: dict[str, list[dict[str, float]]] = {name: [] for name in sides}  # warm-up steps included, per seed
    runners: dict[str, Any] = {}
    for index, seed in enumerate(seeds):
        last = index == len(seeds) - 1
        cfg = compose_config(tmp_dir, seed)
        if len(seeds) > 1:
            log(f"seed {seed} ({index + 1} of {len(seeds)})")
        runners = run_session(cfg, problems, sides, args, threads, tmp_dir)
        for name in sides:
            records[name] += [dict(r, seed=seed) for r in runners[name].records]
            if not last:
                runners[name].close()
    for name in sides:
        runner = runners[name]
        side_result = finish_side(records[name], args.warmup, len(seeds))
        side_result["prompt_ids"] = runner.prompt_ids
        if name == "trl":
            side_result["trainer_build_s"] = runner.build_s
            side_result["optim"] = runner.optim
        result["sides"][name] = side_result
    if args.profile and "ours" in runners:
        if getattr(runners["ours"], "ctx", None) is None:
            log("--profile needs ours to be the last side or the interleaved schedule; skipped")
        else:
            if "trl" in runners and hasattr(runners["trl"], "trainer"):
                runners["trl"].close()  # free memory first
            result["sides"]["ours"]["profile"] = runners["ours"].profile(out_path.with_name(out_path.stem + "_profile.txt"))

    if "ours" in result["sides"] and "trl" in result["sides"]:
        ours, trl_side = result["sides"]["ours"], result["sides"]["trl"]
        result["prompt_ids_identical"] = ours["prompt_ids"] == trl_side["prompt_ids"]
        o, t = ours["summary"], trl_side["summary"]
        result["ratio"] = o["step_s"]["mean"] / t["step_s"]["mean"]
        result["ratio_per_token"] = (o["step_s"]["mean"] / o["completion_tokens"]["mean"]) / (
            t["step_s"]["mean"] / t["completion_tokens"]["mean"]
        )
        result["ratio_median"] = o["step_s"]["median"] / t["step_s"]["median"]
        result["ratio_cpu"] = o["cpu_s"]["mean"] / t["cpu_s"]["mean"]
        result["ratio_generate"] = o["generate_s"]["mean"] / t["generate_s"]["mean"]
        result["ratio_update"] = o["update_s"]["mean"] / t["update_s"]["mean"]
        result["target_ratio"] = TARGET_RATIO
        result["meets_target"] = result["ratio"] <= TARGET_RATIO
        result["target_generate_ratio"] = TARGET_GENERATE_RATIO
        result["meets_generate_target"] = result["ratio_generate"] <= TARGET_GENERATE_RATIO
    else:
        result["ratio"] = None
    for side in result["sides"].values():
        side["prompt_lengths"] = [len(p) for p in side.pop("prompt_ids")]

    # Our own process accounts for about `threads` of the load average; more means other jobs compete for
    # the cores. With several OpenMP threads, every small parallel op (thousands per generate call) then
    # waits for a descheduled worker, and generation times can grow by an order of magnitude at random.
    loads = [r["load_average_1m"] for side in result["sides"].values() for r in side["timed_steps"]
             if r.get("load_average_1m") is not None]
    result["max_load_average_1m"] = max(loads) if loads else None
    result["contention_warning"] = None
    if loads and max(loads) > threads + 0.5:
        result["contention_warning"] = (
            f"1-min load average reached {max(loads):.2f} on {cpu_count} CPUs with {threads} torch threads: other jobs "
            "competed for the cores, and wall-clock times (generation above all) are unreliable"
            + ("; rerun on an idle machine or with --threads 1" if threads > 1 else "; rerun on an idle machine")
        )

    rows = [fmt_side(n, result["sides"][n]) for n in ("ours", "trl") if n in result["sides"]]
    print()
    print(text_table(rows))
    if result["ratio"] is not None:
        print(
            f"ratio ours/TRL = {result['ratio']:.2f} (target <= {TARGET_RATIO:.2f}); "
            f"generate ours/TRL = {result['ratio_generate']:.2f} (target <= {TARGET_GENERATE_RATIO:.2f})"
        )
        print(
            f"median ours/TRL = {result['ratio_median']:.2f}; process CPU time ours/TRL = {result['ratio_cpu']:.2f}; "
            f"per completion token: ours/TRL = {result['ratio_per_token']:.2f}; "
            f"generate ours/TRL = {result['ratio_generate']:.2f}; update ours/TRL = {result['ratio_update']:.2f}; "
            f"identical prompt ids: {result['prompt_ids_identical']}"
        )

    if result["contention_warning"]:
        print(f"WARNING: {result['contention_warning']}")

    atomic_write(out_path, json.dumps(result, indent=2) + "\n")
    atomic_write(out_path.with_suffix(".md"), markdown(result))
    log(f"wrote {out_path} and {out_path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
