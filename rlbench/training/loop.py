"""The training loop: steps over a seeded order of the training problems, logging each step,
checkpointing (rlbench.training.checkpoint) and saying so when steps learn nothing (no trainable
token in the loss)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from rlbench import faults
from rlbench.sandbox import limits_from_config
from rlbench.config.schema import ModelConfig, RunConfig
from rlbench.dataset.base import Problem
from rlbench.model.loading import load_policy
from rlbench.rollout.engines import frozen_model_engine
from rlbench.rollout.groups import GenerationCost, GroupSampler
from rlbench.training import checkpoint
from rlbench.training.async_pipeline import AsyncPipeline
from rlbench.training.curricula import Curriculum, difficulty_filter
from rlbench.training.interrupt import StopSignals
from rlbench.training.step import StepContext, train_step
from rlbench.utils import STREAM_DIFFICULTY_FILTER, Progress, make_generator

log = logging.getLogger(__name__)


class UntrainedSteps:
    """Counts the steps whose loss had no trainable token (metric ``trainable_tokens`` = 0): their
    gradient is zero, so the policy did not learn from them (e.g. DAPO's overlong filter masking
    every response that hit rollout.max_new_tokens). Warns once per run."""

    def __init__(self) -> None:
        self.count = 0

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` plus ``steps_without_trainable_tokens`` (cumulative)."""
        if metrics.get("trainable_tokens", 1.0) == 0:
            self.count += 1
            if self.count == 1:
                log.warning(
                    "step %d: the loss has no trainable token (every response masked%s), so this step learned "
                    "nothing; such steps are counted in steps_without_trainable_tokens (metrics.jsonl, summary.json)",
                    step, f", truncated_rate={metrics['truncated_rate']:.2f}" if "truncated_rate" in metrics else "",
                )
        return {**metrics, "steps_without_trainable_tokens": float(self.count)}


