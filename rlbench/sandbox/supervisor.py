"""Sandbox supervisor: the trusted process of one run. It starts the untrusted harness in a
sandbox, runs the benchmark's tests itself, calls the program's functions through proxies that
exchange plain data, enforces the wall clock, kills everything the program started and reports
one JSON object on stdout.

Started by :func:`rlbench.sandbox.run_tests` as ``python -I -B -S supervisor.py`` in a new session
(a process separate from the caller's), with a minimal environment, an empty work directory as
cwd and the request (JSON) on stdin: ``{"program", "tests", "setup", "entry_point", "workdir",
"harness", "audit_hook", "bwrap" (the executable or null), "limits"}``. Standard library only (isolated mode; it must not
import ``rlbench``; it loads ``plain.py`` from its own directory).

Layers (each reported under ``isolation``; see the package docstring for the threat model):

* As root, the supervisor first enters a private mount namespace of its own and mounts a tmpfs
  (``file_size_mb`` in all, ``WORK_INODES`` entries) on the work directory, owned by the run's
  own uid: the program's files never reach the host's disk and vanish with the namespace.
* Cgroups (v1 or v2, where the hierarchy is writable): a ``pids`` limit and a ``memory`` limit
  that counts memfds, tmpfs and shared memory, for this run alone.
* bubblewrap (``bwrap``) when installed: new PID, network, IPC, UTS and mount namespaces with a
  minimal root (``/usr``, the Python installation, the harness's two files, ``/proc`` of its own
  PID namespace, a minimal ``/dev``, the work directory at ``/sandbox``), ``--die-with-parent``,
  ``--new-session``, an empty environment. As root, ``setpriv`` then becomes a uid chosen at random
  for this run (so ``RLIMIT_NPROC`` is counted per run); without root, bwrap's user namespace.
* Without bwrap (the fallback): network and mount namespaces made here (every mount read-only but
  the work directory), the run's uid, and the subreaper clean-up; the project and the data stay
  readable.
* Always: resource limits (CPU, address space, file size, processes, open files, no core).
"""

from __future__ import annotations

