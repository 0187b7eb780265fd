"""One run, in named stages:

    validate   the config, before anything expensive (rlbench.validation), then typed once (RunConfig)
    prepare    actor folder, resume point, seeds, processes, data, logger          (prepare)
    load       the policy, the engine, guidance traces                            (load_policy_and_engine)
    evaluate   pi_theta before training                                           (Run.evaluate)
    train      for step in 1..S: prompts -> rollout -> update                     (train: TrainingRun)
    evaluate   pi_theta after
    summarise  summary.json, result tables, wandb                                 (summarise)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

import rlbench
from rlbench import faults
from rlbench.algorithm import Algorithm
from rlbench.config.identity import run_identity
from rlbench.config.schema import RunConfig
from rlbench.config.typed import typed_config
from rlbench.dataset import load_problems
from rlbench.guidance import GuidanceOptions, load_guidance
from rlbench.eval.evaluate import Benchmark, EvalResult, evaluate, usable_problems
from rlbench.eval.judge_accuracy import add_judge_accuracy, judge_by_benchmark, judge_table
from rlbench.logger import RunLogger, SilentLogger
from rlbench.errors import AlreadyFinished, ConfigError
from rlbench.logger.run_status import FINISHED, command_line_overrides, config_key, in_sweep, read_status
from rlbench.model import load_policy
from rlbench.model.lora import apply_lora, is_lora, save_lora
from rlbench.reward.graders import make_grader, training_grader
from rlbench.rollout import make_engine
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.env import env_factory, env_roles
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
    LaggedStops, SwarmPool, actor_config, agreed_resume_step, check_resume_swarm, external_groups, join_swarm, swarm_manifest,
    swarm_rollout, valid_checkpoint_steps,
)
from rlbench.utils import STREAM_EVAL, atomic_write_text, make_generator, seed_everything
from rlbench.validation import notice_fidelity, notice_inactive_terms, resolve_device, validate_config

log = logging.getLogger(__name__)


def load_benchmarks(cfg: DictConfig, config: RunConfig) -> list[Benchmark]:
    """Each benchmark of ``eval`` loaded (from the composed node, which the loaders read) with its grader
    (from the typed config); with ``eval.prompt`` set, posed in that prompt instead of its own."""
    benchmarks = []
    for name, spec in cfg.eval.benchmarks.items():
        if cfg.eval.get("prompt") is not None:  # one prompt for the suite (paper=motif: MOTIF's system prompt)
            spec = copy.copy(spec)  # the composed config keeps the benchmark's own
            with open_dict(spec):
                spec.prompt = cfg.eval.prompt
        loaded = load_problems(spec, seed=cfg.seed, data_dir=cfg.data_dir, source=cfg.data_source)
        skipped = getattr(loaded, "skipped", 0)
        problems = usable_problems(name, loaded[: cfg.eval.limit] if cfg.eval.limit is not None else loaded, spec, skipped)
        grader = make_grader(config.reward, config.eval.benchmarks[name], config.sandbox)
        benchmarks.append(Benchmark(name, spec, problems, grader, skipped=skipped))
    return benchmarks


def load_run_guidance(run: Run, tokenizer: Any, grader: Any) -> Any:
    """The checked guidance traces of the run (guidance=<source>), or None without a source; bad
    traces are counted and logged, or refuse the run here, before training (guidance.on_bad)."""
    options = GuidanceOptions.from_config(run.config.guidance)
    if options.source == "none":
        return None
    return load_guidance(options, run.train_problems, tokenizer, grader, run.config.rollout.max_new_tokens, run.config.dataset,
                         run.config.seed)


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
    if judge_by_benchmark(result):  # eval.judge_accuracy: SPARK's judge (pointwise, pairwise), before and after
        print(judge_table(result, baseline) + "\n")
    if any("reflection_revised" in r for r in result.rows):  # eval.self_reflection: SPARK's judge-then-revise loop
        header = f"{'self-reflection':<24} {'revised':>8} {'revisions':>9} {'wrong->right':>12} {'right->wrong':>12}"
        print(header + "\n" + "-" * len(header))
        for r in (r for r in result.rows if r["k"] == result.rows[0]["k"]):
            print(f"{r['benchmark']:<24} {r['reflection_revised']:>8.4f} {r['reflection_revisions']:>9} "
                  f"{r['reflection_wrong_to_right']:>12} {r['reflection_right_to_wrong']:>12}")
        print()


def resume_point(config: RunConfig, resolved: dict[str, Any], pool: SwarmPool | None = None) -> checkpoint.Checkpoint | None:
    """``resume=<run folder>``: its latest valid checkpoint, after checking that this run writes into
    that folder and has the configuration the checkpoint was saved with (``resume_allow`` lists the
    keys that may differ). None for a new run. Runs before anything is loaded. A swarm's actor
    (``pool``: the actors sharing groups) resumes from the newest step every actor has a checkpoint of."""
    if not config.resume:
        return None
    folder = Path(config.resume)
    if pool is not None:  # every actor continues from the same step (the shared groups are then the same)
        own = valid_checkpoint_steps(folder)
        step = agreed_resume_step(pool.gather([own]))
        saved = checkpoint.latest_checkpoint(folder, before_step=step + 1)
        if step != own[-1]:
            log.warning("resume: the swarm's newest common checkpoint is at step %d: resuming %s", step, saved.path)
    else:
        saved = checkpoint.latest_checkpoint(folder)
    trainer = config.trainer
    if trainer.parallelism == "swarm":
        check_resume_swarm(saved.manifest, saved.path, launched_world_size(), external_groups(trainer))
    else:
        checkpoint.check_resume_world(saved, trainer.parallelism, launched_world_size())
    if folder.resolve() != Path(config.output_dir).resolve():
        raise ConfigError(f"resume={config.resume} continues that run in its own folder, but output_dir is {config.output_dir}")
    checkpoint.check_resume_config(saved.manifest["config"], resolved, config.resume_allow, saved.path)
    if config.mode != "train" or trainer.steps < saved.step:
        raise ConfigError(
            f"resume: checkpoint {saved.path} is at step {saved.step}; the resumed run must train "
            f"(mode=train) for trainer.steps >= {saved.step} (got mode={config.mode}, trainer.steps={trainer.steps})"
        )
    if trainer.steps == saved.step and not config.resume_evaluate_again and previous_status(folder) == FINISHED:
        raise AlreadyFinished(
            f"{config.resume} already finished ({saved.step} steps; its results are in that folder): nothing to resume.\n"
            f"  evaluate it again: rlbench resume={config.resume} resume_evaluate_again=true\n"
            f"  train it longer:   rlbench resume={config.resume} trainer.steps={saved.step + 1} \"resume_allow=[trainer.steps]\"")
    return saved


def previous_status(folder: Path) -> str | None:
    """The status the run folder had before this process started (the CLI keeps it in
    ``previous_status`` of status.json while it marks the run running)."""
    record = read_status(folder) or {}
    return record.get("previous_status", record.get("status"))


BEFORE_EVAL_FILE = "before.json"  # eval/before.json: the evaluation before training, kept for a resumed run


def save_eval_result(path: Path, result: EvalResult) -> None:
    """JSON keeping the rows' column order (the result tables are written from them)."""
    atomic_write_text(path, json.dumps(dataclasses.asdict(result)) + "\n")


