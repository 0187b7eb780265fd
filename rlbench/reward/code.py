"""Code reward: run the completion's code against the problem's tests in the sandbox.

A code :class:`~rlbench.dataset.base.Problem` carries in ``meta``:

* ``tests``: list of test snippets, one test each (an ``assert``, or HumanEval's
  ``check(<entry_point>)``);
* ``test_setup``: trusted code run before the tests, outside the sandbox (MBPP's
  ``test_imports``, HumanEval's ``def check(candidate): ...``); optional;
* ``entry_point``: the function the tests call (HumanEval); optional;
* ``code_prefix``: HumanEval's prompt (imports, signature, docstring), put in front of the
  completion when the completion does not define ``entry_point`` itself; optional.

Programs run through :func:`rlbench.sandbox.run_many`: the completion's code in the sandbox, the
tests in a trusted process that calls it with plain data (see :mod:`rlbench.sandbox` for what the
sandbox defends against and what it does not).
"""

from __future__ import annotations

import ast
import logging
import re
import threading
from typing import TYPE_CHECKING, Sequence

from rlbench.errors import ConfigError, DataError
from rlbench.reward.math import Grade
from rlbench.sandbox import SandboxLimits, SandboxResult, run_many

if TYPE_CHECKING:  # a runtime import would be circular (rlbench.dataset imports rlbench.reward)
    from rlbench.dataset.base import Problem

logger = logging.getLogger(__name__)

__all__ = [
    "CODE_REWARD_MODES", "CodeReward", "extract_code", "problem_entry_point", "problem_program", "problem_setup",
    "problem_tests",
]  # fmt: skip

CODE_REWARD_MODES = ("all_pass", "pass_rate")
#: Fence languages taken as Python (a bare fence counts too).
PYTHON_FENCES = ("python", "py", "python3", "")

_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
_OPEN_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n", re.MULTILINE)
_CODE_LINE_RE = re.compile(r"^[ \t]*(?:def |import |from [\w.]+ import )", re.MULTILINE)


#: A closed ```python block as a tool-integrated turn writes it (env=python_tool runs each; GTPO's code-similarity
#: shaping compares them): the fence opens at ```python anywhere in the text and closes at the next ```.
TOOL_BLOCK = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)


def tool_blocks(text: str) -> list[str]:
    """The bodies of the closed :data:`TOOL_BLOCK` blocks of ``text``, in order."""
    return [match.group(1) for match in TOOL_BLOCK.finditer(text)]


def _fenced_block(text: str) -> str | None:
    """Body of the last closed Python fence; else of a final unclosed one (a completion cut off
    by the length limit); else None."""
    closed = [m for m in _FENCE_RE.finditer(text) if m.group(1).lower() in PYTHON_FENCES]
    if closed:
        return closed[-1].group(2)
    opening = list(_OPEN_FENCE_RE.finditer(text))
    if opening and opening[-1].group(1).lower() in PYTHON_FENCES:
        rest = text[opening[-1].end() :]
        if "```" not in rest:
            return rest
    return None


def _extract(completion: str) -> tuple[str | None, bool]:
    """(code, came from a fence); see :func:`extract_code`."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    block = _fenced_block(completion)
    if block is not None:
        return block, True
    return (completion if _CODE_LINE_RE.search(completion) else None), False


def extract_code(completion: str) -> str | None:
    """Code in a model completion.

    The last fenced block marked ``python``/``py``/``python3`` or bare (a final unclosed fence
    counts, to the end of the text); without any such fence, the whole text if it has a
    ``def``/``import``/``from ... import`` line; else None.
    """
    return _extract(completion)[0]


def _meta_str(problem: Problem, key: str) -> str:
    value = problem.meta.get(key) or ""
    if not isinstance(value, str):
        raise DataError(f"problem {problem.uid}: meta[{key!r}] must be a string, got {type(value).__name__}")
    return value


def tests_in_prompt(problem: Problem) -> frozenset[int]:
    """Indices of the tests the prompt shows (``problem.meta["tests_in_prompt"]``; none if unset)."""
    shown = problem.meta.get("tests_in_prompt") or []
    if not isinstance(shown, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in shown):
        raise DataError(f"problem {problem.uid}: meta['tests_in_prompt'] must be a list of test indices, got {shown!r}")
    return frozenset(shown)


def problem_tests(problem: Problem) -> list[str]:
    """``problem.meta["tests"]``, checked: a non-empty list of strings."""
    tests = problem.meta.get("tests")
    if not isinstance(tests, (list, tuple)) or not tests or not all(isinstance(t, str) for t in tests):
        raise DataError(
            f"problem {problem.uid}: meta['tests'] must be a non-empty list of test code strings "
            f"(one assert or check(...) call each), got {tests!r}"
        )
    return list(tests)


def _top_level_imports(code: str) -> str:
    """The ``import``/``from ... import`` statements at the top level of ``code`` (none if it does
    not parse)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ""
    return "\n".join(ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))


