"""Policy losses: per-token loss matrices, aggregated separately (see aggregation.py).

Inputs offered by the trainer (a function declares the ones it needs):
    logp           [B,T]  log pi_theta(o_t | q, o_<t), with gradient
    old_logp       [B,T]  log pi_old of the policy that sampled the batch (no gradient)
    advantages     [B,T]  per-token advantages
    response_mask  [B,T]  1 on response tokens
Every loss returns (loss_matrix [B,T], metrics) where metrics are masked token means (floats).
"""

from __future__ import annotations

import torch

from rlbench.algorithm.registry import POLICY_LOSSES

LOG_RATIO_LIMIT = 20.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(m * v) / max(sum(m), 1)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with decoupled clip range
    (DAPO "clip-higher", Yu et al. 2025, arXiv:2503.14476) and optional dual clip (Ye et al. 2020,
    arXiv:1912.09729).

        rho_t  = exp(logp_t - old_logp_t)                      (log-ratio clamped to +-20)
        l_t    = max(-A_t rho_t, -A_t clip(rho_t, 1 - clip_low, 1 + clip_high))
        l_t    = min(l_t, -A_t c)   where A_t < 0, if dual_clip = c (> 1)

    Metrics: clip_fraction (tokens where the clipped term is active), clip_fraction_low/high,
    approx_kl = mean(old_logp - logp), ratio_mean.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    mask = response_mask.to(loss.dtype)
    with torch.no_grad():
        is_clipped = (clipped > unclipped).to(loss.dtype)
        metrics = {
            "clip_fraction": masked_mean(is_clipped, mask).item(),
            "clip_fraction_low": masked_mean(is_clipped * (ratio < 1).to(loss.dtype), mask).item(),
            "clip_fraction_high": masked_mean(is_clipped * (ratio > 1).to(loss.dtype), mask).item(),
            "approx_kl": masked_mean(-log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss * mask, metrics
