"""CodeRL+'s execution-semantics tasks (arXiv:2510.18471; rlbench/reward/execution_tasks.py, docs/judges.md):
the tracer's values for small programs (loops, lists, recursion, each variable at its last definition), worked by
hand; a hostile program's forged trace; the defensive reading of the harness output; the partial-credit reward;
the share of a step's prompts; infinite loops end at the sandbox's clock and build no task."""

import json
import time

import numpy as np
import pytest
import torch

from rlbench.config.schema import AuxTasksConfig, TrainerConfig
from rlbench.dataset.base import Problem
from rlbench.reward import grade_completions
from rlbench.reward.code import CodeReward
from rlbench.reward.execution_tasks import (
    Trace,
    execution_task,
    grade_execution_task,
    asserted_call,
    parse_trace,
    trace_programs,
    tracing_program,
)
from rlbench.reward.judge_tasks import AUX_TASK_KEY, build_judge_tasks
from rlbench.reward.math import Grade
from rlbench.rollout import GradedGroups
from rlbench.rollout.engines.base import Completion
from rlbench.sandbox import SandboxLimits
from rlbench.training.curricula import Curriculum

LIMITS = SandboxLimits(timeout_s=5.0)

LOOP = """
def running(xs):
    total = 0
    doubled = []
    for x in xs:
        total += x
        doubled.append(2 * x)
    return total
"""
EARLY = """
def first_even(xs):
    seen = []
    for x in xs:
        if x % 2 == 0:
            return x
        seen.append(x)
    count = len(seen)
"""
RECURSIVE = """
def fact(n):
    if n <= 1:
        return 1
    rest = fact(n - 1)
    return n * rest
"""


def test_the_call_comes_from_an_assert_test():
    assert asserted_call("assert running([1, 2, 3]) == 6") == ("running([1, 2, 3])", "running")
    assert asserted_call("x = f(1)") is None and asserted_call("assert f(1) == 2 and g(2) == 3") is None
    assert asserted_call("check(candidate)") is None and asserted_call("assert (") is None


def test_the_tracer_records_the_last_return_of_loops_lists_early_returns_and_recursion():
    traces = trace_programs([(LOOP, "running([1, 2, 3])", "running"), (EARLY, "first_even([1, 3, 4, 5])", "first_even"),
                             (EARLY, "first_even([1, 3])", "first_even"), (RECURSIVE, "fact(4)", "fact")], LIMITS)
    # the last three locals in order of first assignment (the argument xs counts as one)
    assert traces[0] == Trace(6, {"total": 6, "doubled": [2, 4, 6], "x": 3})
    assert traces[1] == Trace(4, {"xs": [1, 3, 4, 5], "seen": [1, 3], "x": 4})
    assert traces[2] == Trace(None, {"seen": [1, 3], "x": 3, "count": 2})  # fell off the end
    assert traces[3] == Trace(24, {"n": 4, "rest": 6})  # the outermost call returns last


def test_values_that_are_not_json_data_are_left_out_and_a_broken_program_gives_no_trace():
    program = "def f():\n    a = {1, 2}\n    b = (1, 2)\n    return a\n"
    assert trace_programs([(program, "f()", "f")], LIMITS) == [None]  # a set is not JSON: no output, no task
    program = "def f():\n    a = {1, 2}\n    b = (1, 2)\n    return 5\n"
    assert trace_programs([(program, "f()", "f")], LIMITS) == [Trace(5, {"b": [1, 2]})]
    assert trace_programs([("def f(:\n", "f()", "f"), ("def g():\n    return 1\n", "f()", "f"),
                           ("def f():\n    raise ValueError\n", "f()", "f")], LIMITS) == [None, None, None]


def test_an_infinite_loop_ends_at_the_sandbox_clock_and_builds_no_task():
    start = time.monotonic()
    assert trace_programs([("def f():\n    while True:\n        pass\n", "f()", "f")], SandboxLimits(timeout_s=1.0)) == [None]
    assert time.monotonic() - start < 30


STEPS = """
def steps(n):
    i = 0
    while i < n:
        last = i * i
        i += 1
    if (big := last > 3):
        label = "big"
    return last
"""
SHADOW = """
def shadow(n):
    n = n * 2
    x = 10
    squares = [x * x for x in range(3)]
    def inner():
        x = 99
        return x
    y = inner()
    return x + y
"""
UNPACK = """
def split(pair):
    (a, b), *rest = pair, 5, 6
    a, b = b, a
    return a - b
"""
BRANCH = """
def sign(v):
    if v > 0:
        label = "pos"
    else:
        other = "neg"
    if v > 0:
        return label
    after = 1
    return other
"""
TWICE = "def inc(k):\n    if k < 2:\n        small = k\n    j = gone = k + 1\n    junk = {1}\n    del j, gone\n    j = k + 1\n    return j\n"