def problem_program(code: str, problem: Problem) -> str:
    """The program to run for ``code`` on ``problem`` (in the sandbox).

    ``code_prefix + code`` whenever the problem has a ``code_prefix`` (HumanEval's prompt:
    imports, helper functions such as ``is_palindrome`` and the signature with its docstring),
    else ``code``. Always prepending works for both kinds of completion: a bare function body
    continues the prompt's signature, and a whole function redefines it (the prompt's own copy
    has the docstring as its body), while the prompt's imports and helpers stay defined. The
    top-level imports of ``test_setup`` follow on their own lines (MBPP's solutions may rely on
    its ``test_imports``); the rest of the set-up (``check``) never enters the sandbox.
    """
    prefix = _meta_str(problem, "code_prefix")
    program = prefix + code if prefix else code
    imports = _top_level_imports(_meta_str(problem, "test_setup"))
    if imports:
        program = program.rstrip("\n") + "\n\n" + imports + "\n"
    return program


def problem_setup(problem: Problem) -> str:
    """The trusted code the tests run after (outside the sandbox): the ``code_prefix`` (so that
    the prompt's helpers the tests use, such as HumanEval's ``poly``, are the benchmark's own and
    not the completion's) and then ``test_setup``. The entry point is then rebound to the
    program's function (see :func:`rlbench.sandbox.run_tests`)."""
    parts = (_meta_str(problem, "code_prefix"), _meta_str(problem, "test_setup"))
    return "\n\n".join(part.rstrip("\n") for part in parts if part) + ("\n" if any(parts) else "")


