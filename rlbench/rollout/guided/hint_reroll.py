"""``rollout=hint_reroll`` (Guide; Nath et al. 2025, "Adaptive Guidance Accelerates Reinforcement Learning
of Reasoning Models", arXiv:2506.13923): an all-wrong group is re-sampled (``rollout.n`` responses) with a
hint (rlbench/rollout/guided/hints.py); if one of them is right, the hinted group replaces the original.
The hinted responses are trained for the prompt *without* the hint: each is off-policy in every token with
behaviour log-prob log pi_old(y | x, h) (the engine's scores under the hinted prompt), so the ratio is
pi_theta(y | x) / pi_old(y | x, h) (the loss ``policy_shaping`` shapes it, no clip).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.hints import (
    first_trace_text,
    hint_text,
    hinted_problem,
    replace_groups,
    retrained_without_hint,
    unsolved_groups,
)
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class HintRerollOptions:
    """The ``rollout.hint_reroll`` block."""

    hint_share: float = 0.5  # the hint: this share of the trace's words


@register_strategy("hint_reroll")
class HintReroll(RolloutStrategy):
    """Guide: re-roll all-wrong groups with a hint; the hinted responses train the unhinted prompt."""

    def __init__(self, setup: RolloutSetup, hint_share: float):
        self.setup, self.hint_share = setup, hint_share

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        share = strategy_options(rollout, "hint_reroll", HintRerollOptions).hint_share
        if not 0.0 < share <= 1.0:
            raise ConfigError(f"rollout.hint_reroll.hint_share must lie in (0, 1], got {share}")
        return {"hint_share": share}

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        prompt_ids = sampler.encode(problems)
        graded = sampler(problems, setup.n, setup.params, setup.generator, prompt_ids)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item())}  # the policy without hints
        unsolved = [g for g in unsolved_groups(graded) if first_trace_text(setup, problems[g])]
        metrics["groups_unsolved_with_trace"] = float(len(unsolved))
        kept: list[int] = []
        if unsolved:
            hinted = [hinted_problem(problems[g], hint_text(first_trace_text(setup, problems[g]), self.hint_share)) for g in unsolved]
            requests = [GenerationRequest(prompt_ids=ids, n=setup.n) for ids in sampler.encode(hinted)]
            groups = sampler.generate(requests, setup.params, setup.generator)
            groups = [[retrained_without_hint(c, prompt_ids[g]) for c in group] for g, group in zip(unsolved, groups)]
            rerolled = sampler.grade([problems[g] for g in unsolved], groups, setup.params.max_new_tokens)
            solved = [i for i in range(len(unsolved)) if i not in unsolved_groups(rerolled)]
            kept = [unsolved[i] for i in solved]
            if kept:
                graded = replace_groups(graded, rerolled.select(solved), kept)
        metrics["groups_hinted"] = float(len(kept))
        return graded, metrics
