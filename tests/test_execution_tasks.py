"""CodeRL+'s execution-semantics tasks (arXiv:2510.18471; rlbench/reward/execution_tasks.py, docs/judges.md):
the tracer's values for small programs (loops, lists, recursion), worked by hand; the partial-credit reward;
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


def test_the_rewritten_function_keeps_its_nested_scopes():
    program = "def f(x):\n    def g(y):\n        return y + 1\n    z = g(x)\n    return z\n"
    traced = tracing_program(program, "f(1)", "f", 3)
    assert traced.count("_rlbench_record(locals()") == 2  # f's return and its appended fall-through, not g's
    assert trace_programs([(program, "f(1)", "f")], LIMITS)[0].output == 2


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


def test_the_share_of_execution_tasks_holds_per_step():
    """CodeRL+ mixes 40% of each batch from the tasks once the buffer is warm: 2 of 5 prompts."""
    trainer = TrainerConfig(prompts_per_step=5, aux_tasks=AuxTasksConfig(share=0.4, kinds=["execution"], per_group=2))
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
        curriculum.observe(step, graded(prompts, [["no program"] for _ in prompts]))
