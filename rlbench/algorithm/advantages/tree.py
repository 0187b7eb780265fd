"""Advantages of tree rollouts (rlbench/rollout/strategies/tree.py): TreePO's subtree baselines and TreeRPO's
sibling groups; ARPO's hard advantage attribution on the branched episodes of rollout=multi_turn
(``branch: entropy_tool``, rlbench/rollout/strategies/multi_turn.py).

Both read ``tree_nodes`` [B, T] (long): the tree node of every response token, -1 on padding. A node
is a run of tokens sampled once and shared by every response (leaf) below it; ids are unique in the
batch, and the nodes along a row, in order of first appearance, are the leaf's path from the prompt.
The prompt itself (depth 0) is the response's group (``group_index``).
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _tokens, _valid, _whiten, group_mean_std
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError

TREE_WEIGHTINGS = ("average", "group_size")


def leaf_paths(tree_nodes: torch.Tensor, response_mask: torch.Tensor) -> list[list[int]]:
    """The node ids along each row, in order (each node once), over the valid tokens."""
    paths = []
    for row, valid in zip(tree_nodes.tolist(), _valid(response_mask).tolist()):
        path: list[int] = []
        for node, keep in zip(row, valid):
            if keep and node >= 0 and (not path or path[-1] != node):
                if node in path:
                    raise ValueError(f"tree node {node} appears twice, apart, in one response: tree_nodes is not a path")
                path.append(node)
        paths.append(path)
    return paths


def _leaves_below(paths: list[list[int]], rewards: torch.Tensor) -> dict[int, tuple[int, float]]:
    """node -> (number of leaves below it, mean reward of those leaves)."""
    members: dict[int, list[int]] = {}
    for row, path in enumerate(paths):
        for node in path:
            members.setdefault(node, []).append(row)
    values = rewards.to(torch.float64)
    return {node: (len(rows), float(values[rows].mean())) for node, rows in members.items()}


@ADVANTAGES.register("tree")
def tree_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    tree_nodes: torch.Tensor,
    response_mask: torch.Tensor,
    weighting: str = "average",
    whiten: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """TreePO's tree advantage (Li et al. 2025, arXiv:2508.17445, section 3; the released
    ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage`` with ``adv_weight_strategy``).

    For leaf i, S_0(i) is its prompt's group and S_d(i) (d >= 1) the leaves below the d-th node of
    its path; the subtrees of one leaf only count where they hold another leaf:

        a_{i,d} = r_i - mean_{j in S_d(i)} r_j          for d = 0, and d >= 1 with |S_d(i)| > 1
        A_i     = mean_d a_{i,d}                         (weighting="average", the paper's run)
        A_i     = sum_d |S_d(i)| a_{i,d} / sum_d |S_d(i)|  (weighting="group_size")

    then, with ``whiten``, whitened over the valid tokens of the batch (REINFORCE++-baseline,
    arXiv:2501.03262), as the released recipe does. A tree whose nodes all hold one leaf gives
    a_{i,0} alone: the REINFORCE++-baseline (Dr.GRPO-centred) advantage. A group of one response
    has a_{i,0} = 0 (the released code subtracts 0 there instead).
    """
    if weighting not in TREE_WEIGHTINGS:
        raise ConfigError(f"algorithm.advantage.weighting must be one of {TREE_WEIGHTINGS}, got {weighting!r}")
    mean0, _, count0 = group_mean_std(rewards, group_index)
    values = rewards.to(torch.float64)
    paths = leaf_paths(tree_nodes, response_mask)
    below = _leaves_below(paths, rewards)
    sequence = torch.zeros_like(values)
    for i, path in enumerate(paths):
        terms = [(float(count0[i]), float(values[i] - mean0[i]))]
        terms += [(float(size), float(values[i]) - mean) for size, mean in (below[node] for node in path) if size > 1]
        if weighting == "average":
            sequence[i] = sum(a for _, a in terms) / len(terms)
        else:
            sequence[i] = sum(size * a for size, a in terms) / sum(size for size, _ in terms)
    tokens = sequence[:, None].expand(response_mask.shape)
    if whiten:
        tokens = _whiten(tokens, _valid(response_mask), epsilon)
    return _tokens(tokens, response_mask)


@ADVANTAGES.register("treerpo", advantage_level="token")
def treerpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    tree_nodes: torch.Tensor,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """TreeRPO's step-level group advantage (Yang et al. 2025, arXiv:2506.05183, section 3).

    The value of a node is the mean reward of the leaves below it, V(k) = mean_{j below k} r_j. The
    children of one parent (for the first nodes: the prompt) form a group, and every token of node
    k gets

        A(k) = (V(k) - mean_{siblings} V) / (std_{siblings} V + epsilon)

    (std unbiased, as GRPO's); a node without a sibling, or whose siblings all have its value,
    gets 0. With one node per response below the prompt (a flat tree) this is GRPO's advantage.
    """
    paths = leaf_paths(tree_nodes, response_mask)
    below = _leaves_below(paths, rewards)
    parent: dict[int, tuple[str, int]] = {}
    for row, path in enumerate(paths):
        for depth, node in enumerate(path):
            parent[node] = ("node", path[depth - 1]) if depth else ("prompt", int(group_index[row]))
    nodes = sorted(parent)
    sibling_ids = {key: k for k, key in enumerate(sorted(set(parent.values())))}
    node_values = torch.tensor([below[node][1] for node in nodes], dtype=torch.float64)
    sibling_group = torch.tensor([sibling_ids[parent[node]] for node in nodes], dtype=torch.long)
    mean, std, count = group_mean_std(node_values, sibling_group) if nodes else (node_values,) * 3
    centred = node_values - mean
    node_advantage = torch.where((count > 1) & (std > 0), centred / (std + epsilon), torch.zeros_like(centred))
    lookup = {node: float(a) for node, a in zip(nodes, node_advantage)}
    tokens = torch.zeros(response_mask.shape, dtype=torch.float64)
    for row, nodes_of_row in enumerate(tree_nodes.tolist()):
        for t, node in enumerate(nodes_of_row):
            if node >= 0:
                tokens[row, t] = lookup.get(node, 0.0)
    return _tokens(tokens, response_mask)


@ADVANTAGES.register("arpo_hard", advantage_level="token")
def arpo_hard_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    tree_nodes: torch.Tensor,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """ARPO's hard advantage attribution (Dong et al. 2025, "Agentic Reinforced Policy Optimization",
    arXiv:2507.19849, section 3, advantage attribution estimation).

    Each leaf (a complete episode) gets GRPO's advantage within its prompt's group,
    A_i = (r_i - mean_g r) / (std_g r + epsilon) (:func:`grpo_advantage`); a token of node k, shared by the
    leaves below k (read over every token: a branch carries its inherited prefix as context, loss mask 0), gets
    their mean

        A(k) = mean_{j below k} A_j

    so a token sampled once and shared by several branches carries the mean advantage of its descendant
    leaves, and a token of one leaf its own A_i. A flat tree (no shared node) is GRPO exactly. (ARPO's soft
    attribution is GRPO itself on branches that each keep their copy of the prefix: ``grpo``.)
    """
    ones = torch.ones(rewards.shape[0], 1)
    sequence = grpo_advantage(rewards, group_index, ones, epsilon, scale_by_std)[:, 0]
    below = _leaves_below(leaf_paths(tree_nodes, tree_nodes >= 0), sequence)  # a branch's inherited tokens are context
    tokens = torch.zeros(response_mask.shape, dtype=torch.float64)
    for row, nodes_of_row in enumerate(tree_nodes.tolist()):
        for t, node in enumerate(nodes_of_row):
            if node in below:
                tokens[row, t] = below[node][1]
    return _tokens(tokens, response_mask)
