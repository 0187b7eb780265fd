"""Ctrl-C (SIGINT) and SIGTERM during a run.

The first signal inside a training step is deferred: the step finishes and is logged, a checkpoint
is written, then the run stops with :class:`Interrupted`. Outside a step (an evaluation, loading)
the first signal stops the run at once; nothing stateful is lost (an evaluation's result is
written only when it ends). A second signal stops the run at once wherever it is, without a new
checkpoint (the earlier ones stay valid). The exit code is 128 + the signal number (130 for
SIGINT, 143 for SIGTERM), as a shell reports a process killed by that signal.

Under torchrun (trainer.parallelism=ddp|fsdp) the ranks agree at each step boundary: a signal that
reached any rank stops every rank after the same step, and they write the checkpoint together. A
swarm's actors (trainer.parallelism=swarm sharing groups) agree the same way through their pool
(rlbench.training.swarm.SwarmPool), each writing its own checkpoint of that step.
A signal outside a step stops a rank at once, as in one process, but writes no new checkpoint
(the ranks are not at the same point; the earlier checkpoints stay valid).
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from rlbench.training.distributed import SINGLE, World

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run was stopped by a signal. ``mid_step``: it arrived inside a training step (a second
    signal), so the in-memory training state is not consistent and must not be checkpointed."""

    def __init__(self, signum: int, mid_step: bool = False, at_step_boundary: bool = False):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum, self.mid_step, self.at_step_boundary = signum, mid_step, at_step_boundary

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StopSignals:
    """Installs handlers for SIGINT and SIGTERM while the run lasts (``with StopSignals() as stop``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.in_step = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        first = self.signum is None
        self.signum = signum
        if self.in_step and first:
            log.warning("%s: finishing the current step, then writing a checkpoint (send it again to stop now)",
                        signal.Signals(signum).name)
            return
        raise Interrupted(signum, mid_step=self.in_step)

    @contextmanager
    def step(self) -> Iterator[None]:
        """A training step: a first signal inside it waits for its end."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def raise_if_requested(self, world: World = SINGLE) -> None:
        """At a step boundary: stop when a signal came. With several ranks every rank calls it after
        the same step and they agree (an all-reduce; a swarm's pool in place of ``world``): a signal
        that reached any rank stops them all there, so that they can write the checkpoint together."""
        signum = world.max_over_ranks(self.signum or 0)
        if signum:
            raise Interrupted(signum, at_step_boundary=True)
