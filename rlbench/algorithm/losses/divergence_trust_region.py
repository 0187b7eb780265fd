"""DPPO, Divergence Proximal Policy Optimization (Qi et al. 2026, "Rethinking the Trust Region in LLM
Reinforcement Learning", arXiv:2602.04879): PPO's ratio clip replaced by a mask on a direct estimate of
the divergence between the current policy and the one that sampled the token, in its two binary
approximations (section 4): total variation (``dppo_tv``) and KL (``dppo_kl``), as verl registers them
(``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_dppo_tv`` / ``_dppo_kl``; the paper's own
code is sail-sg/Stable-RL).

Not to be confused with D-PPO (``loss=dppo``, Xie et al. 2023, arXiv:2310.20380), the dropout of
high-variance samples in ratio_clipped.py: another paper, another mechanism. The names here are verl's.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.common import _ratio_metrics, log_ratio, masked_mean
from rlbench.algorithm.registry import POLICY_LOSSES

#: verl's epsilon inside the binary KL's log((1 - mu) / (1 - pi)), so that p = 1 stays finite.
BINARY_KL_EPSILON = 1e-8
#: The truncation C of the importance weight. verl reads it from ``clip_ratio_c``, whose ActorConfig
#: default (3.0, the dual-clip bound) is what a verl run gets unless it sets it; the paper (section 5.4)
#: recommends a large C to avoid the truncation's bias, the authors' code defaults to 10 and verl's
#: DPPO example sets 10000. rlbench takes the authors' 10.
DEFAULT_TRUNCATION = 10.0

#: The term that acts only off ratio 1 (registry.Needs.ratio_term): at pi_theta = pi_old no token is
#: masked (the divergence is 0) and the weight is 1, so the gradient is REINFORCE's.
DPPO_RATIO_TERM = "its divergence mask (tokens whose probability moved past delta in the advantage's direction) and truncated IS weight"
DPPO_TOKEN_RATIO_ONLY = (
    (
        "sequence-level importance ratio: DPPO masks tokens by the divergence of each token's own "
        "distribution and weights each token's gradient by its own truncated ratio"
    ),
)
#: What both variants declare where they are registered (registry.Needs); verl's DPPO example aggregates
#: with seq-mean-token-sum-norm.
DPPO_NEEDS = {
    "ratio_level": "token", "paper_aggregation": "seq_mean_token_sum_norm", "conflicts": DPPO_TOKEN_RATIO_ONLY,
    "ratio_term": DPPO_RATIO_TERM, "ratio_term_metric": "dppo_masked_fraction",
}


def binary_total_variation(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """The signed change of the sampled token's probability, pi_t - mu_t; its absolute value is the
    total variation between the binary distributions {o_t, not o_t} under pi and mu (arXiv:2602.04879,
    section 4, Binary-TV)."""
    return torch.exp(logp) - torch.exp(old_logp)


def binary_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """KL(Bern(mu_t) || Bern(pi_t)) = mu log(mu / pi) + (1 - mu) log((1 - mu + e) / (1 - pi + e)),
    with mu = exp(old_logp), pi = exp(logp) and verl's e = 1e-8 (arXiv:2602.04879, section 4, Binary-KL)."""
    mu, pi = torch.exp(old_logp), torch.exp(logp)
    return mu * (old_logp - logp) + (1 - mu) * torch.log((1 - mu + BINARY_KL_EPSILON) / (1 - pi + BINARY_KL_EPSILON))


def _dppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    pushed_up_too_far: torch.Tensor,
    pushed_down_too_far: torch.Tensor,
    truncation: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """l_t = -M_t A_t sg(min(rho_t, C)) u_t with u_t = exp(logp_t - sg(logp_t)) (value 1, gradient
    grad logp_t), and M_t = 0 where A_t > 0 and the token is ``pushed_up_too_far``, or A_t <= 0 and it
    is ``pushed_down_too_far`` (verl's torch.where(A > 0, ...)); both indicators are detached."""
    if truncation <= 1.0:
        raise ValueError(f"truncation is the absolute cap C of the importance weight and must be > 1, got {truncation}")
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    with torch.no_grad():
        outside = torch.where(advantages > 0, pushed_up_too_far, pushed_down_too_far)
        weight = ratio.clamp(max=truncation)
    unit = torch.exp(logp - logp.detach())
    mask = response_mask.to(ratio.dtype)
    kept = (~outside).to(ratio.dtype)
    metrics = _ratio_metrics(lr, ratio, mask, dppo_masked_fraction=outside)
    with torch.no_grad():
        metrics["dppo_truncated_fraction"] = masked_mean(((ratio > truncation) & ~outside).to(mask.dtype), mask).item()
    return -advantages * weight * unit * kept * mask, metrics


