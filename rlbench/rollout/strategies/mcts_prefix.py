"""Staged GRPO on tree-search prefixes (``rollout=mcts_prefix``; Huang, Nguyen & Zimmer 2025,
"Tree-OPO: Off-policy Monte Carlo Tree-Guided Advantage Optimization for Multistep Reasoning",
arXiv:2509.09284, sections 3-4): a search tree over partial solutions is grown for each prompt, a
solution it found is revealed up to stage depths, and the prompt's GRPO group is ``rollout.n``
completions of ``prompt + revealed prefix``, split evenly over the step's depths. Stages move from deep
prefixes (easy: most of a good solution is given) to shallow ones (the prompt alone), the paper's reverse
curriculum; a stage may mix several depths, each response then carries its prefix's depth
(``prefix_stage``), which Staged Advantage Estimation reads (``algorithm/advantage=sae``,
rlbench/algorithm/advantages/staged.py).

Configuration (``rollout.mcts_prefix``; conf/rollout/mcts_prefix.yaml):

    search:               # the search tree: rlbench/rollout/strategies/tree.py's segment tree with rollout.n leaves
      segment_tokens: 4   # tokens per segment (a partial solution grows one segment per level)
      root_branching: 2
      branching: 2
      rounds: 2           # MCTS selection rounds after the segment tree, offline or online (0: none, the tree as grown)
      exploration: 1.414  # UCT's constant c (default sqrt(2))
    stage_depths: [2, 1, 0]  # one entry per stage: a depth (segments revealed; 0: the prompt alone) or a list
                             # of depths mixed within the step (rollout.n / its length completions each)
    steps_per_stage: 10      # training steps per stage; the last stage lasts to the end of the run
    teacher_tree: ${output_dir}/teacher_tree.json  # the offline teacher tree (below); "": online
    teacher_prompts: 0       # with teacher_tree: the first K training prompts are the tree's and the run's (0: all)
    value_heuristic: expectation  # V(p) of each response's prefix (prefix_value, read by sae baseline=tree_value)

Each response also carries ``prefix_value``: V(p) of its prefix p in the step's tree (the teacher's, or the online
search's), from the rewards of the tree's leaves that extend p (:func:`prefix_value`; no search this step: 0).

Online (``teacher_tree: ""``), at a step whose deepest depth is d > 0: the search tree
(rlbench.rollout.strategies.tree.TreeSampling.grow, its engine calls through the run's GroupSampler, so shared
prefixes count as reused tokens) gives ``rollout.n`` leaves per prompt, graded and reward-shaped; the best
leaf (highest reward, the first among ties) is the search's solution. With ``search.rounds`` > 0 the step's tree
then runs the MCTS rounds below (the teacher's code path), and the solution is a best leaf of all its rollouts.
Its leaves are not trained.

Offline (``teacher_tree: <file>``): the tree is the teacher's, grown once before training and never again.
A file that exists is read (its tokenizer fingerprint and segment length must be the run's); otherwise, at
the first step, before any update, the policy (the initial policy: the teacher) grows the search tree of
every training prompt, and the tree is written there (JSON: per prompt uid, its prompt ids and its leaves'
token paths and rewards, and its search nodes with their visits N and summed values W (below)). The tree travels in the checkpoint.
A different teacher writes the file from its own run with the same tokenizer (``trainer.steps=1``).
Each step draws, per prompt, one of the tree's best leaves (highest reward, uniformly among ties).

MCTS selection rounds (online or offline, ``search.rounds: R`` > 0; :func:`mcts_rounds`). The segment tree's leaves are
read as a search tree of partial solutions cut at segment boundaries (:func:`search_nodes`: the prompt, every
prefix of whole segments that two leaves share, and each leaf's first segment past its last shared prefix,
which the rest of the leaf evaluated as a rollout; a leaf that ends inside a segment ends a terminal node),
each leaf's reward backed up its path (N: visits, W: summed values). Then R rounds per prompt: a path is
selected from the root by UCT (:func:`uct_score`, the unvisited child first, the first child among ties)
down to a node without children; a terminal node backs up its own reward again; any other is expanded by
``branching`` continuations of ``segment_tokens`` tokens sampled by the teacher, each new node evaluated by
a rollout to the end (or by itself when it ended: EOS or ``max_new_tokens``), graded by the run's reward,
and the value backed up its path (:func:`backup`). Every rollout is a new leaf of the file, so the draw
(a best leaf) sees the search's solutions. The file stores each node's parent, tokens, N and W
(``nodes``); a file without them (written before) still reads. rounds 0 writes today's leaves exactly.

Either way the prefix at depth d is the solution's first d * segment_tokens tokens (at most the whole
segments before its last token); each depth's completions come from one request (rlbench.rollout.continuation),
each response (prefix included) at most ``rollout.max_new_tokens`` long. The prefix is context
(``loss_mask`` 0, behaviour "prefix"): only the completions are trained. The group is the prompt's (all its
depths); ``group_index`` is the prompt, so plain GRPO compares completions of different prefixes (the paper's
GRPO baseline) and ``sae`` keys its baselines by (prompt, prefix). The metric ``rollout_outcome_mean`` is the
mean outcome of responses to the prompt alone (the online search's leaves, else the depth-0 completions;
all completions when the step has no depth 0), which a revealed prefix does not inflate.

Simplifications against the paper (docs/rollout-trees.md): the search starts from a segment tree and evaluates
a node by one graded rollout (no value model); the teacher is the run's initial policy unless a file of
another model's run is given; a step's prefixes of a prompt come from one solution path.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.config.typed import settings_block
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
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
from rlbench.utils import atomic_write_text, tokenizer_fingerprint

SEARCH = "mcts_prefix.search"
PREFIX_STAGE = "prefix_stage"
PREFIX_VALUE = "prefix_value"
VALUE_HEURISTICS = ("expectation", "optimistic", "pessimistic")
TREE_FORMAT = "rlbench/mcts_prefix_tree/1"
TREE_CHUNK = 16  # prompts per search when the teacher grows its tree
UCT_KEYS = ("rounds", "exploration")  # keys of the search block read here, not by the segment tree (TreeOptions)


@dataclasses.dataclass(frozen=True)
class UCTOptions:
    """The MCTS keys of ``rollout.mcts_prefix.search``."""

    rounds: int = 2  # selection rounds per prompt after the segment tree (the teacher's or online); 0: none
    exploration: float = math.sqrt(2)  # UCT's c


def uct_score(value_sum: float, visits: int, parent_visits: int, c: float) -> float:
    """UCT (Kocsis & Szepesvari 2006), the selection rule of Tree-OPO's teacher MCTS (arXiv:2509.09284, section 3):
    score(child) = W(child) / N(child) + c * sqrt(ln N(parent) / N(child)), with W the child's summed values and N
    its visits; an unvisited child (N = 0) scores +inf (it is selected first)."""
    if visits == 0:
        return math.inf
    return value_sum / visits + c * math.sqrt(math.log(max(parent_visits, 1)) / visits)


def uct_select(value_sums: list[float], visits: list[int], parent_visits: int, c: float) -> int:
    """The index of the child with the highest :func:`uct_score` (the first among ties: deterministic)."""
    scores = [uct_score(w, n, parent_visits, c) for w, n in zip(value_sums, visits)]
    return scores.index(max(scores))


def backup(visits: list[int], value_sums: list[float], path: list[int], value: float) -> tuple[list[int], list[float]]:
    """MCTS backup of one evaluation: N(v) <- N(v) + 1 and W(v) <- W(v) + value for every node v on ``path``
    (node indices, root first); the other nodes unchanged. New lists."""
    visits, value_sums = list(visits), list(value_sums)
    for v in path:
        visits[v] += 1
        value_sums[v] += value
    return visits, value_sums


def _node(parent: int, tokens: list[int], ended: bool, leaf: int) -> dict[str, Any]:
    """A search node of the file: its parent's index (-1: the prompt), its own tokens, visits N, summed values W,
    whether its path ended (terminal) and the leaf that evaluated it (-1: none)."""
    return {"parent": parent, "tokens": list(tokens), "N": 0, "W": 0.0, "ended": ended, "leaf": leaf}


def _backup_nodes(nodes: list[dict[str, Any]], path: list[int], value: float) -> None:
    visits, sums = backup([node["N"] for node in nodes], [node["W"] for node in nodes], path, value)
    for node, n, w in zip(nodes, visits, sums):
        node["N"], node["W"] = n, w


def search_nodes(paths: list[list[int]], rewards: list[float], segment_tokens: int) -> list[dict[str, Any]]:
    """The search tree of a prompt's leaves (token paths with their rewards): node 0 is the prompt; a node is a
    prefix of whole segments shared by two leaves or more, or a leaf's first segment past its last shared prefix
    (evaluated by the leaf as its rollout); a leaf that ends inside it ends a terminal node. Each leaf's reward
    is backed up its path (:func:`backup`)."""

    def cuts(length: int) -> list[int]:
        return [*range(segment_tokens, length, segment_tokens), length] if length else []

    through = Counter(tuple(ids[:cut]) for ids in paths for cut in cuts(len(ids)))
    nodes, index = [_node(-1, [], False, -1)], {(): 0}
    for leaf, (ids, reward) in enumerate(zip(paths, rewards)):
        path, start = [0], 0
        for cut in cuts(len(ids)):
            key = tuple(ids[:cut])
            if key not in index:
                index[key] = len(nodes)
                nodes.append(_node(path[-1], ids[start:cut], False, leaf))
            if cut == len(ids):
                nodes[index[key]].update(ended=True, leaf=leaf)
            path.append(index[key])
            start = cut
            if through[key] < 2:
                break
        _backup_nodes(nodes, path, float(reward))
    return nodes


def select_path(nodes: list[dict[str, Any]], c: float) -> list[int]:
    """The UCT path (node indices) from the prompt down to a node without children (:func:`uct_select` at each node)."""
    children: dict[int, list[int]] = {}
    for k, node in enumerate(nodes):
        if node["parent"] >= 0:
            children.setdefault(node["parent"], []).append(k)
    path = [0]
    while path[-1] in children:
        kids = children[path[-1]]
        pick = uct_select([nodes[k]["W"] for k in kids], [nodes[k]["N"] for k in kids], nodes[path[-1]]["N"], c)
        path.append(kids[pick])
    return path


def mcts_rounds(
    setup: RolloutSetup, problems: list[Problem], records: list[dict[str, Any]], rounds: int, c: float,
    segment_tokens: int, branching: int,
) -> None:
    """``rounds`` MCTS rounds on each prompt's record (its ``prompt_ids``, ``leaves`` and ``nodes``, changed in
    place), the prompts' rounds batched: select (:func:`select_path`), expand a non-terminal node by ``branching``
    continuations of ``segment_tokens`` tokens, evaluate each new node by a rollout to the end (a node that ended
    is its own rollout) graded by the run's reward (a terminal node selected again: its leaf's reward), back up."""
    sampler, params, max_new = setup.sampler, setup.params, setup.params.max_new_tokens
    for _ in range(rounds):
        expand = []
        for p, record in enumerate(records):
            nodes = record["nodes"]
            path = select_path(nodes, c)
            node = nodes[path[-1]]
            if node["ended"]:
                _backup_nodes(nodes, path, float(record["leaves"][node["leaf"]]["reward"]))
            else:
                expand.append((p, path, [t for v in path for t in nodes[v]["tokens"]]))
        if not expand:
            continue
        requests = [
            (GenerationRequest(tuple(records[p]["prompt_ids"]), n=branching, prefix_ids=tuple(tokens), score_prefix=False),
             min(segment_tokens, max_new - len(tokens)))
            for p, _, tokens in expand
        ]
        new = [
            (p, path, len(tokens), child, child.finished or len(child.response_ids) >= max_new)
            for (p, path, tokens), children in zip(expand, continue_with_budgets(sampler, requests, params, setup.generator))
            for child in children
        ]
        open_ = [child for _, _, _, child, ended in new if not ended]
        requests = [
            (GenerationRequest(child.prompt_ids, n=1, prefix_ids=tuple(child.response_ids), score_prefix=False), max_new - len(child.response_ids))
            for child in open_
        ]
        rollouts = iter(done[0] for done in continue_with_budgets(sampler, requests, params, setup.generator))
        leaves = [child if ended else next(rollouts) for _, _, _, child, ended in new]
        graded_prompts = sorted({p for p, *_ in new})
        groups = [[leaf for (p, *_), leaf in zip(new, leaves) if p == q] for q in graded_prompts]
        graded = sampler.grade([problems[q] for q in graded_prompts], groups, max_new)
        rewards = iter(graded.rewards.tolist())  # in the groups' order: by prompt, then as sampled
        by_prompt = {q: [(entry, leaf) for entry, leaf in zip(new, leaves) if entry[0] == q] for q in graded_prompts}
        for q in graded_prompts:
            record = records[q]
            for (_, path, start, child, ended), leaf in by_prompt[q]:
                reward = float(next(rewards))
                record["leaves"].append({"response_ids": list(leaf.response_ids), "reward": reward})
                record["nodes"].append(_node(path[-1], list(child.response_ids[start:]), ended, len(record["leaves"]) - 1))
                _backup_nodes(record["nodes"], [*path, len(record["nodes"]) - 1], reward)


@dataclasses.dataclass(frozen=True)
class MCTSPrefixOptions:
    """The ``rollout.mcts_prefix`` block."""

    search: dict = dataclasses.field(default_factory=dict)  # the search tree: a tree block (TreeOptions)
    stage_depths: tuple[int | tuple[int, ...], ...] = (2, 1, 0)  # per stage: a depth, or depths mixed in a step
    steps_per_stage: int = 10  # training steps per stage; the last stage runs to the end
    teacher_tree: str = ""  # "": the policy grows a tree online each step; a file: the offline teacher tree (the
    # preset's default: ${output_dir}/teacher_tree.json, which a run folder gives)
    teacher_prompts: int = 0  # with teacher_tree: the first K training prompts are the teacher's and the run's (0: all)
    value_heuristic: str = "expectation"  # V(p) of prefix_value: expectation | optimistic | pessimistic


def prefix_value(prefix: tuple[int, ...], leaves: list[tuple[list[int], float]], heuristic: str) -> float:
    """Tree-OPO's V(p) (arXiv:2509.09284, section 4, as summarised second-hand): over the rewards R of the tree's
    leaves whose tokens extend ``prefix`` (the rollouts of its subtree; ``leaves``: (token ids, reward) pairs),
    expectation mean(R) (the subtree's empirical success rate), optimistic max(R) (a success in the subtree) or
    pessimistic min(R) (no failure in it). No leaf (no tree this step): 0, which a group of one prefix cancels."""
    rewards = [reward for ids, reward in leaves if tuple(ids[: len(prefix)]) == prefix]
    if not rewards:
        return 0.0
    return {"expectation": sum(rewards) / len(rewards), "optimistic": max(rewards), "pessimistic": min(rewards)}[heuristic]


def revealed_length(leaf_length: int, depth: int, segment_tokens: int) -> int:
    """Tokens of a leaf of ``leaf_length`` tokens revealed at stage ``depth``: ``depth`` segments, at
    most the whole segments before the leaf's last token (a prefix always leaves a token to sample)."""
    whole = (max(leaf_length - 1, 0) // segment_tokens) * segment_tokens
    return min(depth * segment_tokens, whole)


def write_tree(path: str | Path, tree: dict[str, Any]) -> None:
    """The teacher tree as JSON (``tree``: the :func:`grow_teacher_tree` record), written atomically."""
    Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path).expanduser(), json.dumps(tree))


