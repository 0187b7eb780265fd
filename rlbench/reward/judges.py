"""Judges: a configured call that scores responses (``reward.judge``; docs/judges.md).

A judge answers two kinds of question, each in batches:

* pairwise: ``prefer(items)`` -> P(response a is better than response b), one per (question, a, b);
* pointwise: ``flag(items)`` -> P(the response is flawed), one per (question, response, reference).

A verdict is a probability in [0, 1], or ``None`` when the call failed (an unparseable answer, the
step's time or token budget spent); the reward terms (rlbench/reward/terms.py) turn a failure into
their configured default reward and count it, never into a silent 1.

Two kinds exist:

* :class:`ScriptedJudge`: a rule (``shorter``, ``longer``, ``bare_answer``) or, in tests, any function;
  no model, for tests and CPU experiments;
* :class:`ModelJudge`: a model call through a :class:`JudgeBackend` (the rollout layer's
  ``rlbench.rollout.judge_backend.EngineJudgeBackend`` wraps the engine interface, so the HF engine
  judges on the CPU and vLLM on a GPU): a prompt template, a verdict read as the probability of the
  first label token against the second (``verdict=probability``), as the first label found in a
  greedy answer (``verdict=label``), or, pointwise, as FAPO's GenRM answers: the index of the earliest
  wrong step of the response split into steps, flawed iff not -1 (``verdict=step_index``,
  rlbench.reward.genrm), batches of ``batch_size`` prompts, a cache keyed by (judge,
  prompt text) (the prompt text holds the question and the responses), and per-step budgets.

:class:`JudgeStats` counts the calls, cache hits, failures by reason, tokens and seconds; the step
logs them (``judge_*`` metrics).
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from rlbench.reward.genrm import NO_ERROR, STEP_INDEX_TEMPLATE, parse_step_index, split_steps, step_question

# The rules a scripted judge knows, with what they prefer or flag (the schema's help lists them).
SCRIPTED_RULES = {
    "shorter": "pairwise: prefers the shorter response (characters), 0.5 on a tie",
    "longer": "pairwise: prefers the longer response, 0.5 on a tie",
    "bare_answer": "pointwise: flags a response with no working (no operator or '=' sign) as flawed",
}

Verdict = float | None
VERDICTS = ("probability", "label", "step_index")
log = logging.getLogger(__name__)


@dataclass
class PairItem:
    """One pairwise question: is ``first`` better than ``second`` as an answer to ``question``?"""

    question: str
    first: str
    second: str


@dataclass
class PointItem:
    """One pointwise question: is ``response`` to ``question`` flawed? ``reference``: the reference
    answer when the method shows it to the judge (``reward.judge.sees_reference``), else None."""

    question: str
    response: str
    reference: str | None = None


@dataclass
class JudgeStats:
    """What the judge did since the last :meth:`take`."""

    calls: int = 0
    cache_hits: int = 0
    tokens: int = 0
    seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str, count: int = 1) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + count

    def take(self) -> dict[str, float]:
        """The counts as step metrics (``judge_calls``, ``judge_cache_hits``, ``judge_tokens``,
        ``judge_s``, ``judge_failures`` and one ``judge_failures_<reason>`` per reason), reset."""
        out = {
            "judge_calls": float(self.calls),
            "judge_cache_hits": float(self.cache_hits),
            "judge_tokens": float(self.tokens),
            "judge_s": self.seconds,
            "judge_failures": float(sum(self.failures.values())),
            **{f"judge_failures_{reason}": float(n) for reason, n in self.failures.items()},
        }
        self.calls = self.cache_hits = self.tokens = 0
        self.seconds = 0.0
        self.failures = {}
        return out


class Judge:
    """The interface the reward terms call; each returns one verdict per item."""

    name = "judge"
    stats: JudgeStats

    def prefer(self, items: Sequence[PairItem]) -> list[Verdict]:
        raise NotImplementedError(f"judge {self.name} has no pairwise verdict")

    def flag(self, items: Sequence[PointItem]) -> list[Verdict]:
        raise NotImplementedError(f"judge {self.name} has no pointwise verdict")


def _by_length(first: str, second: str, shorter: bool) -> float:
    if len(first) == len(second):
        return 0.5
    return float((len(first) < len(second)) == shorter)


_WORKING = re.compile(r"[+\-*/×=]")


class ScriptedJudge(Judge):
    """A judge that follows a rule (:data:`SCRIPTED_RULES`) or given functions: ``pairwise(question, a,
    b) -> P(a better)`` (a preference matrix in tests) and ``pointwise(question, response, reference)
    -> P(flawed)``. A function may return None (a failed verdict, for the failure paths)."""

    def __init__(
        self,
        rule: str | None = None,
        pairwise: Callable[[str, str, str], Verdict] | None = None,
        pointwise: Callable[[str, str, str | None], Verdict] | None = None,
    ) -> None:
        if rule is not None and rule not in SCRIPTED_RULES:
            raise ValueError(f"scripted judge rule {rule!r} is unknown; choose one of {sorted(SCRIPTED_RULES)}")
        if rule in ("shorter", "longer"):
            pairwise = lambda q, a, b, shorter=(rule == "shorter"): _by_length(a, b, shorter)
        elif rule == "bare_answer":
            pointwise = lambda q, r, ref: 0.0 if _WORKING.search(r) else 1.0
        self.name = f"scripted:{rule or 'function'}"
        self._pairwise, self._pointwise = pairwise, pointwise
        self.stats = JudgeStats()

    def prefer(self, items: Sequence[PairItem]) -> list[Verdict]:
        if self._pairwise is None:
            return super().prefer(items)
        self.stats.calls += len(items)
        return self._count_failures([self._pairwise(i.question, i.first, i.second) for i in items])

    def flag(self, items: Sequence[PointItem]) -> list[Verdict]:
        if self._pointwise is None:
            return super().flag(items)
        self.stats.calls += len(items)
        return self._count_failures([self._pointwise(i.question, i.response, i.reference) for i in items])

    def _count_failures(self, verdicts: list[Verdict]) -> list[Verdict]:
        failed = sum(v is None for v in verdicts)
        if failed:
            self.stats.fail("unparseable", failed)
        return verdicts


class JudgeBackend(Protocol):
    """A model the judge calls (rlbench.rollout.judge_backend wraps an engine in it)."""

    def complete(self, prompts: Sequence[str], max_new_tokens: int) -> list[tuple[str, int]]:
        """Greedy answers: (text, tokens processed: prompt and answer) per prompt."""
        ...

    def label_probabilities(self, prompts: Sequence[str], labels: Sequence[str]) -> list[tuple[list[float], int]]:
        """(P(label | prompt) for each label, tokens processed) per prompt."""
        ...


PAIRWISE_TEMPLATE = (
    "Question: {question}\n\nResponse A: {first}\n\nResponse B: {second}\n\n"
    "Which response answers the question better? Answer A or B.\nAnswer:"
)
POINTWISE_TEMPLATE = (
    "Question: {question}\n\nSolution: {response}\n{reference_line}\n"
    "Is the reasoning of this solution flawed (a guess, a jump, a wrong step)? Answer yes or no.\nAnswer:"
)


def parse_label(text: str, labels: Sequence[str]) -> int | None:
    """The index of the label found first in ``text`` (whole words, case-insensitive); None when no label,
    or two labels at the same place, is found."""
    found = []
    for index, label in enumerate(labels):
        match = re.search(rf"(?<![A-Za-z0-9]){re.escape(label.strip())}(?![A-Za-z0-9])", text, re.IGNORECASE)
        if match:
            found.append((match.start(), index))
    if not found:
        return None
    found.sort()
    if len(found) > 1 and found[0][0] == found[1][0]:
        return None
    return found[0][1]


class ModelJudge(Judge):
    """A judge that asks a model (:class:`JudgeBackend`). ``verdict``: ``probability`` (P(first label) /
    (P(first) + P(second)) of the next token, Pairwise-RL's "probability of the preference token"),
    ``label`` (a greedy answer of ``max_new_tokens``, parsed by :func:`parse_label`) or, pointwise only,
    ``step_index`` (FAPO's GenRM, arXiv:2510.22543: the response cut by :func:`rlbench.reward.genrm.split_steps`,
    asked as numbered steps, a greedy answer read by :func:`~rlbench.reward.genrm.parse_step_index`; P(flawed)
    is 1 when it names a step, 0 when it says -1; an unreadable index is a failed verdict). ``pointwise_template``
    None: :data:`POINTWISE_TEMPLATE` (step_index: :data:`~rlbench.reward.genrm.STEP_INDEX_TEMPLATE`). The first of
    ``pairwise_labels`` means "the first response is better", the first of ``pointwise_labels``
    means "flawed". ``cache``: keep verdicts by (judge, prompt) for the run (off for a judge whose
    weights change: the policy itself). ``time_budget_s`` / ``token_budget``: the judge's own seconds and tokens per
    step (:meth:`new_step`); once spent, the remaining items of the step fail with reason ``budget`` (checked between batches). A call
    that raises fails its batch's items with reason ``error`` (logged once), never the run."""

    def __init__(
        self,
        backend: JudgeBackend,
        name: str = "model",
        verdict: str = "probability",
        pairwise_template: str = PAIRWISE_TEMPLATE,
        pointwise_template: str | None = None,
        pairwise_labels: Sequence[str] = ("A", "B"),
        pointwise_labels: Sequence[str] = ("yes", "no"),
        max_new_tokens: int = 8,
        batch_size: int = 16,
        cache: bool = True,
        time_budget_s: float | None = None,
        token_budget: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if verdict not in VERDICTS:
            raise ValueError(f"judge verdict {verdict!r} is unknown; choose one of {list(VERDICTS)}")
        self.backend, self.name, self.verdict = backend, name, verdict
        if pointwise_template is None:
            pointwise_template = STEP_INDEX_TEMPLATE if verdict == "step_index" else POINTWISE_TEMPLATE
        self.pairwise_template, self.pointwise_template = pairwise_template, pointwise_template
        self.pairwise_labels, self.pointwise_labels = tuple(pairwise_labels), tuple(pointwise_labels)
        self.max_new_tokens, self.batch_size = int(max_new_tokens), max(1, int(batch_size))
        self.cache: dict[tuple[str, str], float] | None = {} if cache else None
        self.time_budget_s, self.token_budget = time_budget_s, token_budget
        self.clock = clock
        self.stats = JudgeStats()
        self.warned = False
        self.new_step()

    def new_step(self) -> None:
        """Start the step's budgets (the judge's own seconds and tokens in the step)."""
        self.step_seconds, self.step_tokens = 0.0, 0

    def prefer(self, items: Sequence[PairItem]) -> list[Verdict]:
        if self.verdict == "step_index":
            raise ValueError(f"judge {self.name}: verdict=step_index asks a pointwise question only")
        prompts = [self.pairwise_template.format(question=i.question, first=i.first, second=i.second) for i in items]
        return self._ask(prompts, self.pairwise_labels)

    def flag(self, items: Sequence[PointItem]) -> list[Verdict]:
        if self.verdict == "step_index":
            steps = [split_steps(i.response) for i in items]
            prompts = [step_question(i.question, s, i.reference, self.pointwise_template) for i, s in zip(items, steps)]
            return self._ask(prompts, self.pointwise_labels, [len(s) for s in steps])
        prompts = [
            self.pointwise_template.format(
                question=i.question, response=i.response, reference=i.reference or "",
                reference_line="" if i.reference is None else f"Reference answer: {i.reference}\n",
            )
            for i in items
        ]
        return self._ask(prompts, self.pointwise_labels)

    def _spent(self) -> bool:
        over_time = self.time_budget_s is not None and self.step_seconds >= self.time_budget_s
        over_tokens = self.token_budget is not None and self.step_tokens >= self.token_budget
        return over_time or over_tokens

    def _ask(self, prompts: list[str], labels: tuple[str, ...], step_counts: list[int] | None = None) -> list[Verdict]:
        verdicts: list[Verdict] = [None] * len(prompts)
        todo = []
        for index, prompt in enumerate(prompts):
            cached = None if self.cache is None else self.cache.get((self.name, prompt))
            if cached is not None:
                verdicts[index] = cached
                self.stats.cache_hits += 1
            else:
                todo.append(index)
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start:start + self.batch_size]
            if self._spent():
                self.stats.fail("budget", len(todo) - start)
                break
            began = self.clock()
            try:
                counts = None if step_counts is None else [step_counts[i] for i in batch]
                answers = self._call([prompts[i] for i in batch], labels, counts)
            except Exception as error:  # a failed call (a prompt past the model's context, ...): counted, logged
                self._spend(self.clock() - began)
                self.stats.fail("error", len(batch))
                if not self.warned:
                    log.warning("judge %s: a call failed (%s: %s); its items get the failure reward, counted in "
                                "judge_failures_error (logged once)", self.name, type(error).__name__, error)
                    self.warned = True
                continue
            self._spend(self.clock() - began)
            self.stats.calls += len(batch)
            for index, (verdict, tokens) in zip(batch, answers):
                self.stats.tokens += tokens
                self.step_tokens += tokens
                if verdict is None:
                    self.stats.fail("unparseable")
                    continue
                verdicts[index] = verdict
                if self.cache is not None:
                    self.cache[(self.name, prompts[index])] = verdict
        return verdicts

    def _spend(self, seconds: float) -> None:
        self.stats.seconds += seconds
        self.step_seconds += seconds

    def _call(self, prompts: list[str], labels: tuple[str, ...], step_counts: list[int] | None = None) -> list[tuple[Verdict, int]]:
        if self.verdict == "step_index":
            out = []
            for (text, tokens), n_steps in zip(self.backend.complete(prompts, self.max_new_tokens), step_counts):
                index = parse_step_index(text, n_steps)
                out.append((None if index is None else float(index != NO_ERROR), tokens))
            return out
        if self.verdict == "label":
            out = []
            for text, tokens in self.backend.complete(prompts, self.max_new_tokens):
                found = parse_label(text, labels)
                out.append((None if found is None else float(found == 0), tokens))
            return out
        out = []
        for probabilities, tokens in self.backend.label_probabilities(prompts, labels):
            first, second = probabilities[0], probabilities[1]
            total = first + second
            ok = math.isfinite(total) and total > 0  # NaN or both zero: no verdict
            out.append((first / total if ok else None, tokens))
        return out
