"""Trainer side of the sandbox: limits, results, :func:`run_tests` and :func:`run_many`.

See the package docstring (:mod:`rlbench.sandbox`) for the design and the threat model.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rlbench.errors import ConfigError

logger = logging.getLogger(__name__)

SUPERVISOR = Path(__file__).with_name("supervisor.py")
HARNESS = Path(__file__).with_name("harness.py")
#: Seconds past the run's deadline after which the caller's watchdog kills the supervisor (which
#: enforces the deadline itself, but cannot while one C call runs: a set built from a message of
#: colliding hashes, a slow comparison in a trusted test). The margin covers only its clean-up and
#: report; a run stopped by the watchdog is a ``timeout``, and its cgroups are removed from here.
SUPERVISOR_MARGIN_S = 5.0
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
    "max_reply_bytes": 1 << 26,
    "cpu_cores": 1024.0,
}


INTEGER_LIMITS = ("memory_mb", "file_size_mb", "max_output_bytes", "max_reply_bytes")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one program run.

    timeout_s:        wall-clock seconds for the whole run (start-up, program and all tests).
    cpu_s:            CPU seconds (``RLIMIT_CPU``); None means ``ceil(timeout_s)``.
    memory_mb:        address-space limit in MiB (``RLIMIT_AS``) and, where a memory cgroup is
                      available, the limit on all memory the run holds (memfds, tmpfs included).
    file_size_mb:     largest file the program may write, in MiB (``RLIMIT_FSIZE``); this also
                      caps what it can print, and (as root) the whole work folder's tmpfs.
    max_output_bytes: bytes of stdout and of stderr kept in the result (the rest is cut off,
                      with a note saying so).
    max_reply_bytes:  longest message the trusted side decodes (a function's result as JSON);
                      a longer result fails its test with ``cannot cross: ... longer than``.
                      Decoding takes some 30 times the text in the supervisor, outside any cgroup.
    cpu_cores:        CPU one run may use at once, in cores (its cpu cgroup's quota; the cgroup
                      also makes the kernel share CPU between runs first, so a run's hundreds of
                      processes weigh as one).
    network:          must be False: the program never gets a network (kept so a config can
                      state it; True is refused rather than silently ignored).
    bwrap_fallback:   when bubblewrap is installed but cannot start (after retries), run the
                      weaker fallback instead of failing the run with ``sandbox_error``. An
                      explicit choice, logged; each run tries bubblewrap first again.
    """

    timeout_s: float = 5.0
    cpu_s: float | None = None
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_output_bytes: int = 65536
    max_reply_bytes: int = 1 << 20
    cpu_cores: float = 1.0
    network: bool = False
    bwrap_fallback: bool = False

    def __post_init__(self) -> None:
        positive = {
            "timeout_s": self.timeout_s,
            "cpu_s": self.cpu_s if self.cpu_s is not None else 1,
            "memory_mb": self.memory_mb,
            "file_size_mb": self.file_size_mb,
            "max_output_bytes": self.max_output_bytes,
            "max_reply_bytes": self.max_reply_bytes,
            "cpu_cores": self.cpu_cores,
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
        if not isinstance(self.bwrap_fallback, bool):
            raise ConfigError(f"sandbox bwrap_fallback must be true or false, got {self.bwrap_fallback!r}")

    @property
    def cpu_seconds(self) -> int:
        """The ``RLIMIT_CPU`` value in whole seconds."""
        return max(1, math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s))


CONFIG_LIMIT_KEYS = ("timeout_s", "memory_mb", "file_size_mb", "max_output_bytes", "max_reply_bytes", "cpu_cores", "bwrap_fallback")


