"""The code grader: extraction, program assembly, rewards, and every faking trick graded wrong.

The problems are HumanEval/0 and MBPP task 2 (sanitized) as the dataset files give them, built
by hand into :class:`Problem` records the way a code loader does.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import needs_data

import rlbench.sandbox.core as sandbox_core
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
from rlbench.reward.code import (
    CodeReward,
    extract_code,
    problem_entry_point,
    problem_program,
    problem_setup,
)
from rlbench.sandbox import SandboxLimits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

HUMANEVAL_PROMPT = (
    "from typing import List\n\n\n"
    "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    "    given threshold.\n"
    "    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
    "    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n"
    '    """\n'
)
HUMANEVAL_TEST = (
    "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\n"
    "def check(candidate):\n"
    "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
    "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False\n"
    "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True\n"
    "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False\n"
    "    assert candidate([1.0, 2.0, 3.0, 4.0, 5.0, 2.0], 0.1) == True\n"
    "    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True\n"
    "    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False\n\n"
)
HUMANEVAL_BODY = (
    "    for idx, elem in enumerate(numbers):\n"
    "        for idx2, elem2 in enumerate(numbers):\n"
    "            if idx != idx2:\n"
    "                distance = abs(elem - elem2)\n"
    "                if distance < threshold:\n"
    "                    return True\n\n"
    "    return False\n"
)
HUMANEVAL = Problem(
    uid="humaneval/test/0",
    prompt=HUMANEVAL_PROMPT,
    answer="",
    meta={
        "tests": ["check(has_close_elements)"],
        "test_setup": HUMANEVAL_TEST,
        "entry_point": "has_close_elements",
        "code_prefix": HUMANEVAL_PROMPT,
    },
)
MBPP = Problem(
    uid="mbpp/test/2",
    prompt="Write a function to find the shared elements from the given two lists.",
    answer="def similar_elements(test_tup1, test_tup2):\n  res = tuple(set(test_tup1) & set(test_tup2))\n  return (res) ",
    meta={
        "tests": [
            "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
            "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
            "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))",
        ],
        "test_setup": "",
        "entry_point": None,
        "code_prefix": "",
    },
)
MBPP_WITH_IMPORTS = Problem(
    uid="mbpp/test/82",
    prompt="Write a function to find the volume of a sphere.",
    answer="",
    meta={
        "tests": [
            "assert math.isclose(volume_sphere(10), 4188.790204786391, rel_tol=0.001)",
            "assert math.isclose(volume_sphere(25), 65449.84694978735, rel_tol=0.001)",
        ],
        "test_setup": "import math",
    },
)

MBPP_BUILTIN_NAME = Problem(  # MBPP 126: the function under test is called sum
    uid="mbpp/test/126",
    prompt="Write a python function to find the sum of common divisors of two given numbers.",
    answer="def sum(a,b): \n    sum = 0\n    for i in range (1,min(a,b)): \n        if (a % i == 0 and b % i == 0): \n            sum += i \n    return sum",
    meta={"tests": ["assert sum(10,15) == 6", "assert sum(100,150) == 93", "assert sum(4,6) == 3"], "test_setup": ""},
)

WRONG_HE = "def has_close_elements(numbers, threshold):\n    return False\n"


