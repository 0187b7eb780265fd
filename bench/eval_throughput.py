"""Grading throughput: graded problems per second for math and for code, parallel against serial.

* **math**: ``rlbench.reward.MathReward()`` on MATH-500 (``math500/test.jsonl`` in the data
  directory, found by ``rlbench.dataset.resolve_data_dir``). Two completions per problem: the
  reference answer in ``\\boxed{}`` (correct) and the next problem's answer in ``\\boxed{}``
  (almost always wrong; the symbolic comparisons it triggers are the slow path). The serial path
  grades in this process; the parallel path in a pool of ``--workers`` processes (``math-verify``
  times out with ``SIGALRM``, which only works on a main thread, so threads would not help).
  Both the pool and this process are warmed up (``math-verify`` imported) before timing.
* **humaneval**: the same on HumanEval (``humaneval/test.jsonl``, loaded through
  ``conf/benchmark/humaneval.yaml``): the prompt plus the canonical solution, graded by
  ``check(<entry_point>)``.
* **code**: ``rlbench.reward.code.CodeReward()`` on MBPP sanitized (``mbpp/sanitized.jsonl``):
  the completion is the reference ``code`` in a ```` ```python ```` fence, the tests are
  ``test_list``, the set-up is ``test_imports``. Serial: ``workers=1``; parallel:
  ``--workers`` sandboxes at a time (default: one per CPU core). Each program gets its own sandbox (fresh
  supervisor and harness processes).

Both paths grade the same inputs in the same run; the script checks that they agree. Next to
the wall clock it records CPU milliseconds per problem (math: inside the grading processes;
code: this process plus every supervisor and harness process), which does not depend on how
busy the machine is; the wall-clock ratio does.

Usage::

    python bench/eval_throughput.py                       # all 500 math problems, all 427 MBPP tasks
    python bench/eval_throughput.py --math-limit 100 --code-limit 50   # a quick look

Writes ``results/bench/eval_throughput.json`` and ``.md`` (atomically). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlbench.dataset import resolve_data_dir  # noqa: E402
from rlbench.dataset.base import Problem  # noqa: E402
from rlbench.reward import MathReward  # noqa: E402
from rlbench.reward.code import CodeReward  # noqa: E402
from rlbench.sandbox import SandboxLimits  # noqa: E402
from rlbench.utils import atomic_write_json, atomic_write_text  # noqa: E402

RESULTS_DIR = ROOT / "results" / "bench"


def read_jsonl(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


# ---------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------


def math_inputs(limit: int | None) -> list[tuple[str, str]]:
    """(completion, reference) pairs: each problem's own answer, then the next one's."""
    rows = read_jsonl(resolve_data_dir() / "math500" / "test.jsonl", limit)
    answers = [r["answer"] for r in rows]
    pairs = []
    for i, answer in enumerate(answers):
        other = answers[(i + 1) % len(answers)]
        pairs.append((f"Working as above, the answer is $\\boxed{{{answer}}}$.", answer))
        pairs.append((f"Working as above, the answer is $\\boxed{{{other}}}$.", answer))
    return pairs


_worker_reward: MathReward | None = None


def _init_math_worker() -> None:
    global _worker_reward
    _worker_reward = MathReward()
    _worker_reward("\\boxed{\\sqrt{2}}", "\\frac{2}{\\sqrt{2}}")  # imports math-verify


def _grade_math(pair: tuple[str, str]) -> tuple[bool, float]:
    """(correct, CPU seconds this process spent grading)."""
    start = time.process_time()
    correct = _worker_reward(*pair).correct
    return correct, time.process_time() - start


def _worker_ready(_: int) -> bool:
    return _worker_reward is not None


def bench_math(limit: int | None, workers: int) -> dict:
    pairs = math_inputs(limit)
    context = get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_math_worker) as pool:
        # Start and warm the workers before this process grades anything, so that neither
        # side inherits the other's caches (answer normalisation, parsed expressions).
        list(pool.map(_worker_ready, range(workers * 2)))
        _init_math_worker()
        serial, serial_s = timed(lambda: [_grade_math(p) for p in pairs])
        chunk = max(1, len(pairs) // (workers * 2))  # few round trips: grading takes ~5 ms
        parallel, parallel_s = timed(lambda: list(pool.map(_grade_math, pairs, chunksize=chunk)))
    return summary(
        "math", len(pairs), workers,
        serial=([c for c, _ in serial], serial_s, sum(t for _, t in serial)),
        parallel=([c for c, _ in parallel], parallel_s, sum(t for _, t in parallel)),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# code
# ---------------------------------------------------------------------------------------


def mbpp_inputs(limit: int | None) -> tuple[list[str], list[Problem]]:
    rows = read_jsonl(resolve_data_dir() / "mbpp" / "sanitized.jsonl", limit)
    completions = [f"```python\n{r['code'].rstrip()}\n```" for r in rows]
    problems = [
        Problem(
            uid=f"mbpp/sanitized/{r['task_id']}",
            prompt=r["prompt"],
            answer=r["code"],
            meta={"tests": list(r["test_list"]), "test_setup": "\n".join(r["test_imports"])},
        )
        for r in rows
    ]
    return completions, problems


def humaneval_inputs(limit: int | None) -> tuple[list[str], list[Problem]]:
    """HumanEval through the benchmark's own spec (conf/benchmark/humaneval.yaml): the completion is
    the prompt plus the canonical solution in a fence, graded by ``check(<entry_point>)``."""
    from omegaconf import OmegaConf

    from rlbench.dataset.code import records_to_code_problems

    spec = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "benchmark" / "humaneval.yaml"))
    rows = read_jsonl(resolve_data_dir() / "humaneval" / "test.jsonl", limit)
    problems = records_to_code_problems(
        ((f"humaneval/test.jsonl:{i + 1}", r) for i, r in enumerate(rows)), spec, name="humaneval", split="test"
    )
    completions = [f"```python\n{r['prompt']}{r['canonical_solution'].rstrip()}\n```" for r in rows]
    return completions, problems


CODE_INPUTS = {"code": mbpp_inputs, "humaneval": humaneval_inputs}


def bench_code(limit: int | None, workers: int, timeout_s: float, task: str = "code") -> dict:
    completions, problems = CODE_INPUTS[task](limit)
    limits = SandboxLimits(timeout_s=timeout_s)
    CodeReward(limits=limits, workers=1).grade_many(completions[:1], problems[:1])  # warm caches

    def grade(n_workers: int):
        """Grades, wall seconds, CPU seconds of this process and every sandbox process."""
        cpu_before = cpu_with_children()
        grades, seconds = timed(lambda: CodeReward(limits=limits, workers=n_workers).grade_many(completions, problems))
        return grades, seconds, cpu_with_children() - cpu_before

    serial, parallel = grade(1), grade(workers)
    result = summary(
        task, len(problems), workers,
        serial=([g.correct for g in serial[0]], *serial[1:]),
        parallel=([g.correct for g in parallel[0]], *parallel[1:]),
    )  # fmt: skip
    result["reference_solutions_failing"] = [
        f"{p.uid} ({g.details['status']})" for p, g in zip(problems, parallel[0]) if not g.correct
    ]
    result["cannot_cross"] = [
        p.uid for p, g in zip(problems, parallel[0])
        if any(str(error).startswith("cannot cross") for _, error in g.details["tests"])
    ]  # problems whose tests need a value that is not plain data (see rlbench.sandbox)
    result["timeout_s"] = timeout_s
    return result


def cpu_with_children() -> float:
    """CPU seconds (user + system) of this process plus its waited-for descendants."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------


