"""``rollout=treerpo`` (TreeRPO, Yang et al. 2025, arXiv:2506.05183, section 3.1): the tree sampler of
rlbench/rollout/strategies/tree.py with an N-ary tree, its options under ``rollout.treerpo``
(conf/rollout/treerpo.yaml)."""

from __future__ import annotations

from rlbench.rollout.strategies.tree import TreeSampling
from rlbench.rollout.strategy import register_strategy


@register_strategy("treerpo")
class TreeRPOSampling(TreeSampling):
    """TreeRPO's groups: :class:`TreeSampling` read from ``rollout.treerpo``."""
