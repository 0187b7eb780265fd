"""Tree rollouts (``rollout=tree``: TreePO's segment tree with its divergence schedule, early stops and
fallback, Li et al. 2025, arXiv:2508.17445, section 3.1; ``rollout=treerpo``: TreeRPO's leaf-budget tree,
Yang et al. 2025, arXiv:2506.05183, section 3.1): a prompt's group is sampled as a tree of fixed-length
segments, so that a prefix shared by several responses is generated once.

``rollout=tree`` is :class:`TreePOSampling`; ``rollout=treerpo`` and the search tree of
``rollout=mcts_prefix`` grow the leaf-budget tree of :class:`TreeSampling`, described here.

Configuration of the leaf-budget tree (``rollout.treerpo``; conf/rollout/treerpo.yaml):

    segment_tokens: 4     # tokens per segment (TreeRPO: 384)
    root_branching: 2     # children of the prompt
    branching: 2          # children of a node at each later segment boundary

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

Each leaf of either tree is an ordinary Completion (all its tokens sampled by the current policy, their
sampling log-probs recorded when sampled) with ``extras["tree_nodes"]``: the node of every token (a step
input, rlbench/algorithm/step_inputs.py), which the tree advantages read (rlbench/algorithm/advantages/tree.py).
A tree strategy therefore needs an advantage that reads ``tree_nodes`` (``algorithm/advantage=tree`` or
``treerpo``). What is simplified against the papers: docs/rollout-trees.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.dataset.jsonl import extract_last_boxed
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
    def from_config(cls, rollout: RolloutConfig) -> TreeOptions:
        """The block, its bounds and :meth:`check` verified (a ConfigError before anything loads)."""
        name = rollout.strategy
        options = strategy_options(rollout, name, cls)
        for key, low in (("segment_tokens", 1), ("root_branching", 1), ("branching", 2)):
            if getattr(options, key) < low:
                raise ConfigError(f"rollout.{name}.{key} must be >= {low}, got {getattr(options, key)}")
        options.check(rollout.n, name)
        return options

    def check(self, n: int, name: str) -> None:
        """The leaf budgets split evenly: ``n / root_branching`` a power of ``branching``."""
        per_root, remainder = divmod(n, self.root_branching)
        if remainder or per_root != self.branching ** round(math.log(per_root, self.branching)):
            fits = sorted({self.root_branching * self.branching**k for k in range(7)})
            raise ConfigError(
                f"rollout.n={n} leaves do not split evenly over rollout.{name}.root_branching={self.root_branching} "
                f"children of the prompt and rollout.{name}.branching={self.branching} children per later node: "
                f"n / root_branching must be a power of branching. Use rollout.n in {fits[:5]}, or "
                f"rollout.{name}.root_branching / .branching that divide rollout.n={n} that way "
                f"(e.g. root_branching={n} for one level of branching)"
            )


@dataclass(eq=False)
class _Node:
    """A run of tokens shared by every leaf below it; the prompt is a node without tokens."""

    id: int
    prompt: int  # index of the prompt in the step
    parent: _Node | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    children: int = 0
    ended: bool = False  # sampled EOS

    def path(self) -> list[_Node]:
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


class TreeSampling(RolloutStrategy):
    """The leaf-budget tree (module docstring): ``rollout=treerpo`` (rlbench/rollout/strategies/treerpo.py)
    and the search tree of ``rollout=mcts_prefix``; ``rollout=tree`` grows by TreePO's schedule
    (:class:`TreePOSampling`)."""

    provides = frozenset({TREE_INPUT})
    options_class: type[TreeOptions] = TreeOptions

    def __init__(self, setup: RolloutSetup, options: TreeOptions):
        self.setup, self.options = setup, options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": cls.options_class.from_config(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """The options, and an advantage that reads the tree."""
        cls.options_class.from_config(rollout)
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

    def _generate(self, requests: list[GenerationRequest], wanted: list[int]) -> list[list[Completion]]:
        """Each request's completions of at most ``wanted[k]`` new tokens: one engine call per length."""
        results: dict[int, list[Completion]] = {}
        for length in sorted(set(wanted)):
            chosen = [k for k, want in enumerate(wanted) if want == length]
            out = self.setup.sampler.generate(
                [requests[k] for k in chosen], dataclasses.replace(self.setup.params, max_new_tokens=length), self.setup.generator
            )
            results.update(zip(chosen, out))
        return [results[k] for k in range(len(requests))]

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
            results = self._generate(requests, wanted)
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