class TrainingRun:
    """The loop over ``trainer.steps`` steps of ``trainer.prompts_per_step`` prompts, and
    everything it carries from step to step, which a checkpoint saves and :meth:`restore` loads:
    the step context's state (rlbench.training.step.StepContext.state_dict), the model and the
    optimizer, the data side (prompt sampler, per-prompt statistics, stages: rlbench.training.curricula),
    the untrained-steps counter, the global random generators and the logger's state (wandb run id,
    metrics so far). With ``trainer.max_staleness`` set the steps run through the asynchronous
    pipeline (rlbench.training.async_pipeline), which checkpoints nothing mid-run (validation refuses
    checkpoint_every and resume with it). ``manifest``: what the checkpoints' manifest
    records besides the step (config, overrides, commit). ``peers``: the processes that stop and
    resume together, agreeing after every step on a stop signal and on the checkpoint resumed: the
    ranks of ``ctx.world`` (the default), or a swarm's actors (rlbench.training.swarm.SwarmPool),
    each a single-process run of its own. ``stops``: who agrees on the stop after each step (default
    ``peers``; a lagged swarm's rlbench.training.swarm.LaggedStops, told the step resumed from)."""

    def __init__(self, config: RunConfig, ctx: StepContext, problems: list[Problem], logger: Any,
                 manifest: dict[str, Any] | None = None, peers: Any = None, stops: Any = None):
        self.trainer, self.output_dir = config.trainer, config.output_dir
        self.ctx, self.logger = ctx, logger
        self.peers = ctx.world if peers is None else peers
        self.stops = self.peers if stops is None else stops
        self.seed, self.problems = config.seed, problems
        self.rollout, self.cache_dir = config.rollout, config.cache_dir  # the difficulty filter's own model, if any
        self.sandbox_limits = limits_from_config(config.sandbox)  # CodeRL+'s execution tasks trace programs with them
        self.curriculum = Curriculum(config.trainer, config.seed, problems, ctx.prompt_stats, self.sandbox_limits)
        self.curriculum.bind(ctx)
        self.presampled = False
        self.untrained = UntrainedSteps()
        self.step = 0  # steps completed
        self.after_step_done = 0  # the last step whose after_step (periodic evaluation) ran
        self.saved_step: int | None = None  # the step of the last checkpoint written or loaded
        self.manifest = dict(manifest or {})

    def files(self) -> dict[str, Any]:
        """This rank's files of the checkpoint: name -> object for torch.save. Every rank writes its
        own state (its random streams differ); the model and the optimizer are written by rank 0
        (single, ddp: every rank holds the same) or, under fsdp, by every rank as shards
        (:func:`rlbench.training.checkpoint.save_sharded`)."""
        world = self.ctx.world
        policy = {} if world.sharded or not world.is_main else {
            checkpoint.MODEL_FILE: checkpoint.model_state(self.ctx.model),
            checkpoint.OPTIMIZER_FILE: checkpoint.optimizer_state(self.ctx.optimizer),
        }
        return {
            **policy,
            checkpoint.state_file(world.rank): {
                "step": self.step,
                "context": self.ctx.state_dict(),
                "curriculum": self.curriculum.state_dict(),
                "untrained_steps": self.untrained.count,
                "after_step_done": self.after_step_done,
                "logger": self.logger.state_dict(),
                "random": checkpoint.global_random_state(),
            },
        }

    def save(self) -> checkpoint.Checkpoint:
        world = self.ctx.world
        shards = (lambda folder: checkpoint.save_sharded(self.ctx.model, self.ctx.optimizer, folder)) if world.sharded else None
        saved = checkpoint.save_checkpoint(self.output_dir, self.step, self.files(),
                                           {**self.manifest, "run_id": self.logger.run_id}, keep=self.trainer.keep_checkpoints,
                                           world=world, write_shards=shards)
        self.saved_step = self.step
        log.info("checkpoint %s (%.1f s)", saved.path, saved.manifest["write_seconds"])
        return saved

    @property
    def resumable(self) -> bool:
        """Checkpoints can continue this run exactly: not with the asynchronous pipeline, whose
        generator thread runs ahead of the learner (its prompt order and random streams are past the
        last trained step)."""
        return self.trainer.max_staleness is None

    @property
    def unsaved(self) -> bool:
        """Steps were completed since the last checkpoint (or none was written yet)."""
        return self.saved_step != self.step

    def restore(self, saved: checkpoint.Checkpoint) -> None:
        """Continue from ``saved``. The loading order matters: the context's parts exist (built
        from the initial model, so the reference and EWMA copies start where the saved run's
        did), then weights, optimizer, the rest, and last the global random generators."""
        device, world = self.ctx.device, self.ctx.world
        if world.sharded:
            checkpoint.load_sharded(self.ctx.model, self.ctx.optimizer, saved.path)
        else:  # every rank loads the whole state (ddp: the same on every rank)
            checkpoint.load_model_state(self.ctx.model, saved.load(checkpoint.MODEL_FILE, device))
            checkpoint.load_optimizer_state(self.ctx.optimizer, saved.load(checkpoint.OPTIMIZER_FILE, device))
        state = saved.load(checkpoint.state_file(world.rank), device)
        self.ctx.load_state_dict(state["context"])
        self.ctx.engine.sync_weights(self.ctx.model)
        self.ctx.prompt_stats.load_state_dict(state["curriculum"]["stats"])  # the pass rates measured before step 1
        self.presample()  # from the restored state: the same problems, nothing sampled
        self.step = self.saved_step = int(state["step"])
        self.curriculum.load_state_dict(state["curriculum"], self.ctx, self.step)
        self.untrained.count = int(state["untrained_steps"])
        self.after_step_done = int(state["after_step_done"])
        self.logger.load_state_dict(state["logger"])
        checkpoint.load_global_random_state(state["random"])
        log.info("resumed from %s: %d of %d steps done", saved.path, self.step, self.trainer.steps)

    def resume(self, saved: checkpoint.Checkpoint) -> checkpoint.Checkpoint:
        """:meth:`restore` from ``saved``, or, when one of its files cannot be loaded, from the
        newest valid checkpoint before it (saying so; each restore overwrites every part). Returns
        the checkpoint restored. With several ranks (or swarm actors: ``peers``) they agree: when any
        cannot load its part, every one goes back to its previous checkpoint, and they must then be at
        the same step (CheckpointError otherwise)."""
        while True:
            problem = None
            try:
                self.restore(saved)
            except checkpoint.CheckpointError as err:
                problem = err
            if not self.peers.max_over_ranks(problem is not None):
                steps = self.peers.gather([saved.step])
                if len(set(steps)) > 1:
                    raise checkpoint.CheckpointError(f"resume: the processes went back to checkpoints of different steps "
                                                     f"{steps} (in rank / actor order); start the run again")
                return saved
            previous = checkpoint.latest_checkpoint(self.output_dir, before_step=saved.step)
            log.warning("%s; resuming from the previous valid checkpoint %s",
                        problem or f"another rank cannot load checkpoint {saved.path}", previous.path)
            saved = previous

    def presample(self) -> None:
        """The work before the first step: the advantage inputs' (PVPO's pre-sampling,
        rlbench.training.advantage_inputs.StepInputSource.before_training), then the offline difficulty
        filter (``trainer.difficulty_filter``, rlbench.training.curricula.difficulty_filter); when they drop
        training problems, the curriculum draws from the rest. A resumed run repeats it from the restored
        state (the sources' and the statistics'), so nothing is sampled again."""
        ctx = self.ctx
        kept = ctx.inputs.before_training(self.problems, ctx.prompt_stats)
        band = self.trainer.difficulty_filter
        if band is not None:
            generator = make_generator(self.seed, STREAM_DIFFICULTY_FILTER)
            samplers: list[GroupSampler] = []  # built on the first chunk: a resumed run samples nothing, loads nothing

            def sample(chunk: list[Problem]) -> Any:
                if not samplers:
                    samplers.append(self.filter_sampler(band.model))
                return samplers[0](chunk, band.samples, ctx.params, generator)

            kept = difficulty_filter(kept, sample, ctx.prompt_stats, band)
            samplers.clear()  # another model's weights are freed here
        if len(kept) != len(self.problems):
            self.curriculum = Curriculum(self.trainer, self.seed, kept, self.ctx.prompt_stats, self.sandbox_limits)
        self.presampled = True

    def filter_sampler(self, model: ModelConfig | None) -> GroupSampler:
        """The sampler the difficulty filter answers with: the policy's, or with ``trainer.difficulty_filter.model``
        the same sampler (prompts, grader, reward terms) over that model, its tokenizer and an engine of its own."""
        sampler = self.ctx.strategy.setup.sampler
        if model is None:
            return sampler
        other, tokenizer = load_policy(model, device=self.ctx.device, dtype=torch.float32, seed=self.seed,
                                       cache_dir=self.cache_dir)
        engine = frozen_model_engine(self.rollout, other.eval().requires_grad_(False), tokenizer, self.ctx.device)
        return dataclasses.replace(sampler, engine=engine, tokenizer=tokenizer, cost=GenerationCost())

    def checkpoint_due(self, step: int) -> bool:
        every = self.trainer.checkpoint_every
        return bool(every) and (step % every == 0 or step == self.trainer.steps)

    def train(self, stop: StopSignals, after_step: Callable[[int], None] | None = None) -> dict[str, Any]:
        """The remaining steps; ``after_step(step)`` runs after each step is logged and checkpointed
        (the runner's periodic evaluation, ``eval.every``; a run resumed from a checkpoint written
        before it ran runs it first). A stop signal during a step lets it finish
        (:class:`rlbench.training.interrupt.StopSignals`). Returns what the run's summary reports
        about training."""
        steps = self.trainer.steps
        if not self.presampled:
            self.presample()
        progress = Progress("train", steps)
        progress.done = self.step
        if after_step is not None and self.after_step_done < self.step:  # checkpointed before it ran
            after_step(self.step)
            self.after_step_done = self.step
        if self.trainer.max_staleness is not None:
            return self.train_async(progress, after_step)
        for step in range(self.step + 1, steps + 1):
            faults.at_step(step)
            with stop.step():
                metrics = train_step(
                    self.ctx, self.curriculum.prompts(step, self.ctx), progress=(step - 1) / steps,
                    draw_prompts=self.curriculum.draw,
                    observe=lambda graded, step=step: self.curriculum.observe(step, graded, self.ctx.world),
                )
                self.curriculum.end_step(step)
                self.curriculum.watch(metrics)
                metrics = {**metrics, **self.curriculum.metrics()}
                self.logger.log_step(step, self.untrained.observe(step, metrics))
                self.step = step
            progress.update(1, note=f"reward {metrics['reward_mean']:.3f} acc {metrics['accuracy']:.3f}")
            if self.checkpoint_due(step):
                self.save()
            stop.raise_if_requested(self.stops)  # with several ranks or actors: all stop after the same step
            if after_step is not None:
                after_step(step)
            self.after_step_done = step
        return {"steps_without_trainable_tokens": self.untrained.count}

    def train_async(self, progress: Progress, after_step: Callable[[int], None] | None) -> dict[str, Any]:
        """The steps through the asynchronous pipeline (trainer.max_staleness): generation for later
        steps overlaps the update; no checkpoint is written mid-run."""
        trainer = self.trainer
        pipeline = AsyncPipeline(self.ctx, self.curriculum, trainer.steps, trainer.max_staleness,
                                 trainer.generator_threads, trainer.weight_sync_every)
        for step, metrics in pipeline.steps():
            self.logger.log_step(step, self.untrained.observe(step, metrics))
            self.step = step
            progress.update(1, note=f"reward {metrics['reward_mean']:.3f} acc {metrics['accuracy']:.3f}")
            if after_step is not None:
                after_step(step)
            self.after_step_done = step
        return {"steps_without_trainable_tokens": self.untrained.count, **pipeline.summary()}
