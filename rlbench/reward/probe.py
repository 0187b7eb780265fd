"""The grader's probe battery: every reference answer of a benchmark, rendered several ways (each
must be accepted), and the canonical wrong answers (each must be rejected unless it equals the
reference).

Renderings of a reference ``r``: ``r`` itself, inside a full completion ending in ``\\boxed{r}``
(extraction included), ``$r$``, and for numbers the plain forms (``1234`` and ``1,234``, ``p/q``,
``\\frac{p}{q}``, a 12-digit decimal) and the value followed by a unit (``r cm``, ``r \\text{ cm}``);
a reference that carries a unit (``864 \\mbox{ inches}^2``) is also accepted without it.

Wrong answers: ``0``, ``1``, ``-1``, ``2``, the negation and twice the value (``-(r)`` and ``2(r)``
for an expression), and, when the reference is a number times a factor that is not a unit
(``3\\sqrt{13}``, ``288 \\pi``, ``5r^5``, ``\\frac{37}{4} m``), the number with the factor dropped.
A wrong answer that equals the reference (``0`` for a reference of zero; ``-1`` when the negation of
``1``) is not asked. Whether a symbolic reference is a constant equal to a small integer
(``\\sqrt{4}``) is decided by sympy through math-verify's LaTeX parser, in this process (references
are trusted input).

``bench/grader_probe.py`` writes the per-benchmark acceptance table; ``tests/test_grader_probe.py``
runs the battery (a fixed subset in the unit tier, everything in the slow tier).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from rlbench.reward.math import _to_fraction, _value_and_unit

__all__ = ["BATTERY_SOURCES", "BatteryResult", "Probe", "battery_problems", "probes_for", "run_battery"]

#: the benchmarks of the battery: name -> (spec file under conf/, split)
BATTERY_SOURCES = {
    "math500": ("benchmark/math500.yaml", "test"),
    "gsm8k": ("benchmark/gsm8k.yaml", "test"),
    "aime24": ("benchmark/aime24.yaml", "test"),
    "amc23": ("benchmark/amc23.yaml", "test"),
    "math_train": ("dataset/math.yaml", "train"),
}

# a number times a factor that is not a unit: "3\sqrt{13}", "288 \pi", "5r^5"
_NUMBER_TIMES_FACTOR_RE = re.compile(r"^(-?\d+(?:\.\d+)?|-?\\frac\{\d+\}\{\d+\})\s*((?:\\[A-Za-z]+|[A-Za-z]).*)$")
# references that are not one expression (negating or doubling them means nothing)
_COMPOUND_RE = re.compile(r",|=|\\text|\\mbox|\\in\b|\\cup|\\cap|\\pm|\\mp|matrix|\\le|\\ge|<|>|\\infty|\\approx|\\(?:emptyset|varnothing)")


@dataclass(frozen=True)
class Probe:
    """One answer put to the grader: ``kind`` ``rendering`` (must be accepted) or ``wrong`` (must
    be rejected); ``name`` says which rendering or wrong answer it is."""

    kind: str
    name: str
    text: str
    completion: bool = False  # True: ``text`` is a whole model response (extraction runs)


def _number_text(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


@lru_cache(maxsize=None)
def _constant_value(ref: str) -> float | None:
    """The value of a symbolic constant reference (``\\sqrt{4}`` -> 2.0); None for anything else."""
    from rlbench.reward.symbolic import _parse

    try:
        parsed = _parse(ref)
        if not parsed or not getattr(parsed[0], "is_number", False):
            return None
        value = complex(parsed[0].evalf(30))
    except Exception:  # noqa: BLE001 - not a constant sympy can evaluate
        return None
    return value.real if abs(value.imag) < 1e-12 else None


def probes_for(ref: str, answer_type: str = "math") -> list[Probe]:
    """The renderings and wrong answers of one reference (module docstring)."""
    norm, unit = _value_and_unit(ref, answer_type)
    value = _to_fraction(norm)
    out = [
        Probe("rendering", "as_is", ref),
        Probe("rendering", "boxed_completion", f"We work it out step by step.\nThe answer is $\\boxed{{{ref}}}$.", True),
        Probe("rendering", "dollars", f"${ref}$"),
    ]
    labelled = value is not None and re.search(r"\\(?:text|mbox|mathrm)\s*\{", ref) and _to_fraction(ref) is None
    if unit or labelled:  # "864 \mbox{ inches}^2": the label is dropped by the normaliser
        out.append(Probe("rendering", "unit_dropped", norm))
    if value is not None:
        out.append(Probe("rendering", "plain", str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"))
        out.append(Probe("rendering", "latex", _number_text(value)))
        if value.denominator == 1 and abs(value) >= 1000:
            out.append(Probe("rendering", "thousands", f"{value.numerator:,}"))
        if value.denominator != 1:
            out.append(Probe("rendering", "decimal", format(float(value), ".12g")))
        if not unit:
            out.append(Probe("rendering", "unit_word", f"{norm} cm"))
            out.append(Probe("rendering", "unit_text", f"{norm} \\text{{ cm}}"))
    wrong: list[tuple[str, str, Fraction | None]] = [
        ("zero", "0", Fraction(0)), ("one", "1", Fraction(1)), ("minus_one", "-1", Fraction(-1)), ("two", "2", Fraction(2)),
    ]
    if value is not None:
        wrong += [("negation", _number_text(-value), -value), ("twice", _number_text(2 * value), 2 * value)]
    elif answer_type in ("math", "number", "expression") and not _COMPOUND_RE.search(norm):
        wrong += [("negation", f"-\\left({norm}\\right)", None), ("twice", f"2\\left({norm}\\right)", None)]
    factor = _NUMBER_TIMES_FACTOR_RE.match(norm) if value is None else None
    if factor and not _COMPOUND_RE.search(norm):
        wrong.append(("factor_dropped", factor.group(1), _to_fraction(factor.group(1))))
    for name, text, wrong_value in wrong:
        if value is not None and wrong_value is not None:
            if wrong_value == value:
                continue
        elif value is None and wrong_value is not None and name != "factor_dropped":
            constant = _constant_value(norm)
            if constant is not None and abs(constant - float(wrong_value)) <= 1e-9 * max(1.0, abs(constant)):
                continue
            if constant is not None and constant == 0 and name in ("negation", "twice"):
                continue
        out.append(Probe("wrong", name, text))
    return out


@dataclass
class BatteryResult:
    """Counts of one benchmark's battery; ``failures`` lists (reference, probe name, answer, verdict)."""

    benchmark: str
    references: int = 0
    renderings: int = 0
    renderings_accepted: int = 0
    wrong: int = 0
    wrong_rejected: int = 0
    seconds: float = 0.0
    failures: list[tuple[str, str, str, bool]] = field(default_factory=list)
    verdicts: list[tuple[str, str, str, bool, bool]] = field(default_factory=list)  # ref, probe, answer, expected, got

    def row(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "references": self.references,
            "renderings": self.renderings,
            "renderings_accepted": self.renderings_accepted,
            "acceptance_rate": self.renderings_accepted / self.renderings if self.renderings else float("nan"),
            "wrong_answers": self.wrong,
            "wrong_rejected": self.wrong_rejected,
            "rejection_rate": self.wrong_rejected / self.wrong if self.wrong else float("nan"),
            "false_accepts": self.wrong - self.wrong_rejected,
            "false_rejects": self.renderings - self.renderings_accepted,
            "seconds": round(self.seconds, 1),
        }


