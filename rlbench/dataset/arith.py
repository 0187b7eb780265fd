"""Procedural arithmetic problems: a tiny task a small model can learn on a CPU.

Difficulty levels (``*`` is multiplication; the usual precedence applies, no parentheses):

1. ``a + b`` with single digits ``a, b`` in 0..9 (100 distinct expressions).
2. ``a + b`` or ``a - b`` with ``a, b`` in 1..99; results may be negative.
3. ``a * b`` with ``a`` a two-digit number (10..99) and ``b`` a digit in 2..9.
4. ``a op b op c`` with ``a, b, c`` in 1..20 and each ``op`` one of ``+ - *``
   (``2 + 3 * 4`` is 14, not 20).
5. ``a op b op c`` with ``a, b, c`` in 10..999 and ops from ``+ - *``, at most one ``*``
   (results up to about a million, possibly negative).

Train/test separation: every expression string belongs to exactly one split, decided by a
hash of the string alone (one in five goes to test). So a test expression never appears in any
training list, whatever the seeds, levels or sizes. Within a split, expressions are distinct as
long as the split's share of the level's expression space allows; small spaces (level 1) repeat
expressions once exhausted.

Each list is a deterministic function of ``(seed, split, level, size)``: the generator is a
local ``random.Random`` seeded with a string built from them, never the global RNG.

Several levels (``arith.level=[1,2]``) give a mixed list whose difficulty varies from prompt to prompt:
problem ``i`` comes from ``levels[i % len(levels)]``, and each level's problems are the first ones of
that level's own list, so a one-level list equals the plain level.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError

LEVELS = (1, 2, 3, 4, 5)
SPLITS = ("train", "test")

_TEST_SHARE = 5  # one expression in _TEST_SHARE belongs to the test split
_MAX_MISSES = 2000  # consecutive rejected draws before repeats are allowed within a split


def evaluate(numbers: list[int], ops: list[str]) -> int:
    """Evaluate ``numbers[0] ops[0] numbers[1] ...`` with ``*`` binding tighter than ``+``/``-``."""
    if len(numbers) != len(ops) + 1:
        raise ValueError("need exactly one more number than operators")
    # Collapse products first into signed terms, then add the terms.
    terms = [numbers[0]]
    signs = [1]
    for op, num in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= num
        elif op in "+-":
            terms.append(num)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r}")
    return sum(s * t for s, t in zip(signs, terms))


def derivation(expression: str) -> str:
    """The worked solution of an arith expression, one operation per step with ``*`` first:
    ``"2 + 3 * 4"`` -> ``"2 + 3 * 4 = 2 + 12 = 14"``; a single operation is ``"37 + 48 = 85"``.
    Its last number is the answer (a guidance trace for the arith task, rlbench.guidance)."""
    parts = expression.split()
    numbers, ops = [int(p) for p in parts[::2]], parts[1::2]
    steps = [expression]
    while ops:
        i = ops.index("*") if "*" in ops else 0
        numbers[i : i + 2] = [evaluate(numbers[i : i + 2], [ops[i]])]
        del ops[i]
        steps.append(_format(numbers, ops))
    return " = ".join(steps)


def _format(numbers: list[int], ops: list[str]) -> str:
    """Render an expression as ``"a op b op c"`` with single spaces."""
    parts = [str(numbers[0])]
    for op, num in zip(ops, numbers[1:]):
        parts += [op, str(num)]
    return " ".join(parts)


def _level1(rng: random.Random) -> tuple[list[int], list[str]]:
    return [rng.randint(0, 9), rng.randint(0, 9)], ["+"]


def _level2(rng: random.Random) -> tuple[list[int], list[str]]:
    return [rng.randint(1, 99), rng.randint(1, 99)], [rng.choice("+-")]


def _level3(rng: random.Random) -> tuple[list[int], list[str]]:
    return [rng.randint(10, 99), rng.randint(2, 9)], ["*"]


def _level4(rng: random.Random) -> tuple[list[int], list[str]]:
    return [rng.randint(1, 20) for _ in range(3)], [rng.choice("+-*") for _ in range(2)]


def _level5(rng: random.Random) -> tuple[list[int], list[str]]:
    ops = [rng.choice("+-*") for _ in range(2)]
    if ops == ["*", "*"]:
        ops[rng.randrange(2)] = rng.choice("+-")
    return [rng.randint(10, 999) for _ in range(3)], ops


_SAMPLERS: dict[int, Callable[[random.Random], tuple[list[int], list[str]]]] = {
    1: _level1,
    2: _level2,
    3: _level3,
    4: _level4,
    5: _level5,
}


def split_of(expression: str) -> str:
    """Return ``"test"`` or ``"train"``: the split an expression string belongs to (seed-free)."""
    digest = hashlib.sha256(expression.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % _TEST_SHARE == 0 else "train"


def generate_arith(level: int, size: int, seed: int, split: str) -> list[Problem]:
    """Generate ``size`` arithmetic problems of a difficulty ``level`` for ``split``.

    ``Problem.prompt`` is the bare expression (``"37 + 48"``), ``answer`` the integer result as a
    string (``"85"``), ``meta`` holds ``{"level": level}``, uid is ``"arith/{split}/{i}"``.
    Raises ConfigError for an unknown level or split or a negative size.
    """
    if isinstance(level, bool) or not isinstance(level, int) or level not in _SAMPLERS:
        raise ConfigError(f"arith.level must be one of {list(LEVELS)}, got {level!r}")
    if split not in SPLITS:
        raise ConfigError(f"arith split must be one of {list(SPLITS)}, got {split!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"arith {split}_size must be a non-negative integer, got {size!r}")

    sampler = _SAMPLERS[level]
    rng = random.Random(f"rlbench-arith/seed={seed}/split={split}/level={level}")
    seen: set[str] = set()
    problems: list[Problem] = []
    misses = 0  # draws since the last accepted expression
    allow_repeats = False  # set once the split's share of the expression space looks exhausted
    while len(problems) < size:
        numbers, ops = sampler(rng)
        expression = _format(numbers, ops)
        if split_of(expression) != split or (expression in seen and not allow_repeats):
            misses += 1
            if misses > _MAX_MISSES:
                if allow_repeats:  # pragma: no cover - would need an empty split partition
                    raise DataError(f"arith level {level}: no {split} expressions found")
                allow_repeats, misses = True, 0
            continue
        misses = 0
        seen.add(expression)
        problems.append(
            Problem(
                uid=f"arith/{split}/{len(problems)}",
                prompt=expression,
                answer=str(evaluate(numbers, ops)),
                meta={"level": level},
            )
        )
    return problems


def generate_arith_levels(levels: int | list[int], size: int, seed: int, split: str) -> list[Problem]:
    """Generate ``size`` problems cycling over ``levels`` (an int is one level).

    Problem ``i`` is drawn from ``levels[i % L]``; level ``levels[j]`` contributes the first
    ``ceil((size - j) / L)`` problems of ``generate_arith(levels[j], ...)``, so ``[level]`` equals
    ``level``. ``meta["level"]`` says which level each problem has. Raises ConfigError for an empty
    list, a repeated level, or any error of :func:`generate_arith`.
    """
    if isinstance(levels, int) and not isinstance(levels, bool):
        return generate_arith(levels, size, seed, split)
    levels = list(levels)
    if not levels or len(set(levels)) != len(levels):
        raise ConfigError(f"arith.level must be a level or a list of distinct levels of {list(LEVELS)}, got {levels!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"arith {split}_size must be a non-negative integer, got {size!r}")
    count = len(levels)
    per_level = [generate_arith(level, -(-(size - j) // count) if size > j else 0, seed, split) for j, level in enumerate(levels)]
    problems = [per_level[i % count][i // count] for i in range(size)]
    return [
        Problem(uid=f"arith/{split}/{i}", prompt=p.prompt, answer=p.answer, meta=dict(p.meta))
        for i, p in enumerate(problems)
    ]
