"""The registered pieces a config can name, and the parameters each takes (from its signature).

A piece YAML (conf/algorithm/<kind>/<option>.yaml) is ``name`` plus parameters; the parameters a
piece accepts are its function's parameters minus the inputs the trainer passes, so a new piece
needs no schema edit. The config walk (rlbench/config/walk.py) gets these kinds passed in by the
run layer (rlbench/validation.py); the schema imports no registry.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import rlbench.algorithm.composition  # noqa: F401  (imports every piece module, which registers the pieces)
from rlbench.algorithm.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, Registry
from rlbench.algorithm.shaping import REWARD_SHAPING


@dataclass(frozen=True)
class PieceKind:
    """One kind of piece: its registry (which knows the inputs the trainer passes) and where it is chosen."""

    registry: Registry
    selected_by: str  # the conf group (algorithm/loss) or the key (algorithm.kl.estimator)
    many: bool = False  # a list of pieces (reward shaping)

    def parameters(self, name: str) -> dict[str, inspect.Parameter]:
        """The config parameters of piece ``name``: its signature minus the trainer's inputs."""
        signature = inspect.signature(self.registry.get(name))
        return {key: p for key, p in signature.parameters.items() if key not in self.registry.inputs}


PIECE_KINDS = {
    "advantage": PieceKind(ADVANTAGES, "algorithm/advantage"),
    "loss": PieceKind(POLICY_LOSSES, "algorithm/loss"),
    "aggregation": PieceKind(AGGREGATIONS, "algorithm/aggregation"),
    "kl_estimator": PieceKind(KL_ESTIMATORS, "algorithm.kl.estimator"),
    "reward_shaping": PieceKind(REWARD_SHAPING, "algorithm.reward_shaping", many=True),
}
