"""Step-split solutions with at most one planted error: the training set of FAPO's GenRM (``dataset=flaw_steps``,
``reward=fapo_genrm``; rlbench/reward/genrm.py; docs/judges.md). Needs no files.

A problem is a chain of 3 to 5 operations on a running value ("Start with 12, add 7, multiply by 3, then
subtract 5. What is the result?") and a solution of one step per operation, ``Step i: a op b = c``, each step's
``a`` the previous step's result. Half the problems of a split (the odd positions) are flawed: one step ``k``
(uniform over the steps) has its result shifted by 1 to 10, and the later steps compute correctly from that
wrong value, so step ``k`` is the earliest (and only) step whose own arithmetic is wrong. The other half are
sound. The problem's text is the GenRM's question (:func:`rlbench.reward.genrm.step_question`, the text the
judge's ``verdict=step_index`` asks), its answer the label (``k``, or ``-1`` when sound), ``meta["n_steps"]``
the number of steps.

Each list is a deterministic function of ``(seed, split, size)`` (a local ``random.Random``). Train/test
separation: a problem belongs to the split :func:`rlbench.dataset.arith.split_of` gives its question (one in
five to test), so no test question appears in a training list, sound or flawed, whatever the seeds and sizes.
"""

from __future__ import annotations

import random

from rlbench.dataset.arith import SPLITS, split_of
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.genrm import NO_ERROR, step_question

MIN_STEPS, MAX_STEPS = 3, 5
_WORDS = {"+": "add {b}", "-": "subtract {b}", "*": "multiply by {b}"}


def apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _chain(rng: random.Random) -> tuple[int, list[tuple[str, int]]]:
    """A start value and 3-5 operations (``*`` by 2..9, ``+``/``-`` by 1..50)."""
    ops = [rng.choice("+-*") for _ in range(rng.randint(MIN_STEPS, MAX_STEPS))]
    return rng.randint(2, 50), [(op, rng.randint(2, 9) if op == "*" else rng.randint(1, 50)) for op in ops]


def _question(start: int, operations: list[tuple[str, int]]) -> str:
    words = [_WORDS[op].format(b=b) for op, b in operations]
    return f"Start with {start}, {', '.join(words[:-1])}, then {words[-1]}. What is the result?"


def _steps(start: int, operations: list[tuple[str, int]], wrong: int, shift: int) -> list[str]:
    """``a op b = c`` per operation; the result of step ``wrong`` (1-based; -1: none) is shifted by ``shift``
    and the later steps continue from it."""
    steps, value = [], start
    for i, (op, b) in enumerate(operations, start=1):
        result = apply(value, op, b) + (shift if i == wrong else 0)
        steps.append(f"{value} {op} {b} = {result}")
        value = result
    return steps


def generate_flaw_steps(size: int, seed: int, split: str) -> list[Problem]:
    """``size`` problems of ``split``, sound at even positions and flawed at odd ones (``answer`` the earliest
    wrong step, 1-based, or ``"-1"``; ``meta["n_steps"]``), uid ``flaw_steps/{split}/{i}``. Questions are
    distinct within a split. Raises ConfigError for a bad split or size."""
    if split not in SPLITS:
        raise ConfigError(f"flaw_steps split must be one of {list(SPLITS)}, got {split!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"flaw_steps {split}_size must be a non-negative integer, got {size!r}")
    rng = random.Random(f"rlbench-flaw-steps/seed={seed}/split={split}")
    problems: list[Problem] = []
    seen: set[str] = set()
    while len(problems) < size:
        start, operations = _chain(rng)
        question = _question(start, operations)
        if split_of(question) != split or question in seen:
            continue
        seen.add(question)
        flawed = len(problems) % 2 == 1
        wrong = rng.randint(1, len(operations)) if flawed else NO_ERROR
        shift = rng.choice([-1, 1]) * rng.randint(1, 10)
        steps = _steps(start, operations, wrong, shift)
        problems.append(Problem(f"flaw_steps/{split}/{len(problems)}", step_question(question, steps), str(wrong),
                                {"n_steps": len(steps)}))
    return problems
