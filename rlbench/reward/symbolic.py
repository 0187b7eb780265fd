"""Symbolic answer comparison with ``math-verify``, run in a separate worker process.

Why a process: math-verify (sympy underneath) can take unbounded time and memory on hostile
answers such as ``10^{10^{10}}``.  Its own timeout uses ``signal.alarm``, which works only in
the main thread and cannot interrupt long C-level work.  Running it in a child process gives
one mechanism that works from any thread: the child interrupts itself with an interval timer
(its own main thread) and runs under a memory limit; if it still does not answer within
``timeout_s + REPLY_GRACE_S`` the parent kills it and starts a fresh one on the next call.
Either way the caller gets :class:`SymbolicCheckError`, never a hang.

The worker is started lazily (first symbolic comparison, ~1 s) and shared by all threads of
a process; requests are serialised by a lock (the GIL would serialise sympy anyway).
Protocol: one JSON object per line on the worker's stdin/stdout.

Comparison in the worker: both sides are parsed by math-verify.  If both are numeric
constants (no free symbols, real) and at least one contains a decimal (a float), they are
compared with the grader's tolerance (:func:`within_tolerance`, so ``1414214`` vs
``10^6\\sqrt{2}`` follows the same rule as plain numbers); two exact real constants
(``\\frac{1}{2^{98}}``, ``\\sqrt{8}``) must agree to :data:`EXACT_DIGITS` significant digits
(math-verify itself rounds to 6 decimals, which equates tiny values); when their difference is
below ``10^-EXACT_DIGITS`` in absolute value (a relative rule cannot decide near zero: an unevaluated
``\\sin(\\pi)`` or ``\\sqrt{4}-2`` evaluates to an imprecise zero), sympy decides exactly whether the
difference simplifies to 0. Otherwise math-verify's ``verify(gold=ref, target=pred)`` decides.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["SymbolicCheckError", "symbolic_equal", "within_tolerance"]

#: seconds the parent waits beyond the request's timeout before killing the worker.
REPLY_GRACE_S = 2.0
#: seconds a fresh worker may take to import math-verify and report ready.
STARTUP_TIMEOUT_S = 120.0
#: two exact constants (no decimals) are equal when they agree to this many significant digits
EXACT_DIGITS = 30
#: address-space limit of the worker (a hostile answer gets MemoryError, not the OOM killer).
WORKER_MEMORY_BYTES = 4 * 1024**3


def within_tolerance(pred, ref, relative: float, absolute: float = 0.0) -> bool:
    """``|pred - ref| <= relative * |ref| + absolute``: the grader's one rule for inexact numbers
    (Fractions or sympy numbers). With ``absolute = 0`` (the default) a reference of any magnitude
    is matched to ``relative`` of itself (``5.89e-7`` does not accept ``0`` or twice the value) and a
    zero reference only by zero."""
    return bool(abs(pred - ref) <= relative * abs(ref) + absolute)


class SymbolicCheckError(RuntimeError):
    """math-verify could not decide: it timed out, ran out of memory or its worker died."""


# ---------------------------------------------------------------------------------------
# worker side (runs in the child process, see ``_Worker._start``)
# ---------------------------------------------------------------------------------------


class _Deadline(BaseException):
    """Raised inside the worker by its interval timer (BaseException: not swallowed by
    math-verify's ``except Exception`` handlers)."""


@lru_cache(maxsize=8192)
def _parse(expr: str):
    """math-verify parse of one bare LaTeX expression (wrapped in ``$...$``); cached.

    LaTeX extraction only (math-verify's default also reads plain-text numbers, which pulls a stray
    number out of a name or a sentence) and without math-verify's own unit removal (it drops any
    trailing ``m``, ``s``, ...: the grader has already removed units by its own rule,
    ``rlbench.reward.units``, which never takes a variable for a unit)."""
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse

    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all", equations=False
        )
    )
    return parse(f"${expr}$", extraction_config=[config], parsing_timeout=None)


def _numeric_value(expr):
    """High-precision real value of a constant sympy expression, else None."""
    from sympy import Expr

    if not isinstance(expr, Expr) or not expr.is_number:
        return None
    value = expr.evalf(EXACT_DIGITS + 20)
    if not value.is_real or not value.is_finite:
        return None
    return value


def _exactly_equal(a, b) -> bool:
    """``a - b`` simplifies to exactly 0 (``\\sqrt{4}-2`` and ``\\sin(\\pi)`` are 0; ``2^{-98}`` is not)."""
    from sympy import simplify

    return bool(simplify(a - b) == 0)


