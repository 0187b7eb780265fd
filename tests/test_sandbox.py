"""The sandbox that runs model-written code: verdicts, limits, and a battery of hostile programs.

Hostile programs run twice where the OS layers can stop them on their own: with the audit hook
(the default) and with ``audit_hook=False``, which checks that the namespaces, the read-only
mounts, the ``nobody`` uid, the rlimits and the process clean-up hold without it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import uuid

import pytest

from rlbench.errors import ConfigError
from rlbench.sandbox import SandboxLimits, SandboxResult, TestOutcome, run_many, run_tests
from rlbench.sandbox.core import SUPERVISOR_MARGIN_S, HarnessReport, judge, parse_report

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
#: The OS layers alone (no audit hook) are only complete as root (mount namespace, uid nobody).
BOTH_LAYERS = pytest.mark.parametrize(
    "audit_hook",
    [True, pytest.param(False, marks=pytest.mark.skipif(not IS_ROOT, reason="OS layers need root"))],
    ids=["hook", "os-only"],
)


def run(program: str, tests=("pass",), limits: SandboxLimits = LIMITS, audit_hook: bool = True) -> SandboxResult:
    return run_tests(program, list(tests), limits, audit_hook=audit_hook)


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


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    return data[data.rfind(b")") + 2 : data.rfind(b")") + 3] != b"Z"


# ---------------------------------------------------------------------------------------
# verdicts on ordinary programs
# ---------------------------------------------------------------------------------------


def test_correct_program_passes_and_reports_isolation():
    result = run("def inc(x):\n    return x + 1\n", ["assert inc(1) == 2", "assert inc(-1) == 0"])
    assert result.passed and result.status == "passed" and result.error is None
    assert result.outcomes == [TestOutcome(True, None), TestOutcome(True, None)]
    assert result.isolation["audit_hook"] is True and result.isolation["rlimits"] is True
    assert result.isolation["subreaper"] is True
    if IS_ROOT:
        assert result.isolation["uid"] == 65534
        assert result.isolation["netns"] and result.isolation["mountns"] and result.isolation["readonly_fs"]
        assert result.isolation["undumpable"] is True


def test_per_test_outcomes_in_order():
    program = "def inc(x):\n    return x + 1\n"
    tests = ["assert inc(1) == 2", "assert inc(1) == 3", "inc(None)", "raise SystemExit(0)", "assert inc(0) == 1"]
    result = run(program, tests)
    assert not result.passed and result.status == "failed"
    assert [o.passed for o in result.outcomes] == [True, False, False, False, True]
    assert result.outcomes[1].error == "AssertionError"
    assert result.outcomes[2].error.startswith("TypeError: ")
    assert result.outcomes[3].error == "SystemExit(0)"


def test_tests_share_the_program_namespace():
    result = run("counter = [0]\n", ["counter[0] += 1\nshared = 5", "assert shared == 5 and counter == [1]"])
    assert result.passed


def test_stdout_and_stderr_are_captured():
    result = run("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n")
    assert result.passed and result.stdout == "to out\n" and result.stderr == "to err\n"


def test_program_starts_in_an_empty_directory_with_a_minimal_environment():
    allowed = {"PATH", "LANG", "LC_CTYPE", "HOME", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    tests = [
        "assert os.listdir('.') == []",  # the output files are unlinked
        f"assert set(os.environ) <= {allowed!r}, sorted(os.environ)",
        "assert os.environ['HOME'] == os.getcwd()",
        "try:\n    input()\nexcept EOFError:\n    pass\nelse:\n    raise AssertionError('stdin is not empty')",
    ]
    result = run("import os\n", tests)
    assert result.passed, result.outcomes


def test_a_program_larger_than_the_pipe_buffer_runs():
    big = "z" * (3 * 2**20)  # more than /proc/sys/fs/pipe-max-size (1 MiB by default)
    result = run(f"BIG = {big!r}\n", ["assert len(BIG) == 3 * 2 ** 20"])
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
    result = run("import os\n", ["pass", "os._exit(0)", "pass"])
    assert not result.passed and result.status == "crashed"
    assert result.outcomes == [TestOutcome(True, None), TestOutcome(False, "not run"), TestOutcome(False, "not run")]


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


def test_fake_report_lines_do_not_pass():
    """Lines that look like the report, on stdout or on the report pipe itself, without this
    run's nonce, followed by a clean exit."""
    program = (
        "import os\n"
        "print('@@rlbench-sandbox@@ ready 1 1\\nload 1\\ntest 0 1\\ndone 1\\nAll tests passed')\n"
        "os.write(3, b'@@rlbench-sandbox@@' + b'0' * 32 + b' load 1\\n')\n"
        "os.write(3, b'@@rlbench-sandbox@@' + b'0' * 32 + b' test 0 1\\n')\n"
        "os.write(3, b'@@rlbench-sandbox@@' + b'0' * 32 + b' done 1\\n')\n"
        "os._exit(0)\n"
    )
    result = run(program, ["pass"])
    assert not result.passed and result.status == "crashed"


