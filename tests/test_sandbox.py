"""The sandbox that runs model-written code: verdicts, limits, and a battery of hostile programs.

Hostile programs run twice where the OS layers can stop them on their own: with the audit hook
(the default) and with ``audit_hook=False``, which checks that the namespaces, the read-only
mounts, the ``nobody`` uid, the rlimits and the process clean-up hold without it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import rlbench.sandbox.core as sandbox_core
from rlbench.errors import ConfigError
from rlbench.sandbox import (
    SandboxLimits,
    SandboxResult,
    TestOutcome,
    run_many,
    run_tests,
)
from rlbench.sandbox.core import SUPERVISOR_MARGIN_S, judge, remove_tree

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
    pytest.mark.slow,  # integration tier: runs programs in the sandbox
]

#: Wall clock of the runs whose subject is not time: generous, so that start-up on a loaded 2-core
#: machine (about 0.1 s idle, up to a second beside two busy processes) cannot turn a verdict into a
#: timeout. No test relies on it to stop a program.
AMPLE_WALL_S = 30.0
LIMITS = SandboxLimits(timeout_s=AMPLE_WALL_S)
IS_ROOT = os.geteuid() == 0
HAS_BWRAP = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin") is not None
#: The OS layers alone (no audit hook) are only complete as root (mount namespace, uid nobody).
BOTH_LAYERS = pytest.mark.parametrize(
    "audit_hook",
    [True, pytest.param(False, marks=pytest.mark.skipif(not IS_ROOT, reason="OS layers need root"))],
    ids=["hook", "os-only"],
)


def run(program: str, tests=("pass",), limits: SandboxLimits = LIMITS, audit_hook: bool = True, setup: str = "") -> SandboxResult:
    return run_tests(program, list(tests), limits, audit_hook=audit_hook, setup=setup)


def processes_of_uid(uid: int) -> set[int]:
    pids = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    pids.add(int(name))
            except FileNotFoundError:
                pass
    return pids


#: A wrong ``add`` and the tests of a right one: a forged pass would grade it correct.
WRONG_ADD = "def add(a, b):\n    return a - b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"]
ADD_CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"
RIGHT_ADD = "def add(a, b):\n    return a + b\n"


#: Hostile runs that stop answering end at this wall clock (still a failure if start-up under load eats it).
HOSTILE_LIMITS = SandboxLimits(timeout_s=5.0)


@pytest.fixture
def correct_run_beside():
    """Correct programs graded one after another in the background for the whole test (at least
    one, overlapping it): a hostile program next to them must not change their verdict."""
    done, results = threading.Event(), []

    def keep_grading():
        while not done.is_set() or not results:
            results.append(run_tests(RIGHT_ADD, ADD_TESTS, LIMITS))

    worker = threading.Thread(target=keep_grading)
    worker.start()
    yield
    done.set()
    worker.join()
    assert all(r.passed for r in results), [r for r in results if not r.passed]


BESIDE_A_CORRECT_RUN = pytest.mark.usefixtures("correct_run_beside")


# ---------------------------------------------------------------------------------------
# verdicts on ordinary programs
# ---------------------------------------------------------------------------------------


def test_correct_program_passes_and_reports_isolation():
    result = run("def inc(x):\n    return x + 1\n", ["assert inc(1) == 2", "assert inc(-1) == 0"])
    assert result.passed and result.status == "passed" and result.error is None
    assert result.outcomes == [TestOutcome(True, None), TestOutcome(True, None)]
    assert result.isolation["audit_hook"] is True and result.isolation["rlimits"] is True
    assert result.isolation["subreaper"] is True and result.isolation["verdict_outside"] is True
    if IS_ROOT:
        assert result.isolation["uid"] >= 1 << 20  # the run's own uid
        assert result.isolation["netns"] and result.isolation["mountns"] and result.isolation["work_tmpfs"]
    if HAS_BWRAP:
        assert result.isolation["bwrap"] and result.isolation["pidns"] and result.isolation["minimal_root"]


def test_per_test_outcomes_in_order():
    program = "def inc(x):\n    return x + 1\n"
    tests = ["assert inc(1) == 2", "assert inc(1) == 3", "inc(None)", "raise SystemExit(0)", "assert inc(0) == 1"]
    result = run(program, tests)
    assert not result.passed and result.status == "failed"
    assert [o.passed for o in result.outcomes] == [True, False, False, False, True]
    assert result.outcomes[1].error == "AssertionError"
    assert result.outcomes[2].error.startswith("TypeError: ")
    assert result.outcomes[3].error == "SystemExit(0)"


def test_tests_that_print_do_not_disturb_the_report():
    result = run("def f():\n    return 1\n", ["print('{}'); print(f())", "import sys\nprint('x', file=sys.stderr)\nassert f() == 1"])
    assert result.passed, result


def test_tests_share_the_program_namespace():
    result = run("counter = [0]\n", ["counter[0] += 1\nshared = 5", "assert shared == 5 and counter == [1]"])
    assert result.passed


def test_stdout_and_stderr_are_captured():
    result = run("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n")
    assert result.passed and result.stdout == "to out\n" and result.stderr == "to err\n"


def test_program_starts_in_an_empty_directory_with_a_minimal_environment():
    allowed = {"PATH", "PWD", "LANG", "LC_CTYPE", "HOME", "TMPDIR", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    program = (
        "import os, sys\n"
        "def facts():\n"
        "    return os.listdir('.'), sorted(os.environ), os.environ['HOME'] == os.getcwd(), sys.stdin.read()\n"
    )
    tests = [
        "listing, names, home_is_cwd, stdin = facts()",
        "assert listing == []",
        f"assert set(names) <= {allowed!r}, names",
        "assert home_is_cwd and stdin == ''",
    ]
    result = run(program, tests)
    assert result.passed, result.outcomes


def test_a_program_larger_than_the_pipe_buffer_runs():
    big = "z" * (3 * 2**20)  # more than /proc/sys/fs/pipe-max-size (1 MiB by default)
    # (a global value that large stays in the sandbox: only values under max_reply_bytes / 4 cross)
    result = run(f"BIG = {big!r}\ndef size():\n    return len(BIG)\n", ["assert size() == 3 * 2 ** 20"])
    assert result.passed, result


def test_load_error_fails_every_test_as_not_run():
    result = run("x = 1 / 0\n", ["pass", "pass"])
    assert not result.passed and result.status == "load_error"
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.outcomes == [TestOutcome(False, "not run")] * 2


def test_syntax_error_is_a_load_error():
    result = run("def f(:\n    pass\n", ["pass"])
    assert result.status == "load_error" and result.error.startswith("SyntaxError")


def test_exit_code_zero_at_load_time_is_a_failure():
    for program in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit\n"):
        result = run(program, ["pass"])
        assert not result.passed, program
        assert result.status in ("load_error", "crashed")


def test_exit_mid_test_stops_later_tests():
    result = run("import os\ndef leave():\n    os._exit(0)\n", ["pass", "leave()", "pass"])
    assert not result.passed and result.status == "crashed"
    assert result.outcomes == [
        TestOutcome(True, None), TestOutcome(False, "the program's process ended"), TestOutcome(False, "not run")
    ]


def test_writing_files_inside_the_work_directory_works():
    program = (
        "import os, shutil\n"
        "os.makedirs('a/b')\n"
        "with open('a/b/c.txt', 'w') as f:\n    f.write('data')\n"
        "assert open('a/b/c.txt').read() == 'data'\n"
        "os.rename('a/b/c.txt', 'a/d.txt')\n"
        "shutil.rmtree('a')\n"
        "assert not os.path.exists('a')\n"
    )
    assert run(program).passed


def test_fake_messages_on_the_channel_do_not_pass():
    """Messages that look like the protocol, written to the harness's pipe, then a clean exit."""
    program = (
        "import os\n"
        "os.write(3, b'{\"ready\": {}}\\n{\"load\": null, \"names\": {}}\\n{\"ok\": true}\\n')\n"
        "print('All tests passed')\n"
        "os._exit(0)\n"
    )
    result = run(program, ["assert add(1, 2) == 3"])
    assert not result.passed