def load_eval_result(path: Path) -> EvalResult | None:
    return EvalResult(**json.loads(path.read_text())) if path.is_file() else None


@dataclass
class Policy:
    """The loaded policy and what samples from it."""

    model: torch.nn.Module
    tokenizer: Any
    engine: Any
    guidance: Any  # the run's checked guidance traces, or None


@dataclass
class Run:
    """What the stages of one run share: built by :func:`prepare` before anything expensive loads."""

    cfg: DictConfig  # the composed config, for the readers that take its nodes (loaders, graders, the step context)
    config: RunConfig  # the same, typed: what the runner reads
    algorithm: Algorithm
    started: float
    resolved: dict[str, Any]
    resumed: checkpoint.Checkpoint | None
    pool: SwarmPool | None  # a swarm's actors sharing groups (J > 0): they agree on stops and the resume step
    world: World
    device: torch.device
    train_problems: list
    benchmarks: list[Benchmark]
    logger: Any
    baseline: EvalResult | None = None
    training_run: TrainingRun | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def training(self) -> bool:
        return self.config.mode == "train" and self.config.trainer.steps > 0

    @property
    def swarm(self) -> bool:
        return self.config.trainer.parallelism == "swarm"

    @property
    def peers(self) -> Any:
        """Who stops after the same step and writes the checkpoint together."""
        return self.pool or self.world

    def evaluate(self, policy: Policy, phase: str, step: int) -> EvalResult:
        ev = self.config.eval
        log.info("evaluating (%s) on %s", phase, ", ".join(b.name for b in self.benchmarks))
        shown = self.benchmarks if self.training_run is None else in_strategy_context(self.benchmarks, self.training_run.ctx.strategy)
        params, seed = SamplingParams(ev.temperature, ev.top_p, ev.max_new_tokens), make_generator(self.config.seed, STREAM_EVAL).initial_seed()
        result = evaluate(policy.engine, policy.tokenizer, shown, n=ev.n, ks=ev.k, params=params, seed=seed, world=self.world,
                          rounds=ev.rounds, env=env_factory(self.config.env, None, self.config.sandbox),  # env=: each sample an episode
                          reflection_rounds=ev.reflection_rounds if ev.self_reflection else 0)  # SPARK's judge-then-revise loop
        if ev.judge_accuracy:  # the policy as SPARK's judge of these samples (docs/judges.md)
            add_judge_accuracy(result, policy.engine, policy.tokenizer, shown, params, seed)
        self.logger.log_evaluation(step, result.with_phase(phase).rows)
        faults.kill_point("eval", step)
        return result

    def summary_fields(self, status: str, exit_code: int) -> dict[str, Any]:
        """The fields every summary has, a finished run's or a stopped one's: the name and what ran
        (mode, model and its source, algorithm, dataset, benchmark: rlbench/config/identity.py)."""
        return {"run_name": self.config.run_name, **run_identity(self.cfg).fields(), "status": status, "exit_code": exit_code}

    def closing_fields(self) -> dict[str, Any]:
        return {"wall_seconds": time.perf_counter() - self.started, "git_commit": git_commit(), "command": " ".join(sys.argv)}


