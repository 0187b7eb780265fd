"""Hints for prompts the policy does not solve, shared by ``rollout=hint_reroll`` (Guide) and
``rollout=scaf_hints`` (Scaf-GRPO), and the demonstrations of ``rollout=icl_expert`` (ICPO): a group whose
every response is wrong is re-rolled with a hint taken from the problem's guidance trace
(``guidance=<source>``, rlbench/guidance/traces.py) added to the prompt.

The hint is the first ``ceil(share * words)`` words of the trace's text (the reference solution); the
hinted prompt is the problem statement followed by ``"\\n\\nHint: <hint>"`` in the dataset's template.
Without a trace for the prompt, or without any all-wrong group, the strategies are ``rollout=iid``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from rlbench.dataset.base import Problem
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import RolloutSetup

HINT_SEPARATOR = "\n\nHint: "


def hint_text(solution: str, share: float) -> str:
    """The first ceil(share * words) words of ``solution`` (share in (0, 1])."""
    words = solution.split()
    return " ".join(words[: math.ceil(share * len(words))])


def hinted_problem(problem: Problem, hint: str) -> Problem:
    """The problem whose statement ends with the hint (the dataset's template then wraps it)."""
    return replace(problem, prompt=problem.prompt + HINT_SEPARATOR + hint)


def unsolved_groups(graded: GradedGroups) -> list[int]:
    """Positions of the groups none of whose responses the grader marks correct."""
    correct = graded.correct
    index = graded.group_index
    return [g for g in range(len(graded.groups)) if not bool(correct[index == g].any())]


def first_trace_text(setup: RolloutSetup, problem: Problem) -> str:
    library = setup.guidance
    traces = library.for_problem(problem) if library is not None else []
    return traces[0].text if traces else ""


def replace_groups(base: GradedGroups, replacement: GradedGroups, positions: Sequence[int]) -> GradedGroups:
    """``base`` with its groups at ``positions`` replaced by the groups of ``replacement`` (in order),
    numbered 0..G-1."""
    where = {g: len(base.groups) + i for i, g in enumerate(positions)}
    merged = GradedGroups.concat([base, replacement])
    return merged.select([where.get(g, g) for g in range(len(base.groups))]).with_group_ids(0)


def retrained_without_hint(completion: Completion, prompt_ids: tuple[int, ...]) -> Completion:
    """A response sampled under the hinted prompt, trained for ``prompt_ids`` (the prompt without the
    hint): off-policy in every token, behaviour log-prob = its score under the hinted prompt."""
    r = len(completion.response_ids)
    return replace(
        completion, prompt_ids=prompt_ids, behaviour="hint", off_policy=[1] * r,
        behaviour_logprobs=list(completion.logprobs),
    )
