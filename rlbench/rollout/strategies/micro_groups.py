"""Micro-group sampling (``rollout=micro_groups``; Infinite Sampling, Wang et al. 2025, arXiv:2506.22950,
section 3: micro sampling groups): a prompt's group of ``rollout.n`` responses is decoded in rounds of
``size`` responses per prompt, so that the rows decoded at once stay bounded while the group (and its
statistics) stays whole.

Configuration (conf/rollout/micro_groups.yaml):

    micro_groups:
      size: 4     # responses per prompt decoded in one round (rollout.n must be a multiple)

Every response draws its tokens from a random stream of its own: the step draws one seed per prompt
from the rollout's stream, and response k of the prompt samples with ``sample_seed(seed, k)`` (the
engine's per-request seeds), so its tokens do not depend on which round decodes it. The group is
therefore the same whatever ``size`` (on one device; up to the float effects of batch composition),
and so are its rewards and group statistics; ``size = n`` is full-group sampling. In each round the
prompt is prefilled once and its KV cache shared by the round's rows (the HF engine shares the prefill
of equal inputs). Not implemented from the paper: continuous sampling across groups and the
length-aware scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import GenerationRequest, sample_seed
from rlbench.rollout.engines.hf import draw_seed
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class MicroGroupsOptions:
    """The ``rollout.micro_groups`` block."""

    size: int = 4  # responses per prompt decoded per round; divides rollout.n


def micro_group_size(rollout: RolloutConfig) -> int:
    """``rollout.micro_groups.size``, checked against ``rollout.n``."""
    size, n = strategy_options(rollout, "micro_groups", MicroGroupsOptions).size, rollout.n
    if size < 1 or n % size:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ConfigError(
            f"rollout.micro_groups.size={size} must divide rollout.n={n} (each round decodes the same number of "
            f"responses per prompt); use one of {divisors}"
        )
    return size


@register_strategy("micro_groups")
class MicroGroupSampling(RolloutStrategy):
    def __init__(self, setup: RolloutSetup, size: int):
        self.setup, self.size = setup, size

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"size": micro_group_size(rollout)}

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        sampler, n = self.setup.sampler, self.setup.n
        prompt_ids = sampler.encode(problems)
        seeds = [draw_seed(self.setup.generator) % (2**31 - 1) for _ in problems]
        groups: list[list] = [[] for _ in problems]
        rounds = 0
        for start in range(0, n, self.size):
            rounds += 1
            requests = [
                GenerationRequest(prompt_ids=ids, n=1, seed=sample_seed(seed, k))
                for ids, seed in zip(prompt_ids, seeds)
                for k in range(start, start + self.size)
            ]
            out = sampler.generate(requests, self.setup.params, None)
            for index, completions in enumerate(out):
                for completion in completions:
                    completion.request_index = index // self.size
                    groups[index // self.size].append(completion)
        return sampler.grade(problems, groups, self.setup.params.max_new_tokens), {"micro_group_rounds": float(rounds)}