def limits_from_config(sandbox: Any) -> SandboxLimits:
    """``SandboxLimits`` from the run config's typed ``sandbox`` (rlbench.config.schema.SandboxConfig; the
    limits check their own values)."""
    return SandboxLimits(**{key: getattr(sandbox, key) for key in CONFIG_LIMIT_KEYS})


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

    passed:    the program loaded, every test ran (in the trusted process) and passed, and the
               run neither timed out nor ended early.
    outcomes:  one per test, in order; tests never reached are ``(False, "not run")``; a test
               that needed a value that is not plain data fails with ``"cannot cross: ..."``.
    status:    ``passed``; else the first that applies of ``timeout`` (wall clock or CPU),
               ``output_limit`` (stdout/stderr reached ``file_size_mb``), ``load_error`` (the
               program raised), ``crashed`` (the program's process ended: killed, ``os._exit``),
               ``failed`` (ran to the end, some test failed); ``sandbox_error`` when the
               sandbox itself broke.
    stdout, stderr: what the program printed, cut to ``max_output_bytes`` each.
    seconds:   wall-clock seconds of the whole call (sandbox start-up included).
    isolation: which protections were active (``verdict_outside``, ``bwrap``, ``pidns``,
               ``netns``, ``ipcns``, ``mountns``, ``minimal_root``, ``work_tmpfs``, ``cgroup_pids``,
               ``cgroup_memory``, ``cgroup_cpu``, ``rlimits``, ``subreaper``, ``audit_hook``; the
               fallback adds ``readonly_fs``, ``userns``), ``uid``: the program's uid as the host sees
               it, ``own_uid``: whether that differs from the caller's, ``bwrap_error``: why a run
               chosen to fall back did.
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
# the verdict (pure)
# ---------------------------------------------------------------------------------------


def judge(supervisor: dict, n_tests: int) -> tuple[bool, str, str | None]:
    """(passed, status, error) from the supervisor's facts: ``loaded``, ``load_error``,
    ``outcomes`` (``[passed, error]`` per test), ``timed_out``, ``cpu_limit``, ``crashed``,
    ``output_limit``. A run passes only if the program loaded, the run neither timed out nor
    ended early, and every one of the ``n_tests`` tests passed."""
    outcomes = supervisor["outcomes"]
    complete = supervisor["loaded"] is True and len(outcomes) == n_tests and not supervisor["crashed"]
    if complete and not (supervisor["timed_out"] or supervisor["cpu_limit"]) and all(passed is True for passed, _ in outcomes):
        return True, "passed", None
    if supervisor["timed_out"] or supervisor["cpu_limit"]:
        kind = "CPU time" if supervisor["cpu_limit"] else "wall-clock time"
        return False, "timeout", f"{kind} limit reached"
    if supervisor["output_limit"]:
        return False, "output_limit", "output reached the file size limit"
    if supervisor["loaded"] is False:
        return False, "load_error", supervisor["load_error"]
    if not complete:
        return False, "crashed", f"the program's process ended (exit code {supervisor['exit_code']})"
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


def _supervisor_env(workdir: str) -> dict[str, str]:
    """The supervisor's environment: nothing from ours (no tokens, no keys)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}


def remove_tree(path: str) -> None:
    """Remove the directory ``path`` and everything under it, however deep: no recursion, one open
    directory at a time, names relative to it (a deep path may exceed ``PATH_MAX``). Entries that
    vanish meanwhile are ignored, and a directory that the program left without permissions for
    its owner (mode 000) is given them back first. Used for the work directory, which the program
    may have filled."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = _open_directory(path, flags, None)
    except FileNotFoundError:
        return
    names: list[str] = []  # from ``path`` down to the directory ``fd`` is
    while True:
        subdir = None
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    subdir = subdir or entry.name
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=fd)
        if subdir is not None:
            child = _open_directory(subdir, flags, fd)
            os.close(fd)
            fd = child
            names.append(subdir)
            continue
        if not names:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(path)
            return
        parent = os.open("..", flags, dir_fd=fd)
        os.close(fd)
        fd = parent
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(names.pop(), dir_fd=fd)


