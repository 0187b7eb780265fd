"""Offline training from a file of graded responses (``rollout=offline``): nothing is sampled; each drawn
prompt's group is its responses in the run's guidance library (``guidance=jsonl guidance.path=<file>
guidance.keep_incorrect=true``; ``rlbench mode=generate`` writes such files, rlbench/guidance/traces.py
checks them and counts what it leaves out), graded by the run's grader and reward shaping like sampled
responses. With a pairwise loss (``algorithm=dpo|ipo|simpo``, docs/preference.md) the group's pairs are
its responses ordered by reward; with ``algorithm/loss=sft`` the correct ones are imitated (the offline
baseline).

A group holds at most ``rollout.n`` of the prompt's responses, taken in turn over the steps the prompt
is drawn (the per-uid counter is the strategy's state, saved with checkpoints). A drawn prompt without a
response in the library is replaced by the next prompts the sampler draws (at most
``offline.max_redraws`` per step; the replaced prompts are counted in ``offline_skipped_prompts``).
Before training, the strategy logs how many training prompts have responses and how many have a pair
(two responses with different rewards), and refuses a library without a single response.

Every response is off-policy with behaviour log-prob 0 (mu = 1, as for guidance traces): a pairwise or
SFT loss reads no ratio; a ratio loss would train on that assumption.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
from rlbench.guidance.traces import Trace, trace_completion
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import RolloutSetup, RolloutStrategy, register_strategy, strategy_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineOptions:
    """The ``rollout.offline`` block."""

    max_redraws: int = 64  # prompts drawn per step, at most, to replace prompts without responses


def offline_options(rollout: RolloutConfig) -> OfflineOptions:
    options = strategy_options(rollout, "offline", OfflineOptions)
    if options.max_redraws < 0:
        raise ConfigError(f"rollout.offline.max_redraws must be >= 0, got {options.max_redraws}")
    return options


def library_coverage(traces: dict[str, list[Trace]]) -> tuple[int, int]:
    """(prompts with a response, prompts with a pair: two responses with different rewards)."""
    with_pair = sum(1 for ts in traces.values() if len({t.reward for t in ts}) > 1)
    return sum(1 for ts in traces.values() if ts), with_pair


@register_strategy("offline")
class Offline(RolloutStrategy):
    def __init__(self, setup: RolloutSetup, max_redraws: int = 64):
        self.setup, self.max_redraws = setup, max_redraws
        self.uses: dict[str, int] = {}  # uid -> responses of it used so far
        library = setup.guidance
        if library is None or len(library) == 0:
            raise DataError(
                "rollout=offline trains on the responses of the run's guidance library, which is empty: set "
                "guidance=jsonl guidance.path=<file> (rlbench mode=generate writes one) and guidance.keep_incorrect=true"
            )
        with_responses, with_pair = library_coverage(library.traces)
        log.info("rollout=offline: %d prompts have responses in the library, %d of them a pair (different rewards)",
                 with_responses, with_pair)
        if with_pair == 0:
            log.warning("rollout=offline: no prompt has two responses with different rewards: a pairwise loss "
                        "trains on nothing (guidance.keep_incorrect=true keeps the incorrect ones)")

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"max_redraws": offline_options(rollout).max_redraws}

    def state_dict(self) -> dict:
        return {"uses": dict(self.uses)}

    def load_state_dict(self, state: dict) -> None:
        self.uses = dict(state["uses"])

    def responses(self, problem: Problem) -> list[Trace]:
        """The next ``rollout.n`` responses of ``problem`` (in turn over the steps; all when it has fewer)."""
        traces = self.setup.guidance.for_problem(problem)
        if len(traces) <= self.setup.n:
            return list(traces)
        start = self.uses.get(problem.uid, 0)
        self.uses[problem.uid] = start + self.setup.n
        return [traces[(start + i) % len(traces)] for i in range(self.setup.n)]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        library = self.setup.guidance
        kept = [p for p in problems if library.for_problem(p)]
        skipped, redraws = len(problems) - len(kept), 0
        while len(kept) < len(problems) and draw_prompts is not None and redraws < self.max_redraws:
            drawn = draw_prompts(min(len(problems) - len(kept), self.max_redraws - redraws))
            redraws += len(drawn)
            found = [p for p in drawn if library.for_problem(p)]
            skipped += len(drawn) - len(found)
            kept += found
        if not kept:
            raise DataError(f"rollout=offline: none of the {len(problems) + redraws} prompts drawn this step has a response "
                            "in the library (rollout.offline.max_redraws bounds the draws)")
        prompt_ids = self.setup.sampler.encode(kept)
        groups = [[trace_completion(t, ids, request_index=k) for t in self.responses(p)]
                  for k, (p, ids) in enumerate(zip(kept, prompt_ids))]
        graded = self.setup.sampler.grade(kept, groups, self.setup.params.max_new_tokens)
        return graded, {"offline_skipped_prompts": float(skipped), "offline_groups": float(len(kept))}
