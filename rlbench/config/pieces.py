"""The registered pieces a config can name, and the parameters each takes (from its signature).

A piece YAML (conf/algorithm/<kind>/<option>.yaml) is ``name`` plus parameters; the parameters a
piece accepts are its function's parameters minus the inputs the trainer passes, so a new piece
needs no schema edit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from rlbench.algorithm import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, Registry  # registers every piece
from rlbench.algorithm.shaping import REWARD_SHAPING


@dataclass(frozen=True)
class PieceKind:
    """One kind of piece: its registry (which knows the inputs the trainer passes) and where it is chosen."""

    registry: Registry
    selected_by: str  # the conf group (algorithm/loss) or the key (algorithm.kl.estimator)
    many: bool = False  # a list of pieces (reward shaping)


PIECE_KINDS = {
    "advantage": PieceKind(ADVANTAGES, "algorithm/advantage"),
    "loss": PieceKind(POLICY_LOSSES, "algorithm/loss"),
    "aggregation": PieceKind(AGGREGATIONS, "algorithm/aggregation"),
    "kl_estimator": PieceKind(KL_ESTIMATORS, "algorithm.kl.estimator"),
    "reward_shaping": PieceKind(REWARD_SHAPING, "algorithm.reward_shaping", many=True),
}

# Bounds of parameters that mean the same in every piece that takes them (a clip range is a width).
PIECE_PARAMETER_BOUNDS = {
    "clip_low": {"ge": 0},
    "clip_high": {"ge": 0},
    "epsilon": {"ge": 0},
    "gamma": {"ge": 0, "le": 1},
    "lam": {"ge": 0, "le": 1},
}


def piece_parameters(kind: str, name: str) -> dict[str, inspect.Parameter]:
    """The config parameters of piece ``name``: its signature minus the trainer's inputs."""
    registry = PIECE_KINDS[kind].registry
    signature = inspect.signature(registry.get(name))
    return {key: p for key, p in signature.parameters.items() if key not in registry.inputs}
