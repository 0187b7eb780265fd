"""Sandbox harness: runs one untrusted program and its tests, then reports the outcomes.

Started by ``supervisor.py`` as ``python -I -B -S harness.py`` inside the namespaces, limits and
user it set up. It must only use the standard library: it runs in isolated mode and must not
import ``rlbench``.

Protocol (file descriptors set up by the supervisor):

* fd 0: the payload, JSON ``{"program", "tests", "prefix", "workdir", "site_packages",
  "audit_hook"}``, read once and closed before any untrusted code runs (fd 0 is then
  ``/dev/null``). ``site_packages`` go on ``sys.path`` (``-S`` skips ``site`` to start
  faster); ``audit_hook`` false leaves the hook out (only to test the OS layers alone).
* fd 1 / fd 2: unlinked files the supervisor reads back (the program's stdout / stderr).
* fd 3: the report channel. Every line starts with ``prefix`` (a marker plus a random nonce):
  ``ready <undumpable 1|0> <audit hook 1|0>``, ``load 1`` or ``load 0 <hex error>``, then per test
  ``test <i> 1`` or ``test <i> 0 <hex error>``, then ``done <number of tests>``.

Nothing that decides or writes the verdict may be looked up at run time through a name the
untrusted code can rebind: the harness binds ``os.write``, ``os._exit``, ``exec``, ``compile``,
the exception classes, ... before the program runs, and the audit hook only uses values bound
in its closure (immutable containers, builtin functions).
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import types

REPORT_FD = 3
#: How much of an exception's text goes into the report.
MAX_ERROR_CHARS = 300


class SandboxViolation(PermissionError):
    """Raised by the audit hook when the program tries something the sandbox refuses."""


class SandboxImportRefused(ImportError):
    """Raised by the audit hook for modules that would give raw memory or process access.

    An ImportError, so that ``try: import ctypes except ImportError: ...`` still works."""


# ---------------------------------------------------------------------------------------
# set-up, before any untrusted code runs
# ---------------------------------------------------------------------------------------


def read_payload() -> dict:
    """Read the JSON payload from fd 0, then put ``/dev/null`` in its place."""
    chunks = []
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # lowest free descriptor: becomes fd 0
    return json.loads(b"".join(chunks))


def make_undumpable() -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: other processes of the sandbox user cannot read this
    one's memory (``/proc/<pid>/mem``, ptrace). ``ctypes`` is then dropped from
    ``sys.modules``; the audit hook refuses to import it again."""
    try:
        import ctypes

        ok = ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except Exception:  # noqa: BLE001 - recorded in the isolation report
        ok = False
    for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
        del sys.modules[name]
    return ok


def disable_fork_exec() -> None:
    """Replace ``_posixsubprocess.fork_exec`` (which starts processes without an audit event)
    with a function that refuses. Re-importing the module is refused by the audit hook."""
    import _posixsubprocess

    def fork_exec(*args, **kwargs):
        raise SandboxViolation("sandbox: starting processes is not allowed")

    _posixsubprocess.fork_exec = fork_exec
    if "subprocess" in sys.modules:
        sys.modules["subprocess"]._fork_exec = fork_exec


