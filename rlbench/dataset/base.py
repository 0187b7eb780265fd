"""The record every dataset and benchmark loader produces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

from rlbench.config.schema import DatasetConfig


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



def spec_value(spec: Mapping[str, Any], key: str) -> Any:
    """``spec[key]`` of a dataset or benchmark spec, or the schema's default where the spec leaves the key out
    (declared once, on rlbench.config.schema.DatasetConfig)."""
    if key in spec:
        return spec[key]
    default = DatasetConfig.__dataclass_fields__[key]
    return default.default_factory() if default.default is MISSING else default.default