def _open_directory(name: str, flags: int, dir_fd: int | None) -> int:
    """Open the directory ``name`` (relative to ``dir_fd``) for :func:`remove_tree`, with read,
    write and search permission for its owner (restored when the program took them away)."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dir_fd)  # a directory: it was one when listed
        fd = os.open(name, flags, dir_fd=dir_fd)
    if not os.access(f"/proc/self/fd/{fd}", os.W_OK | os.X_OK):
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o700)
    return fd


def run_tests(
    program: str,
    tests: Sequence[str],
    limits: SandboxLimits = SandboxLimits(),
    *,
    setup: str = "",
    entry_point: str | None = None,
    audit_hook: bool = True,
    bwrap: bool = True,
) -> SandboxResult:
    """Run ``program`` in a fresh sandbox and ``tests`` against it in a trusted process.

    The tests are trusted code: they run outside the sandbox, in a namespace holding the
    program's global names (functions as proxies that call into the sandbox with plain data,
    plain data values as copies; nothing else crosses, and no name that shadows a builtin), then
    the names ``setup`` (trusted code, e.g. HumanEval's ``def check(candidate)``) defines, then
    ``entry_point`` bound to the program's function of that name (it may shadow a builtin). Never raises for anything the program does; a broken
    sandbox gives status ``sandbox_error``. Linux only. ``audit_hook=False`` and ``bwrap=False``
    switch those layers off, to test that the others hold on their own.
    """
    if not isinstance(program, str) or not all(isinstance(t, str) for t in tests) or not isinstance(setup, str):
        raise TypeError("run_tests needs the program, the setup and every test as str")
    if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise TypeError(f"entry_point must be a Python identifier or None, got {entry_point!r}")
    tests = list(tests)
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="rlbench-sandbox-")
    try:
        request = {
            "program": program, "tests": tests, "setup": setup, "entry_point": entry_point,
            "workdir": os.path.realpath(workdir), "harness": str(HARNESS), "audit_hook": bool(audit_hook),
            "bwrap": find_bwrap() if bwrap else None, "bwrap_fallback": limits.bwrap_fallback,
            "deadline": start + limits.timeout_s,  # CLOCK_MONOTONIC: the same in the supervisor
            "cgroup_name": f"rlbench-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}",
            "limits": _limits_request(limits),
        }  # fmt: skip
        supervisor, problem = _call_supervisor(request)
    finally:
        _remove_workdir(workdir)
    if problem == WATCHDOG_STOPPED:
        passed, status, error = judge({**STOPPED_FACTS, "outcomes": [[False, NOT_RUN]] * len(tests)}, len(tests))
        outcomes = [TestOutcome(False, NOT_RUN) for _ in tests]
        return SandboxResult(passed, outcomes, status, seconds=time.monotonic() - start, error=f"{error} ({problem})")
    if problem is not None:
        return _sandbox_error(len(tests), problem, time.monotonic() - start)
    return _result(supervisor, len(tests), time.monotonic() - start)


def _remove_workdir(workdir: str) -> None:
    """:func:`remove_tree`, never raising: a folder the caller cannot remove is logged, not a
    failure of the batch."""
    try:
        remove_tree(workdir)
    except OSError as exc:
        logger.warning("sandbox work folder %s not removed: %s", workdir, exc)


#: Where bubblewrap is looked for (not ``PATH``: the caller's environment does not choose it).
BWRAP_DIRS = ("/usr/bin", "/bin", "/usr/local/bin")
#: The problem of a run whose supervisor the caller's watchdog stopped, and the facts it stands for.
WATCHDOG_STOPPED = "the supervisor was stopped by the caller's watchdog at the deadline"
STOPPED_FACTS = {"loaded": None, "load_error": None, "timed_out": True, "cpu_limit": False, "crashed": False, "output_limit": False}


def find_bwrap() -> str | None:
    """The bubblewrap executable, or None."""
    for directory in BWRAP_DIRS:
        path = os.path.join(directory, "bwrap")
        if os.access(path, os.X_OK):
            return path
    return None


def _limits_request(limits: SandboxLimits) -> dict:
    return {
        "timeout_s": float(limits.timeout_s),
        "cpu_s": limits.cpu_seconds,
        "memory_mb": int(limits.memory_mb),
        "file_size_mb": int(limits.file_size_mb),
        "max_output_bytes": int(limits.max_output_bytes),
        "max_reply_bytes": int(limits.max_reply_bytes),
        "cpu_cores": float(limits.cpu_cores),
    }


def _supervisor_command() -> list[str]:
    return [sys.executable, "-I", "-B", "-S", str(SUPERVISOR)]


def _call_supervisor(request: dict) -> tuple[dict, str | None]:
    """(the supervisor's report, None), or ({}, what went wrong with the sandbox itself), or ({},
    :data:`WATCHDOG_STOPPED`). The watchdog is this thread: at the deadline plus
    :data:`SUPERVISOR_MARGIN_S` it kills the supervisor's process group, whatever the supervisor
    is doing, and removes the run's cgroups (with the processes in them)."""
    proc = subprocess.Popen(
        _supervisor_command(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=request["workdir"],
        env=_supervisor_env(request["workdir"]),
        start_new_session=True,
    )
    try:
        timeout_s = max(0.0, request["deadline"] + SUPERVISOR_MARGIN_S - time.monotonic())
        out, err = proc.communicate(json.dumps(request).encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        _clean_up_after(request["cgroup_name"], request["workdir"])
        return {}, WATCHDOG_STOPPED
    try:
        report = json.loads(out)
    except ValueError:
        stderr_tail = err.decode("utf-8", "replace").strip()[-500:]
        return {}, f"supervisor exited with {proc.returncode} without a report: {stderr_tail}"
    if "sandbox_error" in report:
        return {}, report["sandbox_error"]
    return report, None


def _clean_up_after(cgroup_name: str, workdir: str) -> None:
    """After the watchdog killed a supervisor: kill what is left in the run's cgroups and remove
    them (the supervisor's own code, in its clean-up mode; standard library only, as root where the
    cgroups are). The work tmpfs went with the supervisor's mount namespace."""
    try:
        subprocess.run(
            _supervisor_command(), input=json.dumps({"cleanup": cgroup_name}).encode(), capture_output=True,
            cwd=workdir, env=_supervisor_env(workdir), timeout=CLEANUP_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("sandbox clean-up of cgroup %s failed: %s", cgroup_name, exc)


#: Seconds the clean-up after a killed supervisor may take.
CLEANUP_TIMEOUT_S = 60.0


def _result(supervisor: dict, n_tests: int, seconds: float) -> SandboxResult:
    passed, status, error = judge(supervisor, n_tests)
    outcomes = [TestOutcome(bool(p), e) for p, e in supervisor["outcomes"]]
    isolation = supervisor["isolation"]
    if "bwrap_error" in isolation:  # every time: the caller chose sandbox.bwrap_fallback
        logger.warning("bubblewrap could not start; this run used the weaker fallback (sandbox.bwrap_fallback=true): %s",
                       isolation["bwrap_error"])  # fmt: skip
    _log_layers_once(tuple(sorted((k, v) for k, v in isolation.items() if k not in ("uid", "bwrap_error"))))
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


#: Layers whose absence is logged as a warning (see the package docstring for what each adds).
KEY_LAYERS = ("bwrap", "cgroup_pids", "cgroup_memory", "cgroup_cpu", "work_tmpfs")


@functools.lru_cache(maxsize=None)
def _log_layers_once(isolation: tuple) -> None:
    layers = dict(isolation)
    active = sorted(k for k, v in layers.items() if v is True)
    missing = [k for k in KEY_LAYERS if not layers.get(k)]
    logger.info("sandbox layers active: %s", ", ".join(active))
    if not layers.get("own_uid") and not layers.get("bwrap"):
        logger.warning(
            "the sandbox fallback runs model code as this process's own uid (not root): it can reach "
            "this user's files and processes that are not read-only to it; install bubblewrap or run as root"
        )
    if missing:
        logger.warning(
            "sandbox layers missing: %s; see docs/evaluation.md#the-sandbox for what holds without them "
            "(install bubblewrap and run as root for all of them)", ", ".join(missing)
        )


def run_many(
    jobs: Sequence[tuple],
    limits: SandboxLimits = SandboxLimits(),
    workers: int | None = None,
) -> list[SandboxResult]:
    """:func:`run_tests` for each job, ``workers`` at a time (default: the number of CPU cores; 1
    runs them one after another). A job is ``(program, tests)`` or ``(program, tests, setup,
    entry_point)``. Results keep the jobs' order."""
    if workers is None:
        workers = os.cpu_count() or 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"sandbox workers must be a positive integer or None, got {workers!r}")
    jobs = list(jobs)
    if not jobs:
        return []

    def run_job(job: tuple) -> SandboxResult:
        program, tests, setup, entry_point = (*job, "", None)[:4] if len(job) == 2 else job
        return run_tests(program, tests, limits, setup=setup, entry_point=entry_point)

    if workers == 1:
        return [run_job(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(run_job, jobs))
