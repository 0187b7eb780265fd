"""Entropy pieces outside the policy loss: the adaptive entropy-bonus coefficient and the
top-entropy-quantile token mask (a top-score token mask, shared with D3S's |A| H mask).

Both read the per-token entropy H_t = -sum_v pi(v | q, o_<t) log pi(v | q, o_<t) (detached).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlbench.algorithm.schedules import settings_from_block
from rlbench.errors import ConfigError


def adaptive_entropy_coefficient(
    coef: float, entropy: float, target: float, delta: float, min_coef: float, max_coef: float
) -> float:
    """Adaptive entropy control (He et al. 2025, "Skywork Open Reasoner 1 Technical Report",
    arXiv:2505.22312, "adaptive entropy control"; the rule TRL implements as ``use_adaptive_entropy``):

        c_{k+1} = clip(c_k + delta, c_min, c_max)    if H_k <= H_target
                = clip(c_k - delta, c_min, c_max)    if H_k >  H_target

    H_k is the mean token entropy of step k's batch. The coefficient of the entropy bonus rises while
    the policy is below the target entropy and falls while it is above, so the bonus pushes only
    when entropy has collapsed below the target. TRL's defaults: H_target = 0.2 nats, delta = 0.005,
    [c_min, c_max] = [0, 1].
    """
    step = delta if entropy <= target else -delta
    return min(max(coef + step, min_coef), max_coef)


ADAPTIVE_ENTROPY_KEYS = {"target", "delta", "min_coef", "max_coef", "gate"}


@dataclass(frozen=True)
class AdaptiveEntropy:
    """``algorithm.entropy_adaptive``: {target, delta, min_coef, max_coef, gate}.

    ``gate=True`` applies the coefficient only while the last observed entropy is at or below the
    target (alpha_k = c_k 1[H_k <= H_target]), the activation rule we read in Skywork-OR1 (verify
    against the paper); ``gate=False`` (default) applies c_k always, like TRL.
    """

    target: float
    delta: float = 0.005
    min_coef: float = 0.0
    max_coef: float = 1.0
    gate: bool = False

    @classmethod
    def from_config(cls, node: Any) -> "AdaptiveEntropy":
        params = {key: value for key, value in dict(node).items() if value is not None}  # null: left out
        unknown = set(params) - ADAPTIVE_ENTROPY_KEYS
        if unknown or "target" not in params:
            raise ConfigError(
                f"algorithm.entropy_adaptive takes target (required) and {sorted(ADAPTIVE_ENTROPY_KEYS - {'target'})}; "
                f"got {sorted(params)}"
            )
        return settings_from_block(cls, params, "algorithm.entropy_adaptive")

    def check(self) -> None:
        if self.target < 0 or self.delta <= 0 or not 0 <= self.min_coef <= self.max_coef:
            raise ConfigError(
                f"algorithm.entropy_adaptive needs target >= 0, delta > 0 and 0 <= min_coef <= max_coef; got {self}"
            )

    def next_coefficient(self, coef: float, entropy: float) -> float:
        return adaptive_entropy_coefficient(coef, entropy, self.target, self.delta, self.min_coef, self.max_coef)

    def applied(self, coef: float, last_entropy: float | None) -> float:
        """The coefficient used in the loss (0 while gated off; the gate is open before any observation)."""
        if self.gate and last_entropy is not None and last_entropy > self.target:
            return 0.0
        return coef


def top_entropy_token_mask(entropy: torch.Tensor, response_mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """High-entropy minority tokens (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority
    Tokens Drive Effective Reinforcement Learning for LLM Reasoning", arXiv:2506.01939, eq. 6):
    only the top-rho fraction of the batch's response tokens by entropy get a policy gradient,

        J = E[ (1 / sum_i |o_i|) sum_i sum_t 1[H_{i,t} >= tau_rho] min(rho_t A_t, clip(rho_t) A_t) ]

    with tau_rho the entropy of the k-th highest-entropy token of the batch, k = ceil(rho N) over
    the N valid tokens (the paper's rho = 0.2): :func:`top_score_token_mask` with score H. The
    normaliser is unchanged: the mask multiplies the token loss matrix before aggregation.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {fraction}")
    return top_score_token_mask(entropy, response_mask, fraction)


def top_score_token_mask(score: torch.Tensor, response_mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """1 on the top ``fraction`` of the valid tokens (response_mask > 0) by ``score`` [B,T] (detached),
    0 elsewhere: the k = ceil(fraction N) highest of the N valid scores are kept, and tokens tied with the
    k-th are kept too (an all-equal batch keeps every token). Returns the mask [B,T] (response_mask's
    dtype), 0 on padding; a batch without valid tokens gives all zeros. The token masks of the
    top-entropy quantile (score H) and of D3S (score |A| H, rlbench.algorithm.downsampling) are this.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"the kept token fraction must be in (0, 1], got {fraction}")
    valid = response_mask > 0
    values = score.detach()[valid]
    if values.numel() == 0:
        return torch.zeros_like(response_mask)
    k = max(1, math.ceil(round(fraction * values.numel(), 9)))  # 0.3 * 10 is 3.0000000000000004
    threshold = torch.topk(values, k).values[-1]
    return (valid & (score.detach() >= threshold)).to(response_mask.dtype)
