"""KL-divergence estimators between the policy and a frozen reference, per token.

Schulman (2020), "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html). With
delta_t = logp_t - ref_logp_t and samples o_t ~ pi_theta, each k estimates KL(pi_theta || pi_ref):
    k1 = delta                        (unbiased, high variance, can be negative)
    k2 = delta^2 / 2                  (biased, low variance; its gradient is the true KL gradient
                                       for small delta)
    k3 = exp(-delta) + delta - 1      (unbiased, low variance, always >= 0; GRPO's choice)
"""

from __future__ import annotations

import torch

from rlbench.algorithm.registry import KL_ESTIMATORS

KL_LOG_RATIO_LIMIT = 20.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - ref_logp)^2 / 2."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1, with the log-ratio clamped to +-20."""
    delta = (ref_logp - logp).clamp(-KL_LOG_RATIO_LIMIT, KL_LOG_RATIO_LIMIT)
    return torch.exp(delta) - delta - 1.0
