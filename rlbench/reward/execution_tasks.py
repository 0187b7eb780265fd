"""CodeRL+'s execution-semantics tasks (Jiang et al. 2025, "CodeRL+: Improving Code Generation via
Reinforcement with Execution Semantics Alignment", arXiv:2510.18471, section 3): a program the policy wrote
(correct or not) is run on a test input, its return value and the values of its function's variables at their
last definition are recorded, and the pair becomes a task for the same policy: "predict the output and those
values", rewarded by exact match with partial credit.

Tracing (the paper's f_p(x) = {var_i: v at t_last(var_i)}: each variable's value at its last definition
point). The program runs only in the code sandbox (rlbench.sandbox.run_tests, the run's limits: an infinite
loop ends at the wall clock, and the task is not built). The sandbox refuses ``sys.settrace``, so the trace is
made by rewriting the source (parsed here with :mod:`ast`, never run here): in the entry function each
statement that binds a variable is followed by ``_rlbench_bind("x", x)`` (assignments, augmented and annotated
assignments, every name of an unpacking; a for-loop's and a with-statement's targets at the start of their
body; ``:=`` in place; the parameters on entry; ``del x`` drops x), and the body runs inside
``_rlbench_enter()`` / ``finally: _rlbench_leave()`` so that only the outermost call records (a recursive call's
variables are another execution's; a second outermost call starts afresh). A record keeps the object bound, so
a list filled by ``append`` after its last assignment is read as it is when the call returns (the paper's
example asks ``"buf": [1, 2]``; the authors' release reads the values when the program ends). Statements that do
not run (a branch not taken, code after the return) record nothing; nested functions, classes, lambdas and
comprehensions keep their own variables (a comprehension's ``x`` does not shadow the function's). After the
program, the test's call runs and one line, a marker with a nonce and JSON, is printed: the return value and
the last ``max_variables`` (3, the authors' release) JSON-valued variables in order of first definition, each
at its last definition. A variable whose value is not JSON data is left out; a run that fails, times out or
prints no marker line builds no task (counted by the caller). Not recorded: names bound by ``import``,
``except ... as``, ``match`` patterns, or assigned by a nested function through ``nonlocal``.

The harness output is the program's to print, so it is read defensively (:func:`parse_trace`): the marker
carries a random nonce made in the trusted process for this run, exactly one marker line must be printed, at
most ``MAX_TRACE_CHARS`` long, with exactly the two keys, at most ``max_variables`` identifier names, and the run
must end with status ``passed`` (``os._exit`` after a forged line is a crash). A program that prints a forged
line (without the nonce, or with it, read out of its own module) gets no task; one that both learns the nonce
and silences the harness's own line can still set its task's labels, as it always could. That decides nothing
for the program itself: its own reward is the unit tests', graded separately in the trusted process, and a
task's labels must still be matched by the predictor's responses.

Reward (section 3.2 of the paper; the constants are the authors' released reward function's, 0.1 and 0.9):
0.1 when the response's last JSON object has both keys ``final_output`` and ``variables``, plus
0.9 x (the number right among the output and the k variables) / (1 + k). Values are compared as JSON
(``1`` and ``1.0`` differ; a tuple is a list). The grade is correct when all are right.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlbench.dataset.base import Problem
from rlbench.reward.code import extract_code, problem_program
from rlbench.reward.math import Grade
from rlbench.sandbox import SandboxLimits, run_many

EXECUTION_KIND = "execution"
TRACE_MARK = "__rlbench_trace__:"
ENTER, LEAVE, BIND, UNBIND = "_rlbench_enter", "_rlbench_leave", "_rlbench_bind", "_rlbench_unbind"
MAX_TRACE_CHARS = 4000  # a longer marker line (a huge value) builds no task
VALID_FORMAT_CREDIT, CONTENT_CREDIT = 0.1, 0.9
SOURCE_CORRECT_KEY = "source_correct"  # Problem.meta key: whether the response a task was built from was verified correct

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


def _bound_names(target: ast.AST) -> list[str]:
    """The variable names an assignment target binds (``a``, ``a, (b, *c)``); none for ``x.attr`` or ``x[i]``."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _bound_names(element)]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    return []


