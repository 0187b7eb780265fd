"""Trainer side of the sandbox: limits, results, :func:`run_tests` and :func:`run_many`.

See the package docstring (:mod:`rlbench.sandbox`) for the design and the threat model.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import signal
import site
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rlbench.errors import ConfigError

logger = logging.getLogger(__name__)

SUPERVISOR = Path(__file__).with_name("supervisor.py")
HARNESS = Path(__file__).with_name("harness.py")
#: Start of every report line; the per-run nonce follows it.
MARKER = "@@rlbench-sandbox@@"
#: The unprivileged user (and group) the program runs as when we are root: ``nobody``.
SANDBOX_UID = 65534
#: Seconds past ``timeout_s`` after which the caller kills the supervisor itself (a backstop:
#: the supervisor enforces ``timeout_s`` on the program).
SUPERVISOR_MARGIN_S = 10.0
#: Statuses of a :class:`SandboxResult`.
STATUSES = ("passed", "failed", "load_error", "timeout", "output_limit", "crashed", "sandbox_error")
NOT_RUN = "not run"


# Largest accepted value of each limit: generous, but finite (an infinite wall clock or an output
# buffer of terabytes would hang or crash the caller rather than the program).
LIMIT_CEILINGS = {
    "timeout_s": 3600.0,
    "cpu_s": 3600.0,
    "memory_mb": 1 << 20,
    "file_size_mb": 1 << 14,
    "max_output_bytes": 1 << 26,
}


INTEGER_LIMITS = ("memory_mb", "file_size_mb", "max_output_bytes")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one program run.

    timeout_s:        wall-clock seconds for the whole run (start-up, program and all tests).
    cpu_s:            CPU seconds (``RLIMIT_CPU``); None means ``ceil(timeout_s)``.
    memory_mb:        address-space limit in MiB (``RLIMIT_AS``).
    file_size_mb:     largest file the program may write, in MiB (``RLIMIT_FSIZE``); this also
                      caps what it can print.
    max_output_bytes: bytes of stdout and of stderr kept in the result (the rest is cut off,
                      with a note saying so).
    network:          must be False: the program never gets a network (kept so a config can
                      state it; True is refused rather than silently ignored).
    """

    timeout_s: float = 5.0
    cpu_s: float | None = None
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_output_bytes: int = 65536
    network: bool = False

    def __post_init__(self) -> None:
        positive = {
            "timeout_s": self.timeout_s,
            "cpu_s": self.cpu_s if self.cpu_s is not None else 1,
            "memory_mb": self.memory_mb,
            "file_size_mb": self.file_size_mb,
            "max_output_bytes": self.max_output_bytes,
        }
        for key, value in positive.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"sandbox limit {key} must be a positive number, got {value!r}")
            if key in INTEGER_LIMITS and not isinstance(value, int):
                raise ConfigError(f"sandbox limit {key} must be a whole number, got {value!r}")
            if not value <= LIMIT_CEILINGS[key]:  # also refuses inf and nan
                raise ConfigError(f"sandbox limit {key}={value!r} is above the ceiling {LIMIT_CEILINGS[key]}; lower it")
        if self.memory_mb < 64:
            raise ConfigError(
                f"sandbox limit memory_mb={self.memory_mb} is too small for the Python "
                "interpreter to start; use at least 64"
            )
        if self.network:
            raise ConfigError(
                "sandbox limit network=True is not supported: programs never get a network; "
                "set network to false"
            )

    @property
    def cpu_seconds(self) -> int:
        """The ``RLIMIT_CPU`` value in whole seconds."""
        return max(1, math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s))


CONFIG_LIMIT_KEYS = ("timeout_s", "memory_mb", "file_size_mb", "max_output_bytes")


def limits_from_config(sandbox_cfg: Any) -> SandboxLimits:
    """``SandboxLimits`` from the run config's ``sandbox`` node (the limits check their own values)."""
    return SandboxLimits(**{k: v for k, v in dict(sandbox_cfg or {}).items() if k in CONFIG_LIMIT_KEYS})


@dataclass
class TestOutcome:
    """One test: whether it passed, else a short error text (``"AssertionError"``,
    ``"SystemExit(0)"``, ``"not run"``)."""

    __test__ = False  # not a pytest test class

    passed: bool
    error: str | None = None