# ---------------------------------------------------------------------------------------------- TreePO

STOP_REASONS = ("eos", "boxed", "length", "repetition")


@dataclass(frozen=True)
class TreePOOptions(TreeOptions):
    """``rollout.tree``: TreePO's segment tree (conf/rollout/tree.yaml; the class docstring of
    :class:`TreePOSampling` says what each key does)."""

    root_branching_max: int = 0  # > root_branching: the prompt's children drawn in [root_branching, root_branching_max]
    divergence: str = "fixed"  # a key of DIVERGENCES
    divergence_temperature: float = 1.0
    stop_at_boxed: bool = False  # a complete \boxed{...} ends a path as EOS does
    repetition_window: int = 32  # characters; 0 turns the repetition stop off
    repetition_count: int = 8

    def check(self, n: int, name: str) -> None:
        """The budget is capped at ``n`` leaves, so any ``n`` works; the settings' own ranges."""
        if self.root_branching > n:
            raise ConfigError(
                f"rollout.{name}.root_branching={self.root_branching} exceeds rollout.n={n}: the prompt cannot have "
                "more children than the group has leaves"
            )
        if self.root_branching_max and self.root_branching_max < self.root_branching:
            raise ConfigError(
                f"rollout.{name}.root_branching_max={self.root_branching_max} is below root_branching={self.root_branching}: "
                "set it to 0 (a fixed root divergence) or to the upper end of the drawn range"
            )
        if self.divergence not in DIVERGENCES:
            raise ConfigError(f"rollout.{name}.divergence must be one of {list(DIVERGENCES)}, got {self.divergence!r}")
        if not self.divergence_temperature > 0:
            raise ConfigError(f"rollout.{name}.divergence_temperature must be > 0, got {self.divergence_temperature}")
        if self.repetition_window < 0 or self.repetition_count < 2:
            raise ConfigError(
                f"rollout.{name}.repetition_window must be >= 0 (0: off) and repetition_count >= 2, "
                f"got {self.repetition_window} and {self.repetition_count}"
            )


def has_repetition(text: str, window: int, count: int) -> bool:
    """Whether some run of ``window`` characters occurs ``count`` times (overlaps included) in ``text``:
    TreePO's repetition early stop (arXiv:2508.17445; the authors' rollout checks each new segment's text
    with a 32-character window and 8 occurrences). ``window`` 0 never stops."""
    if window <= 0 or len(text) < window:
        return False
    seen: dict[str, int] = {}
    for start in range(len(text) - window + 1):
        piece = text[start : start + window]
        seen[piece] = seen.get(piece, 0) + 1
        if seen[piece] >= count:
            return True
    return False


def allocate_divergence(weights: list[float], total: int) -> list[int]:
    """``total`` children over paths with ``weights``: one each, the rest in proportion by largest
    remainders, c_i = 1 + floor(r_i) (+1 for the ``total − Σ`` largest fractional parts of r_i), with
    r_i = w_i / Σw · (total − N) (ties to the earlier path). Needs ``total >= len(weights)``. TreePO's
    allocation (arXiv:2508.17445; the authors' ``weight_to_discrete_allocate``)."""
    rest = total - len(weights)
    norm = sum(weights)
    raw = [w / norm * rest for w in weights]
    counts = [1 + math.floor(x) for x in raw]
    left = total - sum(counts)
    by_remainder = sorted(range(len(raw)), key=lambda k: (-(raw[k] - math.floor(raw[k])), k))
    for k in by_remainder[:left]:
        counts[k] += 1
    return counts


def divergence_budget(remaining: int, paths: int, ended_now: int, branching: int) -> int:
    """The children a prompt's ``paths`` active paths spawn in all at this boundary: TreePO's budget
    (arXiv:2508.17445 section 3.1; the authors' rollout with ``divergence_budget_control=by_fixed_div``),

        B = max(N, min(R, w · (E + N)))

    with N = ``paths``, R = ``remaining`` (n minus the prompt's leaves so far), E = ``ended_now`` (its paths
    that ended in the last round: their branching passes to the survivors) and w = ``branching``. The
    floor N gives every path at least one child."""
    return max(paths, min(remaining, branching * (ended_now + paths)))


