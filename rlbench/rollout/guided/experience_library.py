"""``rollout=experience_library``: Training-Free GRPO (Cai et al. 2025, "Training-Free Group Relative
Policy Optimization", arXiv:2510.08191). No weight changes: an experience library is put in every
prompt, and after each step it is updated from the groups' *semantic* advantages.

Per step:

    prompts  <- each problem preceded by the library (rendered by :func:`render_library`)
    groups   <- rollout.n responses per prompt, graded (the run's GroupSampler)
    lessons  <- for every group whose rewards are not all equal: a summariser's lesson from its
                better and worse responses, scored by the best response's advantage r_best - mean(r)
    library  <- :meth:`ExperienceLibrary.updated` (pure): add / modify / delete / keep, ids stable

The paper lets an LLM summarise each rollout, extract lessons and propose the library operations. Here
the update rule is a pure function and the LLM call is a pluggable summariser (``summariser``):

``best_response``  the lesson is the group's best response itself, an in-context example of what
                   scored higher (no LLM call; the tiny model of the tests writes no readable lesson)
``policy``         the policy writes the lesson: it is shown the problem, the better and the worse
                   response and asked for the lesson (``summary_tokens`` tokens, through the sampler)

Groups whose rewards are all equal carry no relative information and are skipped, as in the paper.
The algorithm preset ``training_free_grpo`` takes no optimizer step (``algorithm.update.schedule=none``);
the evaluation after training sees the library in its prompts too (:meth:`ExperienceLibraryRollout.in_context`).
With ``max_items: 0`` the library stays empty and the strategy is ``rollout=iid`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)

LIBRARY_HEADER = "Experiences from earlier attempts:"


@dataclass(frozen=True)
class Experience:
    """One library item: a stable id, the lesson's text and its score (the best semantic advantage it
    was distilled from)."""

    id: int
    text: str
    score: float


@dataclass(frozen=True)
class LibraryUpdate:
    """What one update did: the ids added, modified, deleted and kept, and the candidates rejected
    (lower-scored than every item of a full library)."""

    added: tuple[int, ...] = ()
    modified: tuple[int, ...] = ()
    deleted: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()
    rejected: int = 0

    def metrics(self) -> dict[str, float]:
        return {"library_added": float(len(self.added)), "library_modified": float(len(self.modified)),
                "library_deleted": float(len(self.deleted)), "library_rejected": float(self.rejected)}


@dataclass(frozen=True)
class ExperienceLibrary:
    """The experience library: items in the order they were added, and the next free id (ids are never
    reused, so an id names one lesson for the whole run)."""

    items: tuple[Experience, ...] = ()
    next_id: int = 0

    def updated(self, candidates: Sequence[tuple[str, float]], max_items: int) -> tuple["ExperienceLibrary", LibraryUpdate]:
        """The library after the step's ``candidates`` (lesson text, score), and the operations:

        * a candidate whose text (stripped) equals an item's modifies it: score <- max(score, candidate's);
        * any other non-empty candidate is added with the next id;
        * while the library holds more than ``max_items`` items, the lowest-scored one is deleted (on a
          tie the oldest, the lowest id); a candidate deleted in the update it came in is rejected;
        * the other items are kept unchanged.
        """
        items = {item.id: item for item in self.items}
        next_id, added, modified = self.next_id, [], set()
        by_text = {item.text: item.id for item in self.items}
        for text, score in candidates:
            text = text.strip()
            if not text:
                continue
            if text in by_text:
                key = by_text[text]
                if score > items[key].score:
                    items[key] = replace(items[key], score=float(score))
                    modified.add(key)
                continue
            items[next_id] = Experience(next_id, text, float(score))
            by_text[text], next_id = next_id, next_id + 1
            added.append(next_id - 1)
        removed = sorted(items.values(), key=lambda item: (item.score, item.id))[: max(len(items) - max_items, 0)]
        for item in removed:
            del items[item.id]
        removed_ids = {item.id for item in removed}
        old_ids = [item.id for item in self.items]
        update = LibraryUpdate(
            added=tuple(i for i in added if i not in removed_ids),
            modified=tuple(sorted(modified - removed_ids)),
            deleted=tuple(i for i in old_ids if i in removed_ids),
            kept=tuple(i for i in old_ids if i not in removed_ids and i not in modified),
            rejected=sum(1 for i in added if i in removed_ids),
        )
        return ExperienceLibrary(tuple(sorted(items.values(), key=lambda item: item.id)), next_id), update

    def state_dict(self) -> dict[str, Any]:
        return {"items": [[item.id, item.text, item.score] for item in self.items], "next_id": self.next_id}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ExperienceLibrary":
        return cls(tuple(Experience(int(i), str(t), float(s)) for i, t, s in state["items"]), int(state["next_id"]))


def render_library(library: ExperienceLibrary) -> str:
    """The library as prompt text: a header, then ``[id] lesson`` per item, best-scored first."""
    ranked = sorted(library.items, key=lambda item: (-item.score, item.id))
    return "\n".join([LIBRARY_HEADER, *(f"[{item.id}] {item.text}" for item in ranked)])


def with_library(problem: Problem, library: ExperienceLibrary) -> Problem:
    """The problem whose statement is preceded by the library (unchanged when the library is empty)."""
    if not library.items:
        return problem
    return replace(problem, prompt=f"{render_library(library)}\n\nProblem: {problem.prompt}")


def semantic_advantage_groups(graded: GradedGroups) -> list[tuple[int, list[int]]]:
    """Groups whose rewards are not all equal, each with its response positions ordered by reward, best
    first (ties: generation order). Zero-variance groups are left out (no relative information)."""
    out = []
    index, rewards = graded.group_index, graded.rewards
    for g in range(len(graded.groups)):
        values = rewards[index == g].tolist()
        if len(values) > 1 and max(values) > min(values):
            out.append((g, sorted(range(len(values)), key=lambda i: (-values[i], i))))
    return out


def best_advantage(graded: GradedGroups, group: int) -> float:
    """The group's semantic advantage score: r_best - mean(r)."""
    values = graded.rewards[graded.group_index == group].to(torch.float64)
    return float(values.max() - values.mean())


