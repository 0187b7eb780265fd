"""Helpers shared by the policy losses: masked means, clamped log-ratios, PPO's clipped term,
ratio metrics and token selection.
"""

from __future__ import annotations

import torch



LOG_RATIO_LIMIT = 20.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(m * v) / max(sum(m), 1)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def sequence_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row masked sum of a token matrix: [B,T] -> [B], sum_t m v."""
    return (values * mask).sum(-1)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row masked mean of a token matrix: [B,T] -> [B], sum_t m v / max(|o_i|, 1).

    A zero-length row gives 0."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def log_ratio(logp: torch.Tensor, base_logp: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_base) per token, clamped to +-LOG_RATIO_LIMIT so that exp() stays finite."""
    return (logp - base_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _ppo_terms(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped loss and where its clipped branch is active.

        l = max(-A r, -A clip(r, lower, upper)),   then  min(l, -A c) where A < 0 (dual clip c)

    ``lower``/``upper`` may be per-token tensors (HAPO). Returns (loss, is_clipped[bool])."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(lower, upper)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss, (clipped > unclipped).detach()


def _ratio_metrics(log_ratio_: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, **fractions) -> dict[str, float]:
    """approx_kl = mean(-log r), ratio_mean, plus the masked mean of each given indicator."""
    with torch.no_grad():
        metrics = {
            "approx_kl": masked_mean(-log_ratio_, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
        for key, indicator in fractions.items():
            metrics[key] = masked_mean(indicator.to(mask.dtype), mask).item()
    return metrics


def _ppo_metrics(log_ratio_: torch.Tensor, ratio: torch.Tensor, is_clipped: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """ppo_clip's metrics: clip_fraction(_low/_high), approx_kl, ratio_mean."""
    return _ratio_metrics(
        log_ratio_,
        ratio,
        mask,
        clip_fraction=is_clipped,
        clip_fraction_low=is_clipped & (ratio < 1),
        clip_fraction_high=is_clipped & (ratio > 1),
    )


def _count(fraction: float, total: int | float) -> int:
    """floor(fraction * total), robust to float error (0.29 * 100 -> 29, not 28)."""
    return int(fraction * total + 1e-9)


def _top_k_mask(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the k highest ``scores`` among ``candidates`` (ties: lower flat index first)."""
    chosen = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    k = min(int(k), int(candidates.sum().item()))
    if k > 0:
        flat = torch.where(candidates, scores.detach(), torch.full_like(scores, -torch.inf)).flatten()
        order = torch.sort(flat, descending=True, stable=True).indices
        chosen[order[:k]] = True
    return chosen.view_as(candidates)
