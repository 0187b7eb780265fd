"""Ratio-based surrogates with a soft trust region instead of PPO's hard clip: SAPO's sigmoid gate,
SPO's quadratic penalty, M2PO's second-moment masking and on-policy MDPO.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.common import _ratio_metrics, _top_k_mask, log_ratio, masked_mean
from rlbench.algorithm.registry import POLICY_LOSSES


@POLICY_LOSSES.register("soft_sapo", paper_aggregation="seq_mean_token_mean",
                        ratio_term="its soft gate on the ratio (at ratio 1 the gradient is the plain policy gradient)")
def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO soft gate (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347;
    as in verl and TRL, which agree).

        f(rho) = sigmoid(tau (rho - 1)) * 4 / tau,   tau = tau_pos if A_t > 0 else tau_neg
        l_t    = -f(rho_t) A_t
    At rho = 1: f = 2 / tau and f' = sigmoid'(0) * 4 = 1, so the gradient is the REINFORCE
    gradient -A grad logp while the value is -2 A / tau. verl and TRL aggregate per sequence
    (seq_mean_token_mean). Metrics: approx_kl, ratio_mean, gate_mean (mean f(rho)).
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    mask = response_mask.to(ratio.dtype)
    metrics = _ratio_metrics(lr, ratio, mask)
    metrics["gate_mean"] = masked_mean(gate.detach(), mask).item()
    return -gate * advantages * mask, metrics


@POLICY_LOSSES.register("spo_simple", ratio_term="its quadratic penalty on the ratio", ratio_term_metric="outside_fraction")
def spo_simple_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Simple Policy Optimization (Xie et al. 2024, "Simple Policy Optimization", arXiv:2401.16025).

        J_t = rho_t A_t - |A_t| / (2 e) (rho_t - 1)^2,   e = clip_high if A_t > 0 else clip_low
        l_t = -J_t
    Per token the optimum is rho* = 1 + sgn(A) e; outside it the penalty keeps pulling rho back
    (PPO's gradient is 0 there). At rho = 1 the gradient is -A grad logp.
    Metrics: approx_kl, ratio_mean, outside_fraction (|rho - 1| > e).
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    eps = torch.where(advantages > 0, torch.full_like(ratio, clip_high), torch.full_like(ratio, clip_low))
    objective = ratio * advantages - advantages.abs() / (2.0 * eps) * (ratio - 1.0) ** 2
    mask = response_mask.to(ratio.dtype)
    return -objective * mask, _ratio_metrics(lr, ratio, mask, outside_fraction=(ratio - 1.0).abs() > eps)


@POLICY_LOSSES.register("m2po", paper_aggregation="token_mean", ratio_term="its second-moment mask",
                        ratio_term_metric="masked_fraction")
def m2po_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    m2_threshold: float = 0.04,
) -> tuple[torch.Tensor, dict[str, float]]:
    """M2PO second-moment trust region, masking variant (Zheng, Zhao & Chen 2025, "Prosperity
    before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161).

        M2 = mean over unmasked valid tokens of (log rho_t)^2
        while M2 > m2_threshold: mask the token with the largest (log rho_t)^2, recompute M2
        l_t = -M_t rho_t A_t                                                   (no other clipping)
    Computed in one pass: sort (log rho)^2 descending and mask the smallest prefix k whose
    removal brings the mean of the rest to <= m2_threshold (ties by position). The statistic is
    over this micro-batch. The paper aggregates with token_mean. The released code's adaptive-clip
    variant is not implemented. Metrics: approx_kl, ratio_mean, m2 (before masking),
    m2_masked (after), masked_fraction.
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    mask = response_mask.to(ratio.dtype)
    valid = mask > 0
    with torch.no_grad():
        squares = lr.detach().double() ** 2
        values = torch.sort(squares[valid], descending=True).values
        n = values.numel()
        # remaining mean after removing the k largest, for k = 0..n (the empty rest has mean 0)
        remaining_sum = torch.cat([values.sum().reshape(1), values.sum() - values.cumsum(0)])
        remaining_count = torch.arange(n, -1, -1, device=values.device, dtype=values.dtype)
        remaining_mean = torch.where(remaining_count > 0, remaining_sum / remaining_count.clamp(min=1), 0.0)
        k = int((remaining_mean > m2_threshold).long().cumprod(0).sum().item())
        masked = _top_k_mask(squares, valid, k)
        m2 = remaining_mean[0].item() if n else 0.0
        m2_masked = remaining_mean[k].item() if n else 0.0
    metrics = _ratio_metrics(lr, ratio, mask, masked_fraction=masked)
    metrics.update(m2=m2, m2_masked=m2_masked)
    return -ratio * advantages * (~masked) * mask, metrics


@POLICY_LOSSES.register("mdpo", ratio_term="its KL(pi_theta || pi_old) penalty", ratio_term_metric="kl")
def mdpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    progress: float,
    step_size: float = 1.0,
    min_step_size: float = 0.01,
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy MDPO (Tomar et al. 2020, "Mirror Descent Policy Optimization", arXiv:2005.09814).

        t_k  = max(step_size (1 - progress), min_step_size)      (paper: t_k = 1 - k/K)
        kl_t = rho_t log rho_t - rho_t + 1                          (>= 0)
        l_t  = -rho_t A_t + kl_t / t_k
    kl_t is an unbiased estimate of the reverse KL(pi_theta || pi_old) from tokens sampled by
    pi_old (E_old[rho log rho] = KL, E_old[rho - 1] = 0); its gradient, rho log rho grad logp,
    is 0 at theta = theta_old. The KL weight 1/t_k grows from 1/step_size to 1/min_step_size
    (the floor keeps it finite at progress = 1). The paper takes m = 10 SGD steps per batch:
    set update.epochs / minibatches in the preset. Metrics: approx_kl, ratio_mean, kl,
    kl_weight.
    """
    progress = min(max(float(progress), 0.0), 1.0)
    kl_weight = 1.0 / max(step_size * (1.0 - progress), min_step_size)
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    kl = ratio * lr - ratio + 1.0
    mask = response_mask.to(ratio.dtype)
    metrics = _ratio_metrics(lr, ratio, mask)
    metrics.update(kl=masked_mean(kl.detach(), mask).item(), kl_weight=kl_weight)
    return (-ratio * advantages + kl_weight * kl) * mask, metrics
