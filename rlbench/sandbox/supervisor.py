"""Sandbox supervisor: starts the harness in a contained child, enforces the wall clock, kills
everything the child left behind, and reports one JSON object on stdout.

Started by :func:`rlbench.sandbox.run_tests` as ``python -I -B -S supervisor.py`` in a new session,
with a minimal environment, the work directory as cwd and the request (JSON) on stdin:
``{"program", "tests", "prefix", "workdir", "harness", "site_packages", "audit_hook", "uid",
"limits"}``.
It must only use the standard library (isolated mode; it must not import ``rlbench``).

The child, between ``fork`` and ``exec`` of the harness: own process group; fds 0-3 (payload
pipe, stdout file, stderr file, report pipe); new network and mount namespaces (no network;
every mount read-only except the work directory; directories that the sandbox user could not
traverse, such as a Python installed under ``/root``, are covered with an empty tmpfs and only
the Python installation is bound back); resource limits; the unprivileged user; ``SIGKILL`` if
the supervisor dies. The supervisor is a child subreaper, so processes orphaned inside the
sandbox are re-parented to it and are killed (with every other descendant) when the harness
ends or the time is up.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import resource
import select
import signal
import stat
import sys
import time

F_SETPIPE_SZ = 1031
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNS = 0x00020000
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
#: Most bytes of report lines kept from the harness (the program could flood the channel).
MAX_REPORT_BYTES = 4 << 20
#: Processes (threads included) the sandbox user may have; a second line behind the audit hook.
MAX_PROCESSES = 512
MAX_OPEN_FILES = 256
#: The harness's whole environment (besides HOME): one thread per numeric library, so that an
#: import does not reserve per-core buffers against RLIMIT_AS or oversubscribe parallel runs.
HARNESS_ENV = {
    "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}  # fmt: skip

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
# planning (in the supervisor, before fork)
# ---------------------------------------------------------------------------------------


def blocking_ancestor(path: str) -> str | None:
    """The highest directory above ``path`` that other users cannot traverse (no ``o+x``)."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
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
    """What the sandbox user must reach: the interpreter, its libraries, the harness and the
    work directory."""
    return [
        sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(request["harness"]),
        *request["site_packages"], request["workdir"],
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------
# the child, between fork and exec
# ---------------------------------------------------------------------------------------


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


def _isolate_filesystem_and_network(workdir: str, plan: dict[str, list[str]], root: bool) -> dict:
    """New network namespace (no interfaces up: no network) and, as root, a new mount
    namespace in which only ``workdir`` is writable. Returns what was achieved."""
    info = {"netns": False, "mountns": False, "userns": False, "readonly_fs": False}
    if root and _libc.unshare(CLONE_NEWNET | CLONE_NEWNS) == 0:
        info["netns"] = info["mountns"] = True
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _expose(plan)
        _mount(workdir, workdir, None, MS_BIND)
        info["hidden"] = sorted(plan)
        info["readonly_fs"] = _remount_read_only(workdir) == 0
    elif _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:  # unprivileged fallback
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


def _child(request: dict, plan: dict, fds: dict) -> None:
    """Runs in the forked child; never returns (exec or ``_exit``)."""
    setup_fd = fcntl_dup_high(fds["setup_w"])
    try:
        os.setpgid(0, 0)
        os.dup2(fds["payload_r"], 0)
        os.dup2(fds["stdout"], 1)
        os.dup2(fds["stderr"], 2)
        os.dup2(fds["report_w"], 3)
        os.closerange(4, setup_fd)
        os.closerange(setup_fd + 1, MAX_OPEN_FILES * 64)
        root = os.geteuid() == 0
        info = _isolate_filesystem_and_network(request["workdir"], plan, root)
        _set_limits(request["limits"])
        info["rlimits"] = True
        # Without a mount namespace a Python under an untraversable directory (e.g. /root)
        # could not start as the sandbox user: stay as we are and say so in the report.
        can_drop = info["mountns"] or not plan
        info["uid"] = _drop_privileges(request["uid"]) if can_drop else os.geteuid()
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        os.write(setup_fd, json.dumps(info).encode())
        os.chdir(request["workdir"])
        env = {**HARNESS_ENV, "HOME": request["workdir"]}
        os.execve(sys.executable, [sys.executable, "-I", "-B", "-S", request["harness"]], env)
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, then exit
        try:
            os.write(setup_fd, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(127)


def fcntl_dup_high(fd: int) -> int:
    """Duplicate ``fd`` to a descriptor >= 100 (close-on-exec) so the dup2s onto 0-3 and the
    closerange around it leave it alone."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)


# ---------------------------------------------------------------------------------------
# waiting, cleaning up, reporting
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
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed |= pids
        _reap_all()
        time.sleep(0.002)
    return len(killed)


def read_output(fd: int, limit: int) -> tuple[str, int]:
    """(first ``limit`` bytes of the file as text, with a note if cut; total size in bytes)."""
    size = os.fstat(fd).st_size
    text = os.pread(fd, limit, 0).decode("utf-8", "replace")
    if size > limit:
        text += f"\n[sandbox: output truncated: {size} bytes written, first {limit} kept]"
    return text, size


def _anonymous_file(directory: str, name: str) -> int:
    """A file opened for reading and writing and already unlinked: the program can write to it
    through the descriptor it inherits but cannot find, replace or delete it by name."""
    path = os.path.join(directory, f".{name}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    return fd


def _write_payload(fd: int, data: bytes) -> None:
    try:
        with open(fd, "wb", closefd=True) as f:
            f.write(data)
    except OSError:  # the harness died before reading it: reported as a crash
        pass


def _send_payload_before_fork(fd: int, data: bytes) -> bool:
    """Write the whole payload now if the pipe can hold it (then no writer thread is needed)."""
    try:
        capacity = fcntl.fcntl(fd, F_SETPIPE_SZ, max(len(data), 1 << 16))
    except OSError:  # larger than /proc/sys/fs/pipe-max-size
        return False
    if len(data) > capacity:
        return False
    _write_payload(fd, data)
    return True


def _start_harness(request: dict) -> tuple[int, float, dict]:
    """Fork the harness's process (see :func:`_child`); returns (pid, start time, our fds)."""
    workdir = request["workdir"]
    root = os.geteuid() == 0
    if root:
        os.chown(workdir, request["uid"], request["uid"])
    plan = exposure_plan(needed_paths(request)) if root else {}
    fds = {name: _anonymous_file(workdir, name) for name in ("stdout", "stderr")}
    fds["payload_r"], payload_w = os.pipe()
    fds["report_r"], fds["report_w"] = os.pipe()
    fds["setup_r"], fds["setup_w"] = os.pipe()
    keys = ("program", "tests", "prefix", "workdir", "site_packages", "audit_hook")
    payload = json.dumps({k: request[k] for k in keys}).encode()
    payload_sent = _send_payload_before_fork(payload_w, payload)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(request, plan, fds)
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child already did it (or already exec'ed)
        pass
    for name in ("payload_r", "report_w", "setup_w"):
        os.close(fds.pop(name))
    if not payload_sent:
        import threading

        threading.Thread(target=_write_payload, args=(payload_w, payload), daemon=True).start()
    return pid, start, fds


def _wait(pid: int, deadline: float, buffers: dict[int, bytearray]) -> tuple[int, bool]:
    """Collect the pipes into ``buffers`` until the harness exits or the deadline passes (then
    kill its process group). Returns (wait status, timed out)."""
    poller = select.poll()
    for fd in buffers:
        poller.register(fd, select.POLLIN)
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    if pidfd is not None:  # readable when the harness exits
        poller.register(pidfd, select.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        wait_s = remaining if pidfd is not None else min(remaining, 0.05)
        for fd, _ in poller.poll(max(1, int(wait_s * 1000))):
            if fd in buffers and not _read_into(fd, buffers[fd]):
                poller.unregister(fd)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except ProcessLookupError:
            pass
    return os.waitpid(pid, 0)[1], True


def _read_into(fd: int, buffer: bytearray) -> bool:
    """Read one chunk into ``buffer`` (kept up to MAX_REPORT_BYTES); False at end of file."""
    chunk = os.read(fd, 1 << 16)
    if chunk and len(buffer) < MAX_REPORT_BYTES:
        buffer.extend(chunk)
    return bool(chunk)


def _drain(fd: int, buffer: bytearray) -> None:
    """Read what is left in a pipe whose writers are all gone (or stop when it would block)."""
    os.set_blocking(fd, False)
    try:
        while _read_into(fd, buffer):
            pass
    except BlockingIOError:
        pass


def report_lines(report: bytes, prefix: str) -> list[str]:
    """The harness's lines that carry this run's prefix, with the prefix removed."""
    head = prefix + " "
    text = report.decode("utf-8", "replace")
    return [line[len(head) :] for line in text.split("\n") if line.startswith(head)]


def supervise(request: dict) -> dict:
    limits = request["limits"]
    subreaper = _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    pid, start, fds = _start_harness(request)
    buffers = {fds["report_r"]: bytearray(), fds["setup_r"]: bytearray()}
    status, timed_out = _wait(pid, start + float(limits["timeout_s"]), buffers)
    seconds = time.monotonic() - start
    killed = kill_descendants()
    for fd, buffer in buffers.items():
        _drain(fd, buffer)

    exit_code = os.waitstatus_to_exitcode(status)
    setup = buffers[fds["setup_r"]]
    setup_info = json.loads(setup.decode()) if setup.startswith(b"{") else {}
    max_output = int(limits["max_output_bytes"])
    stdout, stdout_size = read_output(fds["stdout"], max_output)
    stderr, stderr_size = read_output(fds["stderr"], max_output)
    return {
        "exit_code": exit_code,
        "timed_out": timed_out,
        "cpu_limit": exit_code == -signal.SIGXCPU,
        "report": report_lines(bytes(buffers[fds["report_r"]]), request["prefix"]),
        "stdout": stdout,
        "stderr": stderr,
        "output_limit": max(stdout_size, stderr_size) >= int(limits["file_size_mb"]) << 20,
        "setup_error": setup_info.pop("error", None),
        "isolation": {"subreaper": subreaper, **setup_info},
        "descendants_killed": killed,
        "seconds": seconds,
    }


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    try:
        result = supervise(request)
    except Exception as exc:  # noqa: BLE001 - reported as a sandbox infrastructure error
        result = {"sandbox_error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