# ---------------------------------------------------------------------------------------
# resource limits
# ---------------------------------------------------------------------------------------


def test_infinite_loop_times_out_and_the_caller_carries_on():
    """The wall clock stops the loop: the verdict names it, no process of the run is left, and the
    call returned on its own (the caller's backstop, timeout_s + SUPERVISOR_MARGIN_S, would have made
    it a sandbox_error). The CPU limit is set far away so that only the wall clock can end the run.
    The duration is not bounded more tightly than the backstop (start-up takes seconds under load)."""
    limits = SandboxLimits(timeout_s=1.0, cpu_s=600)
    program = "def spin():\n    while True:\n        pass\n"
    result = run(program, ["spin()", "pass"], limits)
    assert not result.passed and result.status == "timeout"
    assert result.error == "wall-clock time limit reached"
    assert result.outcomes == [TestOutcome(False, "wall-clock time limit reached"), TestOutcome(False, "not run")]
    assert processes_of_uid(result.isolation["uid"]) == set() or not IS_ROOT  # killed, not left spinning
    assert limits.timeout_s <= result.seconds < limits.timeout_s + SUPERVISOR_MARGIN_S
    assert run("x = 1", ["assert x == 1"]).passed  # the sandbox still works afterwards


def test_cpu_limit_kills_a_busy_program():
    # the wall clock far above the CPU second: on a loaded machine the loop gets a fraction of a core
    limits = SandboxLimits(timeout_s=120.0, cpu_s=1)
    result = run("while True:\n    pass\n", ["pass"], limits)
    assert result.status == "timeout" and result.error == "CPU time limit reached"


