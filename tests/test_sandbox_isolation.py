"""Isolation of time, CPU and failure in the sandbox (issue 29): attacks that stall the trusted
decoder, starve the runs beside, make bubblewrap fail once, or leave the fallback's clean-up
without permissions; and the harness's interpreter, the reply cap and ``OrderedDict``.

Each test names the layer it needs and skips with the reason where this machine lacks it (root,
bubblewrap, a writable cpu cgroup).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

import rlbench.sandbox.core as sandbox_core
from rlbench.sandbox import SandboxLimits, run_tests
from rlbench.sandbox.core import SUPERVISOR_MARGIN_S, remove_tree

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
    pytest.mark.slow,  # integration tier: runs programs in the sandbox
]

AMPLE = SandboxLimits(timeout_s=30.0)
IS_ROOT = os.geteuid() == 0
REAL_BWRAP = shutil.which("bwrap", path=":".join(sandbox_core.BWRAP_DIRS))
HAS_BWRAP = REAL_BWRAP is not None
RIGHT_ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"]
BWRAP_MODES = pytest.mark.parametrize(
    "bwrap",
    [pytest.param(True, marks=pytest.mark.skipif(not HAS_BWRAP, reason="bubblewrap is not installed")), False],
    ids=["bwrap", "fallback"],
)


def _layers() -> dict:
    """The isolation a plain run gets on this machine."""
    return run_tests(RIGHT_ADD, ADD_TESTS, AMPLE).isolation


def _processes_with_argument(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def _our_cgroup_folders() -> list[str]:
    """Cgroup folders of runs started by this process (their names carry its pid)."""
    pattern = f"rlbench-sandbox-{os.getpid()}-*"
    return glob.glob(f"/sys/fs/cgroup/**/{pattern}", recursive=True)


# ---------------------------------------------------------------------------------------
# the wall clock holds while the trusted side is stuck in one C call
# ---------------------------------------------------------------------------------------


def _hash_collision_program(count: int, marker: str) -> str:
    """A program that answers the first call itself, on the harness's channel (fd 3), with a set of
    ``count`` integers of one hash (``k * (2**61 - 1) + 5``, all above 2**64): building it on the
    trusted side is one C call of quadratic time, which no signal handler can interrupt. First it
    starts a detached process (a new session) that should not outlive the run."""
    return (
        "import json, os, subprocess, time\n"
        f"subprocess.Popen(['/bin/sleep', '{marker}'], start_new_session=True)\n"
        "p = (1 << 61) - 1\n"
        f"members = [{{'i': format(k * p + 5, 'x')}} for k in range(16, 16 + {count})]\n"
        "os.write(3, (json.dumps({'load': None, 'names': {'f': {'callable': True}}}) + '\\n').encode())\n"
        "data = (json.dumps({'ok': {'s': members}}) + '\\n').encode()\n"
        "while data:\n"
        "    data = data[os.write(3, data):]\n"
        "time.sleep(1000)\n"
    )


@BWRAP_MODES
def test_a_decoding_stall_ends_at_the_wall_clock_and_leaves_nothing(bwrap):
    """150,000 colliding integers (about 4 MiB; the reply cap raised to let them in) would keep the
    supervisor building one set for minutes. The caller's watchdog stops it at the deadline plus
    its margin: the run is a ``timeout`` (not a ``sandbox_error`` at a later backstop), no cgroup
    folder of the run is left, and the detached process is gone."""
    marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9}"  # a unique sleep length
    limits = SandboxLimits(timeout_s=4.0, cpu_s=600, max_reply_bytes=8 << 20)
    result = run_tests(_hash_collision_program(150_000, marker), ["f()", "pass"], limits, audit_hook=False, bwrap=bwrap)
    assert result.status == "timeout", (result.status, result.error)
    assert not result.passed and result.error.startswith("wall-clock time limit reached")
    assert result.seconds < limits.timeout_s + SUPERVISOR_MARGIN_S + 30  # generous: clean-up on a loaded machine
    assert _our_cgroup_folders() == []
    deadline = time.monotonic() + 10
    while _processes_with_argument(marker) and time.monotonic() < deadline:  # SIGKILLed ones being reaped
        time.sleep(0.1)
    if bwrap or _layers().get("cgroup_pids"):  # the fallback finds detached processes through its cgroup
        assert _processes_with_argument(marker) == []
    assert run_tests(RIGHT_ADD, ADD_TESTS, AMPLE).passed  # the sandbox still works afterwards


# ---------------------------------------------------------------------------------------
# one run's CPU does not decide another's verdict
# ---------------------------------------------------------------------------------------

#: Busy processes of the hostile run: hundreds against the one process of a correct run.
#: Measured on a loaded 2-core machine: a correct run beside them took 8-13 s without a cpu
#: cgroup per run, 0.3 s with one; its wall clock sits between.
BUSY_PROCESSES = 256
BESIDE_WALL_S = 6.0


@pytest.mark.skipif(not IS_ROOT, reason="per-run cgroups need root (or a delegated cgroup)")
def test_hundreds_of_busy_processes_do_not_time_out_a_correct_run_beside():
    """A run forks 256 processes that spin for its whole wall clock (25 s). Correct programs
    graded beside it, with a 6 s wall clock, must still pass: each run has its own cpu cgroup,
    so the kernel shares CPU between the runs first (without it, a correct run gets about 1/260
    of a core and times out). Each busy process starts a session of its own, so that the
    scheduler's per-session autogroups (which group tasks of the root cpu cgroup) do not hide
    the problem either."""
    if not _layers().get("cgroup_cpu"):
        pytest.skip("no writable cpu cgroup here: CPU is not isolated per run (the log says so)")
    hog = (
        "import os\n"
        "def hog():\n"
        f"    for _ in range({BUSY_PROCESSES}):\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()  # its own session: its own scheduler autogroup, where those apply\n"
        "            while True:\n"
        "                pass\n"
        "    while True:\n"
        "        pass\n"
    )
    hostile = {}
    worker = threading.Thread(
        target=lambda: hostile.update(result=run_tests(hog, ["hog()"], SandboxLimits(timeout_s=25.0, cpu_s=600), audit_hook=False))
    )
    worker.start()
    try:
        time.sleep(4.0)  # the hog is up and spinning
        beside = [run_tests(RIGHT_ADD, ADD_TESTS, SandboxLimits(timeout_s=BESIDE_WALL_S)) for _ in range(2)]
    finally:
        worker.join()
    assert hostile["result"].status == "timeout", hostile["result"]
    assert [r.status for r in beside] == ["passed", "passed"], beside


# ---------------------------------------------------------------------------------------
# bubblewrap failures: retried, and the fallback only when chosen
# ---------------------------------------------------------------------------------------


def _fake_bwrap(folder, fail_times: int | None) -> None:
    """A ``bwrap`` in ``folder`` that fails like an out-of-resources start ``fail_times`` times
    (None: always), then runs the real one."""
    count = folder / "failures"
    real = REAL_BWRAP or "/nonexistent/bwrap"
    limit = 1 << 30 if fail_times is None else fail_times
    script = (
        "#!/bin/sh\n"
        f"n=$(cat {count} 2>/dev/null || echo 0)\n"
        f"if [ \"$n\" -lt {limit} ]; then\n"
        f"  echo $((n + 1)) > {count}\n"
        "  echo 'bwrap: Creating new namespace failed: Resource temporarily unavailable' >&2\n"
        "  exit 1\n"
        "fi\n"
        f"exec {real} \"$@\"\n"
    )
    fake = folder / "bwrap"
    fake.write_text(script)
    fake.chmod(0o755)
    count.unlink(missing_ok=True)


def test_a_bubblewrap_that_cannot_start_is_an_error_unless_the_fallback_is_chosen(monkeypatch, tmp_path, caplog):
    """bubblewrap installed but failing every start: the run is a ``sandbox_error`` that says how to
    choose the fallback; with ``bwrap_fallback=True`` it runs there, with a warning each time."""
    _fake_bwrap(tmp_path, None)
    monkeypatch.setattr(sandbox_core, "BWRAP_DIRS", (str(tmp_path),))
    refused = run_tests(RIGHT_ADD, ADD_TESTS, AMPLE)
    assert refused.status == "sandbox_error" and "bwrap_fallback=true" in refused.error, refused.error
    assert "Resource temporarily unavailable" in refused.error
    assert int((tmp_path / "failures").read_text()) == 3  # retried
    chosen = run_tests(RIGHT_ADD, ADD_TESTS, SandboxLimits(timeout_s=30.0, bwrap_fallback=True))
    assert chosen.passed and chosen.isolation["bwrap"] is False
    assert "Resource temporarily unavailable" in chosen.isolation["bwrap_error"]
    assert "this run used the weaker fallback" in caplog.text


@pytest.mark.skipif(not HAS_BWRAP, reason="bubblewrap is not installed")
def test_a_transient_bubblewrap_failure_is_retried_and_lowers_nothing_later(monkeypatch, tmp_path):
    """One failed start (out of pids or memory for a moment): the same run retries and gets
    bubblewrap; a later run too, even after a run that had to fall back."""
    if not _layers().get("bwrap"):
        pytest.skip("bubblewrap cannot start on this machine")
    monkeypatch.setattr(sandbox_core, "BWRAP_DIRS", (str(tmp_path),))
    _fake_bwrap(tmp_path, 1)
    retried = run_tests(RIGHT_ADD, ADD_TESTS, AMPLE)
    assert retried.passed and retried.isolation["bwrap"] is True and "bwrap_error" not in retried.isolation
    _fake_bwrap(tmp_path, None)
    fell_back = run_tests(RIGHT_ADD, ADD_TESTS, SandboxLimits(timeout_s=30.0, bwrap_fallback=True))
    assert fell_back.isolation["bwrap"] is False
    _fake_bwrap(tmp_path, 0)
    later = run_tests(RIGHT_ADD, ADD_TESTS, AMPLE)
    assert later.passed and later.isolation["bwrap"] is True


# ---------------------------------------------------------------------------------------
# the fallback: IPC namespace, the truth about the uid, clean-up under any permission
# ---------------------------------------------------------------------------------------

#: The program's view of itself: its IPC namespace and its pid on the host (no PID namespace in
#: the fallback), read by the trusted test from the host's ``/proc``.
SELF_PROGRAM = "import os\ndef ipc():\n    return os.readlink('/proc/self/ns/ipc')\ndef pid():\n    return os.getpid()\n"
HOST_UID_TEST = (
    "with open(f'/proc/{pid()}/status') as f:\n"
    "    uid = int(next(line for line in f if line.startswith('Uid:')).split()[2])\n"
    "assert False, uid\n"
)


def test_the_fallback_unshares_ipc_and_reports_the_uid_it_really_runs_as():
    """No SysV segment or message queue shared with the host or another run; ``isolation["uid"]``
    is the program's uid as the host sees it (a user namespace's 65534 would be a lie), and
    ``own_uid`` says whether it differs from the caller's."""
    host_ipc = os.readlink("/proc/self/ns/ipc")
    result = run_tests(SELF_PROGRAM, [f"assert ipc() != {host_ipc!r}", HOST_UID_TEST], AMPLE, bwrap=False)
    seen_uid = int(result.outcomes[1].error.split(": ", 1)[1])
    assert result.isolation["uid"] == seen_uid
    assert result.isolation["own_uid"] is (seen_uid != os.geteuid())
    if not IS_ROOT and not result.isolation["userns"]:
        pytest.skip("no user namespaces for this user here: the fallback has no IPC namespace (the log says so)")
    assert result.outcomes[0].passed, result.outcomes
    assert result.isolation["ipcns"] is True