import builtins
import ctypes
import fcntl
import importlib
import json
import os
import re
import resource
import secrets
import select
import signal
import stat
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import NotPlain, from_wire, to_wire  # noqa: E402

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
#: Per-mount options that a read-only bind remount must keep.
MOUNT_OPTION_FLAGS = {
    "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME,
}  # fmt: skip
#: Processes (threads included) one run may have: its pids cgroup, and RLIMIT_NPROC of its uid.
MAX_PROCESSES = 512
MAX_OPEN_FILES = 256
#: Controllers of a run's cgroup (each reported as ``cgroup_<name>``), and the CPU quota's period.
CGROUP_CONTROLLERS = ("pids", "memory", "cpu")
CPU_PERIOD_US = 100_000
#: Files and directories the work tmpfs may hold.
WORK_INODES = 4096
#: The run's uid (and gid) as root: drawn at random from this range for each run.
RUN_UID_BASE, RUN_UID_COUNT = 1 << 20, 1 << 20
#: Where the work directory and the harness appear inside bubblewrap's root.
SANDBOX_HOME = "/sandbox"
HARNESS_DIR_INSIDE = "/opt/rlbench-sandbox"
HARNESS_FILES = ("harness.py", "plain.py")
#: Top-level host paths bound read-only (or re-created as the same symlink) into bwrap's root.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The harness's whole environment (besides HOME and TMPDIR): one thread per numeric library.
HARNESS_ENV = {
    "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}  # fmt: skip
#: Standard modules that a program's ``import`` makes available to the tests too (MBPP's tests use
#: ``sys``/``math``/``re`` that only the solution imports): the tests get this process's own copy.
TEST_MODULES = frozenset({
    "array", "bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions", "functools",
    "heapq", "itertools", "math", "operator", "random", "re", "statistics", "string", "sys", "typing",
})  # fmt: skip
#: Start of the error of a run whose bubblewrap could not set up the sandbox: the supervisor then
#: runs the fallback (``isolation["bwrap_error"]`` keeps the message).
BWRAP_FAILED = "bubblewrap could not start"
#: Starts of bubblewrap tried before a run gives up on it (with a growing pause between them).
BWRAP_ATTEMPTS, BWRAP_RETRY_PAUSE_S = 3, 0.2
BWRAP_FALLBACK_HINT = (
    "Fix bubblewrap (e.g. allow user namespaces), or choose the weaker fallback explicitly with "
    "sandbox.bwrap_fallback=true (docs/evaluation.md#the-sandbox)"
)
#: Seconds a harness whose channel closed gets to exit on its own (so its exit status is seen).
EXIT_GRACE_S = 1.0
#: bwrap exits with 128 + N when the program is killed by signal N.
BWRAP_SIGNAL_BASE = 128

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


# ---------------------------------------------------------------------------------------
# the work directory and the cgroups (in the supervisor, before the harness starts)
# ---------------------------------------------------------------------------------------


def private_work_tmpfs(workdir: str, size_bytes: int, uid: int) -> None:
    """As root: enter a mount namespace of our own and mount a capped tmpfs on ``workdir``,
    owned by ``uid``. Nothing the program writes reaches the host; the mount goes with us."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    options = f"size={size_bytes},nr_inodes={WORK_INODES},mode=0700,uid={uid},gid={uid}"
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, options)


def _own_cgroup_paths() -> dict[str, str]:
    """``{controller or "": path}`` from ``/proc/self/cgroup`` (``""``: the cgroup v2 path)."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def cgroup_limits(memory_bytes: int, cpu_cores: float) -> tuple[dict, dict]:
    """(v2 files, v1 files) per controller: processes, memory (memfds, tmpfs and shared memory
    counted) and CPU (a quota of ``cpu_cores`` per period, and the default weight: the kernel
    shares CPU between cgroups first, so a run's many processes weigh as one)."""
    quota = max(1000, int(cpu_cores * CPU_PERIOD_US))
    v2 = {
        "pids": {"pids.max": MAX_PROCESSES},
        "memory": {"memory.max": memory_bytes, "memory.swap.max": 0},
        "cpu": {"cpu.max": f"{quota} {CPU_PERIOD_US}", "cpu.weight": 100},
    }
    v1 = {
        "pids": {"pids.max": MAX_PROCESSES},
        "memory": {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes},
        "cpu": {"cpu.cfs_period_us": CPU_PERIOD_US, "cpu.cfs_quota_us": quota, "cpu.shares": 1024},
    }
    return v2, v1


def cgroup_dirs(name: str) -> list[tuple[str, list[str]]]:
    """``[(directory, [controllers])]`` where this process would make the cgroup ``name`` (v2: one
    directory below its own cgroup; v1: one per controller hierarchy it is in)."""
    try:
        own = _own_cgroup_paths()
    except OSError:
        return []
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers") and "" in own:
        return [(f"/sys/fs/cgroup{own['']}".rstrip("/") + "/" + name, list(CGROUP_CONTROLLERS))]
    return [
        (f"/sys/fs/cgroup/{c}{own[c]}".rstrip("/") + "/" + name, [c])
        for c in CGROUP_CONTROLLERS
        if c in own and os.path.isdir(f"/sys/fs/cgroup/{c}")
    ]


class Cgroups:
    """A pids, a memory and a cpu cgroup for this run (v2: one directory; v1: one per controller),
    where the hierarchy is writable; otherwise nothing (``active`` says which limits hold).
    ``name`` comes from the caller, so that its watchdog can remove them if this process is killed
    (``python supervisor.py`` with ``{"cleanup": name}``)."""

    def __init__(self, name: str, memory_bytes: int, cpu_cores: float) -> None:
        self.dirs: list[str] = []
        self.active = {c: False for c in CGROUP_CONTROLLERS}
        v2, v1 = cgroup_limits(memory_bytes, cpu_cores)
        for path, controllers in cgroup_dirs(name):
            files = v2 if len(controllers) > 1 else v1
            self._make(path, {c: files[c] for c in controllers})

    def _make(self, path: str, limits: dict[str, dict[str, int]]) -> None:
        try:
            os.mkdir(path, 0o700)
        except OSError:
            return
        self.dirs.append(path)
        for controller, files in limits.items():
            written = []
            for file, value in files.items():
                try:
                    with open(os.path.join(path, file), "w") as f:
                        f.write(str(value))
                    written.append(file)
                except OSError:  # e.g. no swap accounting: the other file still holds
                    pass
            self.active[controller] = self.active[controller] or bool(written)

    def join(self) -> None:
        """Move the calling process (the child, before exec) into every cgroup of this run."""
        for path in self.dirs:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write("0")

    def remove(self) -> None:
        """Kill whatever is left in the cgroups, then remove them."""
        remove_cgroups(self.dirs)


def remove_cgroups(dirs: list[str]) -> None:
    """Kill every process in each cgroup of ``dirs`` (gone ones are skipped), then remove it."""
    for path in dirs:
        for _ in range(1000):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                break
            if not pids:
                break
            kill_and_reap(pids)
        for _ in range(100):
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:  # the last processes are still exiting
                time.sleep(0.002)


# ---------------------------------------------------------------------------------------
# the harness's command: bubblewrap, or the fallback made here
# ---------------------------------------------------------------------------------------


def python_executable() -> str:
    """The base interpreter (not a virtual environment's link to it): the harness needs only
    the standard library."""
    return os.path.realpath(sys.executable)


def bwrap_command(bwrap: str, request: dict, root: bool, uid: int) -> list[str]:
    """bubblewrap's command line for the harness (see the module docstring)."""
    harness_dir = os.path.dirname(request["harness"])
    cmd = [
        bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
        "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--clearenv",
    ]  # fmt: skip
    if not root:
        cmd.append("--unshare-user")
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    made: set[str] = set()
    for prefix in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}):
        if not any(prefix == p or prefix.startswith(p + "/") for p in SYSTEM_PATHS):
            # its parents, made traversable but not listable (bwrap would make them 0700: the run's
            # uid could not reach this interpreter's libpython and standard library, and would
            # load the system's)
            for ancestor in _ancestors(prefix):
                if ancestor not in made:
                    made.add(ancestor)
                    cmd += ["--perms", "0711", "--dir", ancestor]
            cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--perms", "0755", "--dir", HARNESS_DIR_INSIDE]
    for name in HARNESS_FILES:
        cmd += ["--ro-bind", os.path.join(harness_dir, name), f"{HARNESS_DIR_INSIDE}/{name}"]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    if root:
        cmd += ["--bind", request["workdir"], SANDBOX_HOME]
    else:
        size = str(int(request["limits"]["file_size_mb"]) << 20)
        cmd += ["--size", size, "--perms", "0700", "--tmpfs", SANDBOX_HOME]
    for key, value in {**HARNESS_ENV, "HOME": SANDBOX_HOME, "TMPDIR": SANDBOX_HOME}.items():
        cmd += ["--setenv", key, value]
    cmd += ["--chdir", SANDBOX_HOME]
    if root:
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", "/usr/bin/setpriv",
                f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]  # fmt: skip
    else:
        cmd.append("--")
    return cmd + [python_executable(), "-I", "-B", "-S", f"{HARNESS_DIR_INSIDE}/harness.py"]


