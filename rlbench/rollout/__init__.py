"""Rollout: prompts -> graded groups of responses.

``engines/`` turn generation requests into completions (hf, vllm and the HF engine's CPU paths);
``strategy.py`` is the seam a training step calls (the :class:`RolloutStrategy` base class and its
registry); ``strategies/`` holds the strategies that sample the policy's own responses and ``guided/`` those
whose groups also hold guided experience (replayed successes, traces, hints, prefixes, edits, an experience
library); ``groups.py`` is what every strategy returns (:class:`GradedGroups`) and the one way to make it
(:class:`GroupSampler`); ``continuation.py`` continues prefixes with a budget per request, for strategies.
Importing this package registers every strategy."""

from rlbench.rollout import guided, strategies  # noqa: F401  (registers every strategy)
from rlbench.rollout.engines import make_engine
from rlbench.rollout.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from rlbench.rollout.engines.hf import HFGenerateEngine
from rlbench.rollout.groups import GradedGroups, GroupSampler
from rlbench.rollout.strategy import STRATEGIES, RolloutSetup, RolloutStrategy, make_strategy, validate_strategy

__all__ = [
    "STRATEGIES",
    "Completion",
    "GenerationRequest",
    "GradedGroups",
    "GroupSampler",
    "HFGenerateEngine",
    "RolloutEngine",
    "RolloutSetup",
    "RolloutStrategy",
    "SamplingParams",
    "make_engine",
    "make_strategy",
    "validate_strategy",
]