def prepare(cfg: DictConfig, algorithm: Algorithm, started: float) -> Run:
    """A swarm actor's own config, the typed config, the resume point, seeds, processes, data and logger."""
    pool = None
    if cfg.trainer.parallelism == "swarm":  # SAPO's actor: a single-process run with its own seed and folder (training/swarm.py)
        cfg = actor_config(cfg, launched_rank())
    config = typed_config(cfg)
    notice_fidelity(config)  # one line per composed preset that is partial or adapted (docs/papers.md)
    notice_inactive_terms(config, algorithm)  # one line when the loss's distinguishing term cannot act in this run
    if config.trainer.parallelism == "swarm" and external_groups(config.trainer):
        pool = join_swarm()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resumed = resume_point(config, resolved, pool)
    seed_everything(config.seed)
    world = init_world(config.trainer.parallelism, resolve_device(config.device))
    device = rank_device(resolve_device(config.device))
    training = config.mode == "train" and config.trainer.steps > 0
    if config.mode == "generate":
        return Run(cfg, config, algorithm, started, resolved, resumed, pool, world, device, [], [], SilentLogger())
    train_problems = load_problems(cfg.dataset, seed=config.seed, data_dir=config.data_dir, source=config.data_source) if training else []
    benchmarks = load_benchmarks(cfg, config)
    logger = RunLogger(Path(config.output_dir), resolved, OmegaConf.to_yaml(cfg, resolve=True), config.logger,
                       job_type="train" if training else "eval", in_sweep=in_sweep(),
                       resume_id=(resumed.manifest.get("run_id") or "") if resumed else None) if world.is_main else SilentLogger()
    return Run(cfg, config, algorithm, started, resolved, resumed, pool, world, device, train_problems, benchmarks, logger)


def load_policy_and_engine(run: Run) -> Policy:
    """The policy (LoRA adapters, FSDP's check, activation checkpointing), its engine and the guidance traces."""
    config = run.config
    model, tokenizer = load_policy(run.config.model, device=run.device, dtype=torch.float32,  # bf16 enters through autocast
                                   seed=config.seed, cache_dir=config.cache_dir)
    if config.model.lora is not None:
        model = apply_lora(model, run.cfg.model.lora, env_roles(config.env) if config.model.lora.per_role else ())
    if run.world.sharded:  # before the evaluation: a model FSDP cannot shard is refused at once
        check_shardable(model, run.world.size)
    if config.trainer.gradient_checkpointing:
        enable_activation_checkpointing(model)
    engine = make_engine(config.rollout, model, tokenizer, run.device)
    guidance = load_run_guidance(run, tokenizer, training_grader(run.config)) if run.training else None  # before any evaluation
    return Policy(model, tokenizer, engine, guidance)


