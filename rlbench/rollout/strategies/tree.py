"""Tree rollouts: a prompt's group is sampled as a tree of fixed-length segments, so that a prefix
shared by several responses is generated once (``rollout=tree``, TreePO, Li et al. 2025,
arXiv:2508.17445, section 3.1; ``rollout=treerpo``, TreeRPO, Yang et al. 2025, arXiv:2506.05183,
section 3.1: the same sampler with an N-ary tree).

Configuration (``rollout.tree`` / ``rollout.treerpo``; conf/rollout/tree.yaml):

    segment_tokens: 4     # tokens per segment (TreePO: 512; TreeRPO: 384)
    root_branching: 2     # children of the prompt (TreePO draws 2..8 per prompt)
    branching: 2          # children of a node at each later segment boundary (TreePO: 2)

How a group of ``rollout.n`` leaves grows. Every node carries a leaf budget; the prompt's is
``n``. A node with budget B spawns c = min(branching, B) children at its segment boundary
(``root_branching`` at the prompt; all B when the next segment is its last), its budget split as
evenly as possible among them; a node with budget 1 will not branch again and is generated to its
end in one piece (a node is a maximal run of tokens without a branch). Each round sends one engine request
per growing node with ``prefix_ids`` = its tokens so far and ``n`` = its children, through
``GroupSampler.generate``: the prefix is prefilled once for the node's children and counted as
reused tokens, only the new segment as generated tokens. A path that samples EOS or reaches
``max_new_tokens`` is a leaf (early termination); a leaf that still held budget B > 1 hands B - 1
back (**fallback**): to randomly chosen growing nodes of its prompt, or, when none is left, to a
randomly chosen node that has branched (the prompt included), which grows new children. Every
prompt ends with exactly ``n`` leaves. ``n / root_branching`` must be a power of ``branching`` so
that the full tree's budgets split evenly (validated before the model loads).

Each leaf is an ordinary Completion (all its tokens sampled by the current policy, their sampling
log-probs recorded when sampled) with ``extras["tree_nodes"]``: the node of every token (a step
input, rlbench/algorithm/step_inputs.py), which the tree advantages read (rlbench/algorithm/advantages/tree.py). A tree strategy therefore needs an
advantage that reads ``tree_nodes`` (``algorithm/advantage=tree`` or ``treerpo``).

Simplifications against the papers (docs/rollout-trees.md): fixed divergence (no probability- or
quality-driven branching), no repetition-based early stop, no answer-based stop before EOS.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import Completion, GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    require_advantage_input,
    strategy_options,
)

TREE_INPUT = "tree_nodes"


@dataclass(frozen=True)
class TreeOptions:
    """The ``rollout.<strategy>`` block of a tree strategy."""

    segment_tokens: int = 4
    root_branching: int = 2
    branching: int = 2

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "TreeOptions":
        name = rollout.strategy
        options = strategy_options(rollout, name, cls)
        for key, low in (("segment_tokens", 1), ("root_branching", 1), ("branching", 2)):
            if getattr(options, key) < low:
                raise ConfigError(f"rollout.{name}.{key} must be >= {low}, got {getattr(options, key)}")
        n = rollout.n
        per_root, remainder = divmod(n, options.root_branching)
        if remainder or per_root != options.branching ** round(math.log(per_root, options.branching)):
            fits = sorted({options.root_branching * options.branching**k for k in range(0, 7)})
            raise ConfigError(
                f"rollout.n={n} leaves do not split evenly over rollout.{name}.root_branching={options.root_branching} "
                f"children of the prompt and rollout.{name}.branching={options.branching} children per later node: "
                f"n / root_branching must be a power of branching. Use rollout.n in {fits[:5]}, or "
                f"rollout.{name}.root_branching / .branching that divide rollout.n={n} that way "
                f"(e.g. root_branching={n} for one level of branching)"
            )
        return options


@dataclass(eq=False)
class _Node:
    """A run of tokens shared by every leaf below it; the prompt is a node without tokens."""

    id: int
    prompt: int  # index of the prompt in the step
    parent: "_Node | None"
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    children: int = 0
    ended: bool = False  # sampled EOS

    def path(self) -> list["_Node"]:
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def path_tokens(self) -> list[int]:
        return [t for node in self.path() for t in node.tokens]


def split_budget(budget: int, children: int) -> list[int]:
    """``budget`` leaves over ``children`` children, as evenly as possible (larger shares first)."""
    share, extra = divmod(budget, children)
    return [share + (1 if k < extra else 0) for k in range(children)]


@register_strategy("tree")
class TreeSampling(RolloutStrategy):
    """``rollout=tree`` (module docstring); ``rollout=treerpo`` is the same sampler (rlbench/rollout/strategies/treerpo.py)."""

    provides = frozenset({TREE_INPUT})

    def __init__(self, setup: RolloutSetup, options: TreeOptions):
        self.setup, self.options = setup, options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": TreeOptions.from_config(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """The options, and an advantage that reads the tree."""
        TreeOptions.from_config(rollout)
        require_advantage_input(
            advantage, TREE_INPUT,
            f"rollout={rollout.strategy} samples each group as a tree, and advantage '{{advantage}}' does not "
            "read the tree (it would treat shared prefixes as independent samples). Add algorithm/advantage=<one of "
            "{readers}> (tree: TreePO's subtree baselines; treerpo: TreeRPO's sibling groups), or use rollout=iid",
        )

    # ------------------------------------------------------------------ sampling

    def _choose(self, count: int) -> int:
        """A uniform index in [0, count) from the rollout's random stream."""
        generator = self.setup.generator
        return int(torch.randint(count, (1,), generator=generator).item()) if count > 1 else 0

    def _children(self, node: _Node, budget: int) -> int:
        """How many children ``node`` spawns for ``budget`` leaves at its next boundary."""
        if budget <= 1:
            return 1
        if self.setup.params.max_new_tokens - len(node.path_tokens()) <= self.options.segment_tokens:
            return budget  # the next segment is the last: every leaf branches off here
        return min(self.options.root_branching if node.parent is None else self.options.branching, budget)

    def grow(self, prompt_ids: list[tuple[int, ...]]) -> tuple[list[list[Completion]], dict[str, float]]:
        """The leaves of one tree per prompt, and the tree's counts."""
        params, n = self.setup.params, self.setup.n
        next_id = 0
        leaves: list[list[_Node]] = [[] for _ in prompt_ids]
        branched: list[list[_Node]] = []
        growing: list[tuple[_Node, int]] = []  # (node, budget of the children it spawns now)
        for p in range(len(prompt_ids)):
            root = _Node(next_id, p, None)
            next_id += 1
            branched.append([root])
            growing.append((root, n))
        rounds = fallbacks = 0
        while growing:
            rounds += 1
            plan = [(node, budget, self._children(node, budget)) for node, budget in growing]
            requests = [
                GenerationRequest(prompt_ids=prompt_ids[node.prompt], n=children, prefix_ids=tuple(node.path_tokens()), score_prefix=False)
                for node, _, children in plan
            ]
            # a path that will not branch again (budget 1) is generated to its end in one piece
            wanted = [
                params.max_new_tokens - len(r.prefix_ids) if budget == 1 else min(self.options.segment_tokens, params.max_new_tokens - len(r.prefix_ids))
                for r, (_, budget, _) in zip(requests, plan)
            ]
            results: dict[int, list[Completion]] = {}
            for length in sorted(set(wanted)):  # one engine call per length
                chosen = [k for k, want in enumerate(wanted) if want == length]
                out = self.setup.sampler.generate(
                    [requests[k] for k in chosen], dataclasses.replace(params, max_new_tokens=length), self.setup.generator
                )
                results.update(zip(chosen, out))
            growing = []
            returned = [0] * len(prompt_ids)
            for k, (node, budget, children) in enumerate(plan):
                start = len(requests[k].prefix_ids)
                extend = children == 1 and node.parent is not None and node.children == 0
                for completion, share in zip(results[k], split_budget(budget, children)):
                    segment, logprobs = completion.response_ids[start:], completion.logprobs[start:]
                    if extend:  # a path without a branch: the same node grows
                        child = node
                        child.tokens += segment
                        child.logprobs += logprobs
                    else:
                        child = _Node(next_id, node.prompt, node, list(segment), list(logprobs))
                        next_id += 1
                        node.children += 1
                        if node.children == 2 and node.parent is not None:
                            branched[node.prompt].append(node)
                    child.ended = completion.finished  # sampled EOS
                    if child.ended or len(child.path_tokens()) >= params.max_new_tokens:
                        leaves[node.prompt].append(child)
                        returned[node.prompt] += share - 1
                    else:
                        growing.append((child, share))
            for p, surplus in enumerate(returned):
                if surplus <= 0:
                    continue
                fallbacks += surplus
                mine = [k for k, (node, _) in enumerate(growing) if node.prompt == p]
                if mine:
                    for _ in range(surplus):
                        k = mine[self._choose(len(mine))]
                        growing[k] = (growing[k][0], growing[k][1] + 1)
                else:
                    candidates = [node for node in branched[p] if len(node.path_tokens()) < params.max_new_tokens]
                    growing.append((candidates[self._choose(len(candidates))], surplus))
        groups = [[self._completion(p, prompt_ids[p], leaf) for leaf in leaves[p]] for p in range(len(prompt_ids))]
        return groups, {"tree_rounds": float(rounds), "tree_fallback_leaves": float(fallbacks), "tree_node_count": float(next_id - len(prompt_ids))}

    def _completion(self, index: int, prompt_ids: tuple[int, ...], leaf: _Node) -> Completion:
        path = leaf.path()
        tokens = [t for node in path for t in node.tokens]
        return Completion(
            request_index=index,
            prompt_ids=tuple(prompt_ids),
            response_ids=tokens,
            logprobs=[lp for node in path for lp in node.logprobs],
            finished=leaf.ended,
            text=self.setup.sampler.tokenizer.decode(tokens, skip_special_tokens=True),
            extras={TREE_INPUT: [node.id for node in path for _ in node.tokens]},
        )

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        sampler = self.setup.sampler
        prompt_ids = sampler.encode(problems)
        groups, metrics = self.grow(prompt_ids)
        return sampler.grade(problems, groups, self.setup.params.max_new_tokens), metrics