def test_the_fallback_without_its_own_uid_says_so_loudly(caplog):
    """Not root: the fallback's program is the caller's uid; the log warns about it."""
    caplog.set_level(logging.INFO, logger="rlbench.sandbox.core")
    sandbox_core._log_layers_once.cache_clear()
    result = run_tests(RIGHT_ADD, ADD_TESTS, AMPLE, bwrap=False)
    assert result.passed
    if result.isolation["own_uid"]:
        assert "runs model code as this process's own uid" not in caplog.text
    else:
        assert "runs model code as this process's own uid" in caplog.text


def _locked_tree(top) -> None:
    """A tree whose folders have lost every permission, with files in them."""
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f.txt").write_text("x")
    (top / "a" / "g.txt").write_text("y")
    (top / "a" / "b").chmod(0)
    (top / "a").chmod(0)


def test_remove_tree_removes_folders_left_with_mode_000(tmp_path):
    """Run as an unprivileged owner (root skips permission checks: a child process becomes the
    ``nobody`` uid for it)."""
    top = tmp_path / "top"
    top.mkdir()
    if not IS_ROOT:
        _locked_tree(top)
        remove_tree(str(top))
        assert not top.exists()
        return
    nobody = 65534
    top = Path(tempfile.mkdtemp(prefix="rlbench-test-locked-"))  # pytest's folder is closed to nobody
    os.chown(top, nobody, nobody)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgid(nobody)
            os.setuid(nobody)
            _locked_tree(top)
            remove_tree(str(top))
            code = 0 if not os.path.exists(top) else 2
        except BaseException as exc:  # noqa: BLE001 - told to the parent through stderr and the code
            os.write(2, repr(exc).encode())
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert not top.exists()


