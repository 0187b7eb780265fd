"""Losses for groups that mix the policy's own responses with tokens it did not sample (guidance
traces, hint-conditioned re-rolls): the ``off_policy`` input (1 on such tokens) says which branch a
token takes. On such tokens ``old_logp`` is the behaviour policy's stored log-prob
(rlbench.training.step.behaviour_old_logp), never a silent ratio 1.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.common import _ppo_terms, _ratio_metrics, log_ratio, masked_mean
from rlbench.algorithm.registry import POLICY_LOSSES

MIN_SHAPING_GAMMA = 1.0e-4  # Guide's floor on the percentile gamma


def shaping_gamma(ratio: torch.Tensor, off_mask: torch.Tensor, gamma: float, gamma_quantile: float | None) -> torch.Tensor:
    """gamma of the shaping f(r) = r / (r + gamma): the fixed ``gamma`` (LUFFY), or, when
    ``gamma_quantile`` is set, that quantile of the detached ratios over the off-policy tokens, at
    least 1e-4 (Guide's 90th percentile). A batch without off-policy tokens then gets gamma 1 (unused)."""
    if gamma_quantile is None:
        return torch.tensor(float(gamma), dtype=ratio.dtype, device=ratio.device)
    values = ratio.detach()[off_mask > 0]
    if values.numel() == 0:
        return torch.tensor(1.0, dtype=ratio.dtype, device=ratio.device)
    return torch.quantile(values.to(torch.float64), gamma_quantile).to(ratio.dtype).clamp(min=MIN_SHAPING_GAMMA)


def shaped_off_policy_terms(
    ratio: torch.Tensor, advantages: torch.Tensor, off: torch.Tensor, clip_low: float, clip_high: float, gamma
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token loss of policy shaping: PPO-clip where ``off`` is False, -A f(r) with
    f(r) = r / (r + gamma), never clipped, where it is True. Returns (loss, is_clipped, f(r))."""
    on_loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    shaped = policy_shaping(ratio, gamma)
    return torch.where(off, -advantages * shaped, on_loss), is_clipped, shaped


def policy_shaping(ratio: torch.Tensor, gamma) -> torch.Tensor:
    """LUFFY's shaping of an off-policy importance weight (arXiv:2504.14945, section 3.3):
    f(r) = r / (r + gamma), in (0, 1) for every r > 0; d f / d log r = gamma r / (r + gamma)^2."""
    return ratio / (ratio + gamma)


@POLICY_LOSSES.register("policy_shaping", paper_aggregation="token_mean")
def policy_shaping_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    off_policy: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    gamma: float = 0.1,
    gamma_quantile: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy shaping of off-policy tokens, PPO-clip on the policy's own (LUFFY, Yan et al. 2025,
    "Learning to Reason under Off-Policy Guidance", arXiv:2504.14945, section 3.3; Guide, Nath et al.
    2025, "Adaptive Guidance Accelerates Reinforcement Learning of Reasoning Models", arXiv:2506.13923):

        r_t = exp(logp_t - old_logp_t)
        on-policy tokens  (off_policy 0):  l_t = ppo_clip(r_t, A_t)           (= ppo_clip exactly)
        off-policy tokens (off_policy 1):  l_t = -A_t f(r_t),  f(r) = r / (r + gamma),  never clipped

    LUFFY: the trace's behaviour log-prob is 0 (mu = 1), so r = pi_theta and f(pi) = pi / (pi + gamma)
    with gamma = 0.1; d l / d logp = -A gamma pi / (pi + gamma)^2, largest at pi = gamma, so the
    trace's low-probability tokens keep a gradient. Guide: old_logp is the hint-conditioned
    log pi_old(y | x, h) and gamma the ``gamma_quantile`` (0.9; it replaces ``gamma``) of the off-policy ratios
    (:func:`shaping_gamma`; here of the micro-batch). With no off-policy token this is ppo_clip.
    Metrics: ppo_clip's (clip_fraction over on-policy tokens only), off_policy_fraction,
    shaped_weight_mean (f over off-policy tokens), shaping_gamma.
    """
    if gamma_quantile is not None and not 0.0 < gamma_quantile <= 1.0:
        raise ValueError(f"gamma_quantile must lie in (0, 1], got {gamma_quantile}")
    if gamma_quantile is None and gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    mask = response_mask.to(ratio.dtype)
    off = (off_policy > 0) & (mask > 0)
    g = shaping_gamma(ratio, off.to(ratio.dtype), gamma, gamma_quantile)
    loss, is_clipped, shaped = shaped_off_policy_terms(ratio, advantages, off, clip_low, clip_high, g)
    on_mask = mask * (~off).to(mask.dtype)
    off_mask = off.to(mask.dtype)
    metrics = _ratio_metrics(lr, ratio, mask)
    with torch.no_grad():
        metrics.update(
            clip_fraction=masked_mean(is_clipped.to(mask.dtype), on_mask).item(),
            off_policy_fraction=masked_mean(off_mask, mask).item(),
            shaped_weight_mean=masked_mean(shaped, off_mask).item(),
            shaping_gamma=float(g.item()),
        )
    return loss * mask, metrics


@POLICY_LOSSES.register("exgrpo", paper_aggregation="token_mean")
def exgrpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    off_policy: torch.Tensor,
    shaping_beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ExGRPO's mixed-policy objective (Zhan et al. 2025, "ExGRPO: Learning to Reason from
    Experience", arXiv:2510.02245, section 3.3): the plain importance-weighted policy gradient on
    the policy's own tokens, no clip; on replayed tokens (``off_policy`` = 1) the weight
    w = pi_theta / mu (mu = the stored behaviour log-prob) shaped as in LUFFY (:func:`policy_shaping`):

        l_t = -A_t rho_t,                          rho_t = pi_theta / pi_old     on-policy tokens
        l_t = -A_t f(w_t),  f(w) = w / (w + shaping_beta)                        replayed tokens

    On-policy tokens: d l / d logp = -A rho (at rho = 1 GRPO's gradient; past 1 +- eps nothing is
    clipped). Replayed: d l / d logp = -A beta w / (w + beta)^2, which keeps the low-probability
    tokens of a replayed success from vanishing and bounds the large ones. Metrics: approx_kl and
    ratio_mean on the policy's own tokens, replay_weight_mean (mean f(w) on replayed tokens)."""
    if shaping_beta <= 0:
        raise ValueError(f"shaping_beta must be > 0, got {shaping_beta}")
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    replayed = off_policy > 0
    shaped = policy_shaping(ratio, shaping_beta)
    mask = response_mask.to(ratio.dtype)
    metrics = _ratio_metrics(lr, ratio, mask * (~replayed).to(mask.dtype))
    metrics["replay_weight_mean"] = masked_mean(shaped.detach(), mask * replayed.to(mask.dtype)).item()
    return -advantages * torch.where(replayed, shaped, ratio) * mask, metrics