Summariser = Callable[[Sequence[Problem], Sequence[Completion], Sequence[Completion]], list[str]]


def best_response_lessons(problems: Sequence[Problem], better: Sequence[Completion], worse: Sequence[Completion]) -> list[str]:
    """The ``best_response`` summariser: each lesson is the better response's text."""
    return [c.text for c in better]


def lesson_request(problem: Problem, better: Completion, worse: Completion) -> Problem:
    """The prompt the ``policy`` summariser answers: the problem, a better and a worse response."""
    return replace(problem, prompt=(
        f"Problem: {problem.prompt}\n\nA better answer: {better.text}\n\nA worse answer: {worse.text}\n\n"
        "In one sentence, state the lesson that explains why the better answer is better."
    ))


class PolicyLessons:
    """The ``policy`` summariser: the policy itself writes each lesson (one response per group)."""

    def __init__(self, setup: RolloutSetup, summary_tokens: int):
        self.setup = setup
        self.params = SamplingParams(setup.params.temperature, setup.params.top_p, summary_tokens)

    def __call__(self, problems: Sequence[Problem], better: Sequence[Completion], worse: Sequence[Completion]) -> list[str]:
        sampler = self.setup.sampler
        prompts = sampler.encode([lesson_request(p, b, w) for p, b, w in zip(problems, better, worse)])
        groups = sampler.generate([GenerationRequest(prompt_ids=ids, n=1) for ids in prompts], self.params, self.setup.generator)
        return [group[0].text for group in groups]


SUMMARISERS = ("best_response", "policy")


@dataclass
class ExperienceLibraryOptions:
    """``rollout.experience_library``."""

    max_items: int = 8  # library capacity; 0: no library (rollout=iid exactly)
    summariser: str = "best_response"  # best_response | policy
    max_chars: int = 400  # a lesson longer than this is cut to its first max_chars characters
    summary_tokens: int = 64  # policy summariser: tokens per lesson

    def validate(self) -> None:
        if self.max_items < 0:
            raise ConfigError(f"rollout.experience_library.max_items must be >= 0, got {self.max_items}")
        if self.summariser not in SUMMARISERS:
            raise ConfigError(f"rollout.experience_library.summariser={self.summariser!r} is unknown; choose one of {list(SUMMARISERS)}")
        if self.max_chars < 1 or self.summary_tokens < 1:
            raise ConfigError("rollout.experience_library.max_chars and .summary_tokens must be >= 1")


def library_options(rollout: RolloutConfig) -> ExperienceLibraryOptions:
    options = strategy_options(rollout, "experience_library", ExperienceLibraryOptions)
    options.validate()
    return options


@register_strategy("experience_library")
class ExperienceLibraryRollout(RolloutStrategy):
    """Training-Free GRPO's rollout: the library in every prompt, updated from each step's groups."""

    def __init__(self, setup: RolloutSetup, options: ExperienceLibraryOptions):
        self.setup, self.options = setup, options
        self.summarise: Summariser = (
            best_response_lessons if options.summariser == "best_response" else PolicyLessons(setup, options.summary_tokens)
        )
        self.library = ExperienceLibrary()

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": library_options(rollout)}

    def in_context(self, problem: Problem) -> Problem:
        """The problem as the policy sees it now (the evaluation after training asks the same)."""
        return with_library(problem, self.library)

    def state_dict(self) -> dict[str, Any]:
        return self.library.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.library = ExperienceLibrary.from_state(state)

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup = self.setup
        shown = [self.in_context(p) for p in problems]
        graded = setup.sampler(shown, setup.n, setup.params, setup.generator)  # the same uids and answers
        contrasting = semantic_advantage_groups(graded)
        candidates: list[tuple[str, float]] = []
        if contrasting and self.options.max_items > 0:
            better = [graded.groups[g][order[0]] for g, order in contrasting]
            worse = [graded.groups[g][order[-1]] for g, order in contrasting]
            lessons = self.summarise([problems[g] for g, _ in contrasting], better, worse)
            candidates = [(text[: self.options.max_chars], best_advantage(graded, g)) for text, (g, _) in zip(lessons, contrasting)]
        self.library, update = self.library.updated(candidates, self.options.max_items)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item()),
                   "groups_summarised": float(len(candidates)), "library_size": float(len(self.library.items)),
                   **update.metrics()}
        return graded, metrics