# ---------------------------------------------------------------------------------------
# resource limits
# ---------------------------------------------------------------------------------------


def test_infinite_loop_times_out_and_the_caller_carries_on():
    """The wall clock stops the loop: the verdict names it, the looping process is gone, and the call
    returned on its own (the caller's backstop, timeout_s + SUPERVISOR_MARGIN_S, would have made it a
    sandbox_error). The CPU limit is set far away so that only the wall clock can end the run: under
    load the supervisor may wake late while the loop keeps its core. The duration is not bounded more
    tightly than the backstop, since start-up alone takes seconds on a loaded machine."""
    limits = SandboxLimits(timeout_s=1.0, cpu_s=600)
    program = "import os\nprint(os.getpid(), flush=True)\ndef spin():\n    while True:\n        pass\n"
    result = run(program, ["spin()"], limits)
    assert not result.passed and result.status == "timeout"
    assert result.error == "wall-clock time limit reached"
    assert result.outcomes == [TestOutcome(False, "not run")]
    assert not alive(int(result.stdout))  # killed, not left spinning
    assert limits.timeout_s <= result.seconds < limits.timeout_s + SUPERVISOR_MARGIN_S
    assert run("x = 1", ["assert x == 1"]).passed  # the sandbox still works afterwards


def test_cpu_limit_kills_a_busy_program():
    # the wall clock far above the CPU second: on a loaded machine the loop gets a fraction of a core
    limits = SandboxLimits(timeout_s=120.0, cpu_s=1)
    result = run("while True:\n    pass\n", ["pass"], limits)
    assert result.status == "timeout" and result.error == "CPU time limit reached"


@BOTH_LAYERS
def test_fork_bomb_is_contained(audit_hook):
    before = processes_of_uid(65534)
    result = run("import os\nwhile True:\n    os.fork()\n", ["pass"], LIMITS, audit_hook)
    assert not result.passed
    if audit_hook:
        assert result.status == "load_error" and "os.fork is not allowed" in result.error
    assert processes_of_uid(65534) - before == set()


def test_memory_bomb_hits_the_address_space_limit():
    program = "def grow():\n    blocks = []\n    while True:\n        blocks.append(bytearray(2 ** 24))\n"
    result = run(program, ["grow()", "x = bytearray(4 * 2 ** 30)"], SandboxLimits(timeout_s=AMPLE_WALL_S, memory_mb=256))
    assert not result.passed
    assert result.outcomes == [TestOutcome(False, "MemoryError"), TestOutcome(False, "MemoryError")]


def test_huge_output_is_cut_and_limited():
    limits = SandboxLimits(timeout_s=AMPLE_WALL_S, file_size_mb=1, max_output_bytes=1000)
    result = run("def shout():\n    print('x' * (3 * 2 ** 20))\n", ["shout()"], limits)
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
def test_writing_outside_the_work_directory_fails(tmp_path, audit_hook):
    target = tmp_path / "escaped.txt"
    shared = f"/tmp/rlbench-sandbox-escape-{uuid.uuid4().hex}"  # world-writable /tmp too
    program = f"def escape(path):\n    with open(path, 'w') as f:\n        f.write('x')\n"
    result = run(program, [f"escape({str(target)!r})", f"escape({shared!r})"], audit_hook=audit_hook)
    assert not result.passed and [o.passed for o in result.outcomes] == [False, False]
    assert not target.exists() and not os.path.exists(shared)


@BOTH_LAYERS
def test_deleting_a_file_outside_fails(tmp_path, audit_hook):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep me")
    program = f"import os, shutil\ndef wipe():\n    os.remove({str(sentinel)!r})\n"
    tests = ["wipe()", f"shutil.rmtree({str(tmp_path)!r})", f"os.rename({str(sentinel)!r}, 'mine.txt')"]
    result = run(program, tests, audit_hook=audit_hook)
    assert [o.passed for o in result.outcomes] == [False, False, False]
    assert sentinel.read_text() == "keep me"


