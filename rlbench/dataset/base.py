"""The record every dataset and benchmark loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    uid:     stable identifier, unique within a dataset split (e.g. ``"gsm8k/test/17"``).
    prompt:  the problem statement, before any chat template or instruction is added.
    answer:  the reference answer as a string (already extracted: ``"18"``, ``"\\frac{1}{2}"``).
    meta:    extra fields kept for analysis (difficulty level, subject, ...).
    """

    uid: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class ProblemList(list):
    """The problems of one split (a list), with ``skipped``: how many source records were left out
    (``skip_bad_answers``), so that the count can be reported beside the scores."""

    def __init__(self, problems=(), skipped: int = 0) -> None:
        super().__init__(problems)
        self.skipped = int(skipped)
