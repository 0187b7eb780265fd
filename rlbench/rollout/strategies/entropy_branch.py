"""AEPO's entropy-balanced rollout (``rollout=entropy_branch``; Dong et al. 2025, "Agentic
Entropy-Balanced Policy Optimization", arXiv:2510.14545, the rollout half; the loss half is
``algorithm=aepo``): a group's budget of n responses is split between global samples (from the prompt)
and branches (continuations of a global sample's prefix), by entropy pre-monitoring, and branching is
penalised when it happens at consecutive steps.

AEPO branches at tool calls; single-turn responses have none, so here a *step* is a segment of
``segment_tokens`` tokens and the branch points are the segment boundaries. The step entropy is the
mean normalised token entropy (entropy / log |V|, under the sampling distribution) over the segment
(the engine's ``position_stats``).

Per prompt:

1. **Pre-monitoring.** One global sample is drawn and scored; with H_root its first segment's entropy
   and H_step the mean over its later segments, the number of global samples is

       m = clip(floor(n * sigmoid(beta * (H_root - H_step))) + 1, 1, n)

   (:func:`global_samples`); m - 1 more global samples are drawn.
2. **Entropy-balanced branching.** The boundaries j = 1, 2, ... (token j * segment_tokens) are visited
   in order, over the global samples that reach them. A sample branches at boundary j when

       (u + entropy_weight * (H_j - H_0)) * max(0, 1 - penalty * l)  >=  branch_threshold

   (u ~ U(0, 1) from the rollout stream, H_j the sample's entropy over segment j, H_0 over its first
   segment, l the number of consecutive boundaries at which this prompt branched just before;
   :func:`branch_probability`). A branch continues ``sample[:j * segment_tokens]`` (the request's
   ``prefix_ids``) to the budget. Branching stops when the group holds n responses; a group still
   short is filled with global samples.

Each branch is a fresh continuation by the policy of a prefix the policy sampled, so every response
is marginally a sample of the policy (the group is not i.i.d.: its branches share prefixes). They are
trained as such (``off_policy`` 0) and labelled ``behaviour="branch"``.

The rule's constants (beta 0.5, the floor + 1, the penalty 0.05 per consecutive branch, the
threshold 0.5) follow a public implementation of the AEPO rollout; the paper's own values are not
verified here (docs/rollout-trees.md). No state between steps.

Engines: both; the statistics are the engine's ``position_stats`` (rlbench/rollout/engines/base.py), which the vLLM
engine computes on the HF policy model it keeps in step.

Configuration (conf/rollout/entropy_branch.yaml):

    strategy: entropy_branch
    entropy_branch:
      segment_tokens: 4        # a step: branch points every 4 tokens (< rollout.max_new_tokens)
      beta: 0.5                # pre-monitoring sensitivity
      entropy_weight: 1.0      # weight of the step's entropy rise in the branch probability
      branch_threshold: 0.5    # branch when the penalised probability reaches this
      penalty: 0.05            # per consecutive branching boundary
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.continuation import continue_with_budgets
from rlbench.rollout.engines.base import Completion, GenerationRequest, PositionStats
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    needs_groups,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class EntropyBranchOptions:
    """The ``rollout.entropy_branch`` block."""

    segment_tokens: int = 4
    beta: float = 0.5
    entropy_weight: float = 1.0
    branch_threshold: float = 0.5
    penalty: float = 0.05

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "EntropyBranchOptions":
        options = strategy_options(rollout, "entropy_branch", cls)
        if options.segment_tokens < 1:
            raise ConfigError(f"rollout.entropy_branch.segment_tokens must be >= 1, got {options.segment_tokens}")
        if options.penalty < 0 or not all(math.isfinite(v) for v in (options.beta, options.entropy_weight, options.branch_threshold)):
            raise ConfigError("rollout.entropy_branch: penalty must be >= 0 and beta, entropy_weight, branch_threshold finite numbers")
        return options


def segment_entropies(stats: PositionStats, segment_tokens: int) -> list[float]:
    """The mean normalised entropy (entropy / log |V|) of each segment of ``segment_tokens`` tokens."""
    normalised = stats.entropy / math.log(stats.vocab_size)
    return [float(normalised[s : s + segment_tokens].mean()) for s in range(0, len(normalised), segment_tokens)]


def global_samples(n: int, root_entropy: float, step_entropy: float, beta: float) -> int:
    """m = clip(floor(n * sigmoid(beta * (H_root - H_step))) + 1, 1, n): the global samples of a group of n."""
    sigmoid = 1.0 / (1.0 + math.exp(-beta * (root_entropy - step_entropy)))
    return max(1, min(n, int(n * sigmoid) + 1))


def branch_probability(uniform: float, entropy_rise: float, consecutive: int, options: EntropyBranchOptions) -> float:
    """(u + entropy_weight * (H_j - H_0)) * max(0, 1 - penalty * l), clipped to [0, 1]."""
    value = (uniform + options.entropy_weight * entropy_rise) * max(0.0, 1.0 - options.penalty * consecutive)
    return min(1.0, max(0.0, value))


@register_strategy("entropy_branch")
class EntropyBranchRollout(RolloutStrategy):
    """AEPO's entropy-balanced rollout (arXiv:2510.14545): global samples vs branches by entropy
    pre-monitoring, branching at segment boundaries with a consecutive-branch penalty."""

    def __init__(self, setup: RolloutSetup, options: EntropyBranchOptions):
        self.setup, self.options = setup, options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": EntropyBranchOptions.from_config(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        options = EntropyBranchOptions.from_config(rollout)
        needs_groups("entropy_branch", rollout, "splits a group between global samples and branches")
        budget = int(rollout.max_new_tokens)
        if options.segment_tokens >= budget:
            raise ConfigError(
                f"rollout.entropy_branch.segment_tokens={options.segment_tokens} is not shorter than rollout.max_new_tokens="
                f"{budget}: a response would have no branch point; lower segment_tokens below {budget}"
            )

    def _entropies(self, prompts: list[tuple[int, ...]], samples: list[tuple[int, Completion]]) -> list[list[float]]:
        params = self.setup.params
        stats = self.setup.sampler.engine.position_stats([(prompts[i], tuple(c.response_ids)) for i, c in samples], params)
        return [segment_entropies(s, self.options.segment_tokens) for s in stats]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler, options = self.setup, self.setup.sampler, self.options
        params, n, budget, size = setup.params, setup.n, setup.params.max_new_tokens, options.segment_tokens
        prompts = sampler.encode(problems)
        # 1. pre-monitoring: one global sample per prompt decides how many global samples the group gets
        first = [g[0] for g in sampler.generate([GenerationRequest(ids, n=1) for ids in prompts], params, setup.generator)]
        monitored = self._entropies(prompts, list(enumerate(first)))
        counts = [
            global_samples(n, h[0], sum(h[1:]) / len(h[1:]) if len(h) > 1 else h[0], options.beta) for h in monitored
        ]
        more = sampler.generate([GenerationRequest(ids, n=m - 1) for ids, m in zip(prompts, counts)], params, setup.generator)
        groups: list[list[Completion]] = [[c, *rest] for c, rest in zip(first, more)]
        # 2. branching at segment boundaries, in order, over each prompt's global samples
        entropies = dict(zip([(i, 0) for i in range(len(problems))], monitored))
        others = [(i, k) for i, g in enumerate(groups) for k in range(1, len(g))]
        entropies.update(zip(others, self._entropies(prompts, [(i, groups[i][k]) for i, k in others])))
        requests: list[tuple[GenerationRequest, int]] = []
        places: list[int] = []
        branches = 0
        for i, group in enumerate(groups):
            wanted, consecutive = n - len(group), 0
            boundaries = max((len(c.response_ids) - 1) // size for c in group)
            for j in range(1, boundaries + 1):
                branched = False
                for k, sample in enumerate(list(group)):
                    h = entropies[(i, k)]
                    if wanted == 0 or j >= len(h):  # the sample ends before boundary j
                        continue
                    u = float(torch.rand((), generator=setup.generator, dtype=torch.float64))
                    if branch_probability(u, h[j] - h[0], consecutive, options) >= options.branch_threshold:
                        prefix = tuple(sample.response_ids[: j * size])
                        requests.append((GenerationRequest(prompts[i], 1, prefix), budget - len(prefix)))
                        places.append(i)
                        wanted -= 1
                        branched = True
                consecutive = consecutive + 1 if branched else 0
            branches += n - len(group) - wanted
            if wanted:  # too few branches: more global samples
                requests.append((GenerationRequest(prompts[i], wanted), budget))
                places.append(i)
        filled = sum(r.n for r, _ in requests if not r.prefix_ids)
        for i, completions in zip(places, continue_with_budgets(sampler, requests, params, setup.generator)):
            for c in completions:
                c.request_index = i
                if c.prefix_len:
                    c.behaviour = "branch"
            groups[i].extend(completions)
        metrics = {
            "entropy_branch_global": float(sum(counts)),
            "entropy_branch_branches": float(branches),
            "entropy_branch_filled": float(filled),
        }
        return sampler.grade(problems, groups, budget), metrics
