"""Per-prompt statistics of every response graded in training: per prompt uid, the responses graded so
far (attempts), how many were correct (pass rate), their mean length, the last step that saw the prompt
and that step's own attempts and correct ones (the recent pass rate), and the reference policy's pass rate
measured before training (PVPO's pre-sampling). The curriculum
(rlbench.training.curricula) feeds the store every step's graded groups; prompt samplers and rollout
strategies (difficulty_adaptive) read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlbench.dataset.base import Problem
from rlbench.rollout.groups import GradedGroups
from rlbench.training.distributed import SINGLE, World
from rlbench.utils import Progress

PRESAMPLE_CHUNK = 64  # prompts per engine call of a pass before training


@dataclass
class PromptStats:
    attempts: int = 0
    correct: int = 0
    length_sum: int = 0
    last_seen: int = 0
    recent_attempts: int = 0  # the responses of the last step that saw the prompt
    recent_correct: int = 0
    reference_pass_rate: float | None = None  # the reference policy's pass rate before training (PVPO's pre-sampling); None: not measured

    @property
    def pass_rate(self) -> float:
        return self.correct / self.attempts if self.attempts else math.nan

    @property
    def recent_pass_rate(self) -> float:
        """The pass rate of the last step that saw the prompt (NaN before any)."""
        return self.recent_correct / self.recent_attempts if self.recent_attempts else math.nan

    @property
    def mean_length(self) -> float:
        return self.length_sum / self.attempts if self.attempts else math.nan


class PromptStatsStore:
    """Per-prompt statistics of every response graded in training (module docstring)."""

    def __init__(self) -> None:
        self.stats: dict[str, PromptStats] = {}

    def observe(self, step: int, graded: GradedGroups, world: World = SINGLE) -> None:
        """Count the step's groups. With several ranks (trainer.parallelism=ddp|fsdp) every rank's
        groups are gathered first, in rank order, so every rank counts the whole step as one process
        does, and the ranks' samplers (a shared seed) keep drawing the same prompts."""
        correct = graded.correct.tolist()
        counts = []  # per group: uid, attempts, correct, length_sum
        row = 0
        for problem, group in zip(graded.problems, graded.groups):
            right = sum(int(correct[row + k] > 0) for k in range(len(group)))
            counts.append((problem.uid, len(group), right, sum(len(c.response_ids) for c in group)))
            row += len(group)
        for uid, attempts, right, length_sum in world.gather(counts):
            entry = self.stats.setdefault(uid, PromptStats())
            if entry.last_seen != step:  # a prompt drawn twice in one step: its groups add up
                entry.recent_attempts = entry.recent_correct = 0
            entry.recent_attempts += attempts
            entry.recent_correct += right
            entry.attempts += attempts
            entry.correct += right
            entry.length_sum += length_sum
            entry.last_seen = step

    def set_reference(self, uid: str, pass_rate: float) -> None:
        """Record the reference policy's pass rate on prompt ``uid`` (PVPO's pre-sampling,
        rlbench.training.advantage_inputs.ReferenceAnchor.presample); strategies read it
        (rollout.mixed_traces.when=reference_unsolved)."""
        self.stats.setdefault(uid, PromptStats()).reference_pass_rate = float(pass_rate)

    def get(self, uid: str) -> PromptStats:
        return self.stats.get(uid, PromptStats())

    def state_dict(self) -> dict[str, Any]:
        return {uid: dataclasses.asdict(entry) for uid, entry in self.stats.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = {uid: PromptStats(**entry) for uid, entry in state.items()}


def measure_before_training(problems: Sequence[Problem], sample: Callable[[list[Problem]], GradedGroups],
                            phase: str) -> dict[str, tuple[list[float], float]]:
    """uid -> (rewards, pass rate) of ``sample``'s graded responses to each of ``problems`` (each uid once), in
    chunks of PRESAMPLE_CHUNK prompts with a progress line: the pass before training of PVPO's pre-sampling
    and of the offline difficulty filter (``trainer.difficulty_filter``)."""
    todo = list({p.uid: p for p in problems}.values())
    progress = Progress(phase, len(todo), enabled=bool(todo))
    measured: dict[str, tuple[list[float], float]] = {}
    for start in range(0, len(todo), PRESAMPLE_CHUNK):
        chunk = todo[start:start + PRESAMPLE_CHUNK]
        graded = sample(chunk)
        for k, problem in enumerate(chunk):
            member = graded.group_index == k
            measured[problem.uid] = (graded.rewards[member].tolist(), float(graded.correct[member].float().mean().item()))
        progress.update(len(chunk))
    return measured