def _compare(pred: str, ref: str, tolerance: float, absolute_tolerance: float = 0.0) -> bool:
    """The worker's verdict for ``pred == ref`` (see the module docstring)."""
    from math_verify import verify
    from sympy import Basic, Float

    gold, target = _parse(ref), _parse(pred)
    if not gold or not target:
        return False
    gold_expr, target_expr = gold[0], target[0]
    ref_value, pred_value = _numeric_value(gold_expr), _numeric_value(target_expr)
    if ref_value is not None and pred_value is not None:
        if any(isinstance(e, Basic) and e.has(Float) for e in (gold_expr, target_expr)):
            return within_tolerance(pred_value, ref_value, tolerance, absolute_tolerance)
        # two exact constants: equal to EXACT_DIGITS digits; math-verify's own rounding to 6
        # decimals would equate 2^-98 with its negation
        if within_tolerance(pred_value, ref_value, 10.0**-EXACT_DIGITS):
            return True
        return bool(abs(pred_value - ref_value) < 10.0**-EXACT_DIGITS) and _exactly_equal(target_expr, gold_expr)
    return bool(verify(gold, target, timeout_seconds=None))


def _raise_deadline(signum, frame):
    raise _Deadline()


def _answer(request: dict) -> dict:
    """Reply for one request: ``{"equal": bool}`` or ``{"error": text}``."""
    signal.setitimer(signal.ITIMER_REAL, float(request["timeout_s"]))
    try:
        equal = _compare(
            request["pred"], request["ref"], float(request["tolerance"]), float(request.get("absolute_tolerance", 0.0))
        )
        return {"equal": bool(equal)}
    except _Deadline:
        return {"error": f"math-verify timed out after {request['timeout_s']} s"}
    except MemoryError:
        return {"error": "math-verify ran out of memory"}
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which counts it
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def serve() -> None:
    """Worker loop: read JSON requests from stdin, write one JSON reply per line."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; EOF stops us
    signal.signal(signal.SIGALRM, _raise_deadline)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ValueError, OSError):
        pass  # a lower hard limit is already in place
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    import math_verify  # noqa: F401 - import before reporting ready

    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(_answer(json.loads(line))) + "\n")
            out.flush()


# ---------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------


def _read_line(fd: int, timeout_s: float) -> bytes | None:
    """One ``\\n``-terminated line from ``fd`` within ``timeout_s``; None on timeout,
    ``b""`` at end of file (the worker died)."""
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        data += chunk
    return bytes(data)


class _Worker:
    """Handle on the math-verify worker process (started on demand, replaced when stuck)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = -1
        atexit.register(self.stop)

    @property
    def pid(self) -> int | None:
        """Process id of the running worker (None if none is running)."""
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> subprocess.Popen:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from rlbench.reward.symbolic import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        ready = _read_line(proc.stdout.fileno(), STARTUP_TIMEOUT_S)
        if not ready:
            proc.kill()
            proc.wait()
            raise SymbolicCheckError(
                f"math-verify worker did not start within {STARTUP_TIMEOUT_S} s "
                f"(exit code {proc.poll()})"
            )
        return proc

    def _running(self) -> subprocess.Popen:
        if self._owner_pid != os.getpid():  # forked: the inherited pipes belong to the parent
            self._proc = None
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
            self._owner_pid = os.getpid()
        return self._proc

    def stop(self) -> int | None:
        """Kill the worker (if it is ours) and return its exit code; the next request
        starts a fresh one."""
        proc, self._proc = self._proc, None
        if proc is None or self._owner_pid != os.getpid():
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def _exchange(self, payload: dict, wait_s: float) -> bytes | None:
        """Send one request; the reply line, None on timeout, ``b""`` if the worker died."""
        proc = self._running()
        try:
            proc.stdin.write((json.dumps(payload) + "\n").encode())
            proc.stdin.flush()
        except OSError:
            return b""
        return _read_line(proc.stdout.fileno(), wait_s)

    def request(self, payload: dict, wait_s: float) -> dict:
        """Send one request and wait up to ``wait_s`` for its reply.  A worker found dead
        (e.g. killed between requests) is replaced and the request sent once more."""
        with self._lock:
            line = self._exchange(payload, wait_s)
            if line == b"":
                self.stop()
                line = self._exchange(payload, wait_s)
            if line is None:
                self.stop()
                raise SymbolicCheckError(
                    f"math-verify did not answer within {wait_s:g} s; worker killed"
                )
            if line == b"":
                exit_code = self.stop()
                raise SymbolicCheckError(f"math-verify worker died (exit code {exit_code})")
            return json.loads(line)


_WORKER = _Worker()


def symbolic_equal(pred: str, ref: str, tolerance: float, timeout_s: float, absolute_tolerance: float = 0.0) -> bool:
    """math-verify's verdict on ``pred == ref`` (see the module docstring).

    Raises :class:`SymbolicCheckError` when it cannot decide within ``timeout_s`` seconds
    (plus :data:`REPLY_GRACE_S`), runs out of memory or crashes.
    """
    payload = {
        "pred": pred, "ref": ref, "tolerance": tolerance, "absolute_tolerance": absolute_tolerance, "timeout_s": timeout_s
    }
    reply = _WORKER.request(payload, timeout_s + REPLY_GRACE_S)
    if "error" in reply:
        raise SymbolicCheckError(reply["error"])
    return bool(reply["equal"])
