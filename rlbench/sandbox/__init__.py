"""Run model-written Python code and its tests in a sandbox (Linux only).

Public API:

- :class:`SandboxLimits` -- wall clock, CPU, memory, file size and output limits.
- :func:`run_tests` -- run one program and its tests; returns a :class:`SandboxResult` with a
  :class:`TestOutcome` per test.
- :func:`run_many` -- many programs in parallel (threads, each driving its own sandbox).

``program`` runs first in a fresh namespace; each test (``assert f(1) == 2``, or HumanEval's
``check(candidate)``) then runs in that namespace, one after another.

How a run works
---------------
1. A fresh temporary work directory per program. ``python -I -B -S supervisor.py`` starts in a
   new session with a minimal environment (``PATH``, ``LANG``, ``HOME`` only, so no secret of
   ours is visible) and the request on stdin. The caller kills the session if the supervisor
   itself overruns (``timeout_s`` + a margin).
2. The supervisor is a child subreaper. It forks the harness's process, which, before
   exec'ing ``python -I -B -S harness.py`` (``-S``: no ``site`` start-up cost; the harness
   puts our site-packages on ``sys.path`` itself): takes its own process group; gets a new network
   namespace (no interface is up: no network at all) and, as root, a new mount namespace in
   which every mount is read-only except the work directory and in which ``/root`` (or any
   directory the sandbox user cannot traverse) is an empty tmpfs with only the Python
   installation bound back; sets ``RLIMIT_CPU/AS/FSIZE/CORE/NPROC/NOFILE``; becomes
   ``nobody`` (uid/gid 65534, no groups); dies with the supervisor (``PR_SET_PDEATHSIG``);
   writes stdout/stderr to unlinked files the supervisor reads back.
3. The harness reads its payload (program, tests, the report prefix: a marker plus a random
   nonce) from a pipe and closes it, makes itself undumpable, binds everything it needs to
   local names, installs an audit hook, runs the program and then each test inside
   ``try/except BaseException``, restoring the builtins before each test. It writes one
   report line per step to a private pipe (fd 3), each prefixed with marker + nonce, encoded
   without ``json`` (which the program could patch), and ends with the captured ``os._exit(0)``.
4. At the wall-clock limit the supervisor kills the harness's process group. Whether or not
   time ran out, it then kills every remaining descendant (orphans are re-parented to it),
   so nothing the program started survives the call. It reports JSON to the caller.
5. :func:`run_tests` passes a run only if the completion line with this run's nonce was
   seen, the program loaded, every test reported a pass and the harness exited with 0.

Defended (each tested in ``tests/test_sandbox.py`` / ``tests/test_reward_code.py``)
---------------------------------------------------------------------------------
* Faking success: ``sys.exit(0)``/``raise SystemExit``/``os._exit(0)``/``KeyboardInterrupt``
  at load time or mid-test, exiting from ``__del__``, printing a fake marker or "all tests
  passed" (stdout is not the report channel), patching ``print``/``json``/``AssertionError``
  or other builtins (``assert`` always raises the real ``AssertionError``; builtins are
  restored before each test), being killed: all are failures.
* Resources: infinite loops (wall clock and CPU), memory bombs (``RLIMIT_AS``), huge output
  (``RLIMIT_FSIZE``; the result keeps ``max_output_bytes``), fork bombs (audit hook, then
  ``RLIMIT_NPROC``), processes that outlive the program (subreaper clean-up).
* Host: no network (network namespace + audit hook on ``socket``); no writes outside the
  work directory (read-only mounts + uid ``nobody`` + audit hook); no view of the caller's
  environment (minimal environment; ``/proc/<other pid>`` refused by the audit hook and by
  the kernel for another uid); no signals to other processes; no ``ctypes``.

Not defended (in-process limits; do not treat this as a security boundary against a
determined attacker)
---------------------------------------------------------------------------------
* The verdict is produced in the same process as the untrusted code. Code that walks the
  stack (``sys._getframe().f_back``, ``inspect.stack()``) reaches the harness's frames and
  can read the nonce or call the reporting function: it can forge a pass. ``gc``
  introspection, ``sys._current_frames``, ``sys.settrace``/``setprofile``, ``ctypes`` and
  ``/proc/self/mem`` are refused, but frame attributes cannot be audited.
* Tests can be fooled without touching the harness: an object whose ``__eq__`` always returns
  True, a global that shadows a builtin used by a test (``set = lambda x: 0``), patching a
  module the tests use (``math.isclose``), or patching builtins while a test runs.
* Audit-hook path checks normalise ``..`` but use the path the program passed: a
  ``os.PathLike`` whose ``__fspath__`` changes between calls, or ``os.open`` with a
  ``dir_fd`` (the ``open`` audit event does not carry it), slips past the hook (symlinks
  cannot be made). The read-only mounts and the ``nobody`` uid still stop the write.
* Sandboxes running at the same time share uid ``nobody`` (and so one ``RLIMIT_NPROC``
  count); a process started by one could signal another only by getting past the audit hook.
* Without root (no mount namespace, no uid change) only the audit hook, the rlimits, the
  process clean-up and, where unprivileged user namespaces are allowed, the network namespace
  apply; ``SandboxResult.isolation`` says what was active.
"""

from rlbench.sandbox.core import (
    STATUSES,
    SandboxLimits,
    SandboxResult,
    TestOutcome,
    limits_from_config,
    run_many,
    run_tests,
)

__all__ = ["STATUSES", "SandboxLimits", "SandboxResult", "TestOutcome", "limits_from_config", "run_many", "run_tests"]