#: Audit events refused outright: network, new processes, signals to other processes, links,
#: raw memory, and the introspection tools that reach the harness's frames and objects.
REFUSED_EVENTS = frozenset(
    {
        "socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
        "os.symlink", "os.link", "resource.prlimit", "webbrowser.open",
        "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "sys.settrace", "sys.setprofile", "threading.settrace", "threading.setprofile",
    }
)  # fmt: skip
REFUSED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess"})
#: Events that change the file system: for each, the (path position, dir_fd position) pairs of
#: its arguments; every such path must lie inside the work directory.
WRITE_PATH_EVENTS = types.MappingProxyType(
    {
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.rename": ((0, 2), (1, 3)),
        "os.truncate": ((0, None),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
        "os.utime": ((0, 3),), "os.mkdir": ((0, 2),), "os.setxattr": ((0, None),),
        "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),), "shutil.move": ((1, None),),
        "shutil.copyfile": ((1, None),), "shutil.copymode": ((1, None),),
        "shutil.copystat": ((1, None),), "shutil.copytree": ((1, None),),
        "shutil.chown": ((0, None),), "shutil.unpack_archive": ((1, None),),
    }
)  # fmt: skip
#: Paths outside the work directory that may still be opened for writing.
WRITABLE_DEVICES = frozenset(
    {"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/fd/1", "/dev/fd/2", "/proc/self/fd/1",
     "/proc/self/fd/2"}
)  # fmt: skip
#: Entries of the harness's own /proc directory that stay refused: its memory, and the links
#: to the root and working directories (which would lead to other processes' entries).
PROC_SECRETS = frozenset({"mem", "map_files", "pagemap", "root", "cwd"})


def make_audit_hook(workdir: str, own_pid: int):
    """The audit hook (``sys.addaudithook``): refuses the events above, writes outside
    ``workdir`` and reads of other processes' ``/proc`` entries.

    It uses only values bound here (builtin functions, frozensets, strings), so the program
    cannot change its decisions by patching ``os``, ``builtins`` or this module.
    """
    refused, refused_imports, write_events = REFUSED_EVENTS, REFUSED_IMPORTS, WRITE_PATH_EVENTS
    writable_devices, proc_secrets = WRITABLE_DEVICES, PROC_SECRETS
    violation, import_refused = SandboxViolation, SandboxImportRefused
    getcwd, readlink, fspath = os.getcwd, os.readlink, os.fspath
    str_, bytes_, int_, len_, isinstance_ = str, bytes, int, len, isinstance
    # Exact copies of str / bytes / int subclasses (whose methods the program could override):
    # join and int.__add__ read the underlying value without calling any Python-level method.
    str_join, bytes_join, int_add, int_and = "".join, b"".join, int.__add__, int.__and__
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    workdir_slash = workdir.rstrip("/") + "/"
    own_proc = ("self", "thread-self", str_(own_pid))

    def exact_int(value) -> int | None:
        return int_add(0, value) if isinstance_(value, int_) else None

    def absolute(path, dir_fd) -> str | None:
        """Absolute path with ``.``/``..`` folded (no symlinks can be made); None for an fd."""
        if isinstance_(path, int_):
            return None
        if not isinstance_(path, (str_, bytes_)):
            path = fspath(path)
        if isinstance_(path, bytes_):
            path = bytes_join([path]).decode("utf-8", "surrogateescape")
        path = str_join([path])
        if not path.startswith("/"):
            base = getcwd() if dir_fd is None else readlink("/proc/self/fd/" + str_(dir_fd))
            path = base + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def check_write(event, path, dir_fd) -> None:
        full = absolute(path, dir_fd)
        if full is None or full in writable_devices:
            return
        if (full + "/").startswith(workdir_slash):
            return
        raise violation(f"sandbox: {event} outside the work directory is not allowed: {full}")

    def check_read(path) -> None:
        full = absolute(path, None)
        if full is None or not full.startswith("/proc/"):
            return
        parts = full.split("/")  # ["", "proc", "self", entry, ...]
        if len_(parts) > 2 and parts[2] in own_proc and proc_secrets.isdisjoint(parts[3:]):
            return
        raise violation(f"sandbox: reading {full} is not allowed")

    def opens_for_writing(mode, flags) -> bool:
        flags = exact_int(flags)
        if flags is not None and int_and(flags, write_flags):
            return True
        if not isinstance_(mode, str_):
            return False
        mode = str_join([mode])
        return "w" in mode or "a" in mode or "x" in mode or "+" in mode

    def hook(event, args):
        if event in refused or event.startswith("ctypes."):
            raise violation(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            if opens_for_writing(mode, flags):
                check_write(event, path, None)
            else:
                check_read(path)
        elif event == "import":
            name = str_join([args[0]]) if isinstance_(args[0], str_) else ""
            if name in refused_imports or name.startswith("ctypes."):
                raise import_refused(f"sandbox: importing {name} is not allowed")
        elif event in write_events:
            for path_at, dir_fd_at in write_events[event]:
                dir_fd = exact_int(args[dir_fd_at]) if dir_fd_at is not None else None
                if dir_fd is not None and dir_fd < 0:
                    dir_fd = None
                check_write(event, args[path_at], dir_fd)

    return hook


# ---------------------------------------------------------------------------------------
# running the program and its tests
# ---------------------------------------------------------------------------------------


def describe(exc: BaseException) -> str:
    """Short text of an exception: ``SystemExit(0)``, ``AssertionError``, ``ValueError: bad``.

    Calls the exception's own ``__str__`` (untrusted); any failure there gives the type name.
    """
    try:
        if isinstance(exc, SystemExit):
            return f"SystemExit({exc.code!r})"[:MAX_ERROR_CHARS]
        name = type(exc).__name__
        if type(name) is not str:
            name = "exception"
        message = str(exc)
        if type(message) is not str:
            message = ""
        return (f"{name}: {message}" if message else name)[:MAX_ERROR_CHARS]
    except BaseException:  # noqa: BLE001 - untrusted __str__
        return "unprintable exception"


def main() -> None:
    # Everything the verdict depends on is bound to local names first.
    write, exit_now, compile_, exec_ = os.write, os._exit, compile, exec
    base_exception, str_, enumerate_, len_ = BaseException, str, enumerate, len
    describe_ = describe
    stdout, stderr = sys.stdout, sys.stderr
    builtins_module, builtins_dict = builtins, builtins.__dict__
    builtins_snapshot = dict(builtins_dict)
    dict_clear, dict_update = dict.clear, dict.update

    payload = read_payload()
    prefix = payload["prefix"].encode("ascii")
    program, tests, workdir = payload["program"], list(payload["tests"]), payload["workdir"]
    sys.path.extend(payload["site_packages"])
    use_audit_hook = payload["audit_hook"]
    del payload

    def emit(line: str) -> None:
        data = prefix + b" " + line.encode("utf-8", "replace") + b"\n"
        while data:
            data = data[write(REPORT_FD, data) :]

    def emit_outcome(head: str, exc) -> None:
        if exc is None:
            emit(head + " 1")
        else:
            emit(head + " 0 " + describe_(exc).encode("utf-8", "replace").hex())

    def flush_output() -> None:
        for stream in (stdout, stderr):
            try:
                stream.flush()
            except base_exception:  # noqa: BLE001 - e.g. the file size limit was reached
                pass

    undumpable = make_undumpable()
    if use_audit_hook:
        disable_fork_exec()
        sys.addaudithook(make_audit_hook(workdir, os.getpid()))
    emit(f"ready {int(undumpable)} {int(use_audit_hook)}")

    namespace = {"__name__": "solution", "__builtins__": builtins_module}
    try:
        exec_(compile_(program, "<solution>", "exec", dont_inherit=True), namespace)  # not our __future__ flags
    except base_exception as exc:  # noqa: BLE001 - SystemExit included: it is a failure
        flush_output()
        emit_outcome("load", exc)
        emit("done " + str_(len_(tests)))
        exit_now(0)
    emit_outcome("load", None)
    for index, test in enumerate_(tests):
        # Undo changes the program made to the builtins, so a test's own expressions
        # (``sorted``, ``abs``, ``len``, ...) mean what they mean in plain Python.
        dict_clear(builtins_dict)
        dict_update(builtins_dict, builtins_snapshot)
        namespace["__builtins__"] = builtins_module
        head = "test " + str_(index)
        try:
            exec_(compile_(test, f"<test {index}>", "exec", dont_inherit=True), namespace)
        except base_exception as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: failures
            emit_outcome(head, exc)
        else:
            emit_outcome(head, None)
    flush_output()
    emit("done " + str_(len_(tests)))
    exit_now(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - no completion line: the supervisor reports a crash
        os._exit(70)
