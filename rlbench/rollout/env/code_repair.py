"""``env=code_repair``: repair a small repository until its tests pass (the multi-turn software-engineering
setting of Golubev et al. 2025, arXiv:2508.03501, section 2, reduced to a toy: a few files as text, two
actions instead of a shell).

An episode starts from a repository (rlbench/dataset/toy_repos.py: a module with a planted bug and its test
file; a problem of ``dataset=toy_repos`` carries one in its meta, any other problem gets the one drawn from
its uid). The first observation is the task, every file in a ```` ```file path=<path> ```` block and the
action format. Each turn the policy takes one action, the first of these in its text (the turn ends just
after it):

- an edit: ```` ```edit path=<path> ````, a newline, the file's whole new text, and a line starting with
  ```` ``` ```` (the closing fence). The file is replaced; the observation is ``edited <path> (<k> lines)``.
  Refused, with an observation saying why (the episode goes on; a tool error): a path that is absolute, holds
  ``..`` or is not normalised (``./a.py``), a path that is not a file of the repository (no new files), the
  test file (read-only), a first line without ``path=``.
- ``RUN_TESTS`` (the literal word): the repository's module files and the tests run in the project's code
  sandbox (rlbench.sandbox.run_tests: the trusted supervisor and the run's ``sandbox`` limits; the program
  writes the files into its own work folder and imports the module under test there; the asserts run in the
  supervisor against it). Model code never runs in the trainer's process and never sees the project or the
  data. All tests pass: reward 1 and the episode ends (``tests_passed``); else the observation is the test
  report (which asserts failed and why, or the load error), cut to ``max_output_chars``.

A turn without an action ends the episode (``no_action``), and so does an edit block never closed
(``unclosed_block``, the turn's budget ran out inside it); both reward 0. Edits and test runs are tool calls
(``env.max_tool_calls`` caps both). The reward is 1 exactly when a test run passed, so it sits on the last
turn's tokens, and the episode is correct when its return is positive. The state key is the repository's
files (GiGPO's anchors: the same files, the same state).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from rlbench.dataset.base import Problem
from rlbench.dataset.toy_repos import ToyRepo, repo_from_meta, toy_repo
from rlbench.errors import ConfigError
from rlbench.rollout.env.base import Environment, Reset, StepResult, output_block, register_env
from rlbench.sandbox import run_tests

RUN_MARKER = "RUN_TESTS"
EDIT_OPEN = "```edit"
#: an edit block from its opening fence: the rest of the header line, then the text up to a line starting with ```
CLOSED_EDIT = re.compile(r"```edit([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
EDIT_HEADER = re.compile(r"[ \t]+path=(\S+)[ \t]*")
INSTRUCTIONS = (
    "\nActions (one per turn):\n"
    "- replace a file: ```edit path=<file>, a newline, the whole new file, then ``` on its own line\n"
    f"- run the tests: {RUN_MARKER}\n"
)

#: the sandboxed program: it writes the repository's files into its work folder and imports the module under test
PROGRAM = """import os, sys
sys.dont_write_bytecode = True
for _path, _text in {files!r}.items():
    if os.path.dirname(_path):
        os.makedirs(os.path.dirname(_path), exist_ok=True)
    with open(_path, "w") as _file:
        _file.write(_text)
sys.path.insert(0, os.getcwd())
del _path, _text, _file, os, sys
from {module} import *
"""


def first_action(text: str) -> tuple[str, int, re.Match | None]:
    """The turn's action: (``run`` | ``edit`` | ``unclosed`` | ``none``, where it ends in ``text`` (-1 when it
    does not), the closed edit block's match)."""
    run, edit = text.find(RUN_MARKER), text.find(EDIT_OPEN)
    if run >= 0 and (edit < 0 or run < edit):
        return "run", run + len(RUN_MARKER), None
    if edit < 0:
        return "none", -1, None
    match = CLOSED_EDIT.match(text, edit)
    return ("edit", match.end(), match) if match else ("unclosed", -1, None)