def fence(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code.rstrip()}\n```\n\nIt runs in O(n^2)."


# (name, completion, problem, correct, sandbox status)
CASES = [
    ("humaneval-body-only", fence(HUMANEVAL_BODY), HUMANEVAL, True, "passed"),
    ("humaneval-full-function", fence(HUMANEVAL_PROMPT + HUMANEVAL_BODY), HUMANEVAL, True, "passed"),
    ("mbpp-correct", fence(MBPP.answer + "\n"), MBPP, True, "passed"),
    ("mbpp-test-imports", fence("def volume_sphere(r):\n    return 4 / 3 * math.pi * r ** 3\n"), MBPP_WITH_IMPORTS, True, "passed"),
    ("wrong-answer", fence(WRONG_HE), HUMANEVAL, False, "failed"),
    ("exception-at-import", fence("import nonexistent_module_xyz\n" + WRONG_HE), HUMANEVAL, False, "load_error"),
    ("exception-in-function", fence("def has_close_elements(numbers, threshold):\n    raise ValueError('x')\n"), HUMANEVAL, False, "failed"),
    ("syntax-error", fence("def has_close_elements(numbers, threshold)\n    return True\n"), HUMANEVAL, False, "load_error"),
    ("sys-exit-top-level", fence("import sys\n" + WRONG_HE + "sys.exit(0)\n"), HUMANEVAL, False, "load_error"),
    ("sys-exit-in-function", fence("import sys\ndef has_close_elements(numbers, threshold):\n    sys.exit(0)\n"), HUMANEVAL, False, "failed"),
    ("os-exit-in-function", fence("import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n"), HUMANEVAL, False, "crashed"),
    ("raise-systemexit-mid-test", fence("def has_close_elements(numbers, threshold):\n    raise SystemExit\n"), HUMANEVAL, False, "failed"),
    (
        "exit-in-__del__",
        fence("import os\nclass Bye:\n    def __del__(self):\n        os._exit(0)\n"
              "def has_close_elements(numbers, threshold):\n    Bye()\n    return False\n"),
        HUMANEVAL, False, "crashed",
    ),
    (
        "print-fake-marker",
        fence("import os\nprint('@@rlbench-sandbox@@ done 1')\nprint('All tests passed!')\n"
              + WRONG_HE + "os._exit(0)\n"),
        HUMANEVAL, False, "crashed",
    ),
    (
        "patch-print-assertionerror-json",
        fence("import builtins, json\nbuiltins.print = lambda *a, **k: None\n"
              "builtins.AssertionError = type('Never', (Exception,), {})\n"
              "json.dumps = lambda *a, **k: '{\"passed\": true}'\n" + WRONG_HE),
        HUMANEVAL, False, "failed",
    ),
    (
        "patch-builtins-used-by-tests",
        fence("import builtins\nbuiltins.set = lambda *a: frozenset()\n"
              "def similar_elements(a, b):\n    return ()\n"),
        MBPP, False, "failed",
    ),
    (
        "shadow-a-builtin-the-tests-use",
        fence("def set(x):\n    return 0\ndef similar_elements(a, b):\n    return ()\n"),
        MBPP, False, "failed",
    ),
    ("function-named-like-a-builtin", fence(MBPP_BUILTIN_NAME.answer), MBPP_BUILTIN_NAME, True, "passed"),
    ("wrong-function-named-like-a-builtin", fence("def sum(a, b):\n    return 6\n"), MBPP_BUILTIN_NAME, False, "failed"),
    (
        "redefine-check",
        fence("def check(candidate):\n    pass\n" + WRONG_HE),
        HUMANEVAL, False, "failed",
    ),
    ("keyboard-interrupt", fence("def has_close_elements(numbers, threshold):\n    raise KeyboardInterrupt\n"), HUMANEVAL, False, "failed"),
    (
        "atexit-exit-zero",
        fence("import atexit, os\natexit.register(os._exit, 0)\n"
              "def has_close_elements(numbers, threshold):\n    raise RuntimeError\n"),
        HUMANEVAL, False, "failed",
    ),
]  # fmt: skip

#: Wall clock of the cases whose subject is not time: generous, so that sandbox start-up on a loaded
#: 2-core machine cannot turn a verdict into a timeout (no case relies on it to stop a program).
LIMITS = SandboxLimits(timeout_s=30.0)


@pytest.fixture(scope="module")
def grader():
    return CodeReward(limits=LIMITS)


@pytest.mark.parametrize("name, completion, problem, correct, status", CASES, ids=[c[0] for c in CASES])
def test_code_grader_cases(grader, name, completion, problem, correct, status):
    grade = grader(completion, problem.answer, problem=problem)
    assert grade.correct is correct, grade
    assert grade.reward == (1.0 if correct else 0.0)
    assert grade.details["status"] == status, grade.details
    assert grade.format_ok is completion.startswith("Here is")
    assert grade.error is None
    assert len(grade.details["tests"]) == len(problem.meta["tests"])


def test_slow_solution_times_out():
    grader = CodeReward(limits=SandboxLimits(timeout_s=1.5))
    completion = fence("def has_close_elements(numbers, threshold):\n    while True:\n        pass\n")
    grade = grader(completion, "", problem=HUMANEVAL)
    assert not grade.correct and grade.reward == 0.0
    assert grade.details == {"tests": [[False, "wall-clock time limit reached"]], "status": "timeout"}


@pytest.mark.parametrize("completion", ["I think the answer is to compare all pairs.", HUMANEVAL_BODY])
def test_no_code_gets_the_incorrect_reward_without_running(grader, completion):
    """Prose, or a bare function body outside a fence (no ``def``/``import`` line)."""
    grade = grader(completion, "", problem=HUMANEVAL)
    assert (grade.correct, grade.extracted, grade.reward, grade.format_ok, grade.details) == (False, None, 0.0, False, None)


def test_unfenced_code_is_graded_but_not_format_ok(grader):
    grade = grader(HUMANEVAL_PROMPT + HUMANEVAL_BODY, "", problem=HUMANEVAL)
    assert grade.correct and not grade.format_ok


def test_failing_test_details(grader):
    grade = grader(fence(WRONG_HE), "", problem=HUMANEVAL)
    assert grade.details == {"tests": [[False, "AssertionError"]], "status": "failed"}
    assert grade.extracted == WRONG_HE.rstrip() + "\n"


PARTLY_RIGHT_MBPP = fence("def similar_elements(a, b):\n    return tuple(x for x in a if x in b and x != 13)\n")


def test_pass_rate_mode_scales_with_the_fraction_passed():
    grader = CodeReward(mode="pass_rate", correct_reward=1.0, incorrect_reward=-1.0, limits=LIMITS)
    partly, full, none = grader.grade_many(
        [PARTLY_RIGHT_MBPP, fence(MBPP.answer), "no code here"], [MBPP, MBPP, MBPP]
    )
    assert partly.details["tests"] == [[True, None], [True, None], [False, "AssertionError"]]
    assert partly.reward == pytest.approx(-1.0 + 2.0 * 2 / 3) and not partly.correct
    assert full.reward == 1.0 and full.correct
    assert none.reward == -1.0


def test_all_pass_mode_gives_nothing_for_a_partial_solution():
    grader = CodeReward(mode="all_pass", correct_reward=2.0, incorrect_reward=-0.5, limits=LIMITS)
    partly, full = grader.grade_many([PARTLY_RIGHT_MBPP, fence(MBPP.answer)], [MBPP, MBPP])
    assert (partly.reward, full.reward) == (-0.5, 2.0)


def test_grade_many_keeps_order_and_uses_one_parallel_call(monkeypatch):
    calls = []
    real_run_many = sandbox_core.run_many

    def counting_run_many(jobs, limits, workers):
        calls.append(len(jobs))
        return real_run_many(jobs, limits, workers)

    monkeypatch.setattr("rlbench.reward.code.run_many", counting_run_many)
    grader = CodeReward(limits=LIMITS, workers=2)
    completions = [fence(WRONG_HE), "no code", fence(HUMANEVAL_BODY), fence(MBPP.answer)]
    grades = grader.grade_many(completions, [HUMANEVAL, HUMANEVAL, HUMANEVAL, MBPP])
    assert [g.correct for g in grades] == [False, False, True, True]
    assert calls == [3]  # the completion without code is not run


def test_sandbox_failures_are_counted_not_raised(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_core, "SUPERVISOR", tmp_path / "missing_supervisor.py")
    grader = CodeReward(limits=LIMITS)
    grade = grader(fence(MBPP.answer), "", problem=MBPP)
    assert not grade.correct and grade.reward == 0.0
    assert grade.error.startswith("supervisor exited with 2 without a report")
    assert grade.details["status"] == "sandbox_error"
    assert grader.failures == 1


# ---------------------------------------------------------------------------------------
# extraction and program assembly
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, code",
    [
        ("```python\ndef f():\n    return 1\n```", "def f():\n    return 1\n"),
        ("text\n```py\nx = 1\n```\nmore\n```python\nx = 2\n```\n", "x = 2\n"),
        ("```\nimport os\n```", "import os\n"),
        ("```python\ndef f(): pass\n```\n```bash\nls\n```", "def f(): pass\n"),
        ("```Python3\ny = 3\n```", "y = 3\n"),
        ("cut off:\n```python\ndef f():\n    return", "def f():\n    return"),
        ("def f():\n    return 1", "def f():\n    return 1"),
        ("from math import pi\nprint(pi)", "from math import pi\nprint(pi)"),
        ("The answer is 42.", None),
        ("```bash\nls -la\n```", None),
    ],
)
def test_extract_code(completion, code):
    assert extract_code(completion) == code