def _call(function: str, *args: ast.expr) -> ast.Call:
    return ast.Call(ast.Name(function, ast.Load()), list(args), [])


def _binds(names: Sequence[str]) -> list[ast.stmt]:
    return [ast.Expr(_call(BIND, ast.Constant(n), ast.Name(n, ast.Load()))) for n in names]


_NESTED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


class _RecordWalrus(ast.NodeTransformer):
    """``(x := v)`` becomes ``_rlbench_bind("x", (x := v))`` (nested scopes keep theirs)."""

    def generic_visit(self, node: ast.AST) -> ast.AST:
        return node if isinstance(node, _NESTED_SCOPES) else super().generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> ast.AST:
        node.value = self.visit(node.value)
        return ast.copy_location(_call(BIND, ast.Constant(node.target.id), node), node)


def _record_block(statements: list[ast.stmt]) -> list[ast.stmt]:
    """``statements`` with each binding of a variable followed by its record (assignment, augmented and annotated
    assignment, unpacking; a for-loop's and a with-statement's targets at the start of their body; ``del`` drops
    the record), into every nested block of the same scope (nested functions and classes keep theirs)."""
    out: list[ast.stmt] = []
    for s in statements:
        after: list[ast.stmt] = []
        if isinstance(s, ast.Assign):
            after = _binds([n for t in s.targets for n in _bound_names(t)])
        elif isinstance(s, (ast.AugAssign, ast.AnnAssign)) and isinstance(s.target, ast.Name) and s.value is not None:
            after = _binds([s.target.id])
        elif isinstance(s, ast.Delete):
            after = [ast.Expr(_call(UNBIND, ast.Constant(n))) for t in s.targets for n in _bound_names(t)]
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            s.body, s.orelse = _binds(_bound_names(s.target)) + _record_block(s.body), _record_block(s.orelse)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            targets = [n for item in s.items if item.optional_vars is not None for n in _bound_names(item.optional_vars)]
            s.body = _binds(targets) + _record_block(s.body)
        elif isinstance(s, (ast.While, ast.If)):
            s.body, s.orelse = _record_block(s.body), _record_block(s.orelse)
        elif isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            s.body, s.orelse, s.finalbody = _record_block(s.body), _record_block(s.orelse), _record_block(s.finalbody)
            for handler in s.handlers:
                handler.body = _record_block(handler.body)
        elif isinstance(s, ast.Match):
            for case in s.cases:
                case.body = _record_block(case.body)
        out += [s, *after]
    return out


def _record_definitions(function: ast.FunctionDef) -> ast.FunctionDef:
    """``function`` recording each of its variables at every definition (its parameters on entry), inside an
    ``_rlbench_enter()`` / ``try: ... finally: _rlbench_leave()`` that tells the outermost call from a recursive one."""
    arguments = function.args
    parameters = [a.arg for a in [*arguments.posonlyargs, *arguments.args, arguments.vararg, *arguments.kwonlyargs,
                                  arguments.kwarg] if a is not None]
    body = [_RecordWalrus().visit(s) for s in function.body]
    function.body = [ast.Expr(_call(ENTER)),
                     ast.Try(body=_binds(parameters) + _record_block(body), handlers=[], orelse=[],
                             finalbody=[ast.Expr(_call(LEAVE))])]
    return function


def tracing_program(program: str, call: str, function: str, max_variables: int, nonce: str = "") -> str | None:
    """``program`` with its top-level ``function`` recording its variables at each definition, then the call and
    the marker line (``TRACE_MARK + nonce + ":" + JSON``); None when the program does not parse or has no such
    top-level function."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return None
    entry = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    if not entry:
        return None
    for node in entry:
        _record_definitions(node)
    trailer = f"""