def path_refusal(path: str, repo: ToyRepo) -> str | None:
    """Why an edit of ``path`` is refused, None when it is allowed."""
    if path.startswith("/") or "\\" in path or ".." in path.split("/") or posixpath.normpath(path) != path:
        return f"edit refused: {path!r} is not a plain path inside the repository"
    if path not in repo.files:
        return f"edit refused: there is no file {path!r} (files: {', '.join(sorted(repo.files))})"
    if path == repo.test_path:
        return f"edit refused: {path} holds the tests and is read-only"
    return None


def test_report(result, tests: tuple[str, ...], limit: int) -> str:
    """The observation of a test run: how many passed, each failure (or the load error), cut to ``limit``."""
    if result.status in ("passed", "failed"):
        failed = [(test, outcome.error) for test, outcome in zip(tests, result.outcomes) if not outcome.passed]
        lines = [f"{len(tests) - len(failed)} passed, {len(failed)} failed"]
        lines += [f"FAILED {test}: {error or 'failed'}" for test, error in failed]
        text = "\n".join(lines) + "\n"
    else:
        text = f"the tests did not run: {result.status}: {result.error or ''}\n"
    return output_block(text, limit)


@register_env("code_repair")
class CodeRepair(Environment):
    @dataclass(frozen=True)
    class Options:
        """The ``env.code_repair`` block."""

        max_output_chars: int = 400   # a test report is cut to this many characters

        def __post_init__(self) -> None:
            if self.max_output_chars < 1:
                raise ConfigError(f"env.code_repair.max_output_chars must be >= 1, got {self.max_output_chars}")

    def reset(self, problem: Problem) -> Reset:
        self.problem = problem
        self.repo = repo_from_meta(problem.meta) or toy_repo(problem.uid)
        self.files = dict(self.repo.files)
        shown = "".join(f"```file path={path}\n{text}```\n" for path, text in sorted(self.files.items()))
        return Reset(f"{self.repo.task}\n\n{shown}{INSTRUCTIONS}", self.state())

    def state(self) -> tuple:
        return tuple(sorted(self.files.items()))

    def turn_end(self, text: str) -> int | None:
        _, end, _ = first_action(text)
        return end if end >= 0 else None

    def step(self, action_text: str) -> StepResult:
        kind, _, match = first_action(action_text)
        if kind in ("none", "unclosed"):
            return StepResult("", 0.0, True, self.state(), ended_by="no_action" if kind == "none" else "unclosed_block")
        if kind == "edit":
            header = EDIT_HEADER.fullmatch(match.group(1))
            path = header.group(1) if header else None
            refusal = path_refusal(path, self.repo) if path else f"edit refused: the block's first line must be {EDIT_OPEN} path=<file>"
            if refusal:
                return StepResult(f"```output\n{refusal}\n```\n", 0.0, False, self.state(), tool_calls=1, tool_errors=1)
            self.files[path] = match.group(2)
            lines = match.group(2).count("\n")
            return StepResult(f"```output\nedited {path} ({lines} lines)\n```\n", 0.0, False, self.state(), tool_calls=1)
        return self.run_tests()

    def run_tests(self) -> StepResult:
        """The tests against the repository as it stands, in the sandbox (module docstring)."""
        code = {path: text for path, text in self.files.items() if path != self.repo.test_path}
        result = run_tests(PROGRAM.format(files=code, module=self.repo.module), list(self.repo.tests), self.context.sandbox_limits)
        if result.passed:
            return StepResult("", 1.0, True, self.state(), ended_by="tests_passed", tool_calls=1)
        errored = result.status not in ("passed", "failed")
        return StepResult(test_report(result, self.repo.tests, self.options.max_output_chars), 0.0, False, self.state(),
                          tool_calls=1, tool_errors=int(errored))
