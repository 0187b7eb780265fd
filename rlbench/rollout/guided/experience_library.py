"""``rollout=experience_library``: Training-Free GRPO (Cai et al. 2025, "Training-Free Group Relative
Policy Optimization", arXiv:2510.08191). No weight changes: an experience library is put in every
prompt, and after each step it is updated from the groups' *semantic* advantages.

Per step:

    prompts  <- each problem preceded by the library (rendered by :func:`render_library`)
    groups   <- rollout.n responses per prompt, graded (the run's GroupSampler)
    lessons  <- for every group whose rewards are not all equal: the summariser's lessons, scored by the
                best response's advantage r_best - mean(r)
    library  <- add / modify / delete / keep (pure functions), ids stable

The lessons come from a summariser (``summariser``):

``contrast``       the paper's (section 3, the default), in two steps: per group, the policy summarises
                   each rollout (``summary_tokens``), then, shown the summaries with their rewards, extracts
                   the group's lessons (``lesson_tokens``); then ONE call per batch shows it the library with
                   its ids and all the groups' lessons, and it answers with operations ``add "text"`` /
                   ``modify <id> "text"`` / ``delete <id>`` / ``keep`` (``operation_tokens``), applied by
                   :meth:`ExperienceLibrary.applied`; a line that is no operation, an unknown id or an empty
                   text is skipped and counted (``library_invalid_ops``). Every call uses the run's engine
                   and sampling.
``best_response``  the lesson is the group's best response itself, an in-context example of what
                   scored higher (no LLM call), under the fixed rule :meth:`ExperienceLibrary.updated`
``policy``         the policy writes one lesson from the better and the worse response (``summary_tokens``
                   tokens), under the same fixed rule

Groups whose rewards are all equal carry no relative information and are skipped, as in the paper.
The algorithm preset ``training_free_grpo`` takes no optimizer step (``algorithm.update.schedule=none``);
the evaluation after training sees the library in its prompts too (:meth:`ExperienceLibraryRollout.in_context`).
With ``max_items: 0`` the library stays empty and the strategy is ``rollout=iid`` exactly.
"""

from __future__ import annotations

import re
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
    invalid: int = 0  # contrast summariser: operations skipped (unparseable, unknown id, empty text)

    def metrics(self) -> dict[str, float]:
        return {"library_added": float(len(self.added)), "library_modified": float(len(self.modified)),
                "library_deleted": float(len(self.deleted)), "library_rejected": float(self.rejected),
                "library_invalid_ops": float(self.invalid)}


