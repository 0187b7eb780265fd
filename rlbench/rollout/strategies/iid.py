"""i.i.d. sampling (``rollout=iid``, the default): ``rollout.n`` independent responses per prompt,
all kept (GRPO, Shao et al. 2024, arXiv:2402.03300, section 4.1: a group of G outputs per question)."""

from __future__ import annotations

from typing import Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import RolloutSetup, RolloutStrategy, register_strategy


@register_strategy("iid")
class IIDSampling(RolloutStrategy):
    def __init__(self, setup: RolloutSetup):
        self.setup = setup

    @classmethod
    def from_config(cls, rollout: RolloutConfig, setup: RolloutSetup) -> "IIDSampling":
        return cls(setup)

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """Nothing beyond the rollout block's own checks."""

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        return self.setup.sample(problems), {}