@dataclass
class SandboxResult:
    """Outcome of running one program and its tests.

    passed:    every test ran and passed, the program loaded, and the harness's completion
               line (with this run's nonce) was seen with exit status 0.
    outcomes:  one per test, in order; tests never reached are ``(False, "not run")``.
    status:    ``passed``; else the first that applies of ``timeout`` (wall clock or CPU),
               ``output_limit`` (stdout/stderr reached ``file_size_mb``), ``load_error`` (the
               program raised), ``crashed`` (no completion line: killed, ``os._exit``, ...),
               ``failed`` (ran to the end, some test failed); ``sandbox_error`` when the
               sandbox itself broke.
    stdout, stderr: what the program printed, cut to ``max_output_bytes`` each.
    seconds:   wall-clock seconds of the whole call (sandbox start-up included).
    isolation: which protections were active (``netns``, ``mountns``, ``readonly_fs``, ``uid``,
               ``rlimits``, ``subreaper``, ``audit_hook``, ``undumpable``, ...).
    error:     the load error, or what went wrong (timeout, crash, sandbox failure).
    """

    passed: bool
    outcomes: list[TestOutcome]
    status: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    isolation: dict = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------
# report parsing (pure)
# ---------------------------------------------------------------------------------------


@dataclass
class HarnessReport:
    """What the harness's report lines say (see ``harness.py`` for the line format)."""

    ready: bool = False
    undumpable: bool = False
    audit_hook: bool = False
    loaded: bool | None = None
    load_error: str | None = None
    outcomes: dict[int, TestOutcome] = field(default_factory=dict)
    done: bool = False
    malformed: bool = False


def _hex_text(fields: list[str]) -> str:
    try:
        return bytes.fromhex(fields[0]).decode("utf-8", "replace") if fields else "error"
    except ValueError:
        return "error"


def parse_report(lines: Sequence[str], n_tests: int) -> HarnessReport:
    """Parse report lines (prefix already removed). Out-of-order, duplicate or unknown lines
    mark the report malformed; such a run never passes."""
    report = HarnessReport()
    for line in lines:
        kind, *fields = line.split(" ")
        if kind == "ready" and not report.ready:
            report.ready = True
            report.undumpable, report.audit_hook = fields[:1] == ["1"], fields[1:2] == ["1"]
        elif kind == "load" and report.loaded is None and fields[:1] in (["0"], ["1"]):
            report.loaded = fields[0] == "1"
            report.load_error = None if report.loaded else _hex_text(fields[1:])
        elif kind == "test" and report.loaded and len(fields) >= 2 and fields[0].isdigit():
            index = int(fields[0])
            if index >= n_tests or index in report.outcomes or index != len(report.outcomes):
                report.malformed = True
                continue
            passed = fields[1] == "1"
            report.outcomes[index] = TestOutcome(passed, None if passed else _hex_text(fields[2:]))
        elif kind == "done" and not report.done and fields == [str(n_tests)]:
            report.done = True
        else:
            report.malformed = True
    return report


def judge(report: HarnessReport, n_tests: int, supervisor: dict) -> tuple[bool, str, str | None]:
    """(passed, status, error) from the parsed report and the supervisor's facts."""
    complete = (
        report.done
        and report.loaded is True
        and not report.malformed
        and len(report.outcomes) == n_tests
        and supervisor["exit_code"] == 0
    )
    passed = complete and not supervisor["timed_out"] and all(o.passed for o in report.outcomes.values())
    if passed:
        return True, "passed", None
    if supervisor["timed_out"] or supervisor["cpu_limit"]:
        kind = "CPU time" if supervisor["cpu_limit"] else "wall-clock time"
        return False, "timeout", f"{kind} limit reached"
    if supervisor["output_limit"]:
        return False, "output_limit", "output reached the file size limit"
    if report.loaded is False:
        return False, "load_error", report.load_error
    if not complete:
        return False, "crashed", f"no completion report (exit code {supervisor['exit_code']})"
    return False, "failed", None


# ---------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------


def _sandbox_error(n_tests: int, message: str, seconds: float) -> SandboxResult:
    logger.warning("sandbox infrastructure error: %s", message)
    return SandboxResult(
        passed=False,
        outcomes=[TestOutcome(False, NOT_RUN) for _ in range(n_tests)],
        status="sandbox_error",
        seconds=seconds,
        error=message,
    )


