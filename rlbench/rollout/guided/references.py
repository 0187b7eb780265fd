"""The references alone (``rollout=references``; OTR, arXiv:2509.26313): each prompt's group is one
guidance trace, sampled by nobody (rlbench/rollout/guided/mixed_traces.py picks the traces in turn)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
from rlbench.guidance.traces import trace_completion
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.mixed_traces import MixedTraces
from rlbench.rollout.strategy import RolloutSetup, register_strategy, strategy_options


@dataclass(frozen=True)
class ReferencesOptions:
    """The ``rollout.references`` block."""

    monitor_n: int = 0  # free samples per prompt drawn only to measure the policy (rollout_outcome_mean); never trained


@register_strategy("references")
class References(MixedTraces):
    """The references alone (``rollout=references``; OTR, arXiv:2509.26313, whose loss samples its own
    one-token rollouts): each prompt's group is one trace of the guidance source (in turn over the steps),
    no response is generated for training, and prompts without a trace are left out of the step
    (DataError when none of them has one: the source is empty). ``monitor_n`` > 0 samples that many free
    responses per prompt only to measure the policy (their mean outcome is ``rollout_outcome_mean``; they
    are never trained on); 0 (the default) generates nothing."""

    def __init__(self, setup: RolloutSetup, monitor_n: int):
        super().__init__(setup, 1)
        self.monitor_n = monitor_n

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"monitor_n": reference_monitor_n(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """The monitor's size alone: a group is one trace, whatever ``rollout.n`` and ``mixed_traces`` say."""
        cls.config_options(rollout)

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup = self.setup
        metrics = {}
        if self.monitor_n:
            metrics["rollout_outcome_mean"] = float(setup.sampler(problems, self.monitor_n, setup.params, setup.generator).outcome.mean().item())
        chosen = [(problem, self.pick_traces(problem)) for problem in problems]
        kept = [(problem, traces) for problem, traces in chosen if traces]
        if not kept:
            raise DataError(
                f"rollout=references: none of the step's {len(problems)} prompts has a guidance trace; "
                "choose a source with traces (guidance=dataset or guidance=jsonl guidance.path=...)"
            )
        prompt_ids = setup.sampler.encode([p for p, _ in kept])
        groups = [[trace_completion(t, ids, request_index=i) for t in traces] for i, ((_, traces), ids) in enumerate(zip(kept, prompt_ids))]
        graded = setup.sampler.grade([p for p, _ in kept], groups, setup.params.max_new_tokens)
        metrics["groups_with_trace"] = float(len(kept))
        return graded, metrics


def reference_monitor_n(rollout: RolloutConfig) -> int:
    n = strategy_options(rollout, "references", ReferencesOptions).monitor_n
    if n < 0:
        raise ConfigError(f"rollout.references.monitor_n must be >= 0, got {n}")
    return n
