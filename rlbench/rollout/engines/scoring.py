"""Per-position statistics of the policy's next-token distribution, for strategies that decide where to
branch (lookahead, entropy_branch): :func:`distribution_stats` turns the log-probs of the distributions
along a response into :class:`~rlbench.rollout.engines.base.PositionStats` (the two most likely tokens with
their probabilities, and the entropy). Every engine provides them through its ``position_stats``
(rlbench/rollout/engines/base.py), computed on the Hugging Face policy model (the vLLM engine keeps one in
step for its scoring)."""

from __future__ import annotations

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import PositionStats


def distribution_stats(logp: torch.Tensor) -> PositionStats:
    """:class:`PositionStats` of the distributions ``logp`` ``[L, V]`` (normalised log-probs, ``-inf``
    outside the support): top two tokens and probabilities, entropy ``-sum p log p`` (nats)."""
    probs = logp.exp()
    top = probs.topk(2, dim=-1)
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(-1)
    return PositionStats(top.indices.cpu(), top.values.double().cpu(), entropy.double().cpu(), probs.shape[-1])


def needs_hf_engine(strategy: str, rollout: RolloutConfig, reason: str) -> None:
    """ConfigError unless ``rollout.engine`` is hf; ``reason``: why the strategy cannot run on vLLM."""
    if rollout.engine != "hf":
        raise ConfigError(f"rollout={strategy} {reason}; set rollout.engine=hf")
