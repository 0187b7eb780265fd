"""Post-rollout edits (``rollout=edit_injection``; EditGRPO, Zhang et al. 2025, "EditGRPO: Reinforcement
Learning with Post-Rollout Edits for Clinically Accurate Chest X-Ray Report Generation", arXiv:2509.22812):
the policy samples ``rollout.n`` responses per prompt; in each group whose prompt has a guidance trace
(``guidance=<source>``), up to ``edits_per_group`` responses graded wrong are edited: their first wrong
step is replaced by the aligned step of the reference (the trace) and the reference's remainder follows.
The response's own tokens before that step stay on-policy (their sampling log-probs); the reference's
tokens are off-policy (``off_policy`` 1) with behaviour log-prob 0 (mu = 1, LUFFY's assumption for a
trace), so ``loss=policy_shaping`` trains them with the shaped term -A f(pi), f(pi) = pi / (pi + gamma).
The edited response replaces the wrong one in its group and the group is graded again.

The paper edits radiology reports sentence by sentence with a clinical-entity matcher; rlbench's step
checkers (``checker``, :data:`CHECKERS`) are simple rules:

``numbers``      (arith, GSM8K, MATH) steps are sentences (a token holding a newline, or a token ending
                 in ``.``, ``!`` or ``?`` followed by a space, ends one); a step is wrong when it states
                 a number that neither the problem nor the reference solution contains. The aligned
                 reference step of the response's step k is the reference's step k (its last one when
                 the reference has fewer steps).
``even_tokens``  (the toy task, reward=even_tokens) every token is a step, wrong when its id is odd:
                 the toy reward's own per-token verdict.

A wrong response in which the checker finds no wrong step (e.g. a right derivation without a final
answer) keeps its steps and gets the reference's steps after them. An edit longer than
``rollout.max_new_tokens`` is cut there. With an empty guidance source nothing is edited and the
groups are ``rollout=iid``'s exactly.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.guidance.traces import Trace
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)

CHECKERS = ("numbers", "even_tokens")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numbers_in(text: str) -> set[str]:
    """The numbers written in ``text`` (thousands commas dropped, ``12.0`` read as ``12``)."""
    found = set()
    for raw in NUMBER.findall(text.replace(",", "")):
        value = float(raw)
        found.add(str(int(value)) if value == int(value) else repr(value))
    return found


def sentence_spans(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Token spans [start, end) of the sentences of a response whose tokens decode to ``pieces``."""
    spans, start = [], 0
    for i, piece in enumerate(pieces):
        following = pieces[i + 1] if i + 1 < len(pieces) else " "
        ends = "\n" in piece or (piece.rstrip()[-1:] in (".", "!", "?") and (piece[-1:].isspace() or following[:1].isspace()))
        if ends:
            spans.append((start, i + 1))
            start = i + 1
    if start < len(pieces):
        spans.append((start, len(pieces)))
    return spans


def step_spans(ids: Sequence[int], checker: str, tokenizer: Any) -> list[tuple[int, int]]:
    """The steps of a token sequence under ``checker`` (module docstring), as token spans."""
    if checker == "even_tokens":
        return [(i, i + 1) for i in range(len(ids))]
    return sentence_spans([tokenizer.decode([t]) for t in ids])


def first_wrong_step(
    ids: Sequence[int], spans: Sequence[tuple[int, int]], checker: str, tokenizer: Any, allowed: set[str]
) -> int:
    """The index of the first wrong step (``len(spans)`` when none is wrong); ``allowed``: the numbers
    of the problem and its reference (``numbers`` checker)."""
    for k, (start, end) in enumerate(spans):
        if checker == "even_tokens":
            wrong = ids[start] % 2 == 1
        else:
            wrong = not numbers_in(tokenizer.decode(list(ids[start:end]))) <= allowed
        if wrong:
            return k
    return len(spans)