def _ancestors(path: str) -> list[str]:
    """``/a``, ``/a/b`` for ``/a/b/c``."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:depth]) for depth in range(1, len(parts))]


def blocking_ancestor(path: str) -> str | None:
    """The highest directory above ``path`` that other users cannot traverse (no ``o+x``)."""
    for ancestor in _ancestors(path):
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def exposure_plan(needed: list[str]) -> dict[str, list[str]]:
    """``{hidden directory: [paths to bind back under it]}`` for paths the sandbox user needs
    (the Python installation, the harness) but could not reach as an unprivileged user."""
    plan: dict[str, list[str]] = {}
    for path in sorted({os.path.realpath(p) for p in needed}):
        hidden = blocking_ancestor(path)
        if hidden is None:
            continue
        binds = plan.setdefault(hidden, [])
        if not any(path == b or path.startswith(b + "/") for b in binds):
            binds.append(path)
    return plan


def needed_paths(request: dict) -> list[str]:
    """What the run's user must reach in the fallback: the interpreter, its libraries, the
    harness and the work directory."""
    return [
        sys.base_prefix, sys.base_exec_prefix, os.path.dirname(python_executable()),
        os.path.dirname(request["harness"]), request["workdir"],
    ]  # fmt: skip


def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _expose(plan: dict[str, list[str]]) -> None:
    """Cover each hidden directory with an empty tmpfs and bind the needed paths back."""
    for hidden, binds in plan.items():
        fds = [os.open(path, os.O_PATH | os.O_CLOEXEC) for path in binds]
        _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
        for path, fd in zip(binds, fds):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            os.close(fd)


def _remount_read_only(keep_writable: str) -> int:
    """Remount every mount read-only except ``keep_writable``; returns the number of failures."""
    failures = 0
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target = _unescape_mountinfo(fields[4])
        if target == keep_writable:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= MOUNT_OPTION_FLAGS.get(option, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            failures += 1
    return failures


def fallback_isolation(workdir: str, plan: dict[str, list[str]], root: bool) -> dict:
    """Without bwrap (in the child): network and IPC namespaces (no SysV segment or POSIX queue
    shared with the host or another run) and, as root, a mount namespace in which only
    ``workdir`` is writable. Returns what was achieved."""
    info = {"netns": False, "ipcns": False, "mountns": False, "userns": False, "readonly_fs": False}
    if root and _libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC) == 0:
        info["netns"] = info["mountns"] = info["ipcns"] = True
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _expose(plan)
        _mount(workdir, workdir, None, MS_BIND | MS_REC)
        info["readonly_fs"] = _remount_read_only(workdir) == 0
    elif _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC) == 0:
        info["netns"] = info["userns"] = info["ipcns"] = True
    elif _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        info["netns"] = info["userns"] = True
    return info


def _set_limits(limits: dict) -> None:
    mib = 1 << 20
    cpu = int(limits["cpu_s"])
    for which, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, limits["memory_mb"] * mib, limits["memory_mb"] * mib),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mib, limits["file_size_mb"] * mib),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, MAX_PROCESSES, MAX_PROCESSES),
        (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
    ):
        resource.setrlimit(which, (soft, hard))


def _drop_privileges(uid: int) -> int:
    """Become ``uid`` (group ``uid``, no supplementary groups) when running as root."""
    if os.geteuid() != 0:
        return os.geteuid()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    return os.geteuid()


def _child(launch: dict, fds: dict, cgroups: Cgroups) -> None:
    """Runs in the forked child; never returns (exec or ``_exit``). Any failure is written to
    the set-up pipe, which the supervisor reports as the cause of a failed start."""
    setup_fd = fcntl.fcntl(fds["setup_w"], fcntl.F_DUPFD_CLOEXEC, 100)
    caller_uid = os.geteuid()
    try:
        os.setpgid(0, 0)
        for target, name in enumerate(("payload_r", "stdout", "stderr", "messages_w", "requests_r")):
            os.dup2(fds[name], target)
        os.closerange(5, setup_fd)
        os.closerange(setup_fd + 1, MAX_OPEN_FILES * 64)
        cgroups.join()
        info = {}
        if launch["command"] is None:  # the fallback: namespaces and uid made here
            info = fallback_isolation(launch["workdir"], launch["plan"], launch["root"])
            os.chdir(launch["workdir"])
        _set_limits(launch["limits"])
        if launch["command"] is None:
            can_drop = info["mountns"] or not launch["plan"]
            # the uid on the host (inside a user namespace ``geteuid`` says 65534, which is not
            # who the program is to the host's files and processes)
            dropped = can_drop and launch["root"] and os.geteuid() == 0  # root here, not in a user namespace
            host_uid = _drop_privileges(launch["uid"]) if dropped else caller_uid
            info["uid"], info["own_uid"] = host_uid, host_uid != caller_uid
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        os.write(setup_fd, json.dumps(info).encode())
        if launch["command"] is None:
            env = {**HARNESS_ENV, "HOME": launch["workdir"], "TMPDIR": launch["workdir"]}
            os.execve(python_executable(), [python_executable(), "-I", "-B", "-S", launch["harness"]], env)
        os.execve(launch["command"][0], launch["command"], {})
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, then exit
        try:
            os.write(setup_fd, b"\n" + json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(127)


# ---------------------------------------------------------------------------------------
# the channel to the harness and the proxies the tests call
# ---------------------------------------------------------------------------------------


class RunOver(BaseException):
    """The run cannot go on (wall clock, the harness gone, a broken channel): the current test
    fails and no later test runs. A BaseException, so that a test's ``except Exception`` does
    not swallow it."""


class CannotCross(BaseException):
    """A value that is not plain data was to cross the boundary; the current test fails."""


class MessageTooLarge(CannotCross):
    """A message from the harness longer than ``max_reply_bytes`` (read and dropped, not decoded)."""


class CandidateError(Exception):
    """The program's function raised an exception that is not a built-in one."""