def summary(task: str, n: int, workers: int, serial: tuple, parallel: tuple) -> dict:
    """``serial`` / ``parallel``: (verdicts, wall seconds, CPU seconds)."""
    (serial_verdicts, serial_s, serial_cpu), (parallel_verdicts, parallel_s, parallel_cpu) = serial, parallel
    return {
        "task": task,
        "graded": n,
        "correct": int(sum(parallel_verdicts)),
        "workers": workers,
        "serial_s": round(serial_s, 3),
        "parallel_s": round(parallel_s, 3),
        "serial_per_s": round(n / serial_s, 2),
        "parallel_per_s": round(n / parallel_s, 2),
        "speedup": round(serial_s / parallel_s, 2),
        "serial_cpu_ms_per_problem": round(1000 * serial_cpu / n, 2),
        "parallel_cpu_ms_per_problem": round(1000 * parallel_cpu / n, 2),
        "verdicts_identical": list(serial_verdicts) == list(parallel_verdicts),
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def markdown(result: dict) -> str:
    lines = [
        "# Grading throughput",
        "",
        f"{result['date']}, {result['machine']['cpus']} CPUs, load average before "
        f"{result['machine']['loadavg_before']} / after {result['machine']['loadavg_after']}, "
        f"Python {result['machine']['python']}.",
        "",
        "| task | graded | correct | serial problems/s | parallel problems/s | workers | parallel/serial "
        "| CPU ms/problem serial | CPU ms/problem parallel | verdicts identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["tasks"]:
        lines.append(
            f"| {r['task']} | {r['graded']} | {r['correct']} | {r['serial_per_s']} | "
            f"{r['parallel_per_s']} | {r['workers']} | {r['speedup']} | {r['serial_cpu_ms_per_problem']} | "
            f"{r['parallel_cpu_ms_per_problem']} | {r['verdicts_identical']} |"
        )
    for r in result["tasks"]:
        if "cannot_cross" in r:
            lines += ["", f"{r['task']}: problems whose tests need values that cannot cross as plain data: "
                      f"{len(r['cannot_cross'])} {r['cannot_cross']}."]
        if r.get("reference_solutions_failing"):
            lines += ["", f"{r['task']} reference solutions that did not pass: {', '.join(r['reference_solutions_failing'])}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--math-limit", type=int, default=None, help="first N MATH-500 problems (default all)")
    parser.add_argument("--code-limit", type=int, default=None, help="first N problems of each code task (default all)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel workers")
    parser.add_argument("--code-timeout", type=float, default=10.0, help="sandbox timeout_s per program")
    parser.add_argument("--tasks", default="math,code,humaneval", help="comma-separated: math, code (MBPP), humaneval")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "eval_throughput.json")
    args = parser.parse_args(argv)

    load_before = [round(x, 2) for x in os.getloadavg()]
    chosen = set(args.tasks.split(","))
    if not chosen <= {"math", *CODE_INPUTS}:
        parser.error(f"--tasks takes math, code and/or humaneval, got {args.tasks!r}")
    tasks = []
    if "math" in chosen:
        tasks.append(bench_math(args.math_limit, args.workers))
    for task in CODE_INPUTS:
        if task in chosen:
            tasks.append(bench_code(args.code_limit, args.workers, args.code_timeout, task))
    result = {
        "date": _dt.date.today().isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "tasks": tasks,
    }
    for r in tasks:
        print(
            f"{r['task']}: {r['graded']} graded, serial {r['serial_per_s']}/s, parallel "
            f"{r['parallel_per_s']}/s with {r['workers']} workers: ratio parallel/serial = {r['speedup']}"
            f" (verdicts identical: {r['verdicts_identical']})"
        )
    atomic_write_json(args.out, result)
    atomic_write_text(args.out.with_suffix(".md"), markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
