"""The training loop: steps over a seeded order of the training problems, logging each step, and
saying so when steps learn nothing (no trainable token in the loss)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import numpy as np

from rlbench.dataset.base import Problem
from rlbench.training.async_pipeline import AsyncPipeline
from rlbench.training.curricula import Curriculum
from rlbench.training.step import StepContext, train_step
from rlbench.utils import STREAM_DATA_ORDER, Progress

log = logging.getLogger(__name__)


class PromptSampler:
    """Shuffled passes over the training problems; the order is a function of the seed alone."""

    def __init__(self, problems: list[Problem], seed: int):
        self.problems = problems
        self.rng = np.random.default_rng([seed, STREAM_DATA_ORDER])
        self.order: list[int] = []

    def next(self, count: int) -> list[Problem]:
        batch = []
        while len(batch) < count:
            if not self.order:
                self.order = self.rng.permutation(len(self.problems)).tolist()
            batch.append(self.problems[self.order.pop()])
        return batch


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


def train(cfg: Any, ctx: StepContext, problems: list[Problem], logger: Any,
          after_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``cfg.trainer.steps`` steps of ``cfg.trainer.prompts_per_step`` prompts; ``after_step(step)``
    runs after each step is logged (the runner's periodic evaluation, ``eval.every``). Returns what
    the run's summary reports about training."""
    curriculum = Curriculum(cfg, problems)
    progress = Progress("train", cfg.trainer.steps)
    untrained = UntrainedSteps()
    pipeline = None
    if cfg.trainer.get("max_staleness") is None:
        steps = synchronous_steps(ctx, curriculum, cfg.trainer.steps)
    else:
        pipeline = AsyncPipeline(ctx, curriculum, cfg.trainer.steps, int(cfg.trainer.max_staleness),
                                 cfg.trainer.get("generator_threads"))
        steps = pipeline.steps()
    for step, metrics in steps:
        logger.log_step(step, untrained.observe(step, metrics))
        progress.update(1, note=f"reward {metrics['reward_mean']:.3f} acc {metrics['accuracy']:.3f}")
        if after_step is not None:
            after_step(step)
    return {"steps_without_trainable_tokens": untrained.count, **(pipeline.summary() if pipeline else {})}


def synchronous_steps(ctx: StepContext, curriculum: Curriculum, steps: int) -> Iterator[tuple[int, dict[str, float]]]:
    """Generate, then update, step after step (the default: trainer.max_staleness=null)."""
    for step in range(1, steps + 1):
        metrics = train_step(
            ctx, curriculum.prompts(step, ctx), progress=(step - 1) / steps, draw_prompts=curriculum.draw,
            observe=lambda graded, step=step: curriculum.observe(step, graded),
        )
        curriculum.end_step(step)
        yield step, metrics
