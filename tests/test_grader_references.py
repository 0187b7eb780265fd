"""Every reference answer of the data folder (MATH-500, GSM8K test, AIME 2024, AMC 2023, MATH train)
written another equivalent way is accepted, and with its digit groups permuted is rejected.

The renderings are those of numbers with thousands separators (issue 29: MATH writes ``10,\\!080``, which
the grader once read as the list ``10, 080``, rejecting ``10080`` and accepting ``80, 10``): a grouped
number inside a reference becomes plain digits and each other separator style (``,``, ``{,}``,
``,\\!``, ``{,}\\!``); an integer reference of four digits or more gets the separators. The permuted
renderings put the digit groups in another order, as a list (``80, 10``) and joined (``08010``). The
grader is each benchmark's own (its YAML's answer type), as in the probe battery. Skipped without the
data folder (``../shared/data`` or ``RLBENCH_DATA_DIR``).
"""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, needs_data

from rlbench.reward.probe import BATTERY_SOURCES, battery_problems

# a grouped number as the references write it: 1,234  1{,}234  10,\!080  10{,}\!080
_SEPARATOR = r"(?:\{,\}|,)(?:\\!)?"
_GROUPED_RE = re.compile(r"(?<![\d.])\d{1,3}(?:" + _SEPARATOR + r"\d{3})+(?![\d.])")
_MARKED = ("{,}", ",\\!", "{,}\\!")  # never a list separator, wherever the number stands
_INTEGER_RE = re.compile(r"-?\d{4,}")


def _groups(number: str) -> list[str]:
    return re.split(_SEPARATOR, number)


def _group_digits(digits: str) -> list[str]:
    head = len(digits) % 3 or 3
    return [digits[:head]] + [digits[i : i + 3] for i in range(head, len(digits), 3)]


def renderings(ref: str) -> tuple[list[str], list[str]]:
    """(equivalent renderings, permuted renderings) of ``ref``; both empty when it has no grouped
    number and is not an integer of four digits or more."""
    ref = ref.strip()
    grouped = [m for m in _GROUPED_RE.finditer(ref) if "{" in m.group(0) or "!" in m.group(0) or m.group(0) == ref]
    if len(grouped) == 1:  # one number written with separators: render it every way
        m = grouped[0]
        groups = _groups(m.group(0))
    elif _INTEGER_RE.fullmatch(ref):
        m = re.search(r"\d+", ref)
        groups = _group_digits(m.group(0))
    else:
        return [], []
    if len(groups) < 2:
        return [], []

    def put(number: str) -> str:
        return ref[: m.start()] + number + ref[m.end() :]

    # a plain comma is a thousands separator only in a number standing alone ("(100,101)" is a pair)
    separators = _MARKED + ((",",) if m.group(0) == ref or _INTEGER_RE.fullmatch(ref) else ())
    same = [put("".join(groups))] + [put(sep.join(groups)) for sep in separators]
    permuted = []
    for order in (groups[::-1], groups[1:] + groups[:1]):
        if order != groups:
            permuted += [put(", ".join(order)), put("".join(order))]
    digits = "".join(groups)
    permuted = [p for p in permuted if p.replace(", ", "") != ref.replace(m.group(0), digits)]
    return [s for s in same if s != ref], permuted


def test_renderings_of_a_marked_number():
    same, permuted = renderings(r"10,\!080")
    assert "10080" in same and "10,080" in same and "10{,}080" in same
    assert "080, 10" in permuted and "08010" in permuted
    same, permuted = renderings("123456")
    assert "123,456" in same and r"123,\!456" in same and "456, 123" in permuted
    assert renderings("12") == ([], []) and renderings(r"\frac{1}{2}") == ([], [])
    assert renderings("(100,101)") == ([], [])
    same, _ = renderings(r"\$32,\!348")
    assert r"\$32348" in same and r"\$32,348" not in same


@needs_data
@pytest.mark.parametrize("name", sorted(BATTERY_SOURCES))
def test_every_reference_rendered_and_permuted(name):
    references, grader = battery_problems(name, ROOT / "conf")
    assert references
    checked, wrong = 0, []
    for ref in references:
        same, permuted = renderings(ref)
        for text in same:
            checked += 1
            if not grader(f"\\boxed{{{text}}}", ref).correct:
                wrong.append(("rejected", ref, text))
        for text in permuted:
            checked += 1
            if grader(f"\\boxed{{{text}}}", ref).correct:
                wrong.append(("accepted", ref, text))
    assert not wrong, wrong[:20]
    if name in ("math500", "math_train", "gsm8k"):  # these hold grouped numbers (MATH writes 10,\!080)
        assert checked > 0
