"""CodeRL+'s execution-semantics tasks (Jiang et al. 2025, "CodeRL+: Improving Code Generation via
Reinforcement with Execution Semantics Alignment", arXiv:2510.18471, section 3): a program the policy wrote
(correct or not) is run on a test input, its return value and the final values of its function's last
local variables are recorded, and the pair becomes a task for the same policy: "predict the output and
those values", rewarded by exact match with partial credit.

Tracing. The program runs only in the code sandbox (rlbench.sandbox.run_tests, the run's limits: an
infinite loop ends at the wall clock, and the task is not built). The sandbox refuses ``sys.settrace``, so
the trace is made by rewriting the source (parsed here with :mod:`ast`, never run here): in the entry
function every ``return x`` becomes ``return _rlbench_record(locals(), x)`` and a final
``return _rlbench_record(locals(), None)`` is appended; after the program, the test's call runs and one line,
a marker and JSON, is printed. The recorded locals are those of the function's last return (the outermost
call's, for a recursive function). A variable whose value is not JSON data is left out; a run that fails,
times out or prints no marker line builds no task (counted by the caller).

What the program prints is the program's: it could print a marker line of its own and stop, and its task's
labels would be what it printed. That decides nothing for the program itself (its own reward is the unit
tests', graded in the trusted process); it only makes an odd task, whose labels the predictor must still
match.

Reward (section 3.2 of the paper; the constants are the authors' released reward function's, 0.1 and 0.9):
0.1 when the response's last JSON object has both keys ``final_output`` and ``variables``, plus
0.9 x (the number right among the output and the k variables) / (1 + k). Values are compared as JSON
(``1`` and ``1.0`` differ; a tuple is a list). The grade is correct when all are right.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlbench.dataset.base import Problem
from rlbench.reward.code import extract_code, problem_program
from rlbench.reward.math import Grade
from rlbench.sandbox import SandboxLimits, run_many

EXECUTION_KIND = "execution"
TRACE_MARK = "__rlbench_trace__:"
RECORD = "_rlbench_record"
VALID_FORMAT_CREDIT, CONTENT_CREDIT = 0.1, 0.9

EXECUTION_TASK = ("Here is a Python program:\n```python\n{code}\n```\n\nIt is run as `{call}`. Predict the value this "
                  "call returns and the final values of the variables {names} of `{function}` when it returns. "
                  "Reason first; the last line must be one JSON object: "
                  '{{"final_output": <value>, "variables": {{{template}}}}}')


@dataclass(frozen=True)
class Trace:
    """A traced run: the call's return value and the final values of the entry function's variables (JSON data)."""

    output: Any
    variables: dict[str, Any]


def asserted_call(test: str) -> tuple[str, str] | None:
    """(the call, the called function's name) of an ``assert f(...) == expected`` test; None for any other form."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test_expr = tree.body[0].test
    call = test_expr.left if isinstance(test_expr, ast.Compare) else test_expr
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        return None
    return ast.unparse(call), call.func.id


class _RecordReturns(ast.NodeTransformer):
    """Rewrites the body of one function: each ``return x`` records the locals first (nested functions and
    classes keep theirs)."""

    def __init__(self, function: str):
        self.function, self.depth = function, 0

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        if node.name != self.function or self.depth:
            return node
        self.depth += 1
        node.body = [self.visit(statement) for statement in node.body]
        node.body.append(ast.parse(f"return {RECORD}(locals(), None)").body[0])
        self.depth -= 1
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        value = node.value or ast.Constant(None)
        call = ast.Call(ast.Name(RECORD, ast.Load()), [ast.Call(ast.Name("locals", ast.Load()), [], []), value], [])
        return ast.copy_location(ast.Return(call), node)

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, (ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)) or (isinstance(node, ast.FunctionDef) and self.depth):
            return node  # another scope: its returns are its own
        return super().generic_visit(node)


def tracing_program(program: str, call: str, function: str, max_variables: int) -> str | None:
    """``program`` with its top-level ``function`` recording its locals at every return, then the call and the
    marker line; None when the program does not parse or has no such top-level function."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return None
    if not any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body):
        return None
    tree = _RecordReturns(function).visit(tree)
    trailer = f"""
import json as _rlbench_json
_rlbench_final = {{}}
def {RECORD}(names, value):
    _rlbench_final.clear()
    _rlbench_final.update(names)
    return value