class Channel:
    """Line-delimited JSON to and from the harness, every wait bounded by the run's deadline."""

    def __init__(self, messages_r: int, requests_w: int, pid: int, deadline: float, max_message_bytes: int) -> None:
        self.messages_r, self.requests_w, self.pid, self.deadline = messages_r, requests_w, pid, deadline
        #: Longest message decoded (``max_reply_bytes``): the JSON decoder's objects take some 30
        #: times the text, outside any cgroup; a longer message is read, dropped and refused.
        self.max_message_bytes = max_message_bytes
        os.set_blocking(requests_w, False)
        self.buffer = bytearray()
        self.over: str | None = None  # why the run ended early: "timeout" or "crashed"
        self.crossing_failure: str | None = None  # set by a proxy; fails the current test
        self.pidfd = os.pidfd_open(pid)

    def _wait(self, fd: int, event: int) -> None:
        poller = select.poll()
        poller.register(fd, event)
        poller.register(self.pidfd, select.POLLIN)
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.end("timeout")
            ready = dict(poller.poll(max(1, int(remaining * 1000))))
            if ready.get(fd):
                return
            if ready.get(self.pidfd):
                self.end("crashed")

    def end(self, why: str) -> None:
        self.over = self.over or why
        raise RunOver(self.over)

    def send(self, message: dict) -> None:
        if self.over:
            raise RunOver(self.over)
        data = memoryview(json.dumps(message).encode() + b"\n")
        while data:
            self._wait(self.requests_w, select.POLLOUT)
            try:
                data = data[os.write(self.requests_w, data) :]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                self.end("crashed")

    def receive(self) -> dict:
        if self.over:
            raise RunOver(self.over)
        too_large, scanned = False, 0
        while (newline := self.buffer.find(b"\n", scanned)) < 0:
            scanned = len(self.buffer)
            if scanned > self.max_message_bytes:  # read the rest of it, keeping none of it
                too_large, scanned = True, 0
                self.buffer.clear()
            self._wait(self.messages_r, select.POLLIN)
            chunk = os.read(self.messages_r, 1 << 16)
            if not chunk:
                self.end("crashed")
            self.buffer += chunk
        line = bytes(self.buffer[:newline])
        del self.buffer[: newline + 1]
        if too_large or len(line) > self.max_message_bytes:
            raise MessageTooLarge(self.max_message_bytes)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if type(message) is not dict:
            self.end("crashed")
        return message