def test_the_entry_point_is_the_called_function_the_solution_defines():
    assert problem_entry_point(HUMANEVAL) == "has_close_elements"
    assert problem_entry_point(MBPP) == "similar_elements"  # not set, called first
    assert problem_entry_point(MBPP_BUILTIN_NAME) == "sum"
    assert problem_entry_point(MBPP_WITH_IMPORTS) is None  # no reference solution


def test_problem_program_puts_the_prompt_before_a_bare_body():
    assert problem_program(HUMANEVAL_BODY, HUMANEVAL) == HUMANEVAL_PROMPT + HUMANEVAL_BODY


def test_problem_program_puts_the_prompt_before_a_whole_function_too():
    code = "def has_close_elements(numbers, threshold):\n    return True\n"
    assert problem_program(code, HUMANEVAL) == HUMANEVAL_PROMPT + code


def test_the_tests_setup_is_trusted_code_outside_the_program():
    """The test set-up (check, imports) and the prompt's helpers never run in the sandbox: the
    program is the completion (after the prompt), the setup is the prompt and then the tests' code."""
    assert HUMANEVAL_TEST not in problem_program(HUMANEVAL_BODY, HUMANEVAL)
    assert problem_setup(HUMANEVAL) == HUMANEVAL_PROMPT.rstrip("\n") + "\n\n" + HUMANEVAL_TEST.rstrip("\n") + "\n"
    assert problem_setup(MBPP_WITH_IMPORTS) == "import math\n"
    assert problem_setup(MBPP) == ""


