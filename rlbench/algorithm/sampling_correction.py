"""Truncated importance sampling (TIS) between the sampling engine and the trainer.

Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS;
verl's ``rollout_is`` token-level truncated weights). A fast engine (vLLM) samples the rollout with
log-probs log pi_sampler that differ from the trainer's log pi_old for the same weights (different
kernels, precision, batching), so the rollout is slightly off-policy. Each token's policy loss is
weighted by the truncated ratio

    w_t = min(pi_old(o_t) / pi_sampler(o_t), C) = min(exp(old_logp_t - sampling_logp_t), C)

(no gradient), and l_t <- w_t l_t before aggregation. C (``cap``, default 2 as in the paper's
experiments) bounds the variance the correction adds.

``algorithm.sampling_correction: {cap: C}`` turns it on; absent (the default) it is off, and the
presets leave it off. With it on, a batch without ``sampling_logp`` is left unchanged (no-op). The
trainer passes ``sampling_logp`` = each Completion's ``logprobs`` (TrainBatch.sampling_logp). With
the HF engine the sampler *is* the trainer's model, so w = 1 up to the numerics of generation
(tests/test_rollout.py checks its log-probs against the training forward to 1e-4): the correction
is meant for the vLLM engine. Completion log-probs are those of the distribution actually sampled
from, after top-p; with top_p < 1 they exceed the trainer's (untruncated) log-probs and w < 1 on
every token, so use the correction with top_p = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlbench.errors import ConfigError

#: The truncation cap C of Yao et al. 2025 (their default).
DEFAULT_TIS_CAP = 2.0
SAMPLING_LOG_RATIO_LIMIT = 20.0


def truncated_importance_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """w_t = min(exp(old_logp_t - sampling_logp_t), cap), [B,T], no gradient. The log-ratio is
    clamped to +-20 first so that exp() stays finite."""
    with torch.no_grad():
        log_ratio = (old_logp - sampling_logp).clamp(-SAMPLING_LOG_RATIO_LIMIT, SAMPLING_LOG_RATIO_LIMIT)
        return torch.exp(log_ratio).clamp(max=cap)


@dataclass(frozen=True)
class SamplingCorrection:
    """``algorithm.sampling_correction``: {cap} of :func:`truncated_importance_weights`."""

    cap: float = DEFAULT_TIS_CAP

    @classmethod
    def from_config(cls, node: Any) -> "SamplingCorrection | None":
        if node is None:
            return None
        params = dict(node)
        unknown = set(params) - {"cap"}
        if unknown:
            raise ConfigError(
                f"algorithm.sampling_correction takes only cap (Yao et al. 2025: 2.0); got {sorted(params)}"
            )
        settings = cls(float(params.get("cap", DEFAULT_TIS_CAP)))
        if settings.cap <= 0:
            raise ConfigError(f"algorithm.sampling_correction.cap must be > 0, got {settings.cap}")
        return settings

    def weights(self, old_logp: torch.Tensor, sampling_logp: torch.Tensor | None) -> torch.Tensor | None:
        """The per-token weights for this batch, or None when there is nothing to correct."""
        if sampling_logp is None:
            return None
        return truncated_importance_weights(old_logp, sampling_logp, self.cap)