@POLICY_LOSSES.register("dppo_tv", **DPPO_NEEDS)
def dppo_tv_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta_low: float = 0.15,
    delta_high: float = 0.15,
    truncation: float = DEFAULT_TRUNCATION,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879, eq. 11 with the binary TV of section 4; verl ``loss_mode=dppo_tv``):

        pi_t = exp(logp_t), mu_t = exp(old_logp_t), rho_t = pi_t / mu_t (log-ratio clamped to +-20)
        M_t  = 0 if A_t > 0 and pi_t - mu_t > delta_high      (pushed up out of the trust region)
               0 if A_t <= 0 and pi_t - mu_t < -delta_low     (pushed down out of it)
               1 otherwise
        l_t  = -M_t A_t sg(min(rho_t, C)) exp(logp_t - sg(logp_t))

    Its gradient, -M_t A_t min(rho_t, C) grad logp_t, is the paper's E[M_t rho_t A_t] (the gradient of
    rho_t is rho_t grad logp_t) with the ratio truncated at C (``truncation``; verl's ``clip_ratio_c``).
    Unlike PPO's ratio clip, a token's trust region is an absolute probability change, so rare tokens
    may move by large ratios and likely tokens cannot move by more than delta. The value of l_t is
    -M_t A_t min(rho_t, C), the paper's surrogate; verl's matrix is -M A sg(min(rho, C)) logp, whose
    gradient is the same and whose value is not a surrogate estimate. verl's deltas are its
    clip_ratio_low / _high (its DPPO example: 0.15).

    pi_old: verl anchors on ``old_log_prob``, the trainer's recomputed pi_old; the paper anchors on the
    rollout policy mu (its "_recompute" variants are verl's). With
    ``algorithm.sampling_correction.bypass=true`` old_logp is the rollout engine's log-probs, which is
    the paper's setting. At rho = 1 (one on-policy update) M = 1 and the gradient is REINFORCE's, that
    of ppo_clip at ratio 1. Metrics: approx_kl, ratio_mean, dppo_masked_fraction,
    dppo_truncated_fraction (kept tokens whose weight was capped at C).
    """
    with torch.no_grad():
        change = binary_total_variation(logp, old_logp)
    return _dppo(logp, old_logp, advantages, response_mask, change > delta_high, change < -delta_low, truncation)


@POLICY_LOSSES.register("dppo_kl", **DPPO_NEEDS)
def dppo_kl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta_low: float = 0.05,
    delta_high: float = 0.05,
    truncation: float = DEFAULT_TRUNCATION,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879, eq. 11 with the binary KL of section 4; verl
    ``loss_mode=dppo_kl``): as :func:`dppo_tv_loss` with the mask

        D_t = mu_t log(mu_t / pi_t) + (1 - mu_t) log((1 - mu_t) / (1 - pi_t))    (binary_kl)
        M_t = 0 if A_t > 0 and D_t > delta_high and pi_t > mu_t
              0 if A_t <= 0 and D_t > delta_low and pi_t < mu_t
              1 otherwise

    The direction condition makes the mask one-sided like the TV one: a token that moved against its
    advantage is never masked. verl's DPPO example sets delta = 0.05. Metrics: as dppo_tv.
    """
    with torch.no_grad():
        divergence = binary_kl(logp, old_logp)
        pi, mu = torch.exp(logp), torch.exp(old_logp)
        up, down = pi > mu, pi < mu
    return _dppo(logp, old_logp, advantages, response_mask, (divergence > delta_high) & up,
                 (divergence > delta_low) & down, truncation)
