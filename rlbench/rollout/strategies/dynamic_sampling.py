"""DAPO's dynamic sampling (``rollout=dynamic_sampling``; Yu et al. 2025, arXiv:2503.14476, section
3.2): keep only groups whose responses differ, drawing more prompts until the batch is full; with
``length_extremes`` also LSPO's length filter on the same groups (``rollout=lspo``; Chen, Koenig & Dilkina
2025, arXiv:2510.01459): of the informative groups of a round, only those whose mean response length is at
the extremes of that round's lengths (:func:`length_extremes`).

Configuration (conf/rollout/dynamic_sampling.yaml; ``algorithm=dapo`` selects it):

    strategy: dynamic_sampling
    dynamic_sampling:
      max_rounds: 16      # generation rounds per step at most (verl: max_num_gen_batches)
      metric: correct     # correct: 0 < #correct < G (the paper) | reward: the rewards differ
      length_extremes: null  # [low, high, max] quantiles: LSPO's length filter (conf/rollout/lspo.yaml)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    needs_groups,
    register_strategy,
    strategy_options,
)

log = logging.getLogger(__name__)

FILTER_METRICS = ("correct", "reward")


def informative_groups(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[G] bool: True for the groups whose ``values`` are not all equal (DAPO's dynamic-sampling
    filter, Yu et al. 2025, arXiv:2503.14476, eq. 11: keep 0 < |{o_i : is_equivalent(a, o_i)}| < G).

    With values = correctness this is the paper's 0 < #correct < G; a group of one response is never
    informative. A group-relative advantage is 0 on every response of the groups this drops.
    """
    index = group_index.long()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    values = values.to(torch.float64)
    high = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, values, reduce="amax")
    low = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, values, reduce="amin")
    return high > low


def length_extremes(lengths: Sequence[float], low: float, high: float, top: float) -> torch.Tensor:
    """LSPO's filter (Chen, Koenig & Dilkina 2025, arXiv:2510.01459) on the mean response lengths L of a
    round's candidate groups: with Q the quantiles of these lengths (linear interpolation), a group is kept
    when L <= Q(low) or Q(high) <= L <= Q(top) (above Q(top): near-truncated responses, left out).
    Returns the [G] bool mask; no candidates: an empty mask."""
    values = torch.as_tensor(list(lengths), dtype=torch.float64)
    if not len(values):
        return torch.zeros(0, dtype=torch.bool)
    q_low, q_high, q_top = torch.quantile(values, torch.tensor([low, high, top], dtype=torch.float64)).tolist()
    return (values <= q_low) | ((values >= q_high) & (values <= q_top))


def mean_lengths(graded: GradedGroups) -> list[float]:
    """Each group's mean response length (tokens)."""
    return [sum(len(c.response_ids) for c in group) / len(group) for group in graded.groups]


@dataclass(frozen=True)
class DynamicSamplingOptions:
    """The ``rollout.dynamic_sampling`` block."""

    max_rounds: int = 16  # generation rounds per step at most
    metric: str = "correct"  # what must differ within a kept group: correct | reward
    length_extremes: tuple[float, float, float] | None = None  # LSPO's (low, high, max) quantiles; None: no length filter

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ConfigError(f"rollout.dynamic_sampling.max_rounds must be >= 1, got {self.max_rounds}")
        if self.metric not in FILTER_METRICS:
            raise ConfigError(f"rollout.dynamic_sampling.metric={self.metric!r} is unknown; choose one of {FILTER_METRICS}")
        bounds = self.length_extremes
        if bounds is not None and (len(bounds) != 3 or not 0 < bounds[0] < bounds[1] < bounds[2] <= 1):
            raise ConfigError(f"rollout.dynamic_sampling.length_extremes=[low, high, max] needs 0 < low < high < max <= 1, "
                              f"got {list(bounds)}")

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "DynamicSamplingOptions":
        return strategy_options(rollout, "dynamic_sampling", cls)

    def filter_values(self, graded: GradedGroups) -> torch.Tensor:
        return graded.correct if self.metric == "correct" else graded.rewards

    def kept_groups(self, graded: GradedGroups) -> tuple[torch.Tensor, int]:
        """[G] bool: the round's groups kept (informative; with length_extremes, LSPO's length filter on the
        informative ones, by this round's own lengths), and how many informative groups the length filter left out."""
        informative = informative_groups(self.filter_values(graded), graded.group_index)
        if self.length_extremes is None:
            return informative, 0
        candidates = informative.nonzero(as_tuple=True)[0]
        lengths = mean_lengths(graded)
        extreme = length_extremes([lengths[g] for g in candidates.tolist()], *self.length_extremes)
        kept = torch.zeros_like(informative)
        kept[candidates[extreme]] = True
        return kept, int(informative.sum().item()) - int(kept.sum().item())


