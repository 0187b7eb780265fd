"""Ratio-based surrogates with a soft trust region instead of PPO's hard clip: SAPO's sigmoid gate,
SPO's quadratic penalty, M2PO's second-moment masking (or its adaptive clip) and on-policy MDPO.
"""

from __future__ import annotations

import math

import torch

from rlbench.algorithm.losses.common import (
    _ppo_terms,
    _ratio_metrics,
    _top_k_mask,
    log_ratio,
    masked_mean,
)
from rlbench.algorithm.registry import POLICY_LOSSES


@POLICY_LOSSES.register("soft_sapo", paper_aggregation="seq_mean_token_mean",
                        ratio_term="its soft gate on the ratio (at ratio 1 the gradient is the plain policy gradient)",
                        ratio_term_metric="gate_damping")
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
    (seq_mean_token_mean). Metrics: approx_kl, ratio_mean, gate_mean (mean f(rho)), gate_damping: the mean of
    1 - w_t over tokens, where w_t = f'(rho_t) = 4 sigmoid(x)(1 - sigmoid(x)), x = tau (rho_t - 1), is the token's
    gradient weight relative to the policy gradient (eq. 5's sech^2(x / 2)); 0 exactly when every rho_t = 1.
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    mask = response_mask.to(ratio.dtype)
    metrics = _ratio_metrics(lr, ratio, mask)
    metrics["gate_mean"] = masked_mean(gate.detach(), mask).item()
    gate_sigmoid = torch.sigmoid(tau * (ratio - 1.0)).detach()
    metrics["gate_damping"] = masked_mean(1.0 - 4.0 * gate_sigmoid * (1.0 - gate_sigmoid), mask).item()
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


def m2po_clip_bounds(
    log_ratio_: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, m2_threshold: float
) -> tuple[float, float, float]:
    """The adaptive-clip variant's trust region (the released ``kpo_clip_harmful_tokens``,
    Infini-AI-Lab/M2PO verl/trainer/ppo/core_algos.py; arXiv:2510.01161). Over the harmful tokens
    H = {A > 0 and rho > 1} u {A < 0 and rho < 1} with d_t = (log rho_t)^2 sorted ascending
    d_(1) <= ... <= d_(n):

        M2 = mean_H d;  if M2 <= m2_threshold: tau = inf (no constraint)
        else k = the first index with sum_{i<=k} d_(i) + (n - k) d_(k) >= n m2_threshold,
             tau = sqrt(d_(k-1)) (0 when k = 1): the largest observed |log rho| whose cap keeps the
             capped mean of H within the budget

    Returns (tau, M2, M2 after capping at tau), float64 statistics of this micro-batch."""
    harmful = valid & (((advantages > 0) & (log_ratio_ > 0)) | ((advantages < 0) & (log_ratio_ < 0)))
    values = torch.sort(log_ratio_.detach().double()[harmful] ** 2).values
    n = values.numel()
    m2 = values.mean().item() if n else 0.0
    if n == 0 or m2 <= m2_threshold + 1e-12:
        return float("inf"), m2, m2
    capped_sums = values.cumsum(0) + values * torch.arange(n - 1, -1, -1, dtype=values.dtype, device=values.device)
    k = int((capped_sums < n * m2_threshold - 1e-12).sum().item())  # capped_sums is non-decreasing
    if k == 0:
        return 0.0, m2, 0.0
    tau_sq = values[k - 1].item()
    return tau_sq**0.5, m2, (values[:k].sum().item() + tau_sq * (n - k)) / n


@POLICY_LOSSES.register("m2po", paper_aggregation="token_mean", ratio_term="its second-moment trust region",
                        ratio_term_metric="masked_fraction")
def m2po_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    m2_threshold: float = 0.04,
    mode: str = "mask",
    min_clip_low: float = 0.3,
    min_clip_high: float = 0.5,
) -> tuple[torch.Tensor, dict[str, float]]:
    """M2PO second-moment trust region (Zheng, Zhao & Chen 2025, "Prosperity before Collapse: How Far
    Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161).

    mode "mask" (the paper's algorithm):
        M2 = mean over unmasked valid tokens of (log rho_t)^2
        while M2 > m2_threshold: mask the token with the largest (log rho_t)^2, recompute M2
        l_t = -M_t rho_t A_t                                                   (no other clipping)
      computed in one pass: sort (log rho)^2 descending and mask the smallest prefix k whose removal
      brings the mean of the rest to <= m2_threshold (ties by position).
    mode "clip" (the released code's compute_m2po_policy_loss): tau from :func:`m2po_clip_bounds`,
        e_l = max(1 - exp(-tau), min_clip_low),  e_h = max(exp(tau) - 1, min_clip_high)
        l_t = ppo_clip(rho_t, A_t, 1 - e_l, 1 + e_h)    (one pair of bounds for the micro-batch)
      within budget tau = inf: e_l = 1, e_h = inf, the unclipped surrogate -rho A.
    The statistics are over this micro-batch. The paper aggregates with token_mean. Metrics:
    approx_kl, ratio_mean, m2 (mask: all tokens; clip: the harmful ones), m2_masked (after masking /
    capping), masked_fraction (tokens without gradient: masked, or clipped), and in clip mode
    clip_low / clip_high (e_l, e_h).
    """
    if mode not in ("mask", "clip"):
        raise ValueError(f"m2po mode must be 'mask' or 'clip', got {mode!r}")
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    mask = response_mask.to(ratio.dtype)
    valid = mask > 0
    if mode == "clip":
        with torch.no_grad():
            tau, m2, m2_capped = m2po_clip_bounds(lr, advantages, valid, m2_threshold)
        eps_low = max(1.0 - math.exp(-tau), min_clip_low)
        eps_high = max(math.expm1(tau) if tau < 700 else math.inf, min_clip_high)
        loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - eps_low, 1.0 + eps_high)
        metrics = _ratio_metrics(lr, ratio, mask, masked_fraction=is_clipped)
        metrics.update(m2=m2, m2_masked=m2_capped, clip_low=eps_low, clip_high=eps_high)
        return loss * mask, metrics
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