def evaluate_before(run: Run, policy: Policy) -> None:
    """The baseline before training (kept in eval/before.json, so a resumed run does not repeat it)."""
    if not (run.training and run.config.eval.before_training):
        return
    run.baseline = load_eval_result(run.out_dir / "eval" / BEFORE_EVAL_FILE) if run.resumed else None
    if run.baseline is None:
        run.baseline = run.evaluate(policy, "before", 0)
        if run.world.is_main:
            save_eval_result(run.out_dir / "eval" / BEFORE_EVAL_FILE, run.baseline)
    run.logger.log_tables(run.baseline.rows, run.baseline.problems)  # the phase's results, kept if the run stops


def train(run: Run, policy: Policy, stop: StopSignals) -> dict[str, Any]:
    """The training steps (rlbench.training.loop.TrainingRun), resumed when a checkpoint was given,
    with the periodic evaluation (eval.every) after the steps it falls on."""
    if not run.training:
        return {}
    config = run.config
    ctx = make_step_context(config, run.algorithm, policy.model, policy.tokenizer, policy.engine, run.device,
                            training_grader(run.config), guidance=policy.guidance, world=run.world)
    if run.swarm:
        ctx.strategy = swarm_rollout(ctx, config, run.pool)
    manifest = {"config": checkpoint.comparable_config(run.resolved), "config_key": config_key(run.resolved),
                "overrides": command_line_overrides(), "rlbench_commit": git_commit(),
                **(swarm_manifest(launched_world_size(), external_groups(config.trainer)) if run.swarm else {})}
    run.train_problems = ctx.strategy.training_problems(run.train_problems)  # rollout=offline: a file's own prompts
    # trainer.swarm.lag = d: the actors agree on a stop after step s from the signals of step s - d
    stops = LaggedStops(run.pool, config.trainer.swarm.lag) if run.pool is not None and config.trainer.swarm.lag else None
    run.training_run = TrainingRun(config, ctx, run.train_problems, run.logger, manifest, peers=run.peers, stops=stops)
    if run.resumed is not None:
        run.resumed = run.training_run.resume(run.resumed)
        if stops is not None:
            stops.resume_at(run.training_run.step)

    def periodic_eval(step: int) -> None:  # eval.every: pass@k curves during training
        every = config.eval.every
        if every and step % every == 0 and step < config.trainer.steps:
            run.evaluate(policy, "during", step)

    with forward_precision(config.trainer.precision):
        return run.training_run.train(stop, after_step=periodic_eval)


def summarise(run: Run, policy: Policy, final: EvalResult, training_summary: dict[str, Any]) -> dict[str, Any]:
    """Save the trained policy (trainer.save_model), then write the summary, the result tables and the samples."""
    config, baseline = run.config, run.baseline
    if run.training and config.trainer.save_model:
        save_policy(policy.model, policy.tokenizer, run.out_dir / "policy", run.world,
                    merge_lora=config.model.lora is not None and config.model.lora.merge_on_save)
        ctx = run.training_run.ctx if run.training_run is not None else None
        if ctx is not None and ctx.reincarnated and ctx.reference is not None:  # the policy at the switch (SACPO's stage 1)
            save_policy(ctx.reference, policy.tokenizer, run.out_dir / "reference", run.world)
    summary = {
        **run.summary_fields("finished", 0),
        "seed": config.seed,
        "pass_at_1_before": baseline.pass_at(1) if baseline else None,
        "pass_at_1_after": final.pass_at(1),
        **({"judge_accuracy": {"before": judge_by_benchmark(baseline) if baseline else None, "after": judge_by_benchmark(final)}} if config.eval.judge_accuracy else {}),
        "eval_seconds": {"before": baseline.seconds if baseline else None, "after": final.seconds},
        "grader_errors": {"before": baseline.grader_errors if baseline else None, "after": final.grader_errors},
        "skipped_records": final.skipped,
        "guidance_traces": policy.guidance.counts if policy.guidance is not None else None,
        **training_summary,
        **({"resumed_from_step": run.resumed.step} if run.resumed else {}),
        "wall_seconds": time.perf_counter() - run.started,
        "device": str(run.device),
        "parallelism": run.world.parallelism,
        "world_size": run.world.size,
        "versions": versions(),
        "git_commit": git_commit(),
        "command": " ".join(sys.argv),
    }
    rows = (baseline.rows if baseline else []) + final.rows
    problem_rows = (baseline.problems if baseline else []) + final.problems
    run.logger.log_eval(rows, problem_rows, final.samples, summary, step=config.trainer.steps if run.training else 0)
    return summary


