"""Which responses a training step learns from: generation and grading of prompt groups, DAPO's
dynamic sampling (keep only groups whose rewards differ, draw more prompts until the batch is full)
and DAPO's overlong filtering (truncated responses are masked out of the loss).

Configuration (under ``algorithm``; both off unless a preset turns them on):

    dynamic_sampling:
      enabled: false      # keep only groups whose responses differ in `metric`
      max_rounds: 16      # generation rounds per step at most (verl: max_num_gen_batches)
      metric: correct     # correct: 0 < #correct < G (the paper) | reward: the rewards differ
    overlong_filter: false  # mask responses that hit rollout.max_new_tokens (no EOS) out of the loss
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.prompting import encode_prompts
from rlbench.reward import grade_completions
from rlbench.reward.math import Grade
from rlbench.rollout.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from rlbench.trainer import TrainBatch

log = logging.getLogger(__name__)

FILTER_METRICS = ("correct", "reward")
DYNAMIC_SAMPLING_KEYS = {"enabled", "max_rounds", "metric"}


@dataclass
class GradedGroups:
    """Graded responses, grouped per prompt. Per-response fields are flat, group after group.

    rewards  [B] the reward after the algorithm's reward shaping (what the advantage sees)
    outcome  [B] the graders' rewards, before shaping
    finished [B] bool, True when the response ended with EOS
    """

    problems: list[Problem]
    groups: list[list[Completion]]
    grades: list[Grade]
    rewards: torch.Tensor
    outcome: torch.Tensor
    finished: torch.Tensor

    @property
    def group_index(self) -> torch.Tensor:
        """[B] long: the group of each response (0..G-1)."""
        sizes = torch.tensor([len(group) for group in self.groups], dtype=torch.long)
        return torch.arange(len(self.groups)).repeat_interleave(sizes)

    @property
    def correct(self) -> torch.Tensor:
        return torch.tensor([float(grade.correct) for grade in self.grades])

    @property
    def uids(self) -> list[str]:
        """The problem uid of every response."""
        return [problem.uid for problem, group in zip(self.problems, self.groups) for _ in group]

    def select(self, group_ids: Sequence[int]) -> "GradedGroups":
        """The groups ``group_ids``, in that order."""
        index = self.group_index
        rows = [row for g in group_ids for row in (index == g).nonzero(as_tuple=True)[0].tolist()]
        take = torch.tensor(rows, dtype=torch.long)
        return GradedGroups(
            problems=[self.problems[g] for g in group_ids],
            groups=[self.groups[g] for g in group_ids],
            grades=[self.grades[row] for row in rows],
            rewards=self.rewards[take],
            outcome=self.outcome[take],
            finished=self.finished[take],
        )

    @staticmethod
    def concat(parts: Sequence["GradedGroups"]) -> "GradedGroups":
        return GradedGroups(
            problems=[p for part in parts for p in part.problems],
            groups=[g for part in parts for g in part.groups],
            grades=[g for part in parts for g in part.grades],
            rewards=torch.cat([part.rewards for part in parts]),
            outcome=torch.cat([part.outcome for part in parts]),
            finished=torch.cat([part.finished for part in parts]),
        )


def shaping_inputs(groups: Sequence[Sequence[Completion]], grades: Sequence[Grade], max_length: int, tokenizer: Any) -> dict[str, Any]:
    """What reward-shaping functions may read (rlbench/algorithm/shaping.py lists the inputs)."""
    flat = [c for group in groups for c in group]
    sizes = torch.tensor([len(group) for group in groups], dtype=torch.long)
    return {
        "response_lengths": torch.tensor([len(c.response_ids) for c in flat], dtype=torch.long),
        "finished": torch.tensor([c.finished for c in flat], dtype=torch.bool),
        "max_length": max_length,
        "correct": torch.tensor([bool(g.correct) for g in grades], dtype=torch.bool),
        "group_index": torch.arange(len(groups)).repeat_interleave(sizes),
        "response_texts": [c.text for c in flat],
        "first_tokens": [tokenizer.decode(c.response_ids[:1]) if c.response_ids else "" for c in flat],
    }


def generate_and_grade(
    engine: RolloutEngine,
    grader: Any,
    shape_rewards: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor],
    problems: Sequence[Problem],
    prompt_ids: Sequence[tuple[int, ...]],
    n: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    tokenizer: Any,
) -> GradedGroups:
    """Sample ``n`` responses per prompt, grade each against its problem (one batch call for graders
    that run programs in parallel) and apply the reward shaping (``shape_rewards(rewards, inputs)``,
    i.e. ``Algorithm.shape_rewards``, with :func:`shaping_inputs`)."""
    groups = engine.generate([GenerationRequest(prompt_ids=ids, n=n) for ids in prompt_ids], params, generator=generator)
    flat = [c for group in groups for c in group]
    grades = grade_completions(grader, [p for p, group in zip(problems, groups) for _ in group], flat)
    outcome = torch.tensor([g.reward for g in grades], dtype=torch.float32)
    inputs = shaping_inputs(groups, grades, params.max_new_tokens, tokenizer)
    rewards = shape_rewards(outcome, inputs).to(torch.float32)
    return GradedGroups(list(problems), groups, grades, rewards, outcome, inputs["finished"])


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


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2)."""

    enabled: bool = False
    max_rounds: int = 16
    metric: str = "correct"

    @classmethod
    def from_config(cls, algorithm_cfg: Any) -> "DynamicSampling":
        node = algorithm_cfg.get("dynamic_sampling") or {}
        unknown = set(node) - DYNAMIC_SAMPLING_KEYS
        if unknown:
            raise ConfigError(
                f"algorithm.dynamic_sampling has no key(s) {sorted(unknown)}; it takes {sorted(DYNAMIC_SAMPLING_KEYS)}"
            )
        options = cls(bool(node.get("enabled", False)), int(node.get("max_rounds", 16)), str(node.get("metric", "correct")))
        if options.max_rounds < 1:
            raise ConfigError(f"algorithm.dynamic_sampling.max_rounds must be >= 1, got {options.max_rounds}")
        if options.metric not in FILTER_METRICS:
            raise ConfigError(
                f"algorithm.dynamic_sampling.metric={options.metric!r} is unknown; choose one of {FILTER_METRICS}"
            )
        return options

    def filter_values(self, graded: GradedGroups) -> torch.Tensor:
        return graded.correct if self.metric == "correct" else graded.rewards


