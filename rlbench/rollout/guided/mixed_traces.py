"""Guidance traces in the group (``rollout=mixed_traces``; LUFFY's Mixed-Policy GRPO, Yan et al. 2025,
arXiv:2504.14945, section 3.1): each prompt with a trace in the run's guidance library
(``guidance=<source>``, rlbench/guidance/traces.py) gets ``rollout.n - traces_per_group`` responses
sampled by the policy plus ``traces_per_group`` traces (7 + 1 with n = 8); a prompt without a trace
gets ``rollout.n`` samples. The group is graded and its advantage computed over all its members, the
traces included. A trace is a Completion labelled with its source (``dataset`` / ``teacher``),
off-policy in every token, with behaviour log-prob 0 (mu = 1, the paper's assumption for a teacher
whose probabilities are unknown); the loss reads the ``off_policy`` mask (loss ``policy_shaping``).

Configuration (conf/rollout/mixed_traces.yaml; ``algorithm=luffy`` selects it):

    strategy: mixed_traces
    mixed_traces:
      traces_per_group: 1   # traces per group (the paper: 1 of 8)
      when: always          # always (LUFFY) | unsolved (DaGRPO's anchors, below) | reference_unsolved (PVPO)

``when: unsolved`` (DaGRPO's off-policy anchors, Xie et al. 2025, arXiv:2512.06337, ``rollout=anchors``):
every prompt gets ``rollout.n`` policy samples, and a group none of whose responses is correct gets
``traces_per_group`` traces added (a group of n + k), graded with it; solved groups are left alone.

``when: reference_unsolved`` (PVPO's ground-truth trajectories, Feng et al. 2025, arXiv:2508.21104): as
``always``, but only for the prompts whose reference pass rate measured before training is 0
(``algorithm.baseline.presample``, recorded in the statistics store); every other prompt gets ``rollout.n``
samples. The trace takes one sample's place, with behaviour log-prob 0 (the ratio's denominator, the
trace's probability under its source, is unknown and taken as 1).

With an empty library (``guidance=none``) the requests are exactly ``rollout=iid``'s, so the groups,
and the run, are the iid ones. A prompt with several traces uses them in turn over the steps it is
drawn (the per-uid counter is the strategy's state, saved with checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.guidance.traces import Trace, trace_completion
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)

WHEN = ("always", "unsolved", "reference_unsolved")


@dataclass(frozen=True)
class MixedTracesOptions:
    """The ``rollout.mixed_traces`` block."""

    traces_per_group: int = 1  # LUFFY: 1 trace + 7 on-policy samples of a group of 8
    when: str = "always"  # always (LUFFY) | unsolved: traces only for groups with no correct response (DaGRPO)
    # | reference_unsolved: traces only for prompts the reference never solved before training (PVPO)


def traces_per_group(rollout: RolloutConfig) -> int:
    return strategy_options(rollout, "mixed_traces", MixedTracesOptions).traces_per_group


def traces_when(rollout: RolloutConfig) -> str:
    when = strategy_options(rollout, "mixed_traces", MixedTracesOptions).when
    if when not in WHEN:
        raise ConfigError(f"rollout.mixed_traces.when={when!r} is unknown; choose always (LUFFY), unsolved (DaGRPO's "
                          "anchors) or reference_unsolved (PVPO)")
    return when


@register_strategy("mixed_traces")
class MixedTraces(RolloutStrategy):
    def __init__(self, setup: RolloutSetup, per_group: int, when: str = "always"):
        self.setup, self.per_group, self.when = setup, per_group, when
        self.uses: dict[str, int] = {}  # uid -> traces of it used so far

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"per_group": traces_per_group(rollout), "when": traces_when(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        k, n = traces_per_group(rollout), int(rollout.n)
        if traces_when(rollout) == "unsolved":  # anchors join a full group of the policy's samples
            if k < 1:
                raise ConfigError(f"rollout.mixed_traces.traces_per_group={k} must be at least 1")
        elif not 1 <= k < n:
            raise ConfigError(
                f"rollout.mixed_traces.traces_per_group={k} must be at least 1 and below rollout.n={n}: "
                "the group needs responses of the policy beside its traces"
            )

    def state_dict(self) -> dict:
        return {"uses": dict(self.uses)}

    def load_state_dict(self, state: dict) -> None:
        self.uses = dict(state["uses"])

    def gets_traces(self, problem: Problem) -> bool:
        """Whether ``problem``'s group holds traces: always, or (reference_unsolved) when the reference's pass
        rate on it before training was 0 (not measured: NaN, no trace)."""
        if self.when != "reference_unsolved":
            return True
        stats = self.setup.prompt_stats
        return stats is not None and stats.get(problem.uid).reference_pass_rate == 0

    def pick_traces(self, problem: Problem) -> list[Trace]:
        """The next ``per_group`` traces of ``problem`` (in turn over the steps), [] without any."""
        if not self.gets_traces(problem):
            return []
        library = self.setup.guidance
        traces = library.for_problem(problem) if library is not None else []
        if not traces:
            return []
        start = self.uses.get(problem.uid, 0)
        self.uses[problem.uid] = start + self.per_group
        return [traces[(start + i) % len(traces)] for i in range(self.per_group)]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        if self.when == "unsolved":
            return self.anchor_rollout(problems)
        setup = self.setup
        sampler = setup.sampler
        prompt_ids = sampler.encode(problems)
        chosen = [self.pick_traces(p) for p in problems]
        requests = [GenerationRequest(prompt_ids=ids, n=setup.n - len(traces)) for ids, traces in zip(prompt_ids, chosen)]
        groups = sampler.generate(requests, setup.params, setup.generator)
        for group, ids, traces in zip(groups, prompt_ids, chosen):
            group.extend(trace_completion(t, ids, request_index=group[0].request_index if group else 0) for t in traces)
        graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        own = torch.tensor([c.behaviour == "policy" for group in groups for c in group])
        metrics = {
            "groups_with_trace": float(sum(1 for traces in chosen if traces)),
            # the policy's own responses' mean outcome (the batch's outcome_mean includes the traces')
            "rollout_outcome_mean": float(graded.outcome[own].mean().item()),
        }
        return graded, metrics

    def anchor_rollout(self, problems: list[Problem]) -> tuple[GradedGroups, dict[str, float]]:
        """``when: unsolved``: n policy samples per prompt; traces join the groups with no correct response."""
        setup = self.setup
        graded = setup.sample(problems)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item())}  # the policy's own samples
        correct = graded.correct
        index = graded.group_index
        groups, anchored = [], 0
        for g, (problem, group) in enumerate(zip(problems, graded.groups)):
            traces = self.pick_traces(problem) if not bool(correct[index == g].any()) else []
            groups.append(list(group) + [trace_completion(t, group[0].prompt_ids, group[0].request_index) for t in traces])
            anchored += bool(traces)
        metrics["groups_anchored"] = float(anchored)
        if anchored:
            graded = setup.sampler.grade(problems, groups, setup.params.max_new_tokens)
        return graded, metrics
