"""Sandbox harness: the untrusted side of a run. It loads one program and calls its functions
when the supervisor asks; it never sees the tests and decides nothing.

Started by ``supervisor.py`` as ``python -I -B -S harness.py`` inside the sandbox (bubblewrap or
the fallback). Standard library only (isolated mode); ``plain.py`` comes from this file's
directory. Everything here runs beside the program, so nothing here is trusted: the supervisor
checks every value it receives (exact plain data only) and runs the tests and every comparison
itself.

Protocol (file descriptors set up by the supervisor; messages are JSON, one per line):

* fd 0: the payload ``{"program", "audit_hook"}``, read once and closed before the program runs
  (fd 0 is then ``/dev/null``).
* fd 1 / fd 2: memory files the supervisor reads back (the program's stdout / stderr).
* fd 3, to the supervisor: ``{"ready": {"audit_hook": bool}}``, then
  ``{"load": null, "names": {name: {"callable": true} | {"value": <plain>} | {"opaque": type}}}``
  (and ``{"module": name}``) or ``{"load": "<error>"}``, then one reply per request:
  ``{"ok": <plain>}``, ``{"raised": [type name, message]}``, ``{"opaque": [type name, truth]}``
  (the result is not plain data) or ``{"refused": reason}``.
* fd 4, from the supervisor: ``{"call": name, "args": <plain list>, "kwargs": <plain dict>}``.

The audit hook and the other in-process measures below are defence in depth only (they make
the fallback without bubblewrap less open); the verdict does not depend on them.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import NotPlain, from_wire, to_wire  # noqa: E402

MESSAGES_FD, REQUESTS_FD = 3, 4
#: Bound before the program runs, so that a program patching ``json`` does not garble its own replies.
dumps, loads = json.dumps, json.loads
#: How much of an exception's text goes into a message.
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
# loading the program and serving calls
# ---------------------------------------------------------------------------------------


def exception_text(exc: BaseException) -> tuple[str, str]:
    """(type name, message) of an exception; its own ``__str__`` may fail (then no message)."""
    try:
        if isinstance(exc, SystemExit):
            return "SystemExit", repr(exc.code)[:MAX_ERROR_CHARS]
        return str(type(exc).__name__), str(exc)[:MAX_ERROR_CHARS]
    except BaseException:  # noqa: BLE001 - untrusted __str__
        return "Exception", "unprintable exception"


def describe(exc: BaseException) -> str:
    """Short text of an exception: ``ValueError: bad``, ``SystemExit(0)``."""
    name, message = exception_text(exc)
    if name == "SystemExit":
        return f"SystemExit({message})"
    return f"{name}: {message}" if message else name


def describe_names(namespace: dict, max_value_bytes: int) -> dict:
    """What each of the program's global names is, as the supervisor needs it (a value whose JSON
    is longer than ``max_value_bytes`` as opaque, so that the message stays under the supervisor's
    cap)."""
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__") and name.endswith("__"):
            continue
        if isinstance(value, type(os)):
            names[name] = {"module": str(value.__name__)}
        elif callable(value):
            names[name] = {"callable": True}
        else:
            try:
                wire = to_wire(value)
                names[name] = {"value": wire} if len(dumps(wire)) <= max_value_bytes else {"opaque": f"large {type(value).__name__}"}
            except (NotPlain, RecursionError):
                names[name] = {"opaque": type(value).__name__}
    return names


#: Mappings of the standard library that a result may be (``collections.Counter``): they cross as
#: a plain dict, which compares with a dict as they do.
#: (``OrderedDict`` is plain data: it crosses as itself, order included.)
DICT_LIKE = ("Counter", "defaultdict")


def reply_for(result) -> dict:
    """The reply for a function's result: plain data; else a dict for the standard library's
    mappings; else only its type name and truth value (a regex match, a generator)."""
    try:
        return {"ok": to_wire(result)}
    except (NotPlain, RecursionError):
        pass
    collections = sys.modules.get("collections")
    try:
        if collections is not None and any(type(result) is getattr(collections, n) for n in DICT_LIKE):
            return {"ok": to_wire(dict(result))}
        return {"opaque": [type(result).__name__, bool(result)]}
    except BaseException as exc:  # noqa: BLE001 - untrusted __bool__, members that are not plain
        return {"refused": describe(exc)}


def send(message: dict) -> None:
    data = (dumps(message) + "\n").encode()
    while data:
        data = data[os.write(MESSAGES_FD, data) :]


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - e.g. the file size limit was reached
            pass


def serve(namespace: dict) -> None:
    """Answer call requests until the supervisor closes the request pipe."""
    requests = os.fdopen(REQUESTS_FD, "rb", buffering=1 << 16)
    for line in requests:
        try:
            request = loads(line)
            function = namespace[request["call"]]
            args, kwargs = from_wire(request["args"]), from_wire(request["kwargs"])
            result = function(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
            flush_output()
            send({"raised": list(exception_text(exc))})
            continue
        reply = reply_for(result)
        flush_output()
        send(reply)


def main() -> None:
    payload = read_payload()
    program, use_audit_hook, max_value_bytes = payload["program"], payload["audit_hook"], payload["max_value_bytes"]
    del payload
    if use_audit_hook:
        disable_fork_exec()
        sys.addaudithook(make_audit_hook(os.getcwd(), os.getpid()))
    send({"ready": {"audit_hook": bool(use_audit_hook)}})
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(program, "<solution>", "exec", dont_inherit=True), namespace)
        names = describe_names(namespace, max_value_bytes)
    except BaseException as exc:  # noqa: BLE001 - SystemExit included: a load error
        flush_output()
        send({"load": describe(exc)})
        os._exit(0)
    flush_output()
    send({"load": None, "names": names})
    serve(namespace)
    flush_output()
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - the supervisor sees the channel close
        os._exit(70)