def sample_informative_groups(
    sample: Callable[[list[Problem]], GradedGroups],
    draw_prompts: Callable[[int], list[Problem]],
    first_prompts: list[Problem],
    options: DynamicSampling,
) -> tuple[GradedGroups, dict[str, float]]:
    """Dynamic sampling: generate rounds of ``len(first_prompts)`` prompts (the first round on
    ``first_prompts``, later ones on ``draw_prompts``) and keep the informative groups
    (:func:`informative_groups`) until there are ``len(first_prompts)`` of them, for at most
    ``options.max_rounds`` rounds. The batch is the first ``len(first_prompts)`` kept groups.

    If the rounds run out first, the batch is filled with the earliest dropped groups (logged; verl
    stops the run with an error instead). Metrics: rounds, groups dropped, groups used to fill, and
    the mean reward of every response generated (the batch's own reward_mean is biased by the selection).
    """
    target = len(first_prompts)
    kept: list[GradedGroups] = []
    dropped: list[GradedGroups] = []
    kept_count = dropped_count = rounds = 0
    sampled_rewards: list[torch.Tensor] = []
    prompts = first_prompts
    while rounds < options.max_rounds and kept_count < target:
        rounds += 1
        graded = sample(prompts)
        sampled_rewards.append(graded.rewards)
        informative = informative_groups(options.filter_values(graded), graded.group_index)
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
            "%d groups whose %s values are all equal (raise algorithm.dynamic_sampling.max_rounds)",
            kept_count, target, options.max_rounds, filled, options.metric,
        )
        batch = GradedGroups.concat([batch, GradedGroups.concat(dropped).select(list(range(filled)))])
    else:
        batch = batch.select(list(range(target)))
    metrics = {
        "dynamic_sampling_rounds": float(rounds),
        "dynamic_sampling_dropped_groups": float(dropped_count),
        "dynamic_sampling_filled_groups": float(filled),
        # the policy's reward on all responses generated this step, before the selection
        "rollout_reward_mean": float(torch.cat(sampled_rewards).mean().item()),
    }
    return batch, metrics


def sample_groups(
    ctx: Any, problems: list[Problem], next_prompts: Callable[[int], list[Problem]] | None
) -> tuple[GradedGroups, dict[str, float]]:
    """``ctx.n`` graded responses per prompt (``ctx``: the runner's StepContext); with DAPO's dynamic
    sampling, only groups whose responses differ, drawing more prompts from ``next_prompts`` until
    there are ``len(problems)`` groups. Returns the groups and the sampling metrics."""

    def sample(batch_problems: list[Problem]) -> GradedGroups:
        prompt_ids = encode_prompts(ctx.tokenizer, batch_problems, ctx.prompt_spec)
        return generate_and_grade(ctx.engine, ctx.grader, ctx.algorithm.shape_rewards, batch_problems, prompt_ids,
                                  ctx.n, ctx.params, ctx.rollout_generator, ctx.tokenizer)

    if not ctx.dynamic_sampling.enabled:
        return sample(problems), {}
    if next_prompts is None:
        raise ValueError("dynamic sampling draws more prompts: pass train_step(..., next_prompts=sampler.next)")
    return sample_informative_groups(sample, next_prompts, problems, ctx.dynamic_sampling)


def mask_truncated(batch: TrainBatch, finished: torch.Tensor) -> TrainBatch:
    """DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476, section 3.4): a response that
    hit the generation budget without EOS is masked out of the loss, m_it = 0 for all its tokens,
    so it adds neither to the policy loss, the KL and entropy terms nor to token_mean's token count.

    The advantages are computed before masking (the truncated response still counts in its group's
    statistics). Under the seq_mean_* aggregations a masked response still counts in N_seq.
    """
    keep = finished.to(batch.response_mask.device, batch.response_mask.dtype)[:, None]
    advantages = None if batch.advantages is None else batch.advantages * keep
    return replace(batch, response_mask=batch.response_mask * keep, advantages=advantages)