@dataclass(frozen=True)
class LibraryOp:
    """One library operation the model proposed (``contrast`` summariser): ``add`` (text), ``modify``
    (id, text), ``delete`` (id) or ``keep``."""

    kind: str
    id: int | None = None
    text: str = ""


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
        next_id = self.next_id
        by_text = {item.text: item.id for item in self.items}
        for text, score in candidates:
            text = text.strip()
            if not text:
                continue
            if text in by_text:
                key = by_text[text]
                items[key] = replace(items[key], score=max(items[key].score, float(score)))
                continue
            items[next_id] = Experience(next_id, text, float(score))
            by_text[text], next_id = next_id, next_id + 1
        return self._settled(items, next_id, max_items)

    def applied(self, operations: Sequence[LibraryOp], score: float, max_items: int,
                invalid: int = 0) -> tuple["ExperienceLibrary", LibraryUpdate]:
        """The library after the model's ``operations`` (in order), each lesson scored ``score``:

        * ``add "text"`` adds an item with the next id (ids are never reused, a deleted one included);
        * ``modify id "text"`` replaces the item's text, score <- max(score, the item's);
        * ``delete id`` removes the item; ``keep`` changes nothing;
        * an operation on an id the library does not hold (never held, or deleted) or with an empty text
          is skipped and counted in ``invalid`` (which starts at ``invalid``: the unparseable lines);
        * past ``max_items`` the lowest-scored item goes, as in :meth:`updated`.
        """
        items = {item.id: item for item in self.items}
        next_id = self.next_id
        for op in operations:
            text = op.text.strip()
            if op.kind == "keep":
                continue
            if op.kind not in ("add", "modify", "delete") or (op.kind != "delete" and not text) or (
                    op.kind != "add" and op.id not in items):
                invalid += 1
            elif op.kind == "add":
                items[next_id], next_id = Experience(next_id, text, float(score)), next_id + 1
            elif op.kind == "modify":
                items[op.id] = Experience(op.id, text, max(items[op.id].score, float(score)))
            else:
                del items[op.id]
        return self._settled(items, next_id, max_items, invalid)

    def _settled(self, items: dict[int, Experience], next_id: int, max_items: int,
                 invalid: int = 0) -> tuple["ExperienceLibrary", LibraryUpdate]:
        """The new library (the lowest-scored items past ``max_items`` removed; a tie: the oldest) and
        what changed against this one: an old item is modified when its text or score changed, and an item
        added and removed in the same update is rejected."""
        removed = sorted(items.values(), key=lambda item: (item.score, item.id))[: max(len(items) - max_items, 0)]
        for item in removed:
            del items[item.id]
        old = {item.id: item for item in self.items}
        old_ids = list(old)
        modified = {i for i in old_ids if i in items and items[i] != old[i]}
        new_ids = range(self.next_id, next_id)
        update = LibraryUpdate(
            added=tuple(i for i in new_ids if i in items),
            modified=tuple(sorted(i for i in modified if i in items)),
            deleted=tuple(i for i in old_ids if i not in items),
            kept=tuple(i for i in old_ids if i in items and i not in modified),
            rejected=sum(1 for i in new_ids if i not in items),
            invalid=invalid,
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


def policy_answers(setup: RolloutSetup, prompts: Sequence[Problem], params: SamplingParams) -> list[str]:
    """The policy's one answer to each prompt, through the run's sampler (its cost is counted)."""
    ids = setup.sampler.encode(list(prompts))
    groups = setup.sampler.generate([GenerationRequest(prompt_ids=i, n=1) for i in ids], params, setup.generator)
    return [group[0].text for group in groups]


class PolicyLessons:
    """The ``policy`` summariser: the policy itself writes each lesson (one response per group)."""

    def __init__(self, setup: RolloutSetup, summary_tokens: int):
        self.setup = setup
        self.params = SamplingParams(setup.params.temperature, setup.params.top_p, summary_tokens)

    def __call__(self, problems: Sequence[Problem], better: Sequence[Completion], worse: Sequence[Completion]) -> list[str]:
        return policy_answers(self.setup, [lesson_request(p, b, w) for p, b, w in zip(problems, better, worse)], self.params)


OPERATION_FORMAT = 'add "<lesson>"\nmodify <id> "<lesson>"\ndelete <id>\nkeep'
_OPERATIONS = (
    (re.compile(r'add\s+"(.*)"', re.IGNORECASE), lambda m: LibraryOp("add", None, m.group(1))),
    (re.compile(r'modify\s+\[?(\d+)\]?\s+"(.*)"', re.IGNORECASE), lambda m: LibraryOp("modify", int(m.group(1)), m.group(2))),
    (re.compile(r"delete\s+\[?(\d+)\]?", re.IGNORECASE), lambda m: LibraryOp("delete", int(m.group(1)))),
    (re.compile(r"keep", re.IGNORECASE), lambda m: LibraryOp("keep")),
)


def parse_operations(text: str) -> tuple[list[LibraryOp], int]:
    """The library operations in the model's answer, one per non-empty line, in the strict format
    :data:`OPERATION_FORMAT` (an id may be written ``[3]``, as the library shows it), and the number of
    non-empty lines that are no operation (skipped, never an error)."""
    ops, unparsed = [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        for pattern, make in _OPERATIONS:
            if (m := pattern.fullmatch(line)) is not None:
                ops.append(make(m))
                break
        else:
            unparsed += 1
    return ops, unparsed


def summary_request(problem: Problem, response: Completion) -> Problem:
    """Step (1) of the ``contrast`` summariser: the prompt asking the policy to summarise one rollout."""
    return replace(problem, prompt=(
        f"Problem: {problem.prompt}\n\nAn attempt: {response.text}\n\n"
        "In one or two sentences, summarise the approach this attempt took and where it went right or wrong."
    ))


def extraction_request(problem: Problem, summaries: Sequence[str], rewards: Sequence[float]) -> Problem:
    """Step (2) of the ``contrast`` summariser, one call per group: the group's summaries with their rewards
    (a success: above the group's mean reward, else a failure); the model compares the successes with the
    failures and answers with the group's lessons (its semantic advantage), one per line."""
    mean = sum(rewards) / len(rewards)
    attempts = "\n".join(
        f"Attempt {i + 1} (reward {r:g}, {'success' if r > mean else 'failure'}): {text.strip()}"
        for i, (text, r) in enumerate(zip(summaries, rewards)))
    return replace(problem, prompt=(
        f"Problem: {problem.prompt}\n\nSummaries of attempts at it:\n{attempts}\n\n"
        "Compare the successful attempts with the failed ones and state the general lessons that explain the "
        "difference, one per line, each under 32 words, and nothing else."
    ))


_LIST_MARK = re.compile(r"^(?:[-*\u2022]|\d+[.)])\s*")


def parse_lessons(text: str, max_chars: int) -> list[str]:
    """The lessons in an extraction answer: one per non-empty line, a list mark (``-``, ``*``, ``1.``,
    ``1)``) stripped, each cut to ``max_chars`` characters."""
    lessons = (_LIST_MARK.sub("", line.strip()).strip() for line in text.splitlines())
    return [lesson[:max_chars] for lesson in lessons if lesson]


UPDATE_UID = "experience_library/update"


def update_request(library: ExperienceLibrary, lessons: Sequence[Sequence[str]]) -> Problem:
    """Step (3) of the ``contrast`` summariser, one call per batch: the current library with its ids and
    the lessons of every summarised group of the batch; the model reconciles them with the library and
    answers with operations in :data:`OPERATION_FORMAT`."""
    shown = render_library(library) if library.items else f"{LIBRARY_HEADER}\n(none yet)"
    groups = "\n".join(f"Group {i + 1}:\n" + "\n".join(f"- {lesson}" for lesson in group)
                       for i, group in enumerate(lessons) if group)
    return Problem(UPDATE_UID, (
        f"{shown}\n\nNew lessons from this batch of problems:\n{groups}\n\n"
        "Update the experiences with these lessons: add a new general lesson, modify an experience to refine it "
        "or to merge a lesson into it, delete an experience that is wrong or redundant, or keep them. Answer with "
        "operations, one per line, exactly in this format, and nothing else:\n" + OPERATION_FORMAT
    ), "")


class ContrastLessons:
    """The ``contrast`` summariser, Training-Free GRPO's semantic advantage and library update
    (arXiv:2510.08191, section 3), for the groups whose rewards differ:

    1. the policy summarises each of their rollouts (``summary_tokens``);
    2. one call per group: given the group's summaries with their rewards, the policy extracts the group's
       lessons (``lesson_tokens``; :func:`parse_lessons`);
    3. one call per batch: given the library with its ids and all the groups' lessons, the policy answers
       with operations (``operation_tokens``; :func:`parse_operations`), applied in order with stable ids
       by :meth:`ExperienceLibrary.applied`, each lesson scored by the batch's best semantic advantage
       max_g (r_best - mean(r)). No lesson at all: no update call, the library unchanged.

    Every call goes through the run's sampler with the run's sampling (temperature, top_p), one response
    per prompt. Returns the new library, what changed and the number of lessons."""

    def __init__(self, setup: RolloutSetup, summary_tokens: int, lesson_tokens: int, operation_tokens: int,
                 max_chars: int):
        self.setup, self.max_chars = setup, max_chars
        self.summary_params = SamplingParams(setup.params.temperature, setup.params.top_p, summary_tokens)
        self.lesson_params = SamplingParams(setup.params.temperature, setup.params.top_p, lesson_tokens)
        self.operation_params = SamplingParams(setup.params.temperature, setup.params.top_p, operation_tokens)

    def __call__(self, library: ExperienceLibrary, problems: Sequence[Problem], graded: GradedGroups,
                 contrasting: Sequence[tuple[int, list[int]]],
                 max_items: int) -> tuple[ExperienceLibrary, LibraryUpdate, int]:
        responses = [(g, c) for g, _ in contrasting for c in graded.groups[g]]
        summaries = policy_answers(self.setup, [summary_request(problems[g], c) for g, c in responses], self.summary_params)
        requests, start = [], 0
        for g, _ in contrasting:
            size = len(graded.groups[g])
            rewards = graded.rewards[graded.group_index == g].tolist()
            requests.append(extraction_request(problems[g], summaries[start:start + size], rewards))
            start += size
        lessons = [parse_lessons(a, self.max_chars) for a in policy_answers(self.setup, requests, self.lesson_params)]
        count = sum(len(group) for group in lessons)
        if count == 0:
            return library.applied([], 0.0, max_items) + (0,)
        answer = policy_answers(self.setup, [update_request(library, lessons)], self.operation_params)[0]
        ops, unparsed = parse_operations(answer)
        score = max(best_advantage(graded, g) for g, _ in contrasting)
        new, update = library.applied([replace(op, text=op.text[: self.max_chars]) for op in ops], score, max_items, unparsed)
        return new, update, count


SUMMARISERS = ("best_response", "policy", "contrast")


@dataclass
class ExperienceLibraryOptions:
    """``rollout.experience_library``."""

    max_items: int = 8  # library capacity; 0: no library (rollout=iid exactly)
    summariser: str = "contrast"  # contrast (the paper's) | best_response | policy
    max_chars: int = 400  # a lesson longer than this is cut to its first max_chars characters
    summary_tokens: int = 64  # policy summariser: tokens per lesson; contrast: tokens per rollout summary
    lesson_tokens: int = 96  # contrast summariser: tokens for a group's lessons
    operation_tokens: int = 256  # contrast summariser: tokens for the batch's library operations

    def validate(self) -> None:
        if self.max_items < 0:
            raise ConfigError(f"rollout.experience_library.max_items must be >= 0, got {self.max_items}")
        if self.summariser not in SUMMARISERS:
            raise ConfigError(f"rollout.experience_library.summariser={self.summariser!r} is unknown; choose one of {list(SUMMARISERS)}")
        if min(self.max_chars, self.summary_tokens, self.lesson_tokens, self.operation_tokens) < 1:
            raise ConfigError("rollout.experience_library.max_chars, .summary_tokens, .lesson_tokens and .operation_tokens must be >= 1")


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
        self.contrast = ContrastLessons(setup, options.summary_tokens, options.lesson_tokens, options.operation_tokens,
                                        options.max_chars)  # summariser=contrast
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
        if self.options.max_items == 0:
            contrasting = []
        lessons = 0
        if contrasting and self.options.summariser == "contrast":
            self.library, update, lessons = self.contrast(self.library, problems, graded, contrasting, self.options.max_items)
        else:
            candidates: list[tuple[str, float]] = []
            if contrasting:
                better = [graded.groups[g][order[0]] for g, order in contrasting]
                worse = [graded.groups[g][order[-1]] for g, order in contrasting]
                texts = self.summarise([problems[g] for g, _ in contrasting], better, worse)
                candidates = [(text[: self.options.max_chars], best_advantage(graded, g)) for text, (g, _) in zip(texts, contrasting)]
                lessons = len(candidates)
            self.library, update = self.library.updated(candidates, self.options.max_items)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item()),
                   "groups_summarised": float(len(contrasting)), "library_lessons": float(lessons),
                   "library_size": float(len(self.library.items)),
                   **update.metrics()}
        return graded, metrics
