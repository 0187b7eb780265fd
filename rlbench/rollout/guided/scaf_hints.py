"""``rollout=scaf_hints`` (Scaf-GRPO; Zhang et al. 2025, "Scaf-GRPO: Scaffolded Group Relative Policy
Optimization for Enhancing LLM Reasoning", arXiv:2510.19807): after a guidance-free exemption (the first
``exemption_fraction`` of the steps), the hint (rlbench/rollout/guided/hints.py) of an all-wrong group
grows tier by tier (``tiers``: the share of the solution revealed) until a hinted response is right; that
response replaces one failed response of the group. It is trained as the policy's own sample of the
*hinted* prompt (the hint is prompt context, never trained), so it is on-policy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import Completion, GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.hints import (
    first_trace_text,
    hint_text,
    hinted_problem,
    unsolved_groups,
)
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class ScafHintsOptions:
    """The ``rollout.scaf_hints`` block."""

    tiers: tuple[float, ...] = (0.25, 0.5, 1.0)  # shares of the solution revealed, tier by tier
    exemption_fraction: float = 0.15  # the first 15% of the steps run without hints (the paper's exemption period)
    total_steps: int = 0  # the run's steps (the YAML sets ${trainer.steps}); 0: no exemption period


@register_strategy("scaf_hints")
class ScafHints(RolloutStrategy):
    """Scaf-GRPO: tiered hints after an exemption period; one failed response replaced by a hinted
    success, trained on-policy for the hinted prompt."""

    def __init__(self, setup: RolloutSetup, tiers: list[float], exempt_steps: int):
        self.setup, self.tiers, self.exempt_steps = setup, tiers, exempt_steps
        self.steps = 0

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        options = strategy_options(rollout, "scaf_hints", ScafHintsOptions)
        tiers = list(options.tiers)
        if not tiers or any(not 0.0 < t <= 1.0 for t in tiers) or tiers != sorted(tiers):
            raise ConfigError(f"rollout.scaf_hints.tiers must be increasing shares of the solution in (0, 1], got {tiers}")
        fraction = options.exemption_fraction
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"rollout.scaf_hints.exemption_fraction must lie in [0, 1), got {fraction}")
        return {"tiers": tiers, "exempt_steps": int(fraction * options.total_steps)}

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        self.steps += 1
        graded = setup.sample(problems)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item()), "groups_scaffolded": 0.0}
        if self.steps <= self.exempt_steps:
            return graded, metrics
        pending = [g for g in unsolved_groups(graded) if first_trace_text(setup, problems[g])]
        rescued: dict[int, Completion] = {}
        for share in self.tiers:
            if not pending:
                break
            hinted = [hinted_problem(problems[g], hint_text(first_trace_text(setup, problems[g]), share)) for g in pending]
            requests = [GenerationRequest(prompt_ids=ids, n=setup.n) for ids in sampler.encode(hinted)]
            groups = sampler.generate(requests, setup.params, setup.generator)
            tried = sampler.grade([problems[g] for g in pending], groups, setup.params.max_new_tokens)
            index = tried.group_index
            still = []
            for i, g in enumerate(pending):
                rows = (index == i).nonzero(as_tuple=True)[0].tolist()
                right = [row for row in rows if tried.grades[row].correct]
                if right:
                    c = groups[i][rows.index(right[0])]
                    rescued[g] = replace(c, behaviour="hint", off_policy=[0] * len(c.response_ids))
                else:
                    still.append(g)
            pending = still
        if rescued:
            groups = [list(group) for group in graded.groups]
            for g, c in rescued.items():
                groups[g][0] = c  # every response of the group failed: replace the first
            graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        metrics["groups_scaffolded"] = float(len(rescued))
        return graded, metrics