def sample_informative_groups(
    sample: Callable[[list[Problem]], GradedGroups],
    draw_prompts: Callable[[int], list[Problem]],
    first_prompts: list[Problem],
    options: DynamicSamplingOptions,
    rounds_setting: str = "rollout.dynamic_sampling.max_rounds",
) -> tuple[GradedGroups, dict[str, float]]:
    """Dynamic sampling: generate rounds of ``len(first_prompts)`` prompts (the first round on
    ``first_prompts``, later ones on ``draw_prompts``) and keep the informative groups
    (:func:`informative_groups`) until there are ``len(first_prompts)`` of them, for at most
    ``options.max_rounds`` rounds. The batch is the first ``len(first_prompts)`` kept groups. Group
    ids count the groups generated this step (round 2's first group has id ``len(first_prompts)``).

    If the rounds run out first, the batch is filled with the earliest dropped groups (logged, naming
    ``rounds_setting`` to raise; verl stops the run with an error instead). Metrics: rounds, groups
    dropped, groups used to fill, and the mean reward of every response generated (the batch's own
    reward_mean is biased by the selection).
    """
    target = len(first_prompts)
    kept: list[GradedGroups] = []
    dropped: list[GradedGroups] = []
    kept_count = dropped_count = rounds = generated = length_dropped = 0
    sampled_rewards: list[torch.Tensor] = []
    sampled_outcomes: list[torch.Tensor] = []
    prompts = first_prompts
    while rounds < options.max_rounds and kept_count < target:
        rounds += 1
        graded = sample(prompts).with_group_ids(generated)
        generated += len(graded.groups)
        sampled_rewards.append(graded.rewards)
        sampled_outcomes.append(graded.outcome)
        informative, left_out = options.kept_groups(graded)
        length_dropped += left_out
        kept.append(graded.select(informative.nonzero(as_tuple=True)[0].tolist()))
        dropped.append(graded.select((~informative).nonzero(as_tuple=True)[0].tolist()))
        kept_count += int(informative.sum().item())
        dropped_count += int((~informative).sum().item())
        if kept_count < target and rounds < options.max_rounds:
            prompts = draw_prompts(target)
    batch = GradedGroups.concat(kept)
    filled = max(0, target - kept_count)
    if filled:
        log.warning(
            "dynamic sampling: %d of %d groups informative after max_rounds=%d rounds; filling the batch with "
            "%d groups whose %s values are all equal (raise %s)",
            kept_count, target, options.max_rounds, filled, options.metric, rounds_setting,
        )
        batch = GradedGroups.concat([batch, GradedGroups.concat(dropped).select(list(range(filled)))])
    else:
        batch = batch.select(list(range(target)))
    metrics = {
        "dynamic_sampling_rounds": float(rounds),
        "dynamic_sampling_dropped_groups": float(dropped_count),
        "dynamic_sampling_filled_groups": float(filled),
        **({"lspo_length_dropped_groups": float(length_dropped)} if options.length_extremes is not None else {}),
        # the policy's reward on all responses generated this step, before the selection
        "rollout_reward_mean": float(torch.cat(sampled_rewards).mean().item()),
        "rollout_outcome_mean": float(torch.cat(sampled_outcomes).mean().item()),  # the same, before shaping
    }
    return batch, metrics


def refuse_tracker_baseline(advantage: str, where: str, instead: str) -> None:
    """ConfigError for SPO's advantage with a filter that drops all-equal groups (``where``): the tracker baseline
    already gives those groups a signal (SPO, arXiv:2509.13232)."""
    if advantage == "spo":
        raise ConfigError(f"advantage 'spo' does not combine with {where}: the tracker baseline already gives "
                          f"all-equal groups a signal (SPO, arXiv:2509.13232); use {instead}")


@register_strategy("dynamic_sampling")
class DynamicSampling(RolloutStrategy):
    """The strategy: rounds of i.i.d. groups filtered by :func:`informative_groups` (see
    :func:`sample_informative_groups`)."""

    def __init__(self, setup: RolloutSetup, options: DynamicSamplingOptions):
        self.setup, self.options = setup, options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": DynamicSamplingOptions.from_config(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        super().validate(rollout, advantage)
        needs_groups("dynamic_sampling", rollout, "keeps groups whose responses differ")
        refuse_tracker_baseline(advantage, "rollout=dynamic_sampling", "rollout=iid")

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None
    ) -> tuple[GradedGroups, dict[str, float]]:
        if draw_prompts is None:
            raise ValueError("dynamic sampling draws more prompts: pass train_step(..., draw_prompts=sampler.next)")
        return sample_informative_groups(self.setup.sample, draw_prompts, problems, self.options)