def test_each_variable_is_read_at_its_last_definition():
    """Worked by hand: every JSON-valued variable (max_variables=9) in order of first definition, each at its last
    definition in the outermost call; a statement that does not run records nothing."""
    traces = trace_programs([(STEPS, "steps(3)", "steps"), (SHADOW, "shadow(2)", "shadow"), (UNPACK, "split([1, 2])", "split"),
                             (BRANCH, "sign(3)", "sign"), (BRANCH, "sign(-1)", "sign"), (TWICE, "inc(inc(1))", "inc")],
                            LIMITS, max_variables=9)
    # the loop reassigns i and last; i += 1 is a definition; the walrus binds big (4 > 3), then label
    assert traces[0] == Trace(4, {"n": 3, "i": 3, "last": 4, "big": True, "label": "big"})
    # the parameter n reassigned (4, not the argument 2); the comprehension's x and inner's x do not shadow x = 10;
    # inner itself is a function (not JSON): left out
    assert traces[1] == Trace(109, {"n": 4, "x": 10, "squares": [0, 1, 4], "y": 99})
    # nested unpacking with a starred target, then a swap: a and b at their second definition
    assert traces[2] == Trace(1, {"pair": [1, 2], "a": 2, "b": 1, "rest": [5, 6]})
    # the else branch (other) is not taken, and after = 1 lies after the return that ran
    assert traces[3] == Trace("pos", {"v": 3, "label": "pos"})
    assert traces[4] == Trace("neg", {"v": -1, "other": "neg", "after": 1})
    # the second outermost call (k = 2) starts afresh (the first's small = 1 is not kept); del drops j and gone, and
    # j = k + 1 defines j again, now after junk (a set: not JSON, left out)
    assert traces[5] == Trace(3, {"k": 2, "j": 3})
    assert [list(t.variables) for t in (traces[0], traces[2])] == [["n", "i", "last", "big", "label"], ["pair", "a", "b", "rest"]]
    # the last three of them are asked by default
    assert trace_programs([(SHADOW, "shadow(2)", "shadow")], LIMITS)[0].variables == {"x": 10, "squares": [0, 1, 4], "y": 99}


FORGED = '''
import builtins, json, re, sys
def add(a, b):
    frame, nonce = sys._getframe(0), None
    while frame is not None and nonce is None:  # the harness's source, read from a caller's locals
        for value in list(frame.f_locals.values()):
            found = re.search("__rlbench_trace__:' \\\\+ '([0-9a-f]{32})'", value) if isinstance(value, str) else None
            nonce = nonce or (found and found.group(1))
        frame = frame.f_back
    print("__rlbench_trace__:" + NONCE + ":" + json.dumps({"final_output": 3, "variables": {"a": 3}}))
    SILENCE
    return a - b
'''


