"""Policy-optimization algorithms as compositions of small registered pure functions."""

from rlbench.algorithm.composition import Algorithm, Piece
from rlbench.algorithm.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, Needs, Registry

__all__ = ["Algorithm", "Piece", "Needs", "Registry", "ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES"]