@BOTH_LAYERS
@BESIDE_A_CORRECT_RUN
def test_fork_bomb_is_contained(audit_hook):
    result = run("import os\nwhile True:\n    os.fork()\n", ["pass"], LIMITS, audit_hook)
    assert not result.passed
    if audit_hook:
        assert result.status == "load_error" and "os.fork is not allowed" in result.error
    if IS_ROOT:
        assert processes_of_uid(result.isolation["uid"]) == set()


@BESIDE_A_CORRECT_RUN
def test_memory_bomb_hits_the_address_space_limit():
    program = (
        "def grow():\n    blocks = []\n    while True:\n        blocks.append(bytearray(2 ** 24))\n"
        "def huge():\n    return len(bytearray(4 * 2 ** 30))\n"
    )
    result = run(program, ["grow()", "huge()"], SandboxLimits(timeout_s=AMPLE_WALL_S, memory_mb=256))
    assert not result.passed
    assert result.outcomes == [TestOutcome(False, "MemoryError"), TestOutcome(False, "MemoryError")]


def test_huge_output_is_cut_and_limited():
    limits = SandboxLimits(timeout_s=AMPLE_WALL_S, file_size_mb=1, max_output_bytes=1000)
    result = run("def shout():\n    print('x' * (3 * 2 ** 20), flush=True)\n", ["shout()"], limits)
    assert not result.passed and result.status == "output_limit"
    assert result.outcomes[0].error.startswith("OSError")  # EFBIG: File too large
    body, note = result.stdout[:1000], result.stdout[1000:]
    assert body == "x" * 1000
    assert note == f"\n[sandbox: output truncated: {2 ** 20} bytes written, first 1000 kept]"


def test_long_output_of_a_passing_program_is_truncated_with_a_note():
    result = run("print('y' * 5000)\n", ["pass"], SandboxLimits(timeout_s=AMPLE_WALL_S, max_output_bytes=100))
    assert result.passed
    assert result.stdout == "y" * 100 + "\n[sandbox: output truncated: 5001 bytes written, first 100 kept]"


# ---------------------------------------------------------------------------------------
# the host
# ---------------------------------------------------------------------------------------


@BOTH_LAYERS
@BESIDE_A_CORRECT_RUN
def test_writing_outside_the_work_directory_fails(tmp_path, audit_hook):
    target = tmp_path / "escaped.txt"
    shared = f"/tmp/rlbench-sandbox-escape-{uuid.uuid4().hex}"  # world-writable /tmp too
    program = "def escape(path):\n    with open(path, 'w') as f:\n        f.write('x')\n"
    result = run(program, [f"escape({str(target)!r})", f"escape({shared!r})"], audit_hook=audit_hook)
    assert not result.passed and [o.passed for o in result.outcomes] == [False, False]
    assert not target.exists() and not os.path.exists(shared)


@BOTH_LAYERS
@BESIDE_A_CORRECT_RUN
def test_deleting_a_file_outside_fails(tmp_path, audit_hook):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep me")
    program = (
        "import os, shutil\n"
        f"def wipe():\n    os.remove({str(sentinel)!r})\n"
        f"def wipe_tree():\n    shutil.rmtree({str(tmp_path)!r})\n"
        f"def move():\n    os.rename({str(sentinel)!r}, 'mine.txt')\n"
    )
    result = run(program, ["wipe()", "wipe_tree()", "move()"], audit_hook=audit_hook)
    assert [o.passed for o in result.outcomes] == [False, False, False]
    assert sentinel.read_text() == "keep me"