def _site_packages() -> list[str]:
    """Our site-packages directories: the harness runs with ``-S`` (no ``site``, so no ``.pth``
    processing at start-up) and puts these on ``sys.path`` itself."""
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _supervisor_env(workdir: str) -> dict[str, str]:
    """The supervisor's environment: nothing from ours (no tokens, no keys)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}


def run_tests(
    program: str,
    tests: Sequence[str],
    limits: SandboxLimits = SandboxLimits(),
    *,
    audit_hook: bool = True,
) -> SandboxResult:
    """Run ``program`` in a fresh sandbox, then each of ``tests`` in the same namespace.

    Never raises for anything the program does; a broken sandbox gives status
    ``sandbox_error``. Linux only (namespaces, /proc). ``audit_hook=False`` switches the
    in-process layer off; it exists to test that the OS layers hold on their own.
    """
    if not isinstance(program, str) or not all(isinstance(t, str) for t in tests):
        raise TypeError("run_tests needs the program and every test as str")
    tests = list(tests)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlbench-sandbox-", ignore_cleanup_errors=True) as tmp:
        request = _request(program, tests, limits, os.path.realpath(tmp), audit_hook)
        supervisor, problem = _call_supervisor(request, limits.timeout_s + SUPERVISOR_MARGIN_S)
    if problem is not None:
        return _sandbox_error(len(tests), problem, time.monotonic() - start)
    return _result(supervisor, len(tests), time.monotonic() - start)


def _request(program: str, tests: list[str], limits: SandboxLimits, workdir: str, audit_hook: bool) -> dict:
    """What the supervisor gets on stdin (see ``supervisor.py``)."""
    return {
        "program": program,
        "tests": tests,
        "prefix": MARKER + secrets.token_hex(16),
        "workdir": workdir,
        "harness": str(HARNESS),
        "site_packages": _site_packages(),
        "uid": SANDBOX_UID,
        "audit_hook": bool(audit_hook),
        "limits": {
            "timeout_s": float(limits.timeout_s),
            "cpu_s": limits.cpu_seconds,
            "memory_mb": int(limits.memory_mb),
            "file_size_mb": int(limits.file_size_mb),
            "max_output_bytes": int(limits.max_output_bytes),
        },
    }


def _call_supervisor(request: dict, timeout_s: float) -> tuple[dict, str | None]:
    """(the supervisor's report, None), or ({}, what went wrong with the sandbox itself)."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", "-S", str(SUPERVISOR)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=request["workdir"],
        env=_supervisor_env(request["workdir"]),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(json.dumps(request).encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return {}, "supervisor did not finish"
    try:
        report = json.loads(out)
    except ValueError:
        stderr_tail = err.decode("utf-8", "replace").strip()[-500:]
        return {}, f"supervisor exited with {proc.returncode} without a report: {stderr_tail}"
    if "sandbox_error" in report:
        return {}, report["sandbox_error"]
    if report.get("setup_error"):
        return {}, f"sandbox set-up failed: {report['setup_error']}"
    return report, None


def _result(supervisor: dict, n_tests: int, seconds: float) -> SandboxResult:
    report = parse_report(supervisor["report"], n_tests)
    passed, status, error = judge(report, n_tests, supervisor)
    outcomes = [report.outcomes.get(i, TestOutcome(False, NOT_RUN)) for i in range(n_tests)]
    isolation = {**supervisor["isolation"], "audit_hook": report.audit_hook, "undumpable": report.undumpable}
    if isolation.get("uid") == 0:
        _warn_once(
            "sandboxed programs run as root: no mount namespace was available to make the Python "
            "installation reachable for an unprivileged user; only the audit hook, the rlimits "
            "and the network namespace (if any) contain them"
        )
    return SandboxResult(
        passed=passed,
        outcomes=outcomes,
        status=status,
        stdout=supervisor["stdout"],
        stderr=supervisor["stderr"],
        seconds=seconds,
        isolation=isolation,
        error=error,
    )


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def run_many(
    jobs: Sequence[tuple[str, Sequence[str]]],
    limits: SandboxLimits = SandboxLimits(),
    workers: int | None = None,
) -> list[SandboxResult]:
    """:func:`run_tests` for each ``(program, tests)`` job, ``workers`` at a time (default:
    the number of CPU cores; 1 runs them one after another). Results keep the jobs' order."""
    if workers is None:
        workers = os.cpu_count() or 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"sandbox workers must be a positive integer or None, got {workers!r}")
    jobs = list(jobs)
    if not jobs:
        return []
    if workers == 1:
        return [run_tests(program, tests, limits) for program, tests in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], limits), jobs))