def stopped_summary(run: Run, status: str, exit_code: int, **fields: Any) -> dict[str, Any]:
    """The summary of a run that did not finish (interrupted or failed)."""
    return {
        **run.summary_fields(status, exit_code),
        "steps_completed": run.training_run.step if run.training_run else 0,
        "pass_at_1_before": run.baseline.pass_at(1) if run.baseline else None,
        **fields, **run.closing_fields(),
    }


def interrupted(run: Run, stopped: Interrupted) -> None:
    """A stop signal: checkpoint the steps done so far (when every process stopped after the same step),
    say how to resume, write the interrupted summary."""
    training_run, out_dir = run.training_run, run.out_dir
    saved = None
    # several ranks (or swarm actors) write a checkpoint together only when they stopped after the same step
    together = run.peers.size == 1 or stopped.at_step_boundary
    if training_run is not None and training_run.resumable and training_run.unsaved and not stopped.mid_step and together:
        saved = training_run.save()  # the steps completed so far; a second signal leaves the earlier checkpoints
    log.warning("run %s after %d steps; %s", stopped, training_run.step if training_run else 0,
                f"resume it: rlbench resume={out_dir.parent if run.swarm else out_dir}" if saved or (training_run and training_run.saved_step)
                else "no checkpoint to resume from")
    run.logger.log_summary(stopped_summary(run, "interrupted", stopped.exit_code, signal=stopped.signal_name,
                                           checkpoint=str(saved.path) if saved else None))
    run.logger.finish(stopped.exit_code)
    if together:  # the others wait for rank 0's summary (and every actor's checkpoint): torchrun ends
        run.peers.barrier()  # every process once one has exited


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate, prepare, train (unless mode=eval), evaluate, summarise. Returns the summary. A stop
    signal (Ctrl-C, SIGTERM) checkpoints the training done so far and raises
    :class:`rlbench.training.interrupt.Interrupted` after writing an interrupted summary."""
    started = time.perf_counter()
    algorithm = validate_config(cfg)  # every check before anything expensive
    run = prepare(cfg, algorithm, started)
    if run.config.mode == "generate":  # graded traces for the guided methods (rlbench/guidance/generate.py)
        if run.config.warmup is not None:  # Thinkless' paired warm-up data of two teachers
            from rlbench.guidance.warmup import write_warmup_traces

            return write_warmup_traces(run.cfg, run.config, run.device)
        from rlbench.guidance.generate import write_traces

        return write_traces(run.cfg, run.config, run.device)
    try:
        with StopSignals() as stop:
            policy = load_policy_and_engine(run)
            evaluate_before(run, policy)
            training_summary = train(run, policy, stop)
            final = run.evaluate(policy, "after" if run.training else "eval", run.config.trainer.steps if run.training else 0)
            summary = summarise(run, policy, final, training_summary)
        if run.world.is_main:
            print_table(final, run.baseline)
    except Interrupted as stopped:
        interrupted(run, stopped)
        raise
    except Exception as err:
        run.logger.log_summary(stopped_summary(run, "failed", 1, error=f"{type(err).__name__}: {err}"))
        run.logger.finish(1)
        raise
    finally:
        run.logger.finish()
        close_world(run.world)
    if run.world.is_main:  # after wandb's footer (logger.finish), so the path is the last line printed
        link_latest(run.out_dir)
        print(results_line(run.out_dir), flush=True)
    return summary


def results_line(out_dir: Path) -> str:
    """``results: <run folder>``, with the saved policy's size when there is one."""
    policy = out_dir / "policy"
    if not policy.is_dir():
        return f"results: {out_dir}"
    size = sum(f.stat().st_size for f in policy.rglob("*") if f.is_file())
    return f"results: {out_dir} (policy/ {size / 1e6:.0f} MB; trainer.save_model=false skips it)"
