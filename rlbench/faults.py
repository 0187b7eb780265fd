"""Fault injection for the resume tests (tests/test_resume.py): the environment variable

    RLBENCH_KILL_AT=<phase>:<step>[:<signal>[:<rank>]]     e.g. update:3, checkpoint:4, generate:2:INT

makes the process send itself a signal (default KILL) when it reaches ``phase`` at training step
``step``: ``generate`` (the step's rollout is done, nothing updated), ``update`` (the update
schedule has changed the weights and the optimizer, the step's bookkeeping not yet done),
``checkpoint`` (one file of the step's checkpoint written, the checkpoint incomplete), ``eval``
(an evaluation finished; step 0 is the one before training). Without the variable every kill point
does nothing. Under torchrun every rank reads the variable; with ``<rank>`` only that rank (the
``RANK`` torchrun sets) signals itself, e.g. ``generate:1:INT:1``. A test-only hook: it lets a test
kill a run at a deterministic point.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "RLBENCH_KILL_AT"
_current_step = 0


def at_step(step: int) -> None:
    """The training step the process is in (kill points compare it with the variable's step)."""
    global _current_step
    _current_step = int(step)


def kill_point(phase: str, step: int | None = None) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) not in (2, 3, 4) or parts[0] != phase or int(parts[1]) != (_current_step if step is None else step):
        return
    if len(parts) == 4 and int(parts[3]) != int(os.environ.get("RANK", "0")):
        return
    signum = getattr(signal, f"SIG{parts[2] if len(parts) >= 3 else 'KILL'}")
    os.environ.pop(KILL_ENV)  # once: a signal that is handled must not fire again at the next point
    os.kill(os.getpid(), signum)