def _exact_str(value, limit: int = 300) -> str:
    return value[:limit] if type(value) is str else "?"


def _candidate_exception(kind, message) -> BaseException:
    """The trusted side's copy of an exception the program's function raised: the built-in
    exception of that name (so ``except ValueError`` in a test works), else CandidateError."""
    kind, message = _exact_str(kind, 80), _exact_str(message)
    if kind == "SystemExit":
        return CandidateError(f"SystemExit({message})")
    cls = getattr(builtins, kind, None) if kind.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message) if message else cls()
        except Exception:  # noqa: BLE001 - a built-in that needs other arguments
            pass
    return CandidateError(f"{kind}: {message}" if message else kind)


class OpaqueResult:
    """Stands in the tests for a result that is not plain data (a regex match, a generator): only
    its type name and truth value crossed. ``if f(x):`` and ``assert not f(x)`` work; comparing,
    iterating or reading it fails the test with the reason (a trusted object: nothing of the
    program's runs here)."""

    def __init__(self, candidate: Candidate, type_name: str, truth: bool) -> None:
        self._candidate, self._type_name, self._truth = candidate, type_name, truth

    def __bool__(self) -> bool:
        return self._truth

    def __repr__(self) -> str:
        return f"<{self._type_name} from the program>"

    __hash__ = object.__hash__

    def _refuse(self, *_args):
        name = self._candidate.__name__
        raise self._candidate._refuse(
            f"cannot cross: the result of {name} is a {self._type_name} object; only its truth value crossed"
        )

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __iter__ = __len__ = __getitem__ = __contains__ = _refuse

    def __getattr__(self, name):
        self._refuse()


class Candidate:
    """Stands for one function of the program in the tests' namespace: a call sends the arguments
    as plain data, the harness calls the function, and the result comes back as plain data."""

    def __init__(self, channel: Channel, name: str) -> None:
        self._channel, self.__name__ = channel, name

    def __repr__(self) -> str:
        return f"<program function {self.__name__}>"

    def _refuse(self, reason: str) -> CannotCross:
        self._channel.crossing_failure = self._channel.crossing_failure or reason
        return CannotCross(reason)

    def __call__(self, *args, **kwargs):
        try:
            request = {"call": self.__name__, "args": to_wire(list(args)), "kwargs": to_wire(dict(kwargs))}
        except NotPlain as exc:
            raise self._refuse(f"cannot cross: an argument of {self.__name__}: {exc}") from None
        self._channel.send(request)
        try:
            reply = self._channel.receive()
        except MessageTooLarge as exc:
            raise self._refuse(
                f"cannot cross: the result of {self.__name__} is longer than {exc} bytes (sandbox limit max_reply_bytes)"
            ) from None
        if len(reply) != 1:
            raise self._refuse(f"cannot cross: a malformed reply from {self.__name__}")
        ((kind, body),) = reply.items()
        if kind == "ok":
            try:
                return from_wire(body)
            except (NotPlain, RecursionError) as exc:
                raise self._refuse(f"cannot cross: the result of {self.__name__}: {exc}") from None
        if kind == "raised" and type(body) is list and len(body) == 2:
            raise _candidate_exception(*body)
        if kind == "opaque" and type(body) is list and len(body) == 2 and type(body[1]) is bool:
            return OpaqueResult(self, _exact_str(body[0], 80), body[1])
        if kind == "refused":
            raise self._refuse(f"cannot cross: the result of {self.__name__}: {_exact_str(body)}")
        raise self._refuse(f"cannot cross: a malformed reply from {self.__name__}")