def _rlbench_plain(value):
    try:
        return True, _rlbench_json.loads(_rlbench_json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return False, None
_rlbench_output = {call}
_rlbench_ok, _rlbench_value = _rlbench_plain(_rlbench_output)
_rlbench_vars = [(k, _rlbench_plain(v)) for k, v in _rlbench_final.items() if not k.startswith("_")]
_rlbench_vars = {{k: v for k, (ok, v) in _rlbench_vars if ok}}
_rlbench_vars = dict(list(_rlbench_vars.items())[-{int(max_variables)}:])
if _rlbench_ok:
    print({TRACE_MARK!r} + _rlbench_json.dumps({{"final_output": _rlbench_value, "variables": _rlbench_vars}}))
"""
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" + trailer


def parse_trace(stdout: str) -> Trace | None:
    """The last marker line of a run's standard output, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith(TRACE_MARK)]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1][len(TRACE_MARK):])
        return Trace(data["final_output"], dict(data["variables"]))
    except (ValueError, KeyError, TypeError):
        return None


def trace_programs(requests: Sequence[tuple[str, str, str]], limits: SandboxLimits, max_variables: int = 3) -> list[Trace | None]:
    """Per (program, call, function): its trace, run in the sandbox (several at once), or None."""
    programs = [tracing_program(program, call, function, max_variables) for program, call, function in requests]
    runnable = [i for i, p in enumerate(programs) if p is not None]
    results = run_many([(programs[i], []) for i in runnable], limits) if runnable else []
    traces: list[Trace | None] = [None] * len(requests)
    for i, result in zip(runnable, results):
        traces[i] = parse_trace(result.stdout) if result.status == "passed" else None
    return traces


def execution_task(source: Problem, code: str, call: str, function: str, trace: Trace, key: str, **meta: Any) -> Problem:
    """The task "predict the output and the variables" for ``code`` run as ``call``; its answer is the trace."""
    names = ", ".join(f"`{n}`" for n in trace.variables) or "(none)"
    template = ", ".join(f'"{n}": <value>' for n in trace.variables)
    prompt = EXECUTION_TASK.format(code=code.strip("\n"), call=call, names=names, function=function, template=template)
    answer = json.dumps({"final_output": trace.output, "variables": trace.variables}, sort_keys=True)
    return Problem(uid=f"aux/{EXECUTION_KIND}/{source.uid}/{key}", prompt=prompt, answer=answer,
                   meta={**meta, "source_uid": source.uid})


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def last_json_object(text: str) -> dict | None:
    """The last JSON object of ``text`` (the one that ends last, the outermost of those: the response's last
    line, as the task asks), or None."""
    best: tuple[int, int, dict] | None = None
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, end = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        if isinstance(value, dict) and (best is None or (end, -match.start()) > (best[0], best[1])):
            best = (end, -match.start(), value)
    return None if best is None else best[2]


def grade_execution_task(text: str, problem: Problem) -> Grade:
    """CodeRL+'s reward: 0.1 for a JSON object with both keys, plus 0.9 x right / (1 + k) (module docstring)."""
    expected = json.loads(problem.answer)
    predicted = last_json_object(text)
    nested = predicted is not None and "final_output" in predicted and isinstance(predicted.get("variables"), dict)
    if not nested:
        return Grade(correct=False, extracted=None, reward=0.0, format_ok=False)
    names = list(expected["variables"])
    right = int(_canonical(predicted["final_output"]) == _canonical(expected["final_output"]))
    right += sum(n in predicted["variables"] and _canonical(predicted["variables"][n]) == _canonical(expected["variables"][n])
                 for n in names)
    reward = VALID_FORMAT_CREDIT + CONTENT_CREDIT * right / (1 + len(names))
    return Grade(correct=right == 1 + len(names), extracted=_canonical(predicted), reward=reward, format_ok=True)


def build_execution_tasks(problem: Problem, texts: Sequence[str], picks: Sequence[int], limits: SandboxLimits,
                          max_variables: int = 3, **meta: Any) -> list[Problem]:
    """A task per program of ``texts[i]`` for i in ``picks`` (correct or not), traced on the problem's first test
    of the form ``assert f(...) == ...``; programs that do not parse, fail or time out give none."""
    tests = problem.meta.get("tests") or []
    call = next((c for c in map(asserted_call, tests) if c is not None), None)
    if call is None:
        return []
    requests, codes = [], []
    for i in picks:
        code = extract_code(texts[i])
        if code:
            requests.append((problem_program(code, problem), *call))
            codes.append((i, code))
    traces = trace_programs(requests, limits, max_variables)
    return [execution_task(problem, code, call[0], call[1], trace, f"{i}", **meta)
            for (i, code), trace in zip(codes, traces) if trace is not None]