def _softmax_allocation(scores: list[float], sign: float, temperature: float, total: int) -> list[int]:
    """:func:`allocate_divergence` of ``total`` with weights softmax(sign · (s_i − min s) / T)."""
    low = min(scores)
    shifted = torch.tensor([sign * (s - low) / temperature for s in scores], dtype=torch.float64)
    return allocate_divergence(torch.softmax(shifted, 0).tolist(), total)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# Each divergence rule: (per-path token log-probs, total children, temperature, segment_tokens) -> children per
# path, summing to ``total`` (>= the number of paths). The names are rollout.tree.divergence's values.


def split_evenly(path_logprobs: list[list[float]], total: int, temperature: float, segment_tokens: int) -> list[int]:
    """``fixed``: c_i = floor(B / N), the last path also takes B mod N (the authors' ``fixed_avg``,
    the paper's run)."""
    paths = len(path_logprobs)
    counts = [total // paths] * paths
    counts[-1] += total % paths
    return counts


def low_probability(path_logprobs: list[list[float]], total: int, temperature: float, segment_tokens: int) -> list[int]:
    """``low_probability``: weights softmax(−(S_i − min S) / T), S_i the path's summed log-prob: the less
    likely paths branch more (the authors' ``logprob_weighted_div``)."""
    return _softmax_allocation([sum(lps) for lps in path_logprobs], -1.0, temperature, total)


def high_probability(path_logprobs: list[list[float]], total: int, temperature: float, segment_tokens: int) -> list[int]:
    """``high_probability``: weights softmax(+(S_i − min S) / T), S_i the path's summed log-prob: the more
    likely paths branch more (the authors' ``inverse_logprob_weighted_div``)."""
    return _softmax_allocation([sum(lps) for lps in path_logprobs], 1.0, temperature, total)


def low_probability_per_token(path_logprobs: list[list[float]], total: int, temperature: float, segment_tokens: int) -> list[int]:
    """``low_probability_per_token``: weights softmax(−(M_i − min M) / T), M_i the mean log-prob of the path's
    tokens (the authors' ``norm_logprob_weighted_div``)."""
    return _softmax_allocation([_mean(lps) for lps in path_logprobs], -1.0, temperature, total)


def high_probability_per_token(path_logprobs: list[list[float]], total: int, temperature: float, segment_tokens: int) -> list[int]:
    """``high_probability_per_token``: weights softmax(+(M_i − min M) / T), M_i the mean log-prob of the path's
    tokens (the authors' ``norm_inv_logprob_weighted_div``)."""
    return _softmax_allocation([_mean(lps) for lps in path_logprobs], 1.0, temperature, total)


def low_last_segment_probability(path_logprobs: list[list[float]], total: int, temperature: float, segment_tokens: int) -> list[int]:
    """``low_last_segment_probability``: weights softmax(−(L_i − min L) / T), L_i the mean log-prob of the
    path's last ``segment_tokens`` tokens (its newest segment; the authors' ``node_logprob_weighted_div``)."""
    return _softmax_allocation([_mean(lps[-segment_tokens:]) for lps in path_logprobs], -1.0, temperature, total)


def high_last_segment_probability(path_logprobs: list[list[float]], total: int, temperature: float, segment_tokens: int) -> list[int]:
    """``high_last_segment_probability``: weights softmax(+(L_i − min L) / T), L_i the mean log-prob of the
    path's last ``segment_tokens`` tokens (the authors' ``inverse_node_logprob_weighted_div``)."""
    return _softmax_allocation([_mean(lps[-segment_tokens:]) for lps in path_logprobs], 1.0, temperature, total)


DIVERGENCES: dict[str, Callable[[list[list[float]], int, float, int], list[int]]] = {
    "fixed": split_evenly,
    "low_probability": low_probability,
    "high_probability": high_probability,
    "low_probability_per_token": low_probability_per_token,
    "high_probability_per_token": high_probability_per_token,
    "low_last_segment_probability": low_last_segment_probability,
    "high_last_segment_probability": high_last_segment_probability,
}


def divergence_counts(
    options: TreePOOptions, path_logprobs: list[list[float]], remaining: int, ended_now: int
) -> list[int]:
    """How many children each of a prompt's active paths spawns at this segment boundary (TreePO's
    schedule, arXiv:2508.17445 section 3.1): :func:`divergence_budget`'s total, shared out by the rule
    ``options.divergence`` names (:data:`DIVERGENCES`). ``path_logprobs``: each path's sampling log-probs."""
    total = divergence_budget(remaining, len(path_logprobs), ended_now, options.branching)
    rule = DIVERGENCES[options.divergence]
    return rule(path_logprobs, total, options.divergence_temperature, options.segment_tokens)


@dataclass(eq=False)
class _Leaf:
    node: _Node
    reason: str  # one of STOP_REASONS


@register_strategy("tree")
class TreePOSampling(TreeSampling):
    """``rollout=tree``: TreePO's segment-tree sampling (Li et al. 2025, arXiv:2508.17445, section 3.1;
    re-implemented from the paper and the authors' released rollout, multimodal-art-projection/TreePO,
    ``generate_sequences_tree_deepth_first_vanilla_mode``).

    Every round each active path generates one segment of ``segment_tokens`` tokens; a path that
    spawns c > 1 children at its boundary sends one request with ``n`` = c (its path prefilled once).

    - **Root divergence**: the prompt spawns ``root_branching`` paths, or a number drawn uniformly in
      [``root_branching``, ``root_branching_max``] per prompt when ``root_branching_max`` is larger (capped
      at ``n``).
    - **Divergence schedule** (:func:`divergence_counts`): the prompt's surviving paths spawn
      :func:`divergence_budget` children in all, shared out by the rule ``divergence`` names: an even split
      (``fixed``) or one of the released log-prob weightings (:data:`DIVERGENCES`).
    - **Early stop**: a path ends (a leaf) when it samples EOS, when ``stop_at_boxed`` and its response holds a
      complete ``\\boxed{...}``, at ``max_new_tokens``, or when its new segment repeats itself
      (:func:`has_repetition`: ``repetition_window`` characters seen ``repetition_count`` times).
    - **Fallback**: when a prompt has no active path and fewer than ``n`` leaves, its leaves that ended
      on EOS or a boxed answer (in random order; none: the prompt itself) are cut back to a random segment
      boundary (keeping 0 to all but the last of their segments, uniformly) and each restarts ``branching``
      new paths from there until the missing leaves are covered. Every prompt ends with exactly ``n`` leaves.

    Metrics: ``tree_rounds``, ``tree_node_count``, ``tree_fallback_leaves`` (paths started by a fallback)
    and ``tree_stop_<reason>`` (leaves per stop reason).
    """

    options_class = TreePOOptions

    def _root_children(self) -> int:
        """``root_branching``, or a uniform draw up to ``root_branching_max`` capped at ``n`` (as the authors'
        rollout caps it at the group size)."""
        low, high = self.options.root_branching, min(self.options.root_branching_max, self.setup.n)
        return low + self._choose(high - low + 1) if high > low else low

    def _stop_reason(self, node: _Node, segment: list[int]) -> str | None:
        """Why the path ending at ``node`` stops after its new ``segment`` (None: it goes on)."""
        tokenizer = self.setup.sampler.tokenizer
        if self.options.stop_at_boxed:
            text = tokenizer.decode(node.path_tokens(), skip_special_tokens=True)
            if extract_last_boxed(text) is not None:
                return "boxed"
        if node.ended:
            return "eos"
        if len(node.path_tokens()) >= self.setup.params.max_new_tokens:
            return "length"
        text = tokenizer.decode(segment, skip_special_tokens=True)
        if has_repetition(text, self.options.repetition_window, self.options.repetition_count):
            return "repetition"
        return None

    def _cut(self, leaf: _Node, cut: int, next_id: int) -> tuple[_Node, int]:
        """The node whose path ends ``cut`` tokens into ``leaf``'s response (a node split in two there when
        the cut falls inside it), and the next free node id."""
        start = 0
        for node in leaf.path()[1:]:
            if cut == start:
                return node.parent, next_id  # type: ignore[return-value]
            if cut < start + len(node.tokens):
                k = cut - start
                head = _Node(next_id, node.prompt, node.parent, node.tokens[:k], node.logprobs[:k], children=1)
                node.parent, node.tokens, node.logprobs = head, node.tokens[k:], node.logprobs[k:]
                return head, next_id + 1
            start += len(node.tokens)
        raise ValueError(f"cut {cut} is not inside a response of {start} tokens")

    def _fall_back(self, leaves: list[_Leaf], root: _Node, missing: int, next_id: int) -> tuple[list[tuple[_Node, int]], int]:
        """New (node, children) starts for a prompt without active paths that misses ``missing`` leaves."""
        segment = self.options.segment_tokens
        complete = [leaf.node for leaf in leaves if leaf.reason in ("eos", "boxed")]
        order = torch.randperm(len(complete), generator=self.setup.generator).tolist() if complete else []
        sources = [complete[k] for k in order] or [None]
        starts: list[tuple[_Node, int]] = []
        for source in sources:
            if missing <= 0:
                break
            node = root
            length = len(source.path_tokens()) if source is not None else 0
            if length > 0:
                blocks = -(-length // segment)
                keep = blocks - 1 - self._choose(blocks)  # whole segments kept: 0 .. blocks - 1
                node, next_id = self._cut(source, keep * segment, next_id)
            children = min(self.options.branching, missing)
            starts.append((node, children))
            missing -= children
        return starts, next_id

    def grow(self, prompt_ids: list[tuple[int, ...]]) -> tuple[list[list[Completion]], dict[str, float]]:
        """The leaves of one tree per prompt, grown by TreePO's schedule, and the tree's counts."""
        params, n = self.setup.params, self.setup.n
        roots = [_Node(p, p, None) for p in range(len(prompt_ids))]
        next_id = len(prompt_ids)
        leaves: list[list[_Leaf]] = [[] for _ in prompt_ids]
        plan: list[list[tuple[_Node, int]]] = [[(root, self._root_children())] for root in roots]
        rounds = fallbacks = 0
        while any(plan):
            rounds += 1
            starts = [(p, node, children) for p in range(len(prompt_ids)) for node, children in plan[p]]
            requests = [
                GenerationRequest(prompt_ids=prompt_ids[p], n=children, prefix_ids=tuple(node.path_tokens()), score_prefix=False)
                for p, node, children in starts
            ]
            wanted = [min(self.options.segment_tokens, params.max_new_tokens - len(r.prefix_ids)) for r in requests]
            active: list[list[_Node]] = [[] for _ in prompt_ids]
            ended = [0] * len(prompt_ids)
            for (p, node, children), request, completions in zip(starts, requests, self._generate(requests, wanted)):
                start = len(request.prefix_ids)
                extend = children == 1 and node.parent is not None and node.children == 0
                for completion in completions:
                    segment, logprobs = list(completion.response_ids[start:]), list(completion.logprobs[start:])
                    if extend:  # a path without a branch: the same node grows
                        child = node
                        child.tokens += segment
                        child.logprobs += logprobs
                    else:
                        child = _Node(next_id, p, node, segment, logprobs)
                        next_id += 1
                        node.children += 1
                    child.ended = completion.finished
                    reason = self._stop_reason(child, segment)
                    if reason is None:
                        active[p].append(child)
                    else:
                        leaves[p].append(_Leaf(child, reason))
                        ended[p] += 1
            for p in range(len(prompt_ids)):
                missing = n - len(leaves[p])
                if active[p]:
                    path_logprobs = [[lp for node in path.path() for lp in node.logprobs] for path in active[p]]
                    plan[p] = list(zip(active[p], divergence_counts(self.options, path_logprobs, missing, ended[p])))
                elif missing > 0:
                    plan[p], next_id = self._fall_back(leaves[p], roots[p], missing, next_id)
                    fallbacks += sum(children for _, children in plan[p])
                else:
                    plan[p] = []
        groups = [[self._completion(p, prompt_ids[p], leaf.node) for leaf in leaves[p]] for p in range(len(prompt_ids))]
        metrics = {"tree_rounds": float(rounds), "tree_fallback_leaves": float(fallbacks), "tree_node_count": float(next_id - len(prompt_ids))}
        for reason in STOP_REASONS:
            metrics[f"tree_stop_{reason}"] = float(sum(leaf.reason == reason for group in leaves for leaf in group))
        return groups, metrics
