"""DR-PO's dataset reset (``rollout=dataset_reset``): a group continues an intermediate state of the
prompt's reference solution (see :class:`DatasetReset`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.guided_prefix import prefixed_response, trace_body
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class DatasetResetOptions:
    """The ``rollout.dataset_reset`` block."""

    p_reset: float = 0.5  # probability that a prompt starts from a prefix of its dataset solution


@register_strategy("dataset_reset")
class DatasetReset(RolloutStrategy):
    """DR-PO's dataset reset (Chang et al. 2024, "Dataset Reset Policy Optimization for RLHF",
    arXiv:2404.08495, section 4), the RLVR form: with probability ``p_reset`` a prompt's group starts
    from an intermediate state of its reference solution, the trace cut at h ~ U{0, ..., |trace|}
    (the whole group shares the reset state, so its advantage compares continuations of one state);
    the reset tokens are context (loss_mask 0), the continuations the policy's own samples. ``p_reset``
    0 is ``rollout=iid`` exactly (no random draw is taken)."""

    def __init__(self, setup: RolloutSetup, p_reset: float):
        self.setup, self.p_reset = setup, p_reset

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        p = strategy_options(rollout, "dataset_reset", DatasetResetOptions).p_reset
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"rollout.dataset_reset.p_reset must lie in [0, 1], got {p}")
        return {"p_reset": p}

    def reset_depth(self, body: tuple[int, ...]) -> int:
        """0 (no reset) with probability 1 - p_reset, else h uniform in 0..len(body), from the rollout stream."""
        if not body or self.p_reset == 0.0:
            return 0
        draw = torch.rand((), generator=self.setup.generator).item()
        if draw >= self.p_reset:
            return 0
        return int(torch.randint(0, len(body) + 1, (), generator=self.setup.generator).item())

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        prompt_ids = sampler.encode(problems)
        prefixes = []
        for problem in problems:
            body = trace_body(setup, problem)
            prefixes.append(body[: self.reset_depth(body)])
        requests = [GenerationRequest(ids, n=setup.n, prefix_ids=prefix) for ids, prefix in zip(prompt_ids, prefixes)]
        groups = [
            [prefixed_response(c, len(prefix), behaviour="reset") for c in group] if prefix else list(group)
            for group, prefix in zip(sampler.generate(requests, setup.params, setup.generator), prefixes)
        ]
        graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        own = torch.tensor([c.behaviour == "policy" for group in groups for c in group])
        reset = [len(p) for p in prefixes if p]
        metrics = {
            "groups_reset": float(len(reset)),
            "reset_depth_mean": float(sum(reset) / len(reset)) if reset else 0.0,
            # the groups sampled from the prompt alone (all of them when none was reset)
            "rollout_outcome_mean": float((graded.outcome[own] if bool(own.any()) else graded.outcome).mean().item()),
        }
        return graded, metrics