import json as _rlbench_json
_rlbench_depth = [0]
_rlbench_defs = {{}}
def {ENTER}():
    _rlbench_depth[0] += 1
    if _rlbench_depth[0] == 1:
        _rlbench_defs.clear()
def {LEAVE}():
    _rlbench_depth[0] -= 1
def {BIND}(name, value):
    if _rlbench_depth[0] == 1:
        _rlbench_defs[name] = value
    return value
def {UNBIND}(name):
    if _rlbench_depth[0] == 1:
        _rlbench_defs.pop(name, None)
def _rlbench_plain(value):
    try:
        return True, _rlbench_json.loads(_rlbench_json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return False, None
_rlbench_output = {call}
_rlbench_ok, _rlbench_value = _rlbench_plain(_rlbench_output)
_rlbench_vars = [(k, _rlbench_plain(v)) for k, v in _rlbench_defs.items() if not k.startswith("_")]
_rlbench_vars = {{k: v for k, (ok, v) in _rlbench_vars if ok}}
_rlbench_vars = dict(list(_rlbench_vars.items())[-{int(max_variables)}:])
if _rlbench_ok:
    print({TRACE_MARK!r} + {nonce!r} + ":" + _rlbench_json.dumps({{"final_output": _rlbench_value, "variables": _rlbench_vars}}))
"""
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" + trailer


def parse_trace(stdout: str, nonce: str = "", max_variables: int = 3) -> Trace | None:
    """The trace a run printed, read defensively: exactly one marker line carrying the run's ``nonce``, at most
    ``MAX_TRACE_CHARS`` long, holding a JSON object with exactly the keys ``final_output`` and ``variables``, the
    latter at most ``max_variables`` identifiers mapped to JSON data; anything else is None (no task)."""
    lines = [line for line in stdout.splitlines() if line.startswith(TRACE_MARK)]
    mark = f"{TRACE_MARK}{nonce}:"
    if len(lines) != 1 or not lines[0].startswith(mark) or len(lines[0]) > MAX_TRACE_CHARS:
        return None
    try:
        data = json.loads(lines[0][len(mark):])
    except ValueError:
        return None
    if not isinstance(data, dict) or set(data) != {"final_output", "variables"} or not isinstance(data["variables"], dict):
        return None
    variables = data["variables"]
    if len(variables) > max_variables or not all(n.isidentifier() and not n.startswith("_") for n in variables):
        return None
    return Trace(data["final_output"], variables)


def trace_programs(requests: Sequence[tuple[str, str, str]], limits: SandboxLimits, max_variables: int = 3) -> list[Trace | None]:
    """Per (program, call, function): its trace, run in the sandbox (several at once, each with a fresh nonce in
    its marker), or None."""
    nonces = [secrets.token_hex(16) for _ in requests]
    programs = [tracing_program(program, call, function, max_variables, nonce)
                for (program, call, function), nonce in zip(requests, nonces)]
    runnable = [i for i, p in enumerate(programs) if p is not None]
    results = run_many([(programs[i], []) for i in runnable], limits) if runnable else []
    traces: list[Trace | None] = [None] * len(requests)
    for i, result in zip(runnable, results):
        traces[i] = parse_trace(result.stdout, nonces[i], max_variables) if result.status == "passed" else None
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
                          max_variables: int = 3, correct: Sequence[bool] | None = None, **meta: Any) -> list[Problem]:
    """A task per program of ``texts[i]`` for i in ``picks`` (correct or not: ``correct[i]``, when given, is kept
    in the task's ``meta["source_correct"]``), traced on the problem's first test of the form
    ``assert f(...) == ...``; programs that do not parse, fail or time out give none."""
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
    verdict = (lambda i: {SOURCE_CORRECT_KEY: bool(correct[i])}) if correct is not None else (lambda i: {})
    return [execution_task(problem, code, call[0], call[1], trace, f"{i}", **meta, **verdict(i))
            for (i, code), trace in zip(codes, traces) if trace is not None]
