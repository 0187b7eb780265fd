"""One run:

    validate the config (before anything expensive)
    evaluate pi_theta before training
    for step in 1..S:                       rlbench.training.loop.TrainingRun (checkpoints, resume)
        prompts <- next batch of training problems (seeded order)
        one training step                   rlbench.training.step.train_step
    evaluate pi_theta after; write result files and log to wandb.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import rlbench
from rlbench import faults
from rlbench.validation import notice_inactive_terms, resolve_device, validate_config
from rlbench.dataset import load_problems
from rlbench.guidance import GuidanceOptions, load_guidance
from rlbench.eval.evaluate import Benchmark, EvalResult, evaluate, usable_problems
from rlbench.logger import RunLogger, SilentLogger
from rlbench.errors import ConfigError
from rlbench.logger.run_status import command_line_overrides, config_key, in_sweep
from rlbench.model import load_policy
from rlbench.model.lora import apply_lora, is_lora, save_lora
from rlbench.reward.graders import make_grader
from rlbench.rollout import make_engine
from rlbench.rollout.engines.base import SamplingParams
from rlbench.training import checkpoint
from rlbench.training.distributed import (
    SINGLE, World, check_shardable, close_world, full_model_state, init_world, launched_rank,
    launched_world_size, rank_device,
)
from rlbench.training.forward import forward_precision
from rlbench.training.interrupt import Interrupted, StopSignals
from rlbench.training.loop import TrainingRun
from rlbench.training.memory import enable_activation_checkpointing
from rlbench.training.step import make_step_context
from rlbench.training.swarm import (
    SwarmPool, actor_config, agreed_resume_step, check_resume_swarm, external_groups, join_swarm, swarm_manifest,
    swarm_rollout, valid_checkpoint_steps,
)
from rlbench.utils import STREAM_EVAL, atomic_write_text, make_generator, seed_everything

log = logging.getLogger(__name__)


def load_benchmarks(cfg: DictConfig) -> list[Benchmark]:
    benchmarks = []
    for name, spec in cfg.eval.benchmarks.items():
        loaded = load_problems(spec, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source)
        skipped = getattr(loaded, "skipped", 0)
        problems = usable_problems(name, loaded[: cfg.eval.limit] if cfg.eval.limit is not None else loaded, spec, skipped)
        grader = make_grader(cfg.reward, spec, cfg.get("sandbox"))
        benchmarks.append(Benchmark(name, spec, problems, grader, skipped=skipped))
    return benchmarks


def load_run_guidance(cfg: DictConfig, train_problems: list, tokenizer: Any) -> Any:
    """The checked guidance traces of the run (guidance=<source>), or None without a source; bad
    traces are counted and logged, or refuse the run here, before training (guidance.on_bad)."""
    options = GuidanceOptions.from_config(cfg.get("guidance"))
    if options.source == "none":
        return None
    grader = make_grader(cfg.reward, cfg.dataset, cfg.get("sandbox"))
    return load_guidance(options, train_problems, tokenizer, grader, int(cfg.rollout.max_new_tokens), cfg.dataset, cfg.seed)


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(rlbench.__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import transformers

    return {
        "rlbench": rlbench.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
    }


def save_policy(model: torch.nn.Module, tokenizer: Any, target: Path, world: World = SINGLE, merge_lora: bool = False) -> None:
    """Save in Hugging Face format via a temporary folder, so a half-written checkpoint never appears.
    A LoRA policy saves its adapters (or, with ``merge_lora``, base + adapters merged). Every rank
    calls it (FSDP gathers the full weights); rank 0 writes."""
    state = full_model_state(model) if world.sharded else None
    if not world.is_main:
        return
    tmp = target.with_name(target.name + ".tmp")
    if is_lora(model):
        save_lora(model, tmp, merge=merge_lora)
    else:
        model.save_pretrained(tmp, **({"state_dict": state} if state is not None else {}))
    tokenizer.save_pretrained(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)


def in_strategy_context(benchmarks: list[Benchmark], strategy: Any) -> list[Benchmark]:
    """The benchmarks as the trained policy is asked them: a strategy that puts context in every prompt
    (``in_context``: Training-Free GRPO's experience library) puts it in the evaluation's prompts too."""
    return [dataclasses.replace(b, problems=[strategy.in_context(p) for p in b.problems]) for b in benchmarks]


def link_latest(out_dir: Path) -> None:
    """results/latest -> this run's folder (best effort)."""
    try:
        latest = Path("results") / "latest"
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.parent.mkdir(exist_ok=True)
        latest.symlink_to(out_dir.resolve(), target_is_directory=True)
    except OSError:
        pass


def print_table(result: EvalResult, baseline: EvalResult | None) -> None:
    before = {(r["benchmark"], r["k"]): r["pass_at_k"] for r in baseline.rows} if baseline else {}
    header = f"{'benchmark':<12} {'k':>3} {'pass@k':>8} {'95% CI':>17} {'maj@k':>7} {'before':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in result.rows:
        b = before.get((r["benchmark"], r["k"]))
        before_text = "-" if b is None else f"{b:.4f}"
        maj_text = "-" if r["maj_at_k"] != r["maj_at_k"] else f"{r['maj_at_k']:.4f}"  # NaN: answers cannot vote
        print(
            f"{r['benchmark']:<12} {r['k']:>3} {r['pass_at_k']:>8.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}] "
            f"{maj_text:>7} {before_text:>8}"
        )
    print()


def resume_point(cfg: DictConfig, resolved: dict[str, Any], pool: SwarmPool | None = None) -> checkpoint.Checkpoint | None:
    """``resume=<run folder>``: its latest valid checkpoint, after checking that this run writes into
    that folder and has the configuration the checkpoint was saved with (``resume_allow`` lists the
    keys that may differ). None for a new run. Runs before anything is loaded. A swarm's actor
    (``pool``: the actors sharing groups) resumes from the newest step every actor has a checkpoint of."""
    if not cfg.get("resume"):
        return None
    folder = Path(cfg.resume)
    if pool is not None:  # every actor continues from the same step (the shared groups are then the same)
        own = valid_checkpoint_steps(folder)
        step = agreed_resume_step(pool.gather([own]))
        saved = checkpoint.latest_checkpoint(folder, before_step=step + 1)
        if step != own[-1]:
            log.warning("resume: the swarm's newest common checkpoint is at step %d: resuming %s", step, saved.path)
    else:
        saved = checkpoint.latest_checkpoint(folder)
    if cfg.trainer.strategy == "swarm":
        check_resume_swarm(saved.manifest, saved.path, launched_world_size(), external_groups(cfg))
    else:
        checkpoint.check_resume_world(saved, cfg.trainer.strategy, launched_world_size())
    if folder.resolve() != Path(cfg.output_dir).resolve():
        raise ConfigError(f"resume={cfg.resume} continues that run in its own folder, but output_dir is {cfg.output_dir}")
    checkpoint.check_resume_config(saved.manifest["config"], resolved, cfg.get("resume_allow") or [], saved.path)
    if cfg.mode != "train" or cfg.trainer.steps < saved.step:
        raise ConfigError(
            f"resume: checkpoint {saved.path} is at step {saved.step}; the resumed run must train "
            f"(mode=train) for trainer.steps >= {saved.step} (got mode={cfg.mode}, trainer.steps={cfg.trainer.steps})"
        )
    return saved


BEFORE_EVAL_FILE = "before.json"  # eval/before.json: the evaluation before training, kept for a resumed run


def save_eval_result(path: Path, result: EvalResult) -> None:
    """JSON keeping the rows' column order (the result tables are written from them)."""
    atomic_write_text(path, json.dumps(dataclasses.asdict(result)) + "\n")


def load_eval_result(path: Path) -> EvalResult | None:
    return EvalResult(**json.loads(path.read_text())) if path.is_file() else None


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate, train (unless mode=eval), evaluate, write results. Returns the summary. A stop
    signal (Ctrl-C, SIGTERM) checkpoints the training done so far and raises
    :class:`rlbench.training.interrupt.Interrupted` after writing an interrupted summary."""
    started = time.perf_counter()
    algorithm = validate_config(cfg)  # every check before anything expensive
    notice_inactive_terms(cfg, algorithm)  # one line when the loss's distinguishing term cannot act in this run
    swarm = cfg.trainer.get("strategy") == "swarm"
    pool = None  # a swarm's actors sharing groups (J > 0) agree on stops and on the resume step through it
    if swarm:  # SAPO's actor: a single-process run with its own seed and folder (rlbench/training/swarm.py)
        cfg = actor_config(cfg, launched_rank())
        pool = join_swarm() if external_groups(cfg) else None
    out_dir = Path(cfg.output_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resumed = resume_point(cfg, resolved, pool)
    seed_everything(cfg.seed)
    world = init_world(cfg.trainer.strategy, resolve_device(str(cfg.device)))
    peers = pool or world  # who stops after the same step and writes the checkpoint together
    device = rank_device(resolve_device(str(cfg.device)))
    training = cfg.mode == "train" and cfg.trainer.steps > 0
    if cfg.mode == "generate":  # graded traces for the guided methods (rlbench/guidance/generate.py)
        from rlbench.guidance.generate import write_traces

        return write_traces(cfg, device)

    train_problems = load_problems(cfg.dataset, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source) if training else []
    benchmarks = load_benchmarks(cfg)
    logger = RunLogger(out_dir, resolved, OmegaConf.to_yaml(cfg, resolve=True), cfg.logger,
                       job_type="train" if training else "eval", in_sweep=in_sweep(),
                       resume_id=(resumed.manifest.get("run_id") or "") if resumed else None) if world.is_main else SilentLogger()
    baseline: EvalResult | None = None
    training_run: TrainingRun | None = None

    def partial_summary(status: str, exit_code: int, **fields: Any) -> dict[str, Any]:
        return {
            "run_name": cfg.run_name, "status": status, "exit_code": exit_code,
            "steps_completed": training_run.step if training_run else 0,
            "pass_at_1_before": baseline.pass_at(1) if baseline else None,
            **fields, "wall_seconds": time.perf_counter() - started, "git_commit": git_commit(),
            "command": " ".join(sys.argv),
        }

    try:
        with StopSignals() as stop:
            dtype = torch.float32  # bf16 enters through autocast on CUDA; master weights stay fp32
            model, tokenizer = load_policy(cfg.model, device=device, dtype=dtype, seed=cfg.seed, cache_dir=cfg.cache_dir)
            if cfg.model.get("lora") is not None:
                model = apply_lora(model, cfg.model.lora)
            if world.sharded:  # before the evaluation: a model FSDP cannot shard is refused at once
                check_shardable(model, world.size)
            if cfg.trainer.gradient_checkpointing:
                enable_activation_checkpointing(model)
            engine = make_engine(cfg.rollout, model, tokenizer, device)
            guidance = load_run_guidance(cfg, train_problems, tokenizer) if training else None  # before any evaluation
            ev = cfg.eval
            eval_params = SamplingParams(ev.temperature, ev.top_p, ev.max_new_tokens)
            eval_seed = make_generator(cfg.seed, STREAM_EVAL).initial_seed()

            def run_eval(phase: str, step: int) -> EvalResult:
                log.info("evaluating (%s) on %s", phase, ", ".join(b.name for b in benchmarks))
                shown = benchmarks if training_run is None else in_strategy_context(benchmarks, training_run.ctx.strategy)
                result = evaluate(engine, tokenizer, shown, n=ev.n, ks=list(ev.k), params=eval_params, seed=eval_seed, world=world)
                logger.log_evaluation(step, result.with_phase(phase).rows)
                faults.kill_point("eval", step)
                return result

            def periodic_eval(step: int) -> None:  # eval.every: pass@k curves during training
                if ev.every and step % ev.every == 0 and step < cfg.trainer.steps:
                    run_eval("during", step)

            if training and ev.before_training:
                baseline = load_eval_result(out_dir / "eval" / BEFORE_EVAL_FILE) if resumed else None
                if baseline is None:
                    baseline = run_eval("before", 0)
                    if world.is_main:
                        save_eval_result(out_dir / "eval" / BEFORE_EVAL_FILE, baseline)
                logger.log_tables(baseline.rows, baseline.problems)  # the phase's results, kept if the run stops
            training_summary = {}
            if training:
                ctx = make_step_context(cfg, algorithm, model, tokenizer, engine, device, guidance=guidance, world=world)
                if swarm:
                    ctx.strategy = swarm_rollout(ctx, cfg, pool)
                manifest = {"config": checkpoint.comparable_config(resolved), "config_key": config_key(resolved),
                            "overrides": command_line_overrides(), "rlbench_commit": git_commit(),
                            **(swarm_manifest(launched_world_size(), external_groups(cfg)) if swarm else {})}
                training_run = TrainingRun(cfg, ctx, train_problems, logger, manifest, peers=peers)
                if resumed is not None:
                    resumed = training_run.resume(resumed)
                with forward_precision(cfg.trainer.precision):
                    training_summary = training_run.train(stop, after_step=periodic_eval)
            final = run_eval("after" if training else "eval", int(cfg.trainer.steps) if training else 0)

            if training and cfg.trainer.save_model:
                save_policy(model, tokenizer, out_dir / "policy", world,
                            merge_lora=bool(cfg.model.get("lora") and cfg.model.lora.merge_on_save))
            rows = (baseline.rows if baseline else []) + final.rows
            problem_rows = (baseline.problems if baseline else []) + final.problems
            summary = {
                "run_name": cfg.run_name,
                "status": "finished",
                "exit_code": 0,
                "mode": cfg.mode,
                "algorithm": algorithm.name,
                "model": cfg.model.name,
                "dataset": cfg.dataset.name,
                "seed": cfg.seed,
                "pass_at_1_before": baseline.pass_at(1) if baseline else None,
                "pass_at_1_after": final.pass_at(1),
                "eval_seconds": {"before": baseline.seconds if baseline else None, "after": final.seconds},
                "grader_errors": {"before": baseline.grader_errors if baseline else None, "after": final.grader_errors},
                "skipped_records": final.skipped,
                "guidance_traces": guidance.counts if guidance is not None else None,
                **training_summary,
                **({"resumed_from_step": resumed.step} if resumed else {}),
                "wall_seconds": time.perf_counter() - started,
                "device": str(device),
                "strategy": world.strategy,
                "world_size": world.size,
                "versions": versions(),
                "git_commit": git_commit(),
                "command": " ".join(sys.argv),
            }
            logger.log_eval(rows, problem_rows, final.samples, summary, step=int(cfg.trainer.steps) if training else 0)
        if world.is_main:
            print_table(final, baseline)
            print(f"results: {out_dir}")
    except Interrupted as stopped:
        saved = None
        # several ranks (or swarm actors) write a checkpoint together only when they stopped after the same step
        together = peers.size == 1 or stopped.at_step_boundary
        if training_run is not None and training_run.resumable and training_run.unsaved and not stopped.mid_step and together:
            saved = training_run.save()  # the steps completed so far; a second signal leaves the earlier checkpoints
        log.warning("run %s after %d steps; %s", stopped, training_run.step if training_run else 0,
                    f"resume it: rlbench resume={out_dir.parent if swarm else out_dir}" if saved or (training_run and training_run.saved_step)
                    else "no checkpoint to resume from")
        logger.log_summary(partial_summary("interrupted", stopped.exit_code, signal=stopped.signal_name,
                                           checkpoint=str(saved.path) if saved else None))
        logger.finish(stopped.exit_code)
        if together:  # the others wait for rank 0's summary (and every actor's checkpoint): torchrun ends
            peers.barrier()  # every process once one has exited
        raise
    except Exception as err:
        logger.log_summary(partial_summary("failed", 1, error=f"{type(err).__name__}: {err}"))
        logger.finish(1)
        raise
    finally:
        logger.finish()
        close_world(world)
    if world.is_main:
        link_latest(out_dir)
    return summary
