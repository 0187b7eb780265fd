"""Run model-written Python code in a sandbox and grade it outside (Linux only).

Public API:

- :class:`SandboxLimits` -- wall clock, CPU, memory, file size and output limits.
- :func:`run_tests` -- run one program and its tests; returns a :class:`SandboxResult` with a
  :class:`TestOutcome` per test. ``setup`` (trusted code, e.g. HumanEval's ``check``) and
  ``entry_point`` are optional.
- :func:`run_many` -- many programs in parallel (threads, each driving its own sandbox).

Threat model
------------
The program is hostile: it may try to forge a pass, read the answer key, harm the host or starve
other runs. The design (``docs/evaluation.md#the-sandbox`` has the table of layers):

1. **The verdict is computed outside the process that runs model code.** Per run, ``core`` starts a
   supervisor (``supervisor.py``, a trusted process separate from the caller). It starts the
   harness (``harness.py``) in the sandbox, which loads the program and calls its functions on
   request; it never sees the tests. The supervisor runs the tests itself, with each of the
   program's functions as a proxy that exchanges plain data only (``plain.py``: exact built-in
   types; subclasses and other objects refused). ``assert`` and ``check(candidate)``, and every
   comparison, run there, with the benchmark's own set-up and helpers. Nothing of the program's
   runs in the trusted process; it can only choose what its functions return.
2. **Nothing to read.** bubblewrap gives the harness a minimal root: ``/usr``, the Python
   installation, the harness's two files, its own ``/proc`` and ``/dev``, and the work folder.
3. **Nothing to touch.** PID, network, IPC and UTS namespaces (no signal or pidfd reaches
   outside; everything dies with the run); as root a uid drawn per run, a tmpfs work folder
   capped in bytes and entries, and pids, memory (memfds and tmpfs counted) and cpu cgroups (the
   kernel shares CPU between runs first); rlimits; a cap on each decoded reply.
4. **Clean-up and reporting.** The work folder's tmpfs lives in the supervisor's own mount
   namespace and vanishes with it; the host folder is removed without recursion. The PID
   namespace and the cgroup are killed at the end. The caller's watchdog kills a supervisor still
   running at the deadline plus a margin (stuck in one C call) and removes the run's cgroups. A
   harness that cannot start is a ``sandbox_error`` with its cause. Each run has its own
   processes, uid and cgroups, so one run cannot change another's verdict.

Without bubblewrap, a fallback made in the supervisor (network, IPC and mount namespaces,
read-only mounts, the per-run uid as root, the caller's uid otherwise, said loudly; no PID
namespace; the project and the data readable) runs and the log says which layers are missing.
When bubblewrap is installed but fails to start, a run retries it, then fails unless
``SandboxLimits.bwrap_fallback`` chose the fallback; ``SandboxResult.isolation`` lists the active ones. The audit hook
in the harness is defence in depth only. Not defended: kernel exploits from inside the
namespaces; tests that accept any truthy value; a trusted test that is slow on a huge result
(ends at the wall clock or the caller's backstop).
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
