"""Auxiliary tasks mixed into the batch (``trainer.aux_tasks``): after each step a builder turns its graded
groups into tasks (prompt text + grading rule, rlbench.reward.judge_tasks) kept in a bounded buffer, and each
later step draws ``round(share * prompts_per_step)`` of its prompts from that buffer and the rest from the
prompt sampler. The tasks go through the same rollout, grading (``grade_completions`` grades a judge task by
its label) and loss as the dataset's prompts: SPARK's "same GRPO loss" (arXiv:2509.22624, section 3).

The buffer, its random stream and its counters are part of the curriculum's checkpoint state, so a resumed
run draws the same tasks as an uninterrupted one. EIS-GRPO's judge task (kind ``eis_pairwise``) is posed in
its two orderings by rollout=equivalent_states; CodeRL+'s execution tasks (kind ``execution``) are traced from the
run's programs in the sandbox (rlbench/reward/execution_tasks.py; docs/judges.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlbench.config.schema import AuxTasksConfig, RewardConfig, RolloutConfig, TrainerConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.judge_tasks import (
    AUX_TASK_KEY,
    AUX_TASK_KINDS,
    SOURCE_CORRECT_KEY,
    build_judge_tasks,
    is_aux_task,
)
from rlbench.rollout import GradedGroups
from rlbench.sandbox import SandboxLimits
from rlbench.rollout.strategies.equivalent_states import state_prefixes
from rlbench.utils import STREAM_AUX_TASKS

log = logging.getLogger(__name__)


def check_aux_tasks(trainer: TrainerConfig, rollout: RolloutConfig, reward: RewardConfig) -> None:
    """Refuse bad ``trainer.aux_tasks`` settings before anything loads (EIS-GRPO's judge task is posed in its two
    orderings: it needs rollout=equivalent_states with two states; CodeRL+'s execution tasks need code problems)."""
    aux = trainer.aux_tasks
    if aux is None:
        return
    if not 0.0 <= aux.share < 1.0:
        raise ConfigError(f"trainer.aux_tasks.share={aux.share} must be in [0, 1): the share of each step's prompts "
                          "drawn from the auxiliary tasks (1 would leave no dataset prompt to build tasks from)")
    unknown = [k for k in aux.kinds if k not in AUX_TASK_KINDS]
    if unknown or not aux.kinds:
        raise ConfigError(f"trainer.aux_tasks.kinds={list(aux.kinds)}: choose one or more of {list(AUX_TASK_KINDS)}")
    if "eis_pairwise" in aux.kinds and (rollout.strategy != "equivalent_states" or len(state_prefixes(rollout)) != 2):
        raise ConfigError("trainer.aux_tasks.kinds has eis_pairwise, a judge task posed in its two orderings pooled in one "
                          "group: it needs rollout=equivalent_states with two prefixes (the states of the dataset's problems)")
    if "execution" in aux.kinds and reward.name != "code":
        raise ConfigError(f"trainer.aux_tasks.kinds has execution, CodeRL+'s tasks traced from the run's programs: it "
                          f"needs a code dataset and reward=code (this run has reward={reward.name}), e.g. dataset=mbpp reward=code")
    paired = [k for k in aux.kinds if k in ("pairwise", "eis_pairwise")]
    if aux.balance and paired:
        raise ConfigError(f"trainer.aux_tasks.balance draws tasks by the verdict on the response each was built from; "
                          f"{paired} pair two responses: use balance with pointwise, reflection or execution only")
    if trainer.parallelism != "single" or trainer.max_staleness is not None:
        raise ConfigError("trainer.aux_tasks needs trainer.parallelism=single and trainer.max_staleness=null (each process "
                          "or the generator thread would build its own buffer)")


def dataset_groups(graded: GradedGroups) -> GradedGroups:
    """``graded`` without the auxiliary tasks' groups (the prompt statistics count the dataset's prompts)."""
    aux = [g for g, problem in enumerate(graded.problems) if is_aux_task(problem)]
    return graded if not aux else graded.select([g for g in range(len(graded.problems)) if g not in aux])


def aux_count(share: float, prompts_per_step: int) -> int:
    """The auxiliary prompts a step of ``prompts_per_step`` asks for: round(share * prompts_per_step), at least 1
    when share > 0 (a small batch would otherwise never draw one) and at most prompts_per_step - 1 (one dataset
    prompt stays to build tasks from)."""
    wanted = max(round(share * prompts_per_step), 1) if share > 0 else 0
    return min(wanted, prompts_per_step - 1)


def draw_tasks(correct: Sequence[bool], newest: int, wanted: int, sampling: str, balance: bool,
               rng: np.random.Generator) -> list[int]:
    """The buffer positions (oldest first) of the ``min(wanted, n)`` tasks a step draws from a buffer of
    n = ``len(correct)`` tasks whose last ``newest`` were built by the latest step that built any.

    The pool: every task (``uniform``) or, CodeRL+'s ``recent`` (arXiv:2510.18471; the authors' released buffer),
    the newest build's tasks when they are at least ``wanted``, else the newest ``min(wanted, n)`` tasks, all of
    them. Drawn from the pool uniformly without replacement; with ``balance``, c = min(max(k // 2, k - |W|), |C|)
    from the correct-source tasks C and k - c from the incorrect ones W (half each, the other side filling a
    shortfall), k = min(wanted, n)."""
    n = len(correct)
    count = min(wanted, n)
    if count == 0:
        return []
    if sampling == "recent":
        newest = min(newest, n)
        if newest < count:
            return list(range(n - count, n))
        pool = list(range(n - newest, n))
    else:
        pool = list(range(n))

    def choose(options: list[int], k: int) -> list[int]:
        return [options[j] for j in rng.choice(len(options), size=k, replace=False)] if k else []

    if not balance:
        return sorted(choose(pool, count))
    right = [i for i in pool if correct[i]]
    wrong = [i for i in pool if not correct[i]]
    take_right = min(max(count // 2, count - len(wrong)), len(right))
    return sorted(choose(right, take_right) + choose(wrong, count - take_right))


class AuxTaskBuffer:
    """The tasks built so far (newest last, at most ``capacity``), drawn by a seeded stream as ``sampling`` and
    ``balance`` say (:func:`draw_tasks`; ``uniform``: a drawn task leaves the buffer, ``recent``: it stays, as in
    CodeRL+'s buffer). The curriculum puts the drawn tasks after the dataset's prompts."""

    def __init__(self, options: AuxTasksConfig, seed: int, sandbox_limits: SandboxLimits | None = None):
        self.options, self.sandbox_limits = options, sandbox_limits or SandboxLimits()
        self.tasks: deque[Problem] = deque(maxlen=options.capacity)
        self.rng = np.random.default_rng([seed, STREAM_AUX_TASKS])
        self.built = self.drawn = self.shortfall = 0  # cumulative
        self.newest = 0  # tasks of the latest build that built any
        self.last: dict[str, float] = {}

    def take(self, wanted: int) -> list[Problem]:
        """Up to ``wanted`` tasks out of the buffer (fewer while it holds fewer: the gap is counted)."""
        correct = [bool(t.meta.get(SOURCE_CORRECT_KEY)) for t in self.tasks]
        picks = draw_tasks(correct, self.newest, wanted, self.options.sampling, self.options.balance, self.rng)
        chosen = [self.tasks[i] for i in picks]
        if self.options.sampling == "uniform":
            for i in reversed(picks):
                del self.tasks[i]
        count = len(chosen)
        self.drawn += count
        self.shortfall += wanted - count
        self.last = {"aux_prompts": float(count), "aux_shortfall": float(wanted - count)}
        return chosen

    def add(self, graded: GradedGroups) -> None:
        """Build tasks from a finished step's dataset groups (an auxiliary task's own group builds none)."""
        grades = iter(graded.grades)
        new: list[Problem] = []
        correct_by_kind: dict[str, list[float]] = {}
        for problem, group in zip(graded.problems, graded.groups):
            group_grades = [next(grades) for _ in group]
            if is_aux_task(problem):
                correct_by_kind.setdefault(problem.meta[AUX_TASK_KEY], []).extend(float(g.correct) for g in group_grades)
                continue
            new += build_judge_tasks(problem, [c.text for c in group], group_grades, self.options.kinds,
                                     self.options.per_group, self.rng, self.sandbox_limits)
        self.tasks.extend(new)
        self.newest = len(new) or self.newest
        self.built += len(new)
        self.last.update({"aux_built": float(len(new)), "aux_buffer": float(len(self.tasks))})
        if correct_by_kind:
            self.last["aux_accuracy"] = float(np.mean([c for kind in correct_by_kind.values() for c in kind]))
            self.last.update({f"aux_accuracy_{kind}": float(np.mean(c)) for kind, c in correct_by_kind.items()})

    def metrics(self) -> dict[str, float]:
        """The step's counts (aux_prompts, aux_shortfall, aux_built, aux_buffer; aux_accuracy and
        aux_accuracy_<kind> when the step had tasks) and the run's shortfall so far (aux_shortfall_total)."""
        return {**self.last, "aux_shortfall_total": float(self.shortfall)}

    def state_dict(self) -> dict[str, Any]:
        return {"tasks": [dataclasses.asdict(t) for t in self.tasks], "rng": self.rng.bit_generator.state,
                "built": self.built, "drawn": self.drawn, "shortfall": self.shortfall, "newest": self.newest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tasks = deque((Problem(**t) for t in state["tasks"]), maxlen=self.options.capacity)
        self.rng.bit_generator.state = state["rng"]
        self.built, self.drawn, self.shortfall = int(state["built"]), int(state["drawn"]), int(state["shortfall"])
        self.newest = int(state.get("newest", 0))


__all__ = ["AUX_TASK_KEY", "AuxTaskBuffer", "aux_count", "check_aux_tasks", "dataset_groups", "draw_tasks"]