# ---------------------------------------------------------------------------------------
# the tests (trusted code, run here)
# ---------------------------------------------------------------------------------------


def describe(exc: BaseException) -> str:
    """Short text of an exception: ``AssertionError``, ``ValueError: bad``, ``SystemExit(0)``."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r})"[:300]
    message = str(exc)
    return (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:300]


def tests_namespace(channel: Channel, names: dict, setup: str, entry_point: str | None) -> tuple[dict, dict]:
    """The namespace the tests run in, and ``{name: type}`` of the program's names that could not
    cross. First the program's names (functions as :class:`Candidate`, plain data as copies; never
    one that shadows a builtin), then the trusted ``setup`` (whose names win), then ``entry_point``
    bound to the program's function (it may shadow a builtin: MBPP 126's ``sum``)."""
    namespace: dict = {"__name__": "tests", "__builtins__": builtins}
    opaque: dict[str, str] = {}
    for name, kind in names.items():
        if type(name) is not str or not name.isidentifier() or type(kind) is not dict or len(kind) != 1:
            continue
        if hasattr(builtins, name) or name.startswith("__"):  # ``def set(x): return 0`` would rig the tests
            continue
        ((what, body),) = kind.items()
        if what == "callable":
            namespace[name] = Candidate(channel, name)
        elif what == "module" and body in TEST_MODULES:  # the trusted side's own copy
            namespace[name] = importlib.import_module(body)
        elif what == "value":
            try:
                namespace[name] = from_wire(body)
            except (NotPlain, RecursionError):
                opaque[name] = "malformed"
        else:
            opaque[name] = _exact_str(body, 80)
    if setup:
        exec(compile(setup, "<test setup>", "exec", dont_inherit=True), namespace)
    if entry_point:
        namespace.pop(entry_point, None)
        if type(names.get(entry_point)) is dict and "callable" in names[entry_point]:
            namespace[entry_point] = Candidate(channel, entry_point)
    return namespace, opaque


def run_one_test(test: str, index: int, namespace: dict, opaque: dict, channel: Channel) -> list:
    """[passed, error] of one test."""
    channel.crossing_failure = None
    try:
        exec(compile(test, f"<test {index}>", "exec", dont_inherit=True), namespace)
        error = None
    except RunOver as exc:
        error = {"timeout": "wall-clock time limit reached"}.get(str(exc), "the program's process ended")
    except NameError as exc:
        name = getattr(exc, "name", None)
        error = describe(exc)
        if name in opaque:
            error = f"cannot cross: {name} is a {opaque[name]} object in the program; only functions and plain data cross"
    except BaseException as exc:  # noqa: BLE001 - SystemExit included: a failure
        error = describe(exc)
    if channel.crossing_failure:  # even when the test caught the exception
        error = channel.crossing_failure
    return [error is None, error]


def run_tests_here(channel: Channel, request: dict, names: dict) -> list:
    """Outcomes of every test, in order; tests after the run ended are ``[False, "not run"]``."""
    tests = request["tests"]
    try:
        namespace, opaque = tests_namespace(channel, names, request["setup"], request["entry_point"])
    except RunOver:
        return [[False, "not run"]] * len(tests)
    except BaseException as exc:  # noqa: BLE001 - the benchmark's set-up code failed
        return [[False, f"test setup failed: {describe(exc)}"]] * len(tests)
    outcomes = []
    for index, test in enumerate(tests):
        if channel.over:
            outcomes.append([False, "not run"])
            continue
        outcomes.append(run_one_test(test, index, namespace, opaque, channel))
    return outcomes


# ---------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads), from ``/proc/<pid>/task/<tid>/children``."""
    found = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone meanwhile
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return found


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants(max_rounds: int = 200) -> int:
    """SIGKILL every descendant (orphans come back to us as subreaper) until none is left."""
    killed: set[int] = set()
    for _ in range(max_rounds):
        pids = descendants(os.getpid())
        if not pids:
            break
        kill_and_reap(pids)
        killed |= pids
    return len(killed)