@BOTH_LAYERS
def test_environment_secrets_are_invisible(monkeypatch, audit_hook):
    name, value = f"RLBENCH_TEST_SECRET_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    monkeypatch.setenv(name, value)
    program = (
        "import os\n"
        "def environ_of(pid):\n"
        "    with open(f'/proc/{pid}/environ', 'rb') as f:\n"
        "        return f.read()\n"
    )
    tests = [
        f"assert os.environ.get({name!r}) == {value!r}",
        f"assert {value.encode()!r} in environ_of(os.getppid())",
        f"assert {value.encode()!r} in environ_of({os.getpid()})",
    ]
    result = run(program, tests, audit_hook=audit_hook)
    assert [o.passed for o in result.outcomes] == [False, False, False]
    assert result.outcomes[0].error == "AssertionError"
    assert result.outcomes[2].error.startswith(("SandboxViolation", "PermissionError"))


@BOTH_LAYERS
def test_no_network_connection_reaches_a_local_server(audit_hook):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    accepted = []

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

    stop = threading.Event()
    listener = threading.Thread(target=accept_all)
    listener.start()
    program = "import socket\n"
    tests = [f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hello')"]
    try:
        result = run(program, tests, audit_hook=audit_hook)
    finally:
        stop.set()
        listener.join()
        server.close()
    assert not result.passed and accepted == []
    if not audit_hook and IS_ROOT:
        assert result.outcomes[0].error == "OSError: [Errno 101] Network is unreachable"


def test_a_subprocess_that_outlives_the_program_is_refused():
    program = "import subprocess\n"
    tests = ["subprocess.Popen(['sleep', '30'], start_new_session=True)"]
    result = run(program, tests)
    assert not result.passed and "subprocess.Popen is not allowed" in result.outcomes[0].error


def test_orphaned_and_detached_processes_are_killed_when_the_run_ends():
    """Without the audit hook the program may start processes: a ``sleep`` in its own session
    and a double-forked daemon. Both must be gone when run_tests returns."""
    program = (
        "import os, subprocess, time\n"
        "popen = subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
        "read_end, write_end = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(write_end, str(os.getpid()).encode())\n"
        "        time.sleep(30)\n"
        "    os._exit(0)\n"
        "daemon = int(os.read(read_end, 32))\n"
        "print(popen.pid, daemon)\n"
    )
    result = run(program, ["pass"], audit_hook=False)
    assert result.passed, result
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2
    assert not any(alive(pid) for pid in pids)


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
    summary = lambda rs: [(r.passed, r.status, r.outcomes) for r in rs]  # noqa: E731
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


SUPERVISOR_OK = {"exit_code": 0, "timed_out": False, "cpu_limit": False, "output_limit": False}


def test_report_parsing_and_verdict():
    lines = ["ready 1 1", "load 1", "test 0 1", "test 1 0 " + b"AssertionError".hex(), "done 2"]
    report = parse_report(lines, 2)
    assert report.ready and report.undumpable and report.audit_hook and report.done
    assert report.outcomes == {0: TestOutcome(True, None), 1: TestOutcome(False, "AssertionError")}
    assert judge(report, 2, SUPERVISOR_OK) == (False, "failed", None)
    assert judge(parse_report(["load 1", "test 0 1", "done 1"], 1), 1, SUPERVISOR_OK) == (True, "passed", None)


@pytest.mark.parametrize(
    "lines, supervisor",
    [
        (["load 1", "test 0 1"], SUPERVISOR_OK),  # no completion line
        (["load 1", "test 0 1", "done 2"], SUPERVISOR_OK),  # wrong test count
        (["load 1", "test 0 1", "test 0 1", "done 1"], SUPERVISOR_OK),  # duplicate
        (["test 0 1", "done 1"], SUPERVISOR_OK),  # no load line
        (["load 1", "test 0 1", "done 1", "bogus"], SUPERVISOR_OK),  # unknown line
        (["load 1", "test 0 1", "done 1"], {**SUPERVISOR_OK, "exit_code": 1}),
        (["load 1", "test 0 1", "done 1"], {**SUPERVISOR_OK, "timed_out": True}),
    ],
)
def test_incomplete_or_odd_reports_never_pass(lines, supervisor):
    passed, status, _ = judge(parse_report(lines, 1), 1, supervisor)
    assert not passed and status != "passed"


def test_an_empty_report_is_a_crash():
    assert judge(HarnessReport(), 1, {**SUPERVISOR_OK, "exit_code": -9})[1] == "crashed"