def test_a_program_that_locks_its_folders_spoils_nothing():
    """A folder left with mode 000 in the work directory: the run still passes and nothing is
    left in the temporary folder."""
    program = "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').close()\nos.chmod('a/b', 0)\nos.chmod('a', 0)\n" + RIGHT_ADD
    for bwrap in (True, False):
        assert run_tests(program, ADD_TESTS, AMPLE, bwrap=bwrap).passed


# ---------------------------------------------------------------------------------------
# the harness's interpreter, the reply cap, OrderedDict
# ---------------------------------------------------------------------------------------


@BWRAP_MODES
def test_the_harness_runs_on_the_supervisors_interpreter_and_standard_library(bwrap):
    """The trusted test (in the supervisor) compares the harness's version, prefix and ``os``
    module with its own base interpreter's. On a host whose system Python differs from the one the
    project runs on (here: a pyenv 3.11.7 beside Debian's 3.11.2 in /usr), a harness that cannot
    reach its own installation silently loads the system's."""
    program = "import os, sys\ndef info():\n    return [sys.version, sys.prefix, os.path.dirname(os.__file__)]\n"
    test = (
        "import os as _os, sys as _sys\n"
        "mine = [_sys.version, _os.path.realpath(_sys.base_prefix), _os.path.dirname(_os.path.realpath(_os.__file__))]\n"
        "theirs = info()\n"
        "assert theirs == mine, (theirs, mine)\n"
    )
    result = run_tests(program, [test], AMPLE, bwrap=bwrap)
    assert result.passed, result.outcomes


def test_a_reply_over_the_cap_fails_its_test_with_the_reason_and_the_run_goes_on():
    """A 15 MiB result (five million zeros) is read and dropped, not decoded: the test that called
    it fails with the cap named; the next call still works."""
    program = "def big():\n    return [0] * 5_000_000\n" + RIGHT_ADD
    result = run_tests(program, ["big()", "assert add(1, 2) == 3"], AMPLE)
    assert result.status == "failed", result
    assert result.outcomes[0].error.startswith("cannot cross: the result of big is longer than 1048576 bytes")
    assert result.outcomes[1].passed


def test_an_ordered_dict_keeps_its_order_across():
    program = (
        "from collections import OrderedDict\n"
        "def pairs():\n"
        "    return OrderedDict([('b', 1), ('a', 2)])\n"
    )
    tests = [
        "from collections import OrderedDict\nassert type(pairs()) is OrderedDict",
        "assert list(pairs()) == ['b', 'a']",
        "from collections import OrderedDict\nassert pairs() != OrderedDict([('a', 2), ('b', 1)])",
    ]
    result = run_tests(program, tests, AMPLE)
    assert result.passed, result.outcomes
