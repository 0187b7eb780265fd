"""An algorithm = advantage estimator x policy loss x aggregation x KL x entropy x update schedule.

``Algorithm.from_config`` reads ``cfg.algorithm`` (see conf/algorithm/*.yaml); the two methods
below are the whole objective, read top to bottom:

    advantages = advantage_estimator(rewards, groups)                        (H4)
    loss       = aggregate(policy_loss(logp, old_logp, A))                   (H6)
               + kl_coef * aggregate(kl(logp, ref_logp)) - entropy_coef * aggregate(H)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from rlbench.algorithm import advantages as _advantages  # noqa: F401  (registers pieces)
from rlbench.algorithm import aggregation as _aggregation  # noqa: F401
from rlbench.algorithm import kl as _kl  # noqa: F401
from rlbench.algorithm import losses as _losses  # noqa: F401
from rlbench.algorithm.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from rlbench.errors import ConfigError

ADVANTAGE_INPUTS = {"rewards", "group_index", "response_mask"}
LOSS_INPUTS = {"logp", "old_logp", "advantages", "response_mask"}
AGGREGATION_INPUTS = {"loss_matrix", "response_mask", "batch_tokens", "batch_sequences", "norm_length"}


@dataclass(frozen=True)
class Piece:
    """A registered function name plus its YAML parameters."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, node: Any, what: str) -> "Piece":
        if node is None or "name" not in node:
            raise ConfigError(f"algorithm.{what} needs a 'name' (e.g. algorithm/{what}=<option>)")
        params = {k: v for k, v in dict(node).items() if k != "name"}
        return cls(str(node["name"]), params)


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantage: Piece
    loss: Piece
    aggregation: Piece
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    epochs: int = 1
    minibatches: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> "Algorithm":
        """Build from ``cfg.algorithm`` and check every piece and parameter exists."""
        kl = cfg.get("kl") or {}
        update = cfg.get("update") or {}
        algorithm = cls(
            name=str(cfg.get("name", "custom")),
            advantage=Piece.from_config(cfg.get("advantage"), "advantage"),
            loss=Piece.from_config(cfg.get("loss"), "loss"),
            aggregation=Piece.from_config(cfg.get("aggregation"), "aggregation"),
            kl_coef=float(kl.get("coef", 0.0)),
            kl_estimator=str(kl.get("estimator", "k3")),
            entropy_coef=float(cfg.get("entropy_coef", 0.0)),
            epochs=int(update.get("epochs", 1)),
            minibatches=int(update.get("minibatches", 1)),
        )
        algorithm.validate()
        return algorithm

    def validate(self) -> None:
        ADVANTAGES.validate_params(self.advantage.name, self.advantage.params, ADVANTAGE_INPUTS)
        POLICY_LOSSES.validate_params(self.loss.name, self.loss.params, LOSS_INPUTS)
        AGGREGATIONS.validate_params(self.aggregation.name, self.aggregation.params, AGGREGATION_INPUTS)
        KL_ESTIMATORS.get(self.kl_estimator)
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ConfigError("algorithm.kl.coef and algorithm.entropy_coef must be >= 0")
        if self.epochs < 1 or self.minibatches < 1:
            raise ConfigError("algorithm.update.epochs and algorithm.update.minibatches must be >= 1")

    @property
    def group_relative(self) -> bool:
        """True when the advantage estimator compares responses of the same prompt."""
        return "group_index" in inspect.signature(ADVANTAGES.get(self.advantage.name)).parameters

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is loaded only when the KL term is active."""
        return self.kl_coef > 0

    @property
    def needs_old_logp(self) -> bool:
        """Stored old log-probs are needed only when a batch is reused for several updates."""
        return self.epochs > 1 or self.minibatches > 1

    def compute_advantages(
        self, rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        inputs = {"rewards": rewards, "group_index": group_index, "response_mask": response_mask}
        return ADVANTAGES.call(self.advantage.name, inputs, self.advantage.params)

    def aggregate(self, matrix: torch.Tensor, response_mask: torch.Tensor, norms: Mapping[str, int]) -> torch.Tensor:
        inputs = {"loss_matrix": matrix, "response_mask": response_mask, **norms}
        return AGGREGATIONS.call(self.aggregation.name, inputs, self.aggregation.params)

    def compute_loss(
        self,
        *,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        norms: Mapping[str, int],
        ref_logp: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar loss of one (micro-)batch and its metrics.

        ``norms`` carries the optimizer batch's counts (batch_tokens, batch_sequences, norm_length)
        so that micro-batch losses add up to the full-batch loss.
        """
        mask = response_mask.to(logp.dtype)
        inputs = {"logp": logp, "old_logp": old_logp, "advantages": advantages, "response_mask": mask}
        loss_matrix, metrics = POLICY_LOSSES.call(self.loss.name, inputs, self.loss.params)
        policy_loss = self.aggregate(loss_matrix, mask, norms)
        total = policy_loss
        metrics = dict(metrics)
        metrics["policy_loss"] = policy_loss.item()
        if self.kl_coef > 0:
            if ref_logp is None:
                raise ValueError("the KL term needs reference log-probs")
            kl_matrix = KL_ESTIMATORS.get(self.kl_estimator)(logp, ref_logp) * mask
            kl_value = self.aggregate(kl_matrix, mask, norms)
            total = total + self.kl_coef * kl_value
            metrics["kl"] = kl_value.item()
        if self.entropy_coef > 0:
            if entropy is None:
                raise ValueError("the entropy bonus needs per-token entropies")
            entropy_value = self.aggregate(entropy * mask, mask, norms)
            total = total - self.entropy_coef * entropy_value
        return total, metrics