@pytest.mark.parametrize("task", ["HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/50"])
@needs_data
def test_whole_function_answers_may_use_the_prompts_helpers(task):
    """These prompts define helpers (is_palindrome, poly, encode_cyclic, encode_shift) before the
    function to write; a reply that restates only that function must still see them."""
    import yaml
    from conftest import ROOT

    from rlbench.dataset import load_problems

    spec = yaml.safe_load((ROOT / "conf" / "benchmark" / "humaneval.yaml").read_text())
    problem = next(p for p in load_problems(spec) if p.meta["id"] == task)
    prompt, entry = problem.prompt, problem.meta["entry_point"]
    signature_on = prompt[prompt.index(f"def {entry}(") :]  # the function alone, without the helpers
    reply = f"```python\n{signature_on}{problem.answer}```"
    grade = CodeReward(limits=LIMITS)(reply, "", problem=problem)
    assert grade.correct, grade.details


def test_problem_program_appends_the_setups_imports_only():
    code = "def volume_sphere(r):\n    return r\n"
    assert problem_program(code, MBPP_WITH_IMPORTS) == code + "\nimport math\n"
    assert problem_program(code, MBPP) == code
    mixed = Problem(uid="x/0", prompt="", answer="", meta={"tests": ["pass"], "test_setup": "import re\ndef check(c):\n    import os\n"})
    assert problem_program(code, mixed) == code + "\nimport re\n"


@pytest.mark.parametrize("tests", [None, [], "assert True", [1, 2]])
def test_problems_without_usable_tests_are_refused(grader, tests):
    problem = Problem(uid="bad/0", prompt="", answer="", meta={"tests": tests})
    with pytest.raises(DataError, match=r"bad/0: meta\['tests'\]"):
        grader("```python\nx = 1\n```", "", problem=problem)


def test_bad_mode_is_refused():
    with pytest.raises(ConfigError, match="mode"):
        CodeReward(mode="best_of")


