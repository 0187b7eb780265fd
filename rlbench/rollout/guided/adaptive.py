"""AR3PO's adaptive rollout and response reuse (``rollout=adaptive``; arXiv:2509.25808, "Improving
Sampling Efficiency in RLVR through Adaptive Rollout and Response Reuse", section 3).

Adaptive rollout: responses are sampled in up to ``stages`` stages of ``rollout.n / stages`` per prompt;
a prompt stops being sampled once one of its responses is correct, so hard prompts get more samples and
solved ones cost one stage. A prompt's group is every response sampled for it (variable size; group
statistics are per group).

Response reuse: a prompt still without a correct response after the last stage gets one stored correct
response of the same question from a :class:`rlbench.rollout.guided.replay.ReplayBuffer` (when it holds one),
so its group advantage does not vanish. Correct fresh responses enter the buffer after the step.

How pi_old differs from the replay default: AR3PO recomputes the reused response's old log-probs under
the current policy, i.e. treats it as the current policy's own sample (its first update's ratio is 1).
rlbench's default for replayed tokens (rollout=replay, ``behaviour: stored``) is the opposite: pi_old is
the stored behaviour log-prob, so the ratio is pi_theta / mu. Here AR3PO's rule is the default
(``reuse_behaviour: recomputed``, label ``replay_recomputed``); ``reuse_behaviour: stored`` gives the
importance-corrected variant.

Configuration (conf/rollout/adaptive.yaml; ``algorithm=ar3po`` selects it):

    strategy: adaptive
    adaptive:
      stages: 2                   # S; rollout.n must be a multiple of it (n / S responses per stage)
      reuse: true                 # response reuse for prompts left without a correct response
      reuse_behaviour: recomputed # recomputed (AR3PO) | stored (pi_old = the stored log-probs)
      capacity: 4096              # stored correct responses at most
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.replay import BEHAVIOURS, StoredSuccesses, inject_successes
from rlbench.rollout.strategy import RolloutSetup, register_strategy, strategy_options


@dataclass(frozen=True)
class AdaptiveOptions:
    """The ``rollout.adaptive`` block."""

    stages: int = 2
    reuse: bool = True
    reuse_behaviour: str = "recomputed"
    capacity: int = 4096

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "AdaptiveOptions":
        options, n = strategy_options(rollout, "adaptive", cls), int(rollout.n)
        if options.stages < 1 or n % options.stages:
            raise ConfigError(
                f"rollout.adaptive.stages={options.stages} must be >= 1 and divide rollout.n={n} "
                "(each stage samples rollout.n / stages responses per unresolved prompt)"
            )
        if options.reuse_behaviour not in BEHAVIOURS:
            raise ConfigError(f"rollout.adaptive.reuse_behaviour={options.reuse_behaviour!r}: choose one of {BEHAVIOURS}")
        if options.capacity < 1:
            raise ConfigError(f"rollout.adaptive.capacity must be >= 1, got {options.capacity}")
        return options


@register_strategy("adaptive")
class AdaptiveRollout(StoredSuccesses):
    """Staged sampling that stops at the first correct response, plus reuse of a stored success."""

    def __init__(self, setup: RolloutSetup, options: AdaptiveOptions):
        self.setup, self.options = setup, options
        self.keep_successes(options.capacity, setup.seed)

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": AdaptiveOptions.from_config(rollout)}

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        self.pending.flush(self.buffer)
        per_stage = self.setup.n // self.options.stages
        groups: list[list] = [[] for _ in problems]
        resolved = [False] * len(problems)
        stages_run = 0
        for _ in range(self.options.stages):
            active = [i for i, done in enumerate(resolved) if not done]
            if not active:
                break
            stages_run += 1
            stage = self.setup.sampler([problems[i] for i in active], per_stage, self.setup.params, self.setup.generator)
            for position, i in enumerate(active):
                responses = stage.group_index == position
                groups[i].extend(stage.groups[position])
                resolved[i] = bool((stage.correct[responses] > 0).any())
        fresh_counts = [len(group) for group in groups]
        reused = 0
        if self.options.reuse:
            reused = inject_successes(self.buffer, problems, groups, [0 if done else 1 for done in resolved],
                                      self.options.reuse_behaviour == "recomputed")
        graded = self.setup.sampler.grade(problems, groups, self.setup.params.max_new_tokens)
        self.pending.add_groups(problems, graded, fresh_counts)
        return graded, {
            "adaptive_stages": float(stages_run),
            "adaptive_resolved_fraction": sum(resolved) / len(problems),
            "adaptive_responses_per_prompt": sum(fresh_counts) / len(problems),
            "replay_responses": float(reused),
            "replay_buffer_size": float(len(self.buffer)),
        }
