"""FAPO's generative reward model (GenRM): the step-index question and the reward that trains it (Ding et al. 2025,
"FAPO: Flawed-Aware Policy Optimization for Efficient and Reliable Reasoning", arXiv:2510.22543, the GenRM and
its step-wise RL reward; docs/judges.md).

The GenRM reads a problem and a solution split into numbered steps (``Step 1: ...``) and answers the number of
the earliest wrong step, or -1 when every step is right. Steps are numbered from 1.

* :func:`split_steps` cuts a free-form response into steps: its non-empty lines, or, for a one-line response,
  its sentences (a cut after ``.``, ``!`` or ``?`` followed by white space); a ``Step i:`` prefix already there
  is dropped, so a step-numbered response keeps its own steps.
* :func:`step_question` is the question the GenRM is asked (:data:`STEP_INDEX_TEMPLATE`): the training problems
  of ``dataset=flaw_steps`` are this text, and the judge's ``verdict=step_index`` asks the same text.
* :func:`parse_step_index` reads the answer: the content of the last ``\\boxed{}`` when the answer has one (it
  must be an integer), else the last integer in the text (``-1`` included); an index outside ``{-1, 1..n}``
  is no answer.
* :func:`genrm_reward` is the GenRM's RL reward (partial credit by step distance); :class:`GenRMReward` is the
  grader of ``reward=fapo_genrm`` (it reads the label from the problem's answer, ``n`` from
  ``meta["n_steps"]``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rlbench.reward.math import Grade, extract_answer

STEP_INDEX_TEMPLATE = (
    "Problem: {question}\n\nSolution:\n{steps}\n{reference_line}\n"
    "Which step is the earliest wrong one? Answer with its number in \\boxed{{}}, or \\boxed{{-1}} if every step "
    "is correct."
)
NO_ERROR = -1

_STEP_PREFIX = re.compile(r"^\s*step\s*\d+\s*[:.)]\s*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_INTEGER = re.compile(r"(?<![\d.])-?\d+(?![\d.])")


def split_steps(text: str) -> list[str]:
    """The steps of a solution: its non-empty lines, or the sentences of a one-line text; a leading
    ``Step i:`` of each is dropped. An empty text has no steps."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) == 1:
        lines = [s.strip() for s in _SENTENCE_END.split(lines[0]) if s.strip()]
    return [_STEP_PREFIX.sub("", line) or line for line in lines]


def number_steps(steps: Sequence[str]) -> str:
    """``Step 1: ...`` one a line."""
    return "\n".join(f"Step {i}: {step}" for i, step in enumerate(steps, start=1))


def step_question(question: str, steps: Sequence[str], reference: str | None = None,
                  template: str = STEP_INDEX_TEMPLATE) -> str:
    """The GenRM's prompt for ``steps`` of a solution to ``question`` (``template``'s fields: ``{question}``,
    ``{steps}`` numbered, ``{response}`` the steps unnumbered one a line, ``{reference_line}``)."""
    return template.format(question=question, steps=number_steps(steps), response="\n".join(steps),
                           reference="" if reference is None else reference,
                           reference_line="" if reference is None else f"Reference answer: {reference}\n")


def parse_step_index(text: str, n_steps: int) -> int | None:
    """The step index an answer gives: its last ``\\boxed{}``'s content (an integer) when it has one, else
    its last integer; None when there is none or it is outside ``{-1, 1, ..., n_steps}``."""
    boxed = extract_answer(text, "boxed")
    if boxed is not None:
        found = re.fullmatch(r"\s*(-?\d+)\s*", boxed)
        value = int(found.group(1)) if found else None
    else:
        numbers = _INTEGER.findall(text)
        value = int(numbers[-1]) if numbers else None
    if value is None or not (value == NO_ERROR or 1 <= value <= n_steps):
        return None
    return value


def genrm_reward(predicted: int | None, label: int, n_steps: int) -> float:
    """FAPO's GenRM reward (arXiv:2510.22543), ``R = R_outcome + R_process``, for a solution of ``n_steps``
    steps whose earliest wrong step is ``label`` (-1: sound) and an answer ``predicted`` (None: unparseable):
    ``R_outcome`` is +1 when the answer's flawed / sound verdict is right, else -1; ``R_process`` is
    ``-|predicted - k| / n`` when both say flawed, else 0. So

        sound   (label = -1):  R = +1 if predicted = -1, else -1
        flawed  (label = k):   R = 1 - |predicted - k| / n   if predicted flags a step,  -1 if predicted = -1
        no valid answer:       R = -1
    """
    if predicted is None:
        return -1.0
    if label == NO_ERROR:
        return 1.0 if predicted == NO_ERROR else -1.0
    if predicted == NO_ERROR:
        return -1.0
    return 1.0 - abs(predicted - label) / n_steps


class GenRMReward:
    """The grader of ``reward=fapo_genrm`` on ``dataset=flaw_steps``: the answer read by
    :func:`parse_step_index`, rewarded by :func:`genrm_reward`; ``correct`` when it names the label exactly,
    ``format_ok`` when it was read. A problem's label is its ``answer``, its step count ``meta["n_steps"]``."""

    correct_reward, incorrect_reward = 1.0, -1.0

    def grade_many(self, completions: Sequence[str], problems: Sequence[Any]) -> list[Grade]:
        return [self.grade(text, problem) for text, problem in zip(completions, problems)]

    @staticmethod
    def grade(text: str, problem: Any) -> Grade:
        label, n_steps = int(problem.answer), int(problem.meta["n_steps"])
        predicted = parse_step_index(text, n_steps)
        return Grade(correct=predicted == label, extracted=None if predicted is None else str(predicted),
                     reward=genrm_reward(predicted, label, n_steps), format_ok=predicted is not None)