@BOTH_LAYERS
@BESIDE_A_CORRECT_RUN
def test_environment_secrets_are_invisible(monkeypatch, audit_hook):
    name, value = f"RLBENCH_TEST_SECRET_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    monkeypatch.setenv(name, value)
    program = (
        "import os\n"
        f"def own():\n    return os.environ.get({name!r})\n"
        "def environ_of(pid):\n"
        "    with open(f'/proc/{pid}/environ', 'rb') as f:\n"
        "        return f.read()\n"
        "def all_environs():\n"
        "    found = b''\n"
        "    for entry in os.listdir('/proc'):\n"
        "        try:\n"
        "            found += environ_of(entry)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return found\n"
    )
    tests = [
        f"assert own() == {value!r}",
        f"assert {value.encode()!r} in environ_of({os.getpid()})",
        f"assert {value.encode()!r} in all_environs()",
    ]
    result = run(program, tests, audit_hook=audit_hook)
    assert [o.passed for o in result.outcomes] == [False, False, False]
    assert result.outcomes[0].error == "AssertionError"


def _listening_server(family: int, address):
    """A server socket and the list of connections it accepts until ``stop`` is set."""
    server = socket.socket(family, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(4)
    accepted, stop = [], threading.Event()

    def accept_all():  # until the run is over, however long it takes; then what is still queued
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue
        server.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                accepted.append(server.accept()[0])

    listener = threading.Thread(target=accept_all)
    listener.start()

    def close():
        stop.set()
        listener.join()
        server.close()

    return server, accepted, close


@BOTH_LAYERS
def test_no_network_connection_reaches_a_local_server(audit_hook):
    server, accepted, close = _listening_server(socket.AF_INET, ("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = f"import socket\ndef call_home():\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hello')\n"
    try:
        result = run(program, ["call_home()"], audit_hook=audit_hook)
    finally:
        close()
    assert not result.passed and accepted == []
    if not audit_hook and IS_ROOT:  # an empty network namespace (bubblewrap's has a loopback only)
        assert result.outcomes[0].error in (
            "OSError: [Errno 101] Network is unreachable", "ConnectionRefusedError: [Errno 111] Connection refused"
        )


@pytest.mark.parametrize("abstract", [True, False], ids=["abstract", "path"])
@BESIDE_A_CORRECT_RUN
def test_no_unix_socket_of_the_host_is_reachable(tmp_path, abstract):
    """Without the audit hook (the program may use sockets and ctypes): the host's Unix sockets,
    abstract or on disk, stay out of reach (network namespace; the path is not in the sandbox)."""
    address = f"\0rlbench-test-{uuid.uuid4().hex}" if abstract else str(tmp_path / "host.sock")
    _, accepted, close = _listening_server(socket.AF_UNIX, address)
    program = (
        "import socket\n"
        "def call_home():\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"    s.connect({address!r})\n"
        "    s.sendall(b'hello')\n"
    )
    try:
        result = run(program, ["call_home()"], audit_hook=False)
    finally:
        close()
    assert not result.passed and accepted == []


def test_a_subprocess_that_outlives_the_program_is_refused():
    program = "import subprocess\ndef start():\n    subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
    result = run(program, ["start()"])
    assert not result.passed and "subprocess.Popen is not allowed" in result.outcomes[0].error


@pytest.mark.skipif(not IS_ROOT, reason="needs the run's own uid to find its processes")
@BESIDE_A_CORRECT_RUN
def test_orphaned_and_detached_processes_are_killed_when_the_run_ends():
    """Without the audit hook the program may start processes: a ``sleep`` in its own session
    and a double-forked daemon. None of the run's processes is left when run_tests returns."""
    program = (
        "import os, subprocess, time\n"
        "popen = subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(30)\n"
        "    os._exit(0)\n"
        "def count():\n"
        "    return len([p for p in os.listdir('/proc') if p.isdigit()])\n"
    )
    result = run(program, ["assert count() >= 3"], audit_hook=False)
    assert result.passed, result
    assert processes_of_uid(result.isolation["uid"]) == set()


@pytest.mark.parametrize(
    "program",
    [
        "open('/proc/self/mem', 'rb')",
        "import ctypes",
        "import _posixsubprocess\n_posixsubprocess.fork_exec(*range(23))",
        "import os\nos.kill(1, 0)",
        "import os\nos.symlink('/etc', 'etc')",
        "import gc\ngc.get_objects()",
        "import sys\nsys.settrace(lambda *a: None)",
    ],
    ids=["proc-mem", "ctypes", "fork_exec", "kill", "symlink", "gc", "settrace"],
)
def test_escape_tools_are_refused(program):
    result = run(program)
    assert result.status == "load_error" and "sandbox: " in result.error, result.error


# ---------------------------------------------------------------------------------------
# parallel runs
# ---------------------------------------------------------------------------------------


def test_run_many_keeps_order_and_matches_serial_runs():
    jobs = [
        ("def f():\n    return 1\n", ["assert f() == 1"]),
        ("def f():\n    return 2\n", ["assert f() == 1", "assert f() == 2"]),
        ("raise ValueError('no')\n", ["pass"]),
        ("import sys\n", ["sys.exit(3)"]),
        ("x = 5\n", ["assert x == 5", "assert x > 0", "assert x < 3"]),
    ]
    parallel = run_many(jobs, LIMITS, workers=3)
    serial = run_many(jobs, LIMITS, workers=1)
    summary = lambda rs: [(r.passed, r.status, r.outcomes) for r in rs]
    assert summary(parallel) == summary(serial)
    assert [r.status for r in parallel] == ["passed", "failed", "load_error", "failed", "failed"]
    assert [o.passed for o in parallel[4].outcomes] == [True, True, False]
    assert run_many([], LIMITS) == []


def test_run_many_rejects_bad_worker_counts():
    for workers in (0, -2, 1.5):
        with pytest.raises(ConfigError, match="workers"):
            run_many([("pass", ["pass"])], LIMITS, workers=workers)


# ---------------------------------------------------------------------------------------
# limits and the verdict logic (no sandbox needed)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"cpu_s": -1}, "cpu_s"),
        ({"memory_mb": 16}, "memory_mb"),
        ({"file_size_mb": 0}, "file_size_mb"),
        ({"max_output_bytes": 0}, "max_output_bytes"),
        ({"network": True}, "network"),
    ],
)
def test_bad_limits_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        SandboxLimits(**kwargs)


def test_cpu_seconds_defaults_to_the_rounded_up_timeout():
    assert SandboxLimits(timeout_s=2.2).cpu_seconds == 3
    assert SandboxLimits(timeout_s=2.2, cpu_s=7).cpu_seconds == 7


SUPERVISOR_OK = {
    "loaded": True, "load_error": None, "outcomes": [[True, None]], "exit_code": -9, "timed_out": False,
    "cpu_limit": False, "crashed": False, "output_limit": False,
}  # fmt: skip


def test_verdict_from_the_supervisors_facts():
    assert judge(SUPERVISOR_OK, 1) == (True, "passed", None)
    failed = {**SUPERVISOR_OK, "outcomes": [[True, None], [False, "AssertionError"]]}
    assert judge(failed, 2) == (False, "failed", None)
    assert judge({**SUPERVISOR_OK, "loaded": False, "load_error": "E", "outcomes": [[False, "not run"]]}, 1) == (
        False, "load_error", "E"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"outcomes": []},  # a test missing
        {"outcomes": [[True, None], [True, None]]},  # one too many
        {"loaded": None},  # no load message
        {"crashed": True},
        {"timed_out": True},
        {"cpu_limit": True},
        {"outcomes": [[1, None]]},  # not exactly True
    ],
)
def test_incomplete_or_odd_facts_never_pass(change):
    passed, status, _ = judge({**SUPERVISOR_OK, **change}, 1)
    assert not passed and status != "passed"


