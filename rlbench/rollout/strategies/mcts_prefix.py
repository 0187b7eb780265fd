"""Staged GRPO on tree-search prefixes (``rollout=mcts_prefix``; Huang, Nguyen & Zimmer 2025,
"Tree-OPO: Off-policy Monte Carlo Tree-Guided Advantage Optimization for Multistep Reasoning",
arXiv:2509.09284, sections 3-4): a search tree over partial solutions is grown for each prompt, the
best solution it finds is revealed up to a stage depth, and the prompt's GRPO group is ``rollout.n``
completions of ``prompt + revealed prefix``. Stages move from deep prefixes (easy: most of a good
solution is given) to shallow ones (the prompt alone), the paper's reverse curriculum.

Configuration (``rollout.mcts_prefix``; conf/rollout/mcts_prefix.yaml):

    search:               # the search tree: rlbench/rollout/strategies/tree.py's segment tree with rollout.n leaves
      segment_tokens: 4   # tokens per segment (a partial solution grows one segment per level)
      root_branching: 2
      branching: 2
    stage_depths: [2, 1, 0]  # segments of the best solution revealed, one entry per stage (0: the prompt alone)
    steps_per_stage: 10      # training steps per stage; the last stage lasts to the end of the run

One step at stage depth d > 0: the search tree (rlbench.rollout.strategies.tree.TreeSampling.grow, its engine
calls through the run's GroupSampler, so shared prefixes count as reused tokens) gives ``rollout.n``
leaves per prompt, graded and reward-shaped; the best leaf (highest reward, the first among ties)
is the search's solution; its first d * segment_tokens tokens (at most the whole segments before its
last token) are the prefix. Then one request per prompt: ``rollout.n`` completions of the prefix, each response (prefix
included) at most ``rollout.max_new_tokens`` long (rlbench.rollout.continuation).
The prefix is context (``loss_mask`` 0, behaviour "prefix"): only the completions are trained, and a
group compares completions of one state, so any group advantage (grpo, ...) applies. The search's
leaves are not trained. At depth 0 the step is ``rollout=iid`` (no search is grown). The metric
``rollout_outcome_mean`` is the mean outcome of the responses sampled from the prompt alone (the
search's leaves; at depth 0 the groups), which a revealed prefix does not inflate.

Simplifications against the paper (docs/rollout-trees.md): the tree is grown online by the current policy
(the paper reveals prefixes of a teacher's offline MCTS), in one expansion pass with leaf rewards as
the evaluation (no UCT selection rounds), one prefix per prompt and step (the paper pools groups of
several stages with its staged advantage estimation, SAE).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.continuation import continue_with_budgets
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.guided_prefix import prefixed_response
from rlbench.rollout.strategies.tree import TreeOptions, TreeSampling
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    needs_groups,
    register_strategy,
    strategy_options,
)

SEARCH = "mcts_prefix.search"


@dataclasses.dataclass(frozen=True)
class MCTSPrefixOptions:
    """The ``rollout.mcts_prefix`` block."""

    search: dict = dataclasses.field(default_factory=dict)  # the offline search tree: a tree block (TreeOptions)
    stage_depths: tuple[int, ...] = (2, 1, 0)  # segments of the best solution revealed per stage (0: the prompt alone)
    steps_per_stage: int = 10  # training steps per stage; the last stage runs to the end


def revealed_length(leaf_length: int, depth: int, segment_tokens: int) -> int:
    """Tokens of a leaf of ``leaf_length`` tokens revealed at stage ``depth``: ``depth`` segments, at
    most the whole segments before the leaf's last token (a prefix always leaves a token to sample)."""
    whole = (max(leaf_length - 1, 0) // segment_tokens) * segment_tokens
    return min(depth * segment_tokens, whole)


@register_strategy("mcts_prefix")
class MCTSPrefix(RolloutStrategy):
    """``rollout=mcts_prefix`` (module docstring). State across steps: the step count (the stage)."""

    def __init__(self, setup: RolloutSetup, search: TreeOptions, stage_depths: list[int], steps_per_stage: int):
        self.setup, self.search = setup, search
        self.stage_depths, self.steps_per_stage = stage_depths, steps_per_stage
        self.step = 0

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        options = strategy_options(rollout, "mcts_prefix", MCTSPrefixOptions)
        needs_groups("mcts_prefix", rollout, "trains GRPO groups of completions of one prefix")
        search = TreeOptions.from_config(dataclasses.replace(rollout, strategy=SEARCH, settings={SEARCH: dict(options.search)}))
        depths, steps = list(options.stage_depths), options.steps_per_stage
        if not depths or min(depths) < 0:
            raise ConfigError(f"rollout.mcts_prefix.stage_depths must be a non-empty list of depths >= 0, got {depths}")
        if steps < 1:
            raise ConfigError(f"rollout.mcts_prefix.steps_per_stage must be >= 1, got {steps}")
        max_new = int(rollout.max_new_tokens)
        if max(depths) * search.segment_tokens >= max_new:
            raise ConfigError(
                f"rollout.mcts_prefix.stage_depths={depths} reveal up to {max(depths)} segments of "
                f"{search.segment_tokens} tokens, which leaves nothing to generate within rollout.max_new_tokens={max_new}. "
                f"Use depths below {-(-max_new // search.segment_tokens)} or a smaller search.segment_tokens"
            )
        return {"search": search, "stage_depths": depths, "steps_per_stage": steps}

    @property
    def depth(self) -> int:
        """The stage depth of the coming step."""
        return self.stage_depths[min(self.step // self.steps_per_stage, len(self.stage_depths) - 1)]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        depth = self.depth
        self.step += 1
        prompt_ids = sampler.encode(problems)
        metrics = {"mcts_prefix_depth": float(depth)}
        prefixes: list[tuple[int, ...]] = [()] * len(problems)
        if depth > 0:
            leaves, tree_metrics = TreeSampling(setup, self.search).grow(prompt_ids)
            searched = sampler.grade(problems, leaves, setup.params.max_new_tokens)
            for p, group in enumerate(leaves):
                rewards = searched.rewards[searched.group_index == p].tolist()
                best = group[rewards.index(max(rewards))]
                prefixes[p] = tuple(best.response_ids[: revealed_length(len(best.response_ids), depth, self.search.segment_tokens)])
            metrics.update(tree_metrics)
            # the policy's own responses to the prompt alone: what the learning is judged on
            metrics["rollout_outcome_mean"] = float(searched.outcome.mean().item())
        max_new = setup.params.max_new_tokens
        requests = [(GenerationRequest(ids, n=setup.n, prefix_ids=prefix), max_new - len(prefix)) for ids, prefix in zip(prompt_ids, prefixes)]
        groups = [
            [prefixed_response(c, len(prefix)) for c in group] if prefix else list(group)
            for group, prefix in zip(continue_with_budgets(sampler, requests, setup.params, setup.generator), prefixes)
        ]
        graded = sampler.grade(problems, groups, max_new)
        if depth == 0:
            metrics["rollout_outcome_mean"] = float(graded.outcome.mean().item())
        metrics["mcts_prefix_tokens_mean"] = float(sum(len(p) for p in prefixes) / max(len(prefixes), 1))
        return graded, metrics
