"""Iterative rounds (algorithm.update.round_steps): the frozen policy pi_t of INPO's and REBEL's iterations.

INPO (Zhang et al. 2024, arXiv:2407.00617, Algorithm 1) and REBEL (Gao et al. 2024, arXiv:2404.16767,
Algorithm 1) run rounds t = 1..T: sample responses with pi_t, label them, then minimise a loss in which pi_t
is frozen (INPO's online-mirror-descent step pi_{t+1} ~ pi_t^(1 - eta tau) pi_ref^(eta tau) exp(eta P(y > pi_t)),
REBEL's regression onto pi_t exp(eta R)). Without rounds a step is a round: pi_t is the policy that sampled the
batch. With ``round_steps = k`` a frozen copy of the policy is taken before steps 1, k + 1, 2k + 1, ... and is
the loss's pi_t (its ``old_logp``) on every batch of the round, while the policy trains on the round's k batches.

Who samples a round's batches (``algorithm.update.round_sampling``): ``pi_t`` (the default, the papers'
Algorithm 1: sample with pi_t, label, then fit against the frozen pi_t) draws every batch of the round from the
frozen copy, through an HF engine of its own over that copy (:meth:`RoundPolicy.sampling`: the run's sampler
calls it instead of the policy's engine during the rollout, with the run's random stream); the copy is taken
before the round's first rollout, when it equals the policy. ``policy`` samples each batch with the training
policy as it moves: both losses are squared regressions whose minimiser is fixed pointwise (per pair of
responses), so the sampling policy weighs the pairs but does not move the minimiser while it covers the same
responses. The copy is saved in checkpoints taken inside a round and restored on resume (at a round's boundary
the next step takes a new copy, so none is saved).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlbench.training.batch import TrainBatch
from rlbench.training.distributed import unwrap
from rlbench.training.forward import batch_outputs


class RoundPolicy:
    """pi_t of the current round: a frozen copy of the policy, refreshed every ``round_steps`` steps."""

    def __init__(self, model: torch.nn.Module, round_steps: int,
                 make_engine: Callable[[torch.nn.Module], Any] | None = None):
        """``make_engine(snapshot)``: an engine sampling from the frozen copy (round_sampling=pi_t); None: the
        round's batches are sampled by the training policy (round_sampling=policy)."""
        if round_steps < 1:
            raise ValueError(f"round_steps must be >= 1, got {round_steps}")
        self.round_steps = round_steps
        self.snapshot = copy.deepcopy(unwrap(model)).eval().requires_grad_(False)
        self.make_engine = make_engine
        self.engine = None  # pi_t's engine, built at the first rollout it samples
        self.taken_after: int | None = None  # the policy updates done when the snapshot was last taken

    @classmethod
    def from_algorithm(cls, round_steps: int | None, model: torch.nn.Module,
                       make_engine: Callable[[torch.nn.Module], Any] | None = None) -> RoundPolicy | None:
        """The run's round policy (None without algorithm.update.round_steps)."""
        return None if round_steps is None else cls(model, round_steps, make_engine)

    def round_of(self, updates_done: int) -> int:
        """The round (from 1) of the step that follows ``updates_done`` policy updates."""
        return updates_done // self.round_steps + 1

    def starts_round(self, updates_done: int) -> bool:
        return updates_done % self.round_steps == 0

    def begin_step(self, model: torch.nn.Module, updates_done: int) -> dict[str, float]:
        """Before the step's rollout (and again before its update: once per step): at a round's first step pi_t
        becomes the policy as it is now. Returns the step's metric ``round``."""
        if self.starts_round(updates_done) and self.taken_after != updates_done:
            self.snapshot.load_state_dict(unwrap(model).state_dict())
            self.taken_after = updates_done
        return {"round": float(self.round_of(updates_done))}

    @contextlib.contextmanager
    def sampling(self, sampler: Any) -> Iterator[None]:
        """Within the block ``sampler`` (rlbench.rollout.GroupSampler) samples from pi_t (round_sampling=pi_t);
        a no-op when the training policy samples."""
        if self.make_engine is None:
            yield
            return
        if self.engine is None:
            self.engine = self.make_engine(self.snapshot)
        policy_engine, sampler.engine = sampler.engine, self.engine
        try:
            yield
        finally:
            sampler.engine = policy_engine

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch, micro_batch_size: int, temperature: float) -> torch.Tensor:
        """log pi_t of the batch's tokens ([B, T], zero on padding): the loss's old_logp during the round."""
        return batch_outputs(self.snapshot, batch, micro_batch_size, temperature).logp

    def state_dict(self, updates_done: int) -> dict[str, Any] | None:
        """pi_t's weights inside a round; None at its boundary (the next step copies the policy anyway)."""
        return None if self.starts_round(updates_done) else self.snapshot.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None, updates_done: int) -> None:
        """Restore pi_t saved after ``updates_done`` updates (a state saved inside a round must hold it)."""
        if state is not None:
            self.snapshot.load_state_dict(state)
            self.taken_after = (updates_done // self.round_steps) * self.round_steps
        elif not self.starts_round(updates_done):
            raise ValueError(f"the checkpoint after update {updates_done} is inside round {self.round_of(updates_done)} "
                             "but holds no pi_t (algorithm.update.round_steps): it cannot be resumed exactly")