# ---------------------------------------------------------------------------------------
# hostile programs, by class (issue 10): each must fail, touch nothing of the host and leave a
# concurrent run alone
# ---------------------------------------------------------------------------------------



def graded_fail_beside_a_correct_run(program: str, limits: SandboxLimits = HOSTILE_LIMITS, audit_hook: bool = True):
    """Run ``program`` (tests of ``add``, both as asserts and as HumanEval's ``check``) while a
    correct program runs at the same time; the correct one must pass. Returns the hostile results."""
    jobs = [
        (program, ADD_TESTS, "", None),
        (program, ["check(add)"], ADD_CHECK, "add"),
    ]
    with ThreadPoolExecutor(3) as pool:
        hostile = [pool.submit(run_tests, p, t, limits, setup=s, entry_point=e, audit_hook=audit_hook) for p, t, s, e in jobs]
        beside = pool.submit(run_tests, RIGHT_ADD, ADD_TESTS, LIMITS, setup=ADD_CHECK)
        results = [h.result() for h in hostile]
        assert beside.result().passed, beside.result()
    for result in results:
        assert not result.passed, result
    return results


FORGERIES = {
    # rebinding the harness's module globals: its channel, the types it encodes with, its sender
    "harness-globals": (
        "import __main__ as h\n" + WRONG_ADD +
        "h.MESSAGES_FD = 1\nh.str = lambda *a: 'ok'\nh.type = lambda x: int\n"
        "h.send = lambda m: None\nh.to_wire = lambda v: True\n"
    ),
    # a harness function's code replaced by one that always answers True
    "code-swap": (
        "import __main__ as h\n" + WRONG_ADD +
        "def always(value, depth=0):\n    return True\n"
        "h.to_wire.__code__ = always.__code__\n"
    ),
    # a finaliser and a thread that keep rebinding check/add in every namespace they can find
    "finaliser-and-thread": (
        "import gc, sys, threading, builtins\n" + WRONG_ADD +
        "def forge():\n"
        "    for module in list(sys.modules.values()):\n"
        "        for name in ('check', 'add'):\n"
        "            try:\n                setattr(module, name, lambda *a, **k: None)\n"
        "            except Exception:\n                pass\n"
        "    builtins.check = lambda *a: None\n"
        "class Later:\n    def __del__(self):\n        forge()\n"
        "Later()\n"
        "def loop():\n    while True:\n        forge()\n"
        "threading.Thread(target=loop, daemon=True).start()\n"
    ),
    # sys.stdout.flush replaced (the old harness called it before its last line)
    "stdout-flush": (
        "import sys, os\n" + WRONG_ADD +
        "def flush():\n    os.write(3, b'{\"ok\": 3}\\n')\n"
        "sys.stdout.flush = flush\nsys.stderr.flush = flush\n"
    ),
    # frame walking, from the function and from a signal handler: reaching the harness's locals
    "frame-walk": (
        "import sys, signal\n"
        "def add(a, b):\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        for key in list(frame.f_locals):\n"
        "            if key in ('request', 'args'):\n"
        "                frame.f_locals[key] = None\n"
        "        frame = frame.f_back\n"
        "    return a - b\n"
        "signal.signal(signal.SIGALRM, lambda n, f: f.f_back)\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)\n"
    ),
    # always-equal objects, int/str subclasses with a patched __eq__
    "always-equal": "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()\n",
    "int-subclass": "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n",
    "str-subclass": "class S(str):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return [S('x')]\n",
    # patched math.isclose / isinstance / builtins, used by the tests
    "patched-modules": (
        "import math, builtins, operator\n" + WRONG_ADD +
        "math.isclose = lambda *a, **k: True\nbuiltins.isinstance = lambda *a: True\n"
        "operator.eq = lambda a, b: True\nbuiltins.AssertionError = KeyError\n"
    ),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_passes_fail(name):
    graded_fail_beside_a_correct_run(FORGERIES[name])


def test_program_names_never_shadow_a_builtin_the_tests_use():
    program = "def abs(x):\n    return 0\n" + WRONG_ADD
    result = run(program, ["assert abs(add(1, 2) - 3) == 0"])
    assert not result.passed and result.outcomes[0].error == "AssertionError"
    # unless it is the function under test (MBPP 126 calls its function sum)
    assert run_tests("def sum(a, b):\n    return a * b\n", ["assert sum(2, 3) == 6"], LIMITS, entry_point="sum").passed


def test_patched_math_isclose_does_not_reach_the_tests():
    program = "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 3.0 * r * r\n"
    result = run(program, ["assert math.isclose(area(2.0), 12.566, rel_tol=1e-3)"], setup="import math")
    assert not result.passed and result.outcomes[0].error == "AssertionError"


def test_values_that_are_not_plain_data_fail_with_a_reason():
    program = (
        "import re, collections\n"
        "def gen():\n    return (i for i in range(3))\n"
        "def match(text):\n    return re.match('a', text)\n"
        "def count(text):\n    return collections.Counter(text)\n"
        "def echo(x):\n    return x\n"
        "class Point:\n    pass\n"
        "origin = Point()\n"
    )
    tests = [
        "assert list(gen()) == [0, 1, 2]",
        "echo(lambda: 1)",
        "assert origin is not None",
        "assert echo({1: (2.5, b'x', {3}, frozenset(), 1j, None, True)}) == {1: (2.5, b'x', {3}, frozenset(), 1j, None, True)}",
        "try:\n    echo(lambda: 1)\nexcept BaseException:\n    pass",
        "assert match('abc') and not match('xyz') and count('aab') == {'a': 2, 'b': 1}",
        "assert match('abc') == True",
        "assert re.match('a', 'a') and collections.Counter('a')",  # the program's imports, the tests' own copies
    ]
    result = run(program, tests)
    errors = [o.error for o in result.outcomes]
    assert errors[0] == "cannot cross: the result of gen is a generator object; only its truth value crossed"
    assert errors[1].startswith("cannot cross: an argument of echo")
    assert errors[2] == "cannot cross: origin is a Point object in the program; only functions and plain data cross"
    assert errors[3] is None  # every plain type crosses both ways and compares exactly
    assert errors[4].startswith("cannot cross: an argument of echo")  # even when the test catches it
    assert errors[5] is None  # a match's truth value crosses; a Counter crosses as a dict
    assert errors[6] == "cannot cross: the result of match is a Match object; only its truth value crossed"
    assert errors[7] is None


@pytest.mark.skipif(not HAS_BWRAP, reason="without bubblewrap the project and the data stay readable (the documented fallback)")
@BESIDE_A_CORRECT_RUN
def test_the_answer_key_and_the_project_are_unreadable(tmp_path):
    """A completion that opens the benchmark's data (here: a copy of an answer key on the host),
    the project's source or the host's home and temporary folders reads nothing."""
    key = tmp_path / "answers.jsonl"
    key.write_text('{"canonical_solution": "    return a + b\\n"}\n')
    project_file = os.path.abspath(run_tests.__code__.co_filename)
    targets = [str(key), project_file, os.path.expanduser("~"), tempfile.gettempdir(), "/work", "/etc/passwd"]
    program = (
        "import os\n"
        "def peek(path):\n"
        "    try:\n"
        "        if os.path.isdir(path):\n"
        "            return sorted(os.listdir(path))\n"
        "        with open(path) as f:\n"
        "            return f.read()\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
    )
    result = run(program, [f"assert peek({t!r}) in ('FileNotFoundError', 'PermissionError', [])" for t in targets])
    assert result.passed, result.outcomes


@pytest.mark.skipif(not HAS_BWRAP, reason="the PID namespace comes from bubblewrap")
@BESIDE_A_CORRECT_RUN
def test_signals_and_pidfds_reach_nothing_outside():
    """Without the audit hook (ctypes allowed): kill(-1), kill and pidfd_send_signal on a host
    process of another uid, and /proc through a directory descriptor: nothing outside is reached."""
    victim = subprocess.Popen(["sleep", "60"], user=65534 if IS_ROOT else None)
    try:
        program = (
            "import ctypes, os, signal\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def attack(pid):\n"
            "    libc.kill(pid, 9)\n"
            "    fd = libc.syscall(434, pid, 0)  # pidfd_open\n"
            "    if fd >= 0:\n"
            "        libc.syscall(424, fd, 9, None, 0)  # pidfd_send_signal\n"
            "    proc = os.open('/proc', os.O_RDONLY)\n"
            "    seen = b''\n"
            "    for entry in os.listdir(f'/proc/self/fd/{proc}'):\n"
            "        try:\n"
            "            with open(f'/proc/self/fd/{proc}/{entry}/cmdline', 'rb') as f:\n"
            "                seen += f.read()\n"
            "        except OSError:\n"
            "            pass\n"
            "    return seen\n"
        )
        result = run(program, [f"seen = attack({victim.pid})", "assert b'pytest' not in seen and b'sleep' not in seen",
                               "attack(-1)"], audit_hook=False)  # fmt: skip
        assert victim.poll() is None  # still running
        assert [o.passed for o in result.outcomes[:2]] == [True, True], result.outcomes
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.skipif(not IS_ROOT, reason="per-run uid and cgroups need root")
def test_threads_of_one_run_do_not_starve_another():
    program = (
        "import threading, time\n"
        "def hog():\n"
        "    started = 0\n"
        "    try:\n"
        "        while started < 2000:\n"
        "            threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "            started += 1\n"
        "    except RuntimeError:\n"
        "        pass\n"
        "    time.sleep(30)\n"
    )
    limits = SandboxLimits(timeout_s=15.0, memory_mb=4096)
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(run, program, ["hog()"], limits, False)
        beside = [run("import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n" + RIGHT_ADD, ADD_TESTS) for _ in range(3)]
        assert not hostile.result().passed
    assert all(r.passed for r in beside), beside


def _held_mib(result: SandboxResult) -> int:
    """The last figure the program printed (MiB it held when it stopped)."""
    figures = [int(line) for line in result.stdout.split() if line.isdigit()]
    return figures[-1] if figures else 0


@pytest.mark.skipif(not IS_ROOT, reason="the memory cgroup needs root")
@BESIDE_A_CORRECT_RUN
def test_memfds_count_against_the_memory_limit():
    program = (
        "import os\n"
        "def hold():\n"
        "    fds, held = [], 0\n"
        "    while held < 2048:\n"
        "        fd = os.memfd_create('x')\n"
        "        os.write(fd, b'x' * (8 << 20))\n"
        "        fds.append(fd)\n"
        "        held += 8\n"
        "        print(held, flush=True)\n"
    )
    limits = SandboxLimits(timeout_s=AMPLE_WALL_S, memory_mb=256, file_size_mb=16)
    result = run(program, ["hold()"], limits, audit_hook=False)
    assert not result.passed
    if result.isolation.get("cgroup_memory"):
        assert _held_mib(result) <= 256


@pytest.mark.skipif(not IS_ROOT, reason="the capped work tmpfs needs root")
@BESIDE_A_CORRECT_RUN
def test_the_work_directory_is_capped_in_bytes_and_entries():
    program = (
        "import os\n"
        "def fill():\n"
        "    held = 0\n"
        "    try:\n"
        "        for i in range(1000):\n"
        "            with open(f'f{i}', 'wb') as f:\n"
        "                f.write(b'x' * (1 << 20))\n"
        "            held += 1\n"
        "            print(held, flush=True)\n"
        "    except OSError as exc:\n"
        "        return exc.errno\n"
        "def many():\n"
        "    try:\n"
        "        for i in range(100000):\n"
        "            os.mkdir(f'd{i}')\n"
        "    except OSError as exc:\n"
        "        return i\n"
    )
    limits = SandboxLimits(timeout_s=AMPLE_WALL_S, file_size_mb=8)
    result = run(program, ["import errno\nassert fill() in (errno.ENOSPC, errno.EFBIG)", "assert many() < 5000"], limits)
    assert result.passed, result.outcomes
    assert _held_mib(result) <= 8


def test_a_deep_directory_tree_leaves_nothing_and_spoils_no_batch():
    """The correct program of the batch runs beside the deep one (two workers)."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlbench-sandbox-*")))
    deep = "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n" + RIGHT_ADD
    results = run_many([(deep, ADD_TESTS), (RIGHT_ADD, ADD_TESTS), (WRONG_ADD, ADD_TESTS)], LIMITS, workers=2)
    assert [r.passed for r in results] == [True, True, False], results
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rlbench-sandbox-*"))) == before


def test_remove_tree_handles_any_depth(tmp_path):
    path = tmp_path / "top"
    path.mkdir()
    fd = os.open(path, os.O_RDONLY)
    for _ in range(1500):  # deeper than PATH_MAX allows to name
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(os.open("leaf.txt", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    remove_tree(str(path))
    assert not path.exists()


def test_a_harness_that_cannot_start_is_reported_with_its_cause(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_core, "HARNESS", tmp_path / "missing" / "harness.py")
    for bwrap in (True, False):
        result = run_tests(RIGHT_ADD, ADD_TESTS, LIMITS, bwrap=bwrap)
        assert result.status == "sandbox_error"
        assert result.error.startswith(("the harness did not start", "bubblewrap could not start")), result.error
        assert "harness.py" in result.error or "missing" in result.error, result.error


@pytest.mark.skipif(not IS_ROOT, reason="the fallback's OS layers need root")
def test_the_fallback_without_bubblewrap_still_grades_outside(caplog):
    caplog.set_level(logging.INFO, logger="rlbench.sandbox.core")
    sandbox_core._log_layers_once.cache_clear()
    right = run_tests(RIGHT_ADD, ADD_TESTS, LIMITS, bwrap=False)
    forged = run_tests(FORGERIES["harness-globals"], ADD_TESTS, HOSTILE_LIMITS, bwrap=False)
    assert right.passed and not forged.passed
    assert right.isolation["bwrap"] is False and right.isolation["readonly_fs"] is True
    assert "sandbox layers missing: bwrap" in caplog.text