def _called_names(code: str) -> list[str]:
    """Names called as ``name(...)`` in ``code``, in source order (none if it does not parse)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return [c.func.id for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


def problem_entry_point(problem: Problem) -> str | None:
    """The function the tests call: ``meta["entry_point"]`` (HumanEval); else, when the problem has
    a reference solution (MBPP), the first name the tests call that the solution defines at its top
    level (``sum`` for MBPP 126, ``similar_elements`` in ``set(similar_elements(...))``); else None.
    The sandbox lets the program's name shadow a builtin in the tests only for this name."""
    entry_point = problem.meta.get("entry_point") or None
    if entry_point is not None:
        if not (isinstance(entry_point, str) and entry_point.isidentifier()):
            raise DataError(f"problem {problem.uid}: meta['entry_point'] must be a Python identifier, got {entry_point!r}")
        return entry_point
    try:
        solution = ast.parse(problem.answer or "")
    except SyntaxError:
        return None
    defined = {n.name for n in solution.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return next((name for test in problem_tests(problem) for name in _called_names(test) if name in defined), None)


class CodeReward:
    """Reward from running the completion's code against the problem's tests.

    ``mode="all_pass"``: ``correct_reward`` if every test passed else ``incorrect_reward``.
    ``mode="pass_rate"``: ``incorrect + (correct - incorrect) * passed / total`` over the tests
    the prompt does not show (``problem.meta["tests_in_prompt"]``, MBPP's example assert): a
    completion that only echoes the shown test's expected value earns nothing. When the prompt
    shows every test, the run's all-pass verdict decides.
    ``correct`` is True only when every test passed. A completion without code gets
    ``incorrect_reward`` without running anything. Sandbox failures (not the program's) are
    logged, counted in ``failures`` and graded as incorrect; grading never raises for a
    completion.
    """

    def __init__(
        self,
        mode: str = "all_pass",
        correct_reward: float = 1.0,
        incorrect_reward: float = 0.0,
        limits: SandboxLimits | None = None,
        workers: int | None = None,
    ) -> None:
        if mode not in CODE_REWARD_MODES:
            raise ConfigError(f"reward mode={mode!r} is unknown; use one of {CODE_REWARD_MODES}")
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ConfigError(f"reward workers must be a positive integer or null, got {workers!r}")
        self.mode = mode
        self.correct_reward = float(correct_reward)
        self.incorrect_reward = float(incorrect_reward)
        self.limits = limits if limits is not None else SandboxLimits()
        self.workers = workers
        self.failures = 0
        self._lock = threading.Lock()

    def __call__(
        self, completion: str, reference: str, response_ids: Sequence[int] = (), *, problem: Problem
    ) -> Grade:
        """Grade one completion. ``reference`` and ``response_ids`` are part of the grader
        interface; the tests in ``problem.meta`` decide."""
        return self.grade_many([completion], [problem])[0]

    def grade_many(self, completions: Sequence[str], problems: Sequence[Problem]) -> list[Grade]:
        """Grade ``completions[i]`` against ``problems[i]``; all programs go to one
        :func:`~rlbench.sandbox.run_many` call."""
        if len(completions) != len(problems):
            raise ValueError(f"got {len(completions)} completions for {len(problems)} problems")
        extracted = [_extract(c) for c in completions]
        jobs, job_of = [], {}
        for i, ((code, _), problem) in enumerate(zip(extracted, problems)):
            tests = problem_tests(problem)
            if code is not None:
                job_of[i] = len(jobs)
                jobs.append((problem_program(code, problem), tests, problem_setup(problem), problem_entry_point(problem)))
        try:
            results = run_many(jobs, self.limits, self.workers)
        except Exception as exc:  # noqa: BLE001 - the sandbox itself broke (e.g. no process could start)
            error = f"sandbox unavailable: {type(exc).__name__}: {exc}"
            with self._lock:
                self.failures += len(jobs)
                failures = self.failures
            logger.warning("%s; %d programs graded as incorrect [failures=%d]", error, len(jobs), failures)
            return [Grade(False, code, self.incorrect_reward, format_ok, error=error if code is not None else None)
                    for code, format_ok in extracted]
        grades = []
        for i, (code, format_ok) in enumerate(extracted):
            if code is None:
                grades.append(Grade(False, None, self.incorrect_reward, False))
            else:
                grades.append(self._grade(code, format_ok, results[job_of[i]], tests_in_prompt(problems[i])))
        return grades

    def _grade(self, code: str, format_ok: bool, result: SandboxResult, shown: frozenset[int]) -> Grade:
        error = None
        if result.status == "sandbox_error":
            error = result.error
            with self._lock:
                self.failures += 1
            logger.warning(
                "code sandbox failed (%s); graded as incorrect [failures=%d]", error, self.failures
            )
        return Grade(
            correct=result.passed,
            extracted=code,
            reward=self.reward(result, shown),
            format_ok=format_ok,
            error=error,
            details={
                "tests": [[o.passed, o.error] for o in result.outcomes],
                "status": result.status,
            },
        )

    def reward(self, result: SandboxResult, shown: frozenset[int] = frozenset()) -> float:
        """The scalar reward for one sandbox result under this grader's mode; ``shown``: indices of
        the tests the prompt shows (left out of ``pass_rate``)."""
        if self.mode == "all_pass":
            return self.correct_reward if result.passed else self.incorrect_reward
        hidden = [o for i, o in enumerate(result.outcomes) if i not in shown]
        fraction = sum(o.passed for o in hidden) / len(hidden) if hidden else float(result.passed)
        return self.incorrect_reward + (self.correct_reward - self.incorrect_reward) * fraction

    def __repr__(self) -> str:
        return (
            f"CodeReward(mode={self.mode!r}, correct_reward={self.correct_reward}, "
            f"incorrect_reward={self.incorrect_reward}, limits={self.limits}, workers={self.workers})"
        )