def edited_response(
    completion: Completion, trace: Trace, problem: Problem, checker: str, tokenizer: Any, max_tokens: int
) -> Completion:
    """``completion`` with its first wrong step replaced by the aligned step of ``trace`` and the
    trace's remainder after it (module docstring): the kept tokens on-policy with their sampling
    log-probs, the trace's off-policy with behaviour log-prob 0, labelled ``edited``."""
    ids, reference = list(completion.response_ids), list(trace.token_ids)
    if ids and ids[-1] == getattr(tokenizer, "eos_token_id", None):  # the steps are the text before the EOS
        ids = ids[:-1]
    spans = step_spans(ids, checker, tokenizer)
    ref_spans = step_spans(reference, checker, tokenizer)
    allowed = numbers_in(problem.prompt) | numbers_in(tokenizer.decode(reference)) if checker == "numbers" else set()
    k = first_wrong_step(ids, spans, checker, tokenizer, allowed)
    if k < len(spans):  # replace step k by the aligned reference step, then the reference's remainder
        keep, tail_start = spans[k][0], ref_spans[min(k, len(ref_spans) - 1)][0]
    else:  # no wrong step: keep them all (not the EOS), then the reference's steps after the aligned one
        keep, tail_start = len(ids), ref_spans[min(k, len(ref_spans)) - 1][1] if k else 0
    remainder = reference[tail_start:]
    tail = remainder[: max(max_tokens - keep, 0)]
    response, own = ids[:keep] + tail, list(completion.logprobs[:keep])
    return replace(
        completion,
        response_ids=response,
        logprobs=own + [0.0] * len(tail),
        finished=(trace.finished and len(tail) == len(remainder)) if tail else False,
        text=tokenizer.decode(response),
        prefix_len=0,
        behaviour="edited",
        off_policy=[0] * keep + [1] * len(tail),
        behaviour_logprobs=own + [0.0] * len(tail),
    )


@dataclass(frozen=True)
class EditInjectionOptions:
    """The ``rollout.edit_injection`` block."""

    edits_per_group: int = 1  # wrong responses edited per group (the first ones graded wrong)
    checker: str = "numbers"  # numbers | even_tokens (the toy's rule): which sentence is wrong


def options(rollout: RolloutConfig) -> dict:
    settings = dataclasses.asdict(strategy_options(rollout, "edit_injection", EditInjectionOptions))
    n = int(rollout.n)
    if not 1 <= settings["edits_per_group"] <= n:
        raise ConfigError(f"rollout.edit_injection.edits_per_group={settings['edits_per_group']} must lie in 1..rollout.n={n}")
    if settings["checker"] not in CHECKERS:
        raise ConfigError(f"rollout.edit_injection.checker={settings['checker']!r} is unknown; choose one of {list(CHECKERS)}")
    return settings


@register_strategy("edit_injection")
class EditInjection(RolloutStrategy):
    def __init__(self, setup: RolloutSetup, edits_per_group: int, checker: str):
        self.setup, self.edits_per_group, self.checker = setup, edits_per_group, checker

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        return options(rollout)

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        graded = setup.sample(problems)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item())}  # the policy's own samples, before edits
        library = setup.guidance
        groups, edited, row = [], 0, 0
        for problem, group in zip(problems, graded.groups):
            traces = library.for_problem(problem) if library is not None else []
            budget = self.edits_per_group if traces else 0
            new_group = []
            for completion in group:
                if budget and not graded.grades[row].correct:
                    completion = edited_response(completion, traces[0], problem, self.checker, sampler.tokenizer, setup.params.max_new_tokens)
                    budget -= 1
                    edited += 1
                new_group.append(completion)
                row += 1
            groups.append(new_group)
        if edited:
            graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        flat = [c for group in graded.groups for c in group]
        metrics["edited_responses"] = float(edited)
        metrics["edited_correct"] = float(sum(bool(g.correct) for g, c in zip(graded.grades, flat) if c.behaviour == "edited"))
        return graded, metrics