def run_battery(benchmark: str, references: Sequence[str], grader: Any) -> BatteryResult:
    """Put every probe of every reference to ``grader`` (a :class:`~rlbench.reward.MathReward`,
    whose ``answer_type`` decides how the references are read)."""
    start = time.perf_counter()
    result = BatteryResult(benchmark)
    for ref in references:
        result.references += 1
        for probe in probes_for(ref, grader.answer_type):
            completion = probe.text if probe.completion else f"\\boxed{{{probe.text}}}"
            got = grader(completion, ref).correct
            expected = probe.kind == "rendering"
            if expected:
                result.renderings += 1
                result.renderings_accepted += got
            else:
                result.wrong += 1
                result.wrong_rejected += not got
            result.verdicts.append((ref, probe.name, probe.text, expected, got))
            if got != expected:
                result.failures.append((ref, probe.name, probe.text, got))
    result.seconds = time.perf_counter() - start
    return result


def battery_problems(name: str, conf_dir: Path, every: int = 1) -> tuple[list[str], Any]:
    """The reference answers of battery benchmark ``name`` (every ``every``-th, from the first) and
    its grader, as the benchmark's YAML configures it."""
    from omegaconf import OmegaConf

    from rlbench.config.schema import DatasetConfig, RewardConfig
    from rlbench.config.typed import typed_node
    from rlbench.dataset import load_problems
    from rlbench.reward.graders import make_grader

    path, split = BATTERY_SOURCES[name]
    spec = OmegaConf.load(conf_dir / path)
    problems = load_problems(spec, split=split, source="local")
    grader = make_grader(RewardConfig(name="math"), typed_node(spec, DatasetConfig))
    return [p.answer for p in problems][::every], grader