def kill_and_reap(pids) -> None:
    """SIGKILL each of ``pids``, reap our children among them, and give the rest a moment."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_all()
    time.sleep(0.0005)


def read_output(fd: int, limit: int) -> tuple[str, int]:
    """(first ``limit`` bytes of the file as text, with a note if cut; total size in bytes)."""
    size = os.fstat(fd).st_size
    text = os.pread(fd, limit, 0).decode("utf-8", "replace")
    if size > limit:
        text += f"\n[sandbox: output truncated: {size} bytes written, first {limit} kept]"
    return text, size


def _read_available(fd: int, limit: int = 1 << 16) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except BlockingIOError:
        return b""


def _setup_report(data: bytes) -> tuple[dict, str | None]:
    """(isolation facts, set-up error) from what the child wrote before exec."""
    info, error = {}, None
    for part in data.split(b"\n"):
        try:
            value = json.loads(part) if part.strip() else {}
        except ValueError:
            continue
        if isinstance(value, dict):
            error = value.pop("error", error)
            info.update(value)
    return info, error


def exit_code_of(status: int, bwrap: bool) -> int:
    """The harness's exit code (negative: killed by that signal), through bwrap's 128 + N."""
    code = os.waitstatus_to_exitcode(status)
    if bwrap and code > BWRAP_SIGNAL_BASE:
        return -(code - BWRAP_SIGNAL_BASE)
    return code


def supervise(request: dict) -> dict:
    limits = request["limits"]
    subreaper = _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    root = os.geteuid() == 0
    uid = RUN_UID_BASE + secrets.randbelow(RUN_UID_COUNT) if root else os.geteuid()
    bwrap = request["bwrap"]  # the executable, or None
    if root and not os.access("/usr/bin/setpriv", os.X_OK):
        bwrap = None
    isolation = {"subreaper": subreaper, "verdict_outside": True, "rlimits": True}
    if root:
        private_work_tmpfs(request["workdir"], int(limits["file_size_mb"]) << 20, uid)
        isolation["work_tmpfs"] = True
    cgroups = Cgroups(request["cgroup_name"], int(limits["memory_mb"]) << 20, float(limits["cpu_cores"]))
    isolation.update({f"cgroup_{k}": v for k, v in cgroups.active.items()})
    try:
        if not bwrap:
            return _run(request, root, uid, None, cgroups, {**isolation, "bwrap": False})
        for attempt in range(BWRAP_ATTEMPTS):  # a failed start may be transient (out of pids or memory)
            if attempt:
                kill_descendants()
                time.sleep(BWRAP_RETRY_PAUSE_S * attempt)
            result = _run(request, root, uid, bwrap, cgroups, {**isolation, **bwrap_layers(bwrap, uid, root)})
            error = result.get("sandbox_error", "")
            if not error.startswith(BWRAP_FAILED) or time.monotonic() >= float(request["deadline"]):
                return result
        if not request["bwrap_fallback"]:  # never a silent step down to weaker isolation
            return {"sandbox_error": f"{error[:400]}; {BWRAP_ATTEMPTS} attempts failed. {BWRAP_FALLBACK_HINT}"}
        kill_descendants()  # the caller chose the fallback for when bubblewrap cannot start
        return _run(request, root, uid, None, cgroups, {**isolation, "bwrap": False, "bwrap_error": error[:300]})
    finally:
        kill_descendants()
        cgroups.remove()


def bwrap_layers(bwrap: str | None, uid: int, root: bool) -> dict:
    """What bubblewrap adds (without root its work tmpfs is capped in bytes only, and the program
    is the caller's uid to the host, though it reaches none of its files or processes)."""
    if not bwrap:
        return {"bwrap": False}
    return {"bwrap": True, "pidns": True, "netns": True, "ipcns": True, "mountns": True, "minimal_root": True,
            "uid": uid, "own_uid": root, "work_tmpfs": True}  # fmt: skip


def _run(request: dict, root: bool, uid: int, bwrap: str | None, cgroups: Cgroups, isolation: dict) -> dict:
    limits = request["limits"]
    fds = {name: os.memfd_create(name, os.MFD_CLOEXEC) for name in ("stdout", "stderr")}
    fds["payload_r"], payload_w = os.pipe2(os.O_CLOEXEC)
    fds["messages_r"], fds["messages_w"] = os.pipe2(os.O_CLOEXEC)
    fds["requests_r"], fds["requests_w"] = os.pipe2(os.O_CLOEXEC)
    fds["setup_r"], fds["setup_w"] = os.pipe2(os.O_CLOEXEC)
    launch = {
        "command": bwrap_command(bwrap, request, root, uid) if bwrap else None,
        "workdir": request["workdir"], "harness": request["harness"], "root": root, "uid": uid,
        "plan": exposure_plan(needed_paths(request)) if root and not bwrap else {},
        "limits": limits,
    }  # fmt: skip
    if root and not bwrap:
        os.chown(request["workdir"], uid, uid)
    start = time.monotonic()
    deadline = float(request["deadline"])  # the caller's clock (CLOCK_MONOTONIC is system-wide)
    pid = os.fork()
    if pid == 0:
        _child(launch, fds, cgroups)
    for name in ("payload_r", "messages_w", "requests_r", "setup_w"):
        os.close(fds.pop(name))
    payload = {"program": request["program"], "audit_hook": request["audit_hook"], "max_value_bytes": int(limits["max_reply_bytes"]) // 4}
    payload = json.dumps(payload).encode()
    channel = Channel(fds["messages_r"], fds["requests_w"], pid, deadline, int(limits["max_reply_bytes"]))
    outcomes, loaded, load_error, start_error, ready = [[False, "not run"]] * len(request["tests"]), None, None, None, None
    signal.signal(signal.SIGALRM, lambda *_: channel.end("timeout"))
    signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline - time.monotonic()))
    try:
        try:
            _send_payload(channel, payload_w, payload)
            ready = channel.receive()
        except RunOver:
            ready = None
        if ready is None or "ready" not in ready:
            start_error = "no ready message"
        else:
            isolation.update({k: bool(v) for k, v in ready["ready"].items()} if type(ready["ready"]) is dict else {})
            load = channel.receive()
            loaded = "load" in load and load["load"] is None and type(load.get("names")) is dict
            load_error = None if loaded else _exact_str(load.get("load"))
            if loaded:
                outcomes = run_tests_here(channel, request, load["names"])
    except RunOver:
        pass
    except MessageTooLarge as exc:
        if ready is None or "ready" not in ready:
            start_error = "no ready message"
        else:
            loaded, load_error = False, f"the program's global names take more than {exc} bytes (sandbox limit max_reply_bytes)"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    timed_out = channel.over == "timeout"
    if channel.over == "crashed":  # let bwrap pass on how the harness ended (e.g. SIGXCPU)
        select.select([channel.pidfd], [], [], EXIT_GRACE_S)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    status = os.waitpid(pid, 0)[1]
    exit_code = exit_code_of(status, bwrap is not None)
    setup_info, setup_error = _setup_report(_read_available(fds["setup_r"]))
    isolation.update(setup_info)
    max_output = int(limits["max_output_bytes"])
    stdout, stdout_size = read_output(fds["stdout"], max_output)
    stderr, stderr_size = read_output(fds["stderr"], max_output)
    if start_error is not None and not timed_out:
        if bwrap and stderr.startswith("bwrap:"):
            return {"sandbox_error": f"{BWRAP_FAILED} ({stderr.strip()[:400]})"}
        cause = setup_error or f"exit code {exit_code}: {stderr.strip()[-400:]}"
        return {"sandbox_error": f"the harness did not start ({cause})"}
    return {
        "loaded": loaded,
        "load_error": load_error,
        "outcomes": outcomes,
        "timed_out": timed_out,
        "cpu_limit": exit_code == -signal.SIGXCPU,
        "crashed": channel.over == "crashed",
        "exit_code": exit_code,
        "stdout": stdout,
        "stderr": stderr,
        "output_limit": max(stdout_size, stderr_size) >= int(limits["file_size_mb"]) << 20,
        "isolation": isolation,
        "seconds": time.monotonic() - start,
    }


def _send_payload(channel: Channel, fd: int, data: bytes) -> None:
    """Write the payload to the harness's fd 0 (bounded by the deadline), then close it."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    try:
        while view:
            channel._wait(fd, select.POLLOUT)
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return
    finally:
        os.close(fd)


def main() -> None:
    # The report goes to the caller's pipe through a private descriptor; fd 1 becomes /dev/null, so
    # that whatever the trusted tests print cannot garble it.
    report = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    request = json.loads(sys.stdin.buffer.read())
    if "cleanup" in request:  # the caller's watchdog killed a supervisor: remove what it left
        remove_cgroups([path for path, _ in cgroup_dirs(request["cleanup"])])
        os._exit(0)
    try:
        result = supervise(request)
    except Exception as exc:  # noqa: BLE001 - reported as a sandbox infrastructure error
        result = {"sandbox_error": f"{type(exc).__name__}: {exc}"}
    report.write(json.dumps(result))
    report.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