def test_a_broken_sandbox_is_counted_not_raised(monkeypatch, caplog):
    import rlbench.reward.code as code_module

    def no_processes(*args, **kwargs):
        raise OSError("cannot fork")

    monkeypatch.setattr(code_module, "run_many", no_processes)
    grader = CodeReward()
    grades = grader.grade_many(["```python\nx = 1\n```", "no code here"], [MBPP, MBPP])
    assert [g.correct for g in grades] == [False, False] and grader.failures == 1
    assert "cannot fork" in grades[0].error and grades[1].error is None
    assert "sandbox unavailable" in caplog.text


@needs_data
@pytest.mark.skipif(shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin") is None, reason="the minimal root comes from bubblewrap")
def test_a_completion_that_reads_the_answer_key_fails():
    """HumanEval/0 'solved' by opening the benchmark's data file and running the canonical solution:
    the data directory (and the project) are not in the sandbox, so it fails; the real solution passes."""
    from rlbench.dataset import resolve_data_dir

    data_file = resolve_data_dir() / "humaneval" / "test.jsonl"
    cheat = (
        "import json\n"
        "def has_close_elements(numbers, threshold):\n"
        f"    with open({str(data_file)!r}) as f:\n"
        "        record = json.loads(f.readline())\n"
        "    namespace = {}\n"
        "    exec(record['prompt'] + record['canonical_solution'], namespace)\n"
        "    return namespace['has_close_elements'](numbers, threshold)\n"
    )
    grader = CodeReward(limits=LIMITS)
    cheated, honest = grader.grade_many([fence(cheat), fence(HUMANEVAL_BODY)], [HUMANEVAL, HUMANEVAL])
    assert not cheated.correct and cheated.details["tests"][0][1].startswith("FileNotFoundError")
    assert honest.correct


@needs_data
def test_the_prompts_helpers_in_the_tests_are_the_benchmarks_own():
    """HumanEval/32's check calls the prompt's ``poly`` on the candidate's root. A completion that
    redefines ``poly`` to return 0 everywhere (and answers 0) does not reach the tests' ``poly``."""
    import yaml
    from conftest import ROOT

    from rlbench.dataset import load_problems

    spec = yaml.safe_load((ROOT / "conf" / "benchmark" / "humaneval.yaml").read_text())
    problem = next(p for p in load_problems(spec) if p.meta["id"] == "HumanEval/32")
    forged = "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n"
    honest = problem.answer
    grader = CodeReward(limits=LIMITS)
    forged_grade, honest_grade = grader.grade_many([fence(forged), fence(honest)], [problem, problem])
    assert not forged_grade.correct and forged_grade.details["tests"][0][1] == "AssertionError"
    assert honest_grade.correct, honest_grade.details


def test_pass_rate_leaves_out_the_test_the_prompt_shows():
    """MBPP's prompt shows its first assert (``example_test_in_prompt``): a completion that only
    echoes that assert's expected value passes it and nothing else. ``pass_rate`` pays it nothing
    (it paid a third), and a partial solution is scored on the hidden tests alone."""
    from omegaconf import OmegaConf

    from rlbench.dataset.code import records_to_code_problems

    spec = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf" / "dataset" / "mbpp.yaml"))
    record = {"task_id": 602, "prompt": MBPP.prompt, "code": MBPP.answer, "test_list": MBPP.meta["tests"], "test_imports": []}
    (problem,) = records_to_code_problems([("mbpp.jsonl:1", record)], spec, name="mbpp", split="train")
    assert problem.meta["tests"][0] in problem.prompt and problem.meta["tests_in_prompt"] == [0]
    echo = fence("def similar_elements(a, b):\n    return (4, 5)\n")
    grader = CodeReward(mode="pass_rate", correct_reward=1.0, incorrect_reward=0.0, limits=LIMITS)
    echoed, partly, full = grader.grade_many([echo, PARTLY_RIGHT_MBPP, fence(MBPP.answer)], [problem] * 3)
    assert [t[0] for t in echoed.details["tests"]] == [True, False, False]
    assert echoed.reward == 0.0
    assert partly.reward == pytest.approx(1 / 2)  # hidden tests: one of two passed
    assert full.reward == 1.0
    unshown = grader.grade_many([echo], [MBPP])[0]  # no test shown: every test counts
    assert unshown.reward == pytest.approx(1 / 3)