def read_tree(path: str | Path, tokenizer: str, segment_tokens: int) -> dict[str, Any]:
    """The teacher tree of a file, refused (DataError) when written under another tokenizer or segment length."""
    tree = json.loads(Path(path).expanduser().read_text())
    if tree.get("format") != TREE_FORMAT:
        raise DataError(f"{path} is not a teacher tree of rollout=mcts_prefix (format {tree.get('format')!r}, expected {TREE_FORMAT!r})")
    if tree["tokenizer"] != tokenizer or tree["segment_tokens"] != segment_tokens:
        raise DataError(
            f"the teacher tree {path} was grown with tokenizer {tree['tokenizer']} and segments of {tree['segment_tokens']} "
            f"tokens; this run has tokenizer {tokenizer} and rollout.mcts_prefix.search.segment_tokens={segment_tokens}"
        )
    return tree


@register_strategy("mcts_prefix")
class MCTSPrefix(RolloutStrategy):
    """``rollout=mcts_prefix`` (module docstring). State across steps: the step count (the stage) and the
    teacher tree (offline)."""

    provides = frozenset({PREFIX_STAGE, PREFIX_VALUE})

    def __init__(
        self, setup: RolloutSetup, search: TreeOptions, stage_depths: list[tuple[int, ...]], steps_per_stage: int,
        teacher_tree: str = "", teacher_prompts: int = 0, uct: UCTOptions = UCTOptions(), value_heuristic: str = "expectation",
    ):
        self.setup, self.search = setup, search
        self.stage_depths, self.steps_per_stage = stage_depths, steps_per_stage
        self.teacher_tree, self.teacher_prompts = teacher_tree, teacher_prompts
        self.uct, self.value_heuristic = uct, value_heuristic
        self.tree: dict[str, Any] | None = None  # the offline teacher tree (read_tree's record), once read or grown
        self.problems: list[Problem] = []  # the training problems (training_problems): the teacher's prompts
        self.step = 0

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        options = strategy_options(rollout, "mcts_prefix", MCTSPrefixOptions)
        needs_groups("mcts_prefix", rollout, "trains GRPO groups of completions of one prompt's prefixes")
        block = dict(options.search)
        uct = settings_block({key: block.pop(key) for key in UCT_KEYS if key in block}, UCTOptions, "rollout.mcts_prefix.search")
        search = TreeOptions.from_config(dataclasses.replace(rollout, strategy=SEARCH, settings={SEARCH: block}))
        if uct.rounds < 0 or uct.exploration < 0:
            raise ConfigError(
                f"rollout.mcts_prefix.search.rounds={uct.rounds} and .exploration={uct.exploration} must be >= 0"
            )
        stages = [(entry,) if isinstance(entry, int) else tuple(entry) for entry in options.stage_depths]
        steps, n = options.steps_per_stage, int(rollout.n)
        if not stages or any(not mix or min(mix) < 0 or len(set(mix)) < len(mix) for mix in stages):
            raise ConfigError(
                "rollout.mcts_prefix.stage_depths must be a non-empty list of stages, each a depth >= 0 or a list of "
                f"distinct depths >= 0, got {list(options.stage_depths)}"
            )
        for mix in stages:
            if n % len(mix):
                raise ConfigError(
                    f"rollout.mcts_prefix.stage_depths has a stage mixing {len(mix)} depths {list(mix)}, which does not "
                    f"divide rollout.n={n} completions per prompt evenly: use rollout.n a multiple of {len(mix)}"
                )
        if options.value_heuristic not in VALUE_HEURISTICS:
            raise ConfigError(
                f"rollout.mcts_prefix.value_heuristic must be one of {list(VALUE_HEURISTICS)}, got {options.value_heuristic!r}"
            )
        if steps < 1:
            raise ConfigError(f"rollout.mcts_prefix.steps_per_stage must be >= 1, got {steps}")
        if options.teacher_prompts < 0 or (options.teacher_prompts and not options.teacher_tree):
            raise ConfigError(
                f"rollout.mcts_prefix.teacher_prompts={options.teacher_prompts} must be >= 0, and > 0 only with "
                "rollout.mcts_prefix.teacher_tree=<file> (the prompts the offline teacher tree covers)"
            )
        deepest, max_new = max(max(mix) for mix in stages), int(rollout.max_new_tokens)
        if deepest * search.segment_tokens >= max_new:
            raise ConfigError(
                f"rollout.mcts_prefix.stage_depths={list(options.stage_depths)} reveal up to {deepest} segments of "
                f"{search.segment_tokens} tokens, which leaves nothing to generate within rollout.max_new_tokens={max_new}. "
                f"Use depths below {-(-max_new // search.segment_tokens)} or a smaller search.segment_tokens"
            )
        return {"search": search, "stage_depths": stages, "steps_per_stage": steps, "teacher_tree": options.teacher_tree,
                "teacher_prompts": options.teacher_prompts, "uct": uct, "value_heuristic": options.value_heuristic}

    @property
    def depths(self) -> tuple[int, ...]:
        """The depths of the coming step (its stage's mix)."""
        return self.stage_depths[min(self.step // self.steps_per_stage, len(self.stage_depths) - 1)]

    def training_problems(self, problems: list[Problem]) -> list[Problem]:
        """The teacher's prompts: the first ``teacher_prompts`` of the dataset's (all when 0), which the run trains on."""
        self.problems = list(problems[: self.teacher_prompts] if self.teacher_prompts else problems)
        return self.problems

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, **({"tree": self.tree} if self.tree is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tree = state.get("tree", self.tree)

    def search_records(self, problems: list[Problem], prompt_ids: list[tuple[int, ...]]) -> tuple[list[dict[str, Any]], Any, dict]:
        """The search of ``problems`` by the policy as it is now: the segment tree's leaves graded, read as search
        nodes (:func:`search_nodes`), then ``search.rounds`` MCTS rounds (:func:`mcts_rounds`). Per prompt its record
        (``prompt_ids``, ``leaves``, ``nodes``), the segment tree's grading and the tree's metrics."""
        sampler = self.setup.sampler
        leaves, tree_metrics = TreeSampling(self.setup, self.search).grow(prompt_ids)
        graded = sampler.grade(problems, leaves, self.setup.params.max_new_tokens)
        records = []
        for p, group in enumerate(leaves):
            rewards = graded.rewards[graded.group_index == p].tolist()
            records.append({
                "prompt_ids": list(prompt_ids[p]),
                "leaves": [{"response_ids": list(leaf.response_ids), "reward": float(r)} for leaf, r in zip(group, rewards)],
                "nodes": search_nodes([list(leaf.response_ids) for leaf in group], rewards, self.search.segment_tokens),
            })
        if self.uct.rounds:
            mcts_rounds(self.setup, problems, records, self.uct.rounds, self.uct.exploration, self.search.segment_tokens, self.search.branching)
        return records, graded, tree_metrics

    def grow_teacher_tree(self, problems: list[Problem]) -> dict[str, Any]:
        """The search tree of every prompt of ``problems`` (:meth:`search_records`), grown by the policy as it is now (the teacher)."""
        sampler, prompts = self.setup.sampler, {}
        for start in range(0, len(problems), TREE_CHUNK):
            chunk = problems[start : start + TREE_CHUNK]
            records, _, _ = self.search_records(chunk, sampler.encode(chunk))
            prompts.update({problem.uid: record for problem, record in zip(chunk, records)})
        fingerprint = tokenizer_fingerprint(sampler.tokenizer)
        return {"format": TREE_FORMAT, "tokenizer": fingerprint, "segment_tokens": self.search.segment_tokens, "prompts": prompts}

    def offline_solutions(
        self, problems: list[Problem], prompt_ids: list[tuple[int, ...]], metrics: dict
    ) -> tuple[list[list[int]], list[list[tuple[list[int], float]]]]:
        """A best leaf of each prompt's teacher tree (read, or grown and written at the first step), and the tree's
        leaves (token ids, reward)."""
        if self.tree is None:
            path = Path(self.teacher_tree).expanduser()
            if path.exists():
                self.tree = read_tree(path, tokenizer_fingerprint(self.setup.sampler.tokenizer), self.search.segment_tokens)
            else:
                seen = {problem.uid for problem in self.problems}
                self.tree = self.grow_teacher_tree(self.problems + [p for p in problems if p.uid not in seen])
                write_tree(path, self.tree)
                metrics["mcts_teacher_tree_prompts"] = float(len(self.tree["prompts"]))
        solutions, trees = [], []
        for problem, ids in zip(problems, prompt_ids):
            node = self.tree["prompts"].get(problem.uid)
            if node is None or tuple(node["prompt_ids"]) != tuple(ids):
                raise DataError(
                    f"the teacher tree {self.teacher_tree} has no tree for problem {problem.uid!r} as this run prompts it "
                    "(another data set, prompt template or tokenizer): grow it again (delete the file) or use that run's settings"
                )
            rewards = [leaf["reward"] for leaf in node["leaves"]]
            best = [k for k, r in enumerate(rewards) if r == max(rewards)]
            pick = best[int(torch.randint(len(best), (1,), generator=self.setup.generator))] if len(best) > 1 else best[0]
            solutions.append(list(node["leaves"][pick]["response_ids"]))
            trees.append([(leaf["response_ids"], float(leaf["reward"])) for leaf in node["leaves"]])
        return solutions, trees

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        depths = self.depths
        self.step += 1
        prompt_ids = sampler.encode(problems)
        metrics = {"mcts_prefix_depth": float(max(depths)), "mcts_prefix_depths": float(len(depths))}
        solutions: list[list[int]] = [[] for _ in problems]
        trees: list[list[tuple[list[int], float]]] = [[] for _ in problems]  # each prompt's tree leaves: (ids, reward)
        if self.teacher_tree:
            solutions, trees = self.offline_solutions(problems, prompt_ids, metrics)
        elif max(depths) > 0:
            records, searched, tree_metrics = self.search_records(problems, prompt_ids)
            for p, record in enumerate(records):
                rewards = [leaf["reward"] for leaf in record["leaves"]]
                solutions[p] = list(record["leaves"][rewards.index(max(rewards))]["response_ids"])
                trees[p] = [(leaf["response_ids"], leaf["reward"]) for leaf in record["leaves"]]
            metrics.update(tree_metrics)
            # the policy's own responses to the prompt alone: what the learning is judged on
            metrics["rollout_outcome_mean"] = float(searched.outcome.mean().item())
        max_new, segment = setup.params.max_new_tokens, self.search.segment_tokens
        plan = [
            (p, d, tuple(solutions[p][: revealed_length(len(solutions[p]), d, segment)])) for p in range(len(problems)) for d in depths
        ]
        requests = [(GenerationRequest(prompt_ids[p], n=setup.n // len(depths), prefix_ids=prefix), max_new - len(prefix)) for p, _, prefix in plan]
        groups: list[list] = [[] for _ in problems]
        stages: list[list[int]] = [[] for _ in problems]
        for (p, d, prefix), completions in zip(plan, continue_with_budgets(sampler, requests, setup.params, setup.generator)):
            value = prefix_value(prefix, trees[p], self.value_heuristic)
            for c in completions:
                c = prefixed_response(c, len(prefix)) if prefix else c
                stage = {PREFIX_STAGE: [d] * len(c.response_ids), PREFIX_VALUE: [value] * len(c.response_ids)}
                groups[p].append(dataclasses.replace(c, extras={**c.extras, **stage}))
                stages[p].append(d)
        graded = sampler.grade(problems, groups, max_new)
        if "rollout_outcome_mean" not in metrics:
            alone = torch.tensor([d == 0 for group in stages for d in group])
            metrics["rollout_outcome_mean"] = float((graded.outcome[alone] if bool(alone.any()) else graded.outcome).mean().item())
        metrics["mcts_prefix_tokens_mean"] = float(sum(len(prefix) for _, _, prefix in plan) / max(len(plan), 1))
        return graded, metrics
