"""Toy repositories with a planted bug: the problems of ``env=code_repair`` (``dataset=toy_repos``; needs no files).

A repository is two Python files as text: a module (``calc.py``, ``mathutils.py``, ...) holding two small
functions, one of them with a planted bug, and its test file (``test_<module>.py``: an import line and three
assert statements, the last one on the correct function). The bug is one of

- ``operator``: a wrong arithmetic operator (``a - b`` where ``a + b`` is meant);
- ``off_by_one``: a range one short (``sum(range(n))`` where ``sum(range(n + 1))`` is meant);
- ``comparison``: a strict comparison where the boundary counts (``x > limit`` for ``x >= limit``);
- ``constant``: a wrong constant (``x * 4`` for ``x * 3``).

Two of the asserts fail on the buggy function and pass on the fix (the reference answer). Each repository is
a deterministic function of its seed string (a local ``random.Random``, never the global one), so
:func:`toy_repo` of a problem's uid gives any dataset's problem a repository too (what ``env=code_repair``
does for a problem without one). Train/test separation: a repository belongs to the split that
:func:`rlbench.dataset.arith.split_of` gives its text (one in five to test), so no test repository is in a
training list, whatever the seeds and sizes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlbench.dataset.arith import SPLITS, split_of
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError

BUGS = ("operator", "off_by_one", "comparison", "constant")
MODULES = ("calc", "mathutils", "numtools", "helpers")
_OPERATORS = "+-*"


@dataclass(frozen=True)
class ToyRepo:
    """One repository: ``files`` (path -> text; the test file included), ``tests`` (the assert statements of
    the test file, run by the sandbox's trusted supervisor), ``module`` (the module the tests import),
    ``test_path`` (the read-only test file), ``fix`` (the module's fixed text), ``bug`` (its kind)."""

    files: dict[str, str]
    tests: tuple[str, ...]
    module: str
    test_path: str
    fix: str
    bug: str

    @property
    def task(self) -> str:
        return f"The tests in {self.test_path} fail. Fix the bug in {self.module}.py so that all tests pass."

    def as_meta(self) -> dict:
        """The repository as ``Problem.meta`` (plain values; :func:`repo_from_meta` reads it back)."""
        return {"files": dict(self.files), "tests": list(self.tests), "module": self.module, "test_path": self.test_path,
                "bug": self.bug}


def _function(kind: str, rng: random.Random, buggy: bool) -> tuple[str, str, list[str]]:
    """(name, source, asserts) of one function of ``kind``; ``buggy``: with its bug planted. The first two
    asserts fail on the buggy version (the last is a third check of the correct one)."""
    if kind == "operator":
        op = rng.choice(_OPERATORS)
        wrong = rng.choice([o for o in _OPERATORS if o != op])
        a, b, c, d = rng.sample(range(3, 10), 4)  # distinct, >= 3: +, - and * all differ
        value = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}[op]
        source = f"def combine(a, b):\n    return a {wrong if buggy else op} b\n"
        return "combine", source, [f"assert combine({a}, {b}) == {value(a, b)}", f"assert combine({c}, {d}) == {value(c, d)}",
                                   f"assert combine({b}, {a}) == {value(b, a)}"]
    if kind == "off_by_one":
        n, m = rng.sample(range(2, 10), 2)
        stop = "n" if buggy else "n + 1"
        source = f"def total(n):\n    \"\"\"The sum 0 + 1 + ... + n.\"\"\"\n    return sum(range({stop}))\n"
        return "total", source, [f"assert total({n}) == {n * (n + 1) // 2}", f"assert total({m}) == {m * (m + 1) // 2}",
                                 "assert total(0) == 0"]
    if kind == "comparison":
        limit = rng.randint(2, 9)
        source = f"def at_least(x, limit):\n    return x {'>' if buggy else '>='} limit\n"
        return "at_least", source, [f"assert at_least({limit}, {limit})", f"assert at_least({limit + 1}, {limit + 1})",
                                    f"assert not at_least({limit - 1}, {limit})"]
    if kind == "constant":
        k = rng.randint(2, 9)
        x, y = rng.sample(range(1, 10), 2)
        source = f"def scale(x):\n    \"\"\"x times {k}.\"\"\"\n    return x * {k + 1 if buggy else k}\n"
        return "scale", source, [f"assert scale({x}) == {x * k}", f"assert scale({y}) == {y * k}", "assert scale(0) == 0"]
    raise ValueError(f"unknown bug kind {kind!r}")


def toy_repo(seed: str) -> ToyRepo:
    """The repository drawn from ``seed`` (any string): a module with one buggy and one correct function, and
    its test file (three asserts: two that the bug fails, one on the correct function)."""
    rng = random.Random(f"rlbench-toy-repo/{seed}")
    bug, other = rng.sample(BUGS, 2)
    module = rng.choice(MODULES)
    state = rng.getstate()
    name, buggy_source, asserts = _function(bug, rng, buggy=True)
    rng.setstate(state)
    _, fixed_source, _ = _function(bug, rng, buggy=False)  # the same draws: the same function, fixed
    helper, helper_source, helper_asserts = _function(other, rng, buggy=False)
    header = f'"""{module}: small numeric helpers."""\n\n\n'
    text, fix = (header + source + "\n\n" + helper_source for source in (buggy_source, fixed_source))
    tests = (asserts[0], asserts[1], helper_asserts[0])
    test_path = f"test_{module}.py"
    test_text = f"from {module} import {name}, {helper}\n\n" + "\n".join(tests) + "\n"
    return ToyRepo({f"{module}.py": text, test_path: test_text}, tests, module, test_path, fix, bug)


def repo_from_meta(meta: dict) -> ToyRepo | None:
    """The repository a problem carries in its meta (:meth:`ToyRepo.as_meta`), None when it carries none."""
    if "files" not in meta or "tests" not in meta:
        return None
    return ToyRepo(dict(meta["files"]), tuple(meta["tests"]), meta["module"], meta["test_path"], meta.get("fix", ""),
                   meta.get("bug", ""))


def generate_toy_repos(size: int, seed: int, split: str) -> list[Problem]:
    """``size`` repositories of ``split``: ``prompt`` the task sentence, ``answer`` the fixed module's text,
    ``meta`` the repository (:meth:`ToyRepo.as_meta`), uid ``toy_repos/{split}/{i}``. Distinct while the
    space allows (it holds thousands), then repeats. Raises ConfigError for a bad split or size."""
    if split not in SPLITS:
        raise ConfigError(f"toy_repos split must be one of {list(SPLITS)}, got {split!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"toy_repos {split}_size must be a non-negative integer, got {size!r}")
    problems: list[Problem] = []
    seen: set[str] = set()
    draw = 0
    while len(problems) < size:
        repo = toy_repo(f"{seed}/{draw}")
        draw += 1
        key = "".join(repo.files.values())
        if split_of(key) != split or (key in seen and draw < 50 * (size + 1)):
            continue
        seen.add(key)
        problems.append(Problem(f"toy_repos/{split}/{len(problems)}", repo.task, repo.fix, repo.as_meta()))
    return problems