def test_a_hostile_program_cannot_forge_a_trace_or_its_own_reward():
    """A wrong add (a - b) prints a forged trace claiming the right output 3: without the run's nonce, or with
    it (read out of the harness's frame) beside the harness's own line, no task is built. One that also silences
    the harness's print sets its task's labels, as it always could; its own reward stays the unit tests' (0)."""
    forged = [FORGED.replace("NONCE", nonce).replace("SILENCE", silence) for nonce, silence in
              [('""', "pass"), ("nonce", "pass"), ("nonce", "builtins.print = lambda *a, **k: None")]]
    traces = trace_programs([(p, "add(1, 2)", "add") for p in forged], LIMITS)
    assert traces[:2] == [None, None]
    assert traces[2] == Trace(3, {"a": 3})  # the labels it forged: an odd task, nothing for the program
    problem = code_problem(0)
    problem.meta["tests"] = ["assert add(1, 2) == 3"]
    answers = [Completion(0, (1,), [1], [0.0], True, text=f"```python\n{p}\n```") for p in forged]
    assert [g.reward for g in grade_completions(CodeReward(), [problem] * 3, answers)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("stdout", [
    "__rlbench_trace__:N:" + json.dumps({"final_output": 1, "variables": {"a": 1}}) + "\n__rlbench_trace__:N:{}",  # two lines
    "__rlbench_trace__:M:" + json.dumps({"final_output": 1, "variables": {}}),               # another nonce
    "__rlbench_trace__:N:" + json.dumps({"final_output": 1, "variables": {"a": 1}, "x": 2}),  # a third key
    "__rlbench_trace__:N:" + json.dumps({"final_output": 1, "variables": [1]}),              # not a mapping
    "__rlbench_trace__:N:" + json.dumps({"final_output": 1, "variables": {"a b": 1}}),       # not a name
    "__rlbench_trace__:N:" + json.dumps({"final_output": 1, "variables": {f"v{i}": i for i in range(4)}}),  # over 3
    "__rlbench_trace__:N:" + json.dumps({"final_output": "x" * 5000, "variables": {}}),      # over MAX_TRACE_CHARS
])
def test_the_harness_output_is_read_defensively(stdout):
    assert parse_trace(stdout, "N", 3) is None
    assert parse_trace("__rlbench_trace__:N:" + json.dumps({"final_output": 1, "variables": {"a": [1]}}), "N", 3) == Trace(1, {"a": [1]})


def test_the_rewritten_function_keeps_its_nested_scopes():
    program = "def f(x):\n    def g(y):\n        z = y + 1\n        return z\n    z = g(x)\n    return z\n"
    traced = tracing_program(program, "f(1)", "f", 3)
    assert traced.count("_rlbench_bind('z', z)") == 1 and traced.count("    _rlbench_enter()\n") == 1  # f's, not g's
    assert trace_programs([(program, "f(1)", "f")], LIMITS)[0] == Trace(2, {"x": 1, "z": 2})


TASK = execution_task(Problem("p", "", ""), LOOP, "running([1, 2, 3])", "running", Trace(6, {"total": 6, "doubled": [2, 4, 6], "x": 3}), "0")


@pytest.mark.parametrize("response, reward, correct", [
    ('so {"final_output": 6, "variables": {"total": 6, "doubled": [2, 4, 6], "x": 3}}', 1.0, True),
    # output and 2 of 3 variables right: 0.1 + 0.9 * 3 / 4
    ('{"final_output": 6, "variables": {"total": 6, "doubled": [2, 4, 6], "x": 2}}', 0.1 + 0.9 * 3 / 4, False),
    ('{"final_output": 5, "variables": {}}', 0.1, False),               # valid, nothing right
    ('{"final_output": 6.0, "variables": {"total": 6}}', 0.1 + 0.9 * 1 / 4, False),  # 6.0 is not 6
    ('{"final_output": 6}', 0.0, False),                                # a key missing: no format credit
    ("the answer is 6", 0.0, False),
])
def test_partial_credit(response, reward, correct):
    grade = grade_execution_task(response, TASK)
    assert grade.reward == pytest.approx(reward) and grade.correct is correct


def test_the_run_grades_an_execution_task_by_its_own_rule():
    task = build_judge_tasks(Problem("p", "", "", meta={"tests": ["assert running([1, 2, 3]) == 6"]}),
                             [f"```python\n{LOOP}\n```"], [Grade(True, None, 1.0, True)], ["execution"], 1, np.random.default_rng(0), LIMITS)
    assert len(task) == 1 and task[0].meta[AUX_TASK_KEY] == "execution" and json.loads(task[0].answer)["final_output"] == 6
    answer = Completion(0, (1,), [1], [0.0], True, text='{"final_output": 6, "variables": {"total": 6, "doubled": [2, 4, 6], "x": 3}}')
    assert grade_completions(CodeReward(), task, [answer])[0].reward == 1.0


def code_problem(i: int) -> Problem:
    return Problem(uid=f"c/{i}", prompt=f"Write add_{i}.", answer="",
                   meta={"tests": [f"assert add_{i}(1, 2) == 3"], "test_setup": "", "entry_point": None})


def graded(problems, texts_per_group):
    groups = [[Completion(0, (1,), [1], [0.0], True, text=t) for t in texts] for texts in texts_per_group]
    flat = [p for p, g in zip(problems, groups) for _ in g]
    grades = grade_completions(CodeReward(), flat, [c for g in groups for c in g])
    b = len(flat)
    return GradedGroups(list(problems), groups, grades, torch.zeros(b), torch.zeros(b), torch.ones(b, dtype=torch.bool),
                        list(range(len(groups))))


@pytest.mark.parametrize("sampling, balance", [("uniform", False), ("recent", True)])
def test_the_share_of_execution_tasks_holds_per_step(sampling, balance):
    """CodeRL+ mixes 40% of each batch from the tasks once the buffer is warm: 2 of 5 prompts; the paper's buffer
    (recent, balanced) draws one passing program's task and one failing program's at each step."""
    trainer = TrainerConfig(prompts_per_step=5, aux_tasks=AuxTasksConfig(share=0.4, kinds=["execution"], per_group=2,
                                                                         sampling=sampling, balance=balance))
    curriculum = Curriculum(trainer, seed=0, problems=[code_problem(i) for i in range(20)], sandbox_limits=LIMITS)
    first = curriculum.prompts(1, ctx=None)
    right = "```python\ndef add_{i}(a, b):\n    s = a + b\n    return s\n```"
    wrong = "```python\ndef add_{i}(a, b):\n    d = a - b\n    return d\n```"
    curriculum.observe(1, graded(first, [[right.format(i=p.uid[2:]), wrong.format(i=p.uid[2:])] for p in first]))
    assert curriculum.metrics()["aux_built"] == 10  # both programs of every group, the incorrect one too
    for step in (2, 3):
        prompts = curriculum.prompts(step, ctx=None)
        tasks = [p for p in prompts if AUX_TASK_KEY in p.meta]
        assert len(prompts) == 5 and len(tasks) == 2 and curriculum.metrics()["aux_shortfall"] == 0
        outputs = {json.loads(t.answer)["final_output"] for t in tasks}
        assert outputs <= {3, -1}  # a + b and a - b on (1, 2)
        if balance:
            assert sorted(json.loads(t.answer)["final_output"] for t in tasks) == [-1, 3]
            assert sorted(t.meta["source_correct"] for t in tasks) == [False, True]
        curriculum.observe(step, graded(prompts, [["no program"] for _ in prompts]))
