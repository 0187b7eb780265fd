"""DART's difficulty-adaptive rollout (``rollout=difficulty_adaptive``; Li et al. 2025, "Efficient
Multi-turn RL for GUI Agents via Decoupled Training and Adaptive Data Curation", arXiv:2509.23866,
section 3, adaptive data curation): the group size and the response budget of each prompt follow its
recent accuracy, and a group without any success gets a stored one.

With a = the prompt's accuracy read from the run's per-prompt statistics store
(rlbench.training.curricula.PromptStatsStore: the cumulative pass rate, or with ``accuracy: recent``
the pass rate of the last step that saw it), n = rollout.n and L = rollout.max_new_tokens:

    hard    a < acc_low    n(x) = n_max   L(x) = ceil(hard_length_scale * L)
    easy    a > acc_high   n(x) = n_min   L(x) = max(1, floor(easy_length_scale * L))
    default otherwise      n(x) = n       L(x) = L          (a prompt not seen yet: default)

Responses of equal budget are sampled in one engine call (ascending budgets), so with every prompt in
the default tier the strategy samples exactly what ``rollout=iid`` samples. Group sizes differ between
prompts; the advantage pieces take per-group statistics (rlbench/algorithm/advantages/common.py), as
for ``rollout=adaptive``.

Success injection (``inject: m``): a group whose fresh responses are all wrong gets up to m stored correct
responses of the same question from a :class:`rlbench.rollout.guided.replay.ReplayBuffer` (the same injection
as AR3PO's response reuse, :func:`rlbench.rollout.guided.replay.inject_successes`). Where the stored successes
come from:

- ``pool: <file>`` (DART's pre-collected successes): a pool of verified successes sampled before training,
  written by ``mode=generate rollout=replay_rlep_collect rollout.replay.pool_save=<file>`` and read with
  RLEP's reader (rlbench/rollout/guided/replay_pool.py). The buffer holds exactly the pool's responses (policy
  version -1) and nothing enters it online. Refused before the model loads when missing, malformed or of
  another dataset; when the strategy is built when of another tokenizer; when injected when its prompt token
  ids differ from this run's.
- ``pool: null``: the run's own correct fresh responses, entering the buffer after their step (online).

``inject_behaviour``: stored (pi_old = the stored log-probs, ratio pi_theta / mu) or recomputed. A step that
injects grades its groups a second time (reward shaping sees each whole group).

Why a rollout strategy and not a prompt sampler: a sampler (``trainer.prompt_sampler``) decides which prompts a
step trains on; how many responses each prompt gets and how long they may be are the rollout's
decisions (the strategy holds rollout.n and the sampling parameters, and stages change them there).
The difficulty signal is the store the samplers read, so any sampler composes with it.

The accuracy of a prompt counts every response of its groups, injected successes included (the store
counts what was trained on). Reward shaping that reads the response budget (``max_length``) sees the
step's longest budget.

Configuration (conf/rollout/difficulty_adaptive.yaml; ``algorithm=dart`` selects it):

    strategy: difficulty_adaptive
    difficulty_adaptive:
      n_min: 2                 # easy prompts; 2 <= n_min <= rollout.n <= n_max
      n_max: 8                 # hard prompts
      acc_low: 0.2             # a < acc_low: hard (0 <= acc_low <= acc_high <= 1)
      acc_high: 0.8            # a > acc_high: easy
      accuracy: pass_rate      # pass_rate (all steps so far) | recent (the last step that saw the prompt)
      hard_length_scale: 1.0   # >= 1: hard prompts' budget
      easy_length_scale: 1.0   # in (0, 1]: easy prompts' budget
      inject: 1                # stored successes added to a group without any (0: none)
      inject_behaviour: stored # stored | recomputed
      capacity: 4096           # stored correct responses at most (online collection)
      pool: null               # path: inject only this pool's successes, collected before training (DART)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.replay import BEHAVIOURS, StoredSuccesses, check_pool_prompts, inject_successes
from rlbench.rollout.guided.replay_pool import check_pool_tokenizer, read_pool
from rlbench.rollout.strategy import RolloutSetup, register_strategy, strategy_options

log = logging.getLogger(__name__)

ACCURACY_SOURCES = ("pass_rate", "recent")
HARD, DEFAULT, EASY = "hard", "default", "easy"


@dataclass(frozen=True)
class DifficultyOptions:
    """The ``rollout.difficulty_adaptive`` block (module docstring)."""

    n_min: int = 2
    n_max: int = 8
    acc_low: float = 0.2
    acc_high: float = 0.8
    accuracy: str = "pass_rate"
    hard_length_scale: float = 1.0
    easy_length_scale: float = 1.0
    inject: int = 1
    inject_behaviour: str = "stored"
    capacity: int = 4096
    pool: str | None = None

    POOL_KEY = "rollout.difficulty_adaptive.pool"

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "DifficultyOptions":
        options = strategy_options(rollout, "difficulty_adaptive", cls)
        options.check(int(rollout.n))
        if options.pool is not None:
            read_pool(options.pool, cls.POOL_KEY)  # missing or malformed: refused before the model loads
        return options

    def check(self, n: int) -> None:
        """ConfigError unless the group sizes, thresholds, scales and injection are possible with the
        default group size ``n`` (rollout.n, or a stage's)."""
        key = "rollout.difficulty_adaptive"
        checks = [
            (self.n_min <= self.n_max,
             f"{key}.n_min={self.n_min} > n_max={self.n_max}: easy prompts cannot get more responses than hard ones"),
            (self.n_min >= 2, f"{key}.n_min={self.n_min}: a group needs >= 2 responses for a group baseline"),
            (self.n_min <= n <= self.n_max,
             f"{key}: n_min={self.n_min} <= rollout.n={n} <= n_max={self.n_max} is required (rollout.n is the default tier's group size)"),
            (0 <= self.acc_low <= self.acc_high <= 1,
             f"{key}: 0 <= acc_low <= acc_high <= 1 is required (hard below acc_low, easy above acc_high), "
             f"got acc_low={self.acc_low}, acc_high={self.acc_high}"),
            (self.accuracy in ACCURACY_SOURCES, f"{key}.accuracy={self.accuracy!r}: choose one of {ACCURACY_SOURCES}"),
            (self.hard_length_scale >= 1, f"{key}.hard_length_scale={self.hard_length_scale} must be >= 1 (hard prompts get at least the default budget)"),
            (0 < self.easy_length_scale <= 1, f"{key}.easy_length_scale={self.easy_length_scale} must be in (0, 1]"),
            (self.inject >= 0, f"{key}.inject={self.inject} must be >= 0 (0: no success injection)"),
            (self.inject_behaviour in BEHAVIOURS, f"{key}.inject_behaviour={self.inject_behaviour!r}: choose one of {BEHAVIOURS}"),
            (self.capacity >= 1, f"{key}.capacity must be >= 1, got {self.capacity}"),
            (self.pool is None or self.inject >= 1,
             f"{key}.pool={self.pool} with inject=0 injects nothing from it: set inject >= 1 or drop the pool"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def difficulty_tier(accuracy: float, acc_low: float, acc_high: float) -> str:
    """hard if accuracy < acc_low, easy if accuracy > acc_high, else (or NaN: not seen yet) default."""
    if math.isnan(accuracy):
        return DEFAULT
    if accuracy < acc_low:
        return HARD
    return EASY if accuracy > acc_high else DEFAULT


def rollout_plan(accuracies: Sequence[float], options: DifficultyOptions, n: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """(n(x), L(x)) per prompt from its accuracy (module docstring's table)."""
    plan = {
        HARD: (options.n_max, math.ceil(options.hard_length_scale * max_new_tokens)),
        DEFAULT: (n, max_new_tokens),
        EASY: (options.n_min, max(1, math.floor(options.easy_length_scale * max_new_tokens))),
    }
    return [plan[difficulty_tier(a, options.acc_low, options.acc_high)] for a in accuracies]


@register_strategy("difficulty_adaptive")
class DifficultyAdaptiveRollout(StoredSuccesses):
    """Per-prompt group size and budget from the prompt's accuracy, plus success injection."""

    def __init__(self, setup: RolloutSetup, options: DifficultyOptions):
        self.setup, self.options = setup, options
        self.keep_successes(options.capacity, setup.seed)
        if options.pool is not None:  # DART's pre-collected successes: exactly the pool's, nothing online
            pool = read_pool(options.pool, options.POOL_KEY)
            check_pool_tokenizer(options.pool, pool, setup.sampler.tokenizer, options.POOL_KEY)
            self.buffer.load_pool(pool["questions"])
        elif options.inject:
            log.warning("%s is not set: groups without a success get this run's own earlier successes, collected online "
                        "(early steps inject nothing); DART injects successes collected before training (docs/replay.md)",
                        options.POOL_KEY)

    @classmethod
    def from_config(cls, rollout: RolloutConfig, setup: RolloutSetup) -> "DifficultyAdaptiveRollout":
        if setup.prompt_stats is None:
            raise ValueError("rollout=difficulty_adaptive reads the run's per-prompt statistics: RolloutSetup.prompt_stats is None")
        return cls(setup, DifficultyOptions.from_config(rollout))

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        DifficultyOptions.from_config(rollout)

    def accuracies(self, problems: Sequence[Problem]) -> list[float]:
        stats = [self.setup.prompt_stats.get(p.uid) for p in problems]
        return [s.recent_pass_rate if self.options.accuracy == "recent" else s.pass_rate for s in stats]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        self.pending.flush(self.buffer)
        params = self.setup.params
        accuracies = self.accuracies(problems)
        plan = rollout_plan(accuracies, self.options, self.setup.n, params.max_new_tokens)
        groups: list[list] = [[] for _ in problems]
        for budget in sorted({length for _, length in plan}):
            members = [i for i, (_, length) in enumerate(plan) if length == budget]
            sampled = self.setup.sampler.sample(
                [problems[i] for i in members], [plan[i][0] for i in members],
                dataclasses.replace(params, max_new_tokens=budget), self.setup.generator,
            )
            for i, group in zip(members, sampled):
                groups[i] = group
        fresh_counts = [len(group) for group in groups]
        longest = max(length for _, length in plan)
        graded = self.setup.sampler.grade(problems, groups, longest)
        correct = graded.correct > 0
        solved = [bool(correct[graded.group_index == g].any()) for g in range(len(groups))]
        injected = 0
        if self.options.inject:
            wanted = [0 if ok else self.options.inject for ok in solved]
            injected = inject_successes(self.buffer, problems, groups, wanted, self.options.inject_behaviour == "recomputed")
            if injected and self.options.pool is not None:
                check_pool_prompts(f"{self.options.POOL_KEY}={self.options.pool}", problems, groups, fresh_counts)
            if injected:  # the groups changed: grade and shape them again
                graded = self.setup.sampler.grade(problems, groups, longest)
        if self.options.pool is None:  # online collection: this step's correct responses, stored after it
            self.pending.add_groups(problems, graded, fresh_counts)
        tiers = [difficulty_tier(a, self.options.acc_low, self.options.acc_high) for a in accuracies]
        return graded, {
            "difficulty_hard_fraction": tiers.count(HARD) / len(problems),
            "difficulty_easy_fraction": tiers.count(EASY) / len(problems),
            "difficulty_responses_per_prompt": sum(fresh_counts) / len(problems),
            "difficulty_unsolved_fraction": solved.count(False) / len(problems),
            "replay_responses": float(injected),
            "replay_buffer_size": float(len(self.buffer)),
        }
