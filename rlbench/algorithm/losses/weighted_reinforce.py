"""The REINFORCE family: l_t = -w_t A_t logp_t with a stop-gradient weight w_t (1, a clipped IS
weight, or a regularised one): REINFORCE, CISPO, and the off-policy REC / OPMD / AsymRE losses.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.common import _ratio_metrics, log_ratio
from rlbench.algorithm.registry import POLICY_LOSSES
from rlbench.errors import ConfigError


def _weighted_reinforce(
    logp: torch.Tensor, advantages: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """l_t = -sg(w_t) A_t logp_t  (w = 1 when None): gradient -w A grad logp."""
    loss = -advantages * logp
    return loss if weight is None else weight.detach() * loss


@POLICY_LOSSES.register(
    "reinforce", on_policy="l = -A logp has no importance ratio: its gradient is the policy gradient only for samples of pi_theta"
)
def reinforce_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms for
    connectionist reinforcement learning", Machine Learning 8:229-256), as used by GPG (Chu et al.
    2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv:2504.02546; verl's ``gpg`` loss).

        l_t = -A_t logp_t        (no ratio, no clipping; on-policy by construction)
    Metrics: none.
    """
    mask = response_mask.to(logp.dtype)
    return _weighted_reinforce(logp, advantages) * mask, {}


#: Why CISPO refuses a sequence-level importance ratio.
CISPO_TOKEN_RATIO_ONLY = (
    "sequence-level importance ratio: CISPO clips a per-token IS weight that multiplies "
    "that token's logp gradient; a sequence ratio has no per-token weight to clip (undefined)",
)


#: CISPO's term that acts only off ratio 1 (registry.Needs.ratio_term): at ratio 1 it is REINFORCE.
CISPO_RATIO_TERM = "its clipped importance weight on every token's gradient"


def _cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    lower: float | None,
    upper: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """l_t = -sg(clip(rho_t, lower, upper)) A_t logp_t (see the two registered wrappers)."""
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    weight = ratio.clamp(lower, upper)
    mask = response_mask.to(ratio.dtype)
    metrics = _ratio_metrics(lr, ratio, mask, cispo_clip_fraction=weight != ratio)
    return _weighted_reinforce(logp, advantages, weight) * mask, metrics


@POLICY_LOSSES.register(
    "cispo_upper", ratio_level="token", paper_aggregation="token_mean", conflicts=CISPO_TOKEN_RATIO_ONLY,
    ratio_term=CISPO_RATIO_TERM, ratio_term_metric="cispo_clip_fraction",
)
def cispo_upper_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ratio_max: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO with an upper cap only, TRL's semantics (MiniMax 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585).

        l_t = -sg(min(rho_t, ratio_max)) A_t logp_t
    ratio_max is an ABSOLUTE ratio (TRL's ``epsilon_high`` for cispo; ScaleRL, arXiv:2510.13786,
    recommends 5.0), not 1 + epsilon; values <= 1 are rejected as a likely relative epsilon.
    The gradient flows only through logp, so clipped tokens keep a (capped) gradient; the loss
    value is not a surrogate estimate. verl's ``cispo`` is cispo_two_sided.
    Metrics: approx_kl, ratio_mean, cispo_clip_fraction.
    """
    if ratio_max <= 1.0:
        raise ValueError(f"ratio_max is an absolute ratio cap and must be > 1, got {ratio_max}")
    return _cispo(logp, old_logp, advantages, response_mask, None, ratio_max)


@POLICY_LOSSES.register(
    "cispo_two_sided", ratio_level="token", paper_aggregation="token_mean", conflicts=CISPO_TOKEN_RATIO_ONLY,
    ratio_term=CISPO_RATIO_TERM, ratio_term_metric="cispo_clip_fraction",
)
def cispo_two_sided_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO with a two-sided clip, verl's semantics (MiniMax 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585).

        l_t = -sg(clip(rho_t, 1 - clip_low, 1 + clip_high)) A_t logp_t
    The paper's r^ = clip(r, 1 - e_low^IS, 1 + e_high^IS); it effectively leaves the lower bound
    open (cispo_upper). Equals cispo_upper whenever every ratio lies in
    [1 - clip_low, min(1 + clip_high, ratio_max)]. Metrics: as cispo_upper.
    """
    return _cispo(logp, old_logp, advantages, response_mask, 1.0 - clip_low, 1.0 + clip_high)


CLIP_MODES = ("none", "one_side", "two_side", "ring")


WEIGHTINGS = ("none", "importance", "advantage")


def rec_keep_mask(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_mode: str = "none",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_low_prime: float = 0.6,
    clip_high_prime: float = 2.0,
) -> torch.Tensor:
    """REC's token mask M (Yao et al. 2025, arXiv:2509.24203, section 4; Trinity-RFT's ``rec`` policy
    loss, modelscope/Trinity-RFT trinity/algorithm/policy_loss_fn/rec_policy_loss.py), on sg(rho):

        none     : M = 1
        one_side : M = 0 iff (A > 0 and rho > 1 + e_h) or (A < 0 and rho < 1 - e_l)   (PPO's frozen tokens)
        two_side : M = 1 iff 1 - e_l <= rho <= 1 + e_h
        ring     : M = 1 iff 1 - e_l <= rho <= 1 + e_h
                          or (A >= 0 and rho <= 1 - e_l')  or  (A <= 0 and rho >= 1 + e_h')
    The ring keeps the trust band and the far tokens whose update moves rho back towards 1 (a
    positive token the policy has nearly dropped, a negative one it has greatly raised); it drops
    the band between. Defaults e_l' = 0.6, e_h' = 2 (Trinity-RFT's default_args). Returns bool."""
    ratio = ratio.detach()
    if clip_mode == "none":
        return torch.ones_like(ratio, dtype=torch.bool)
    band = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
    if clip_mode == "two_side":
        return band
    if clip_mode == "one_side":
        return ~(((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low)))
    if clip_mode == "ring":
        return band | ((advantages >= 0) & (ratio <= 1.0 - clip_low_prime)) | (
            (advantages <= 0) & (ratio >= 1.0 + clip_high_prime)
        )
    raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")


def advantage_weighted(advantages: torch.Tensor, temp: float = 1.0) -> torch.Tensor:
    """REC's advantage weighting, the RED-Weight variant (arXiv:2509.24203; Trinity-RFT's ``rec`` loss,
    weight "advantage_unnormalized"):  A' = A exp(A / temp)  (temp > 0; unnormalised). Responses
    with a large positive advantage are up-weighted, negative ones shrunk towards 0."""
    return advantages * torch.exp(advantages / temp)


def check_rec(params) -> None:
    """ConfigError on an unknown clip_mode / weighting or a bad ring bound or temperature."""
    if params.get("clip_mode", "none") not in CLIP_MODES:
        raise ConfigError(f"algorithm.loss.clip_mode must be one of {CLIP_MODES}, got {params['clip_mode']!r}")
    if params.get("weighting", "none") not in WEIGHTINGS:
        raise ConfigError(f"algorithm.loss.weighting must be one of {WEIGHTINGS}, got {params['weighting']!r}")
    if not 0.0 < params.get("clip_low_prime", 0.6) <= 1.0 or params.get("clip_high_prime", 2.0) <= 0.0:
        raise ConfigError("algorithm.loss.clip_low_prime must lie in (0, 1] and clip_high_prime be > 0 (the ring's outer bounds)")
    if params.get("temp", 1.0) <= 0.0:
        raise ConfigError(f"algorithm.loss.temp must be > 0, got {params['temp']}")


def _regularised_reinforce(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_mode: str = "none",
    weighting: str = "none",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_low_prime: float = 0.6,
    clip_high_prime: float = 2.0,
    temp: float = 1.0,
    reg_coef: float = 0.0,
    baseline_shift: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The REC family (see rec_loss): -w M (A + delta) logp + (tau/2)(logp - old_logp)^2."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    adv = advantages + baseline_shift
    with torch.no_grad():
        keep = rec_keep_mask(ratio, adv, clip_mode, clip_low, clip_high, clip_low_prime, clip_high_prime)
        weight = keep * (ratio if weighting == "importance" else 1.0)
    if weighting == "advantage":
        adv = advantage_weighted(adv, temp)
    loss = _weighted_reinforce(logp, adv, weight) + 0.5 * reg_coef * lr**2
    mask = response_mask.to(ratio.dtype)
    return loss * mask, _ratio_metrics(lr, ratio, mask, masked_fraction=~keep)


def _rec_ratio_term(params) -> str | None:
    """The mask, importance weight and regulariser act only off ratio 1; advantage weighting acts at ratio 1."""
    if params.get("weighting", "none") == "advantage":
        return None
    return "its clip_mode mask, importance weighting and regulariser (at ratio 1 every variant is REINFORCE)"


@POLICY_LOSSES.register("rec", paper_aggregation="seq_mean_token_sum", ratio_term=_rec_ratio_term,
                        ratio_term_metric="masked_fraction", check_params=check_rec)
def rec_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_mode: str = "none",
    weighting: str = "none",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_low_prime: float = 0.6,
    clip_high_prime: float = 2.0,
    temp: float = 1.0,
    reg_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REC, off-policy group-relative REINFORCE (Yao et al. 2025, "Group-Relative REINFORCE Is
    Secretly an Off-Policy Algorithm: Demystifying Some Myths About GRPO and Its Friends",
    arXiv:2509.24203; Trinity-RFT's ``rec`` policy loss).

        l_t = -w_t M_t A_t logp_t + (reg_coef / 2) (logp_t - old_logp_t)^2
        M (clip_mode): none | one_side | two_side | ring, on sg(rho)  (rec_keep_mask; ring with
                       e_l' = clip_low_prime, e_h' = clip_high_prime)
        w (weighting): none -> 1 | importance -> sg(rho) | advantage -> A replaced by A exp(A / temp)
                       (advantage_weighted; the RED-Weight variant)
    The paper's A = R_i - mean R (no std: pair with the dr_grpo advantage) and divides by the
    batch size (seq_mean_token_sum). With on-policy data the mask and importance weight are inert
    (rho = 1 is inside every mask); advantage weighting is not. Metrics: approx_kl, ratio_mean,
    masked_fraction.
    """
    return _regularised_reinforce(
        logp, old_logp, advantages, response_mask,
        clip_mode=clip_mode, weighting=weighting, clip_low=clip_low, clip_high=clip_high,
        clip_low_prime=clip_low_prime, clip_high_prime=clip_high_prime, temp=temp, reg_coef=reg_coef,
    )


@POLICY_LOSSES.register("opmd", ratio_term="its regulariser (tau / 2) (log ratio)^2")
def opmd_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """OPMD as regularised REINFORCE (Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement Learning
    with LLMs", arXiv:2501.12599; in the REC form of arXiv:2509.24203).

        l_t = -A_t logp_t + (tau / 2) (logp_t - old_logp_t)^2
    The regulariser is per token (the papers write it on log-probs without fixing token vs
    sequence level); its gradient is 0 at theta = theta_old. = rec(reg_coef=tau).
    Metrics: as rec.
    """
    return _regularised_reinforce(logp, old_logp, advantages, response_mask, reg_coef=tau)


@POLICY_LOSSES.register("asymre")
def asymre_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    baseline_shift: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Asymmetric REINFORCE (Arnal et al. 2025, "Asymmetric REINFORCE for off-Policy Reinforcement
    Learning: Balancing positive and negative rewards", arXiv:2506.20520).

        A'_t = R_i - (mean R - delta) = A_t + delta,    l_t = -A'_t logp_t
    A lowered baseline (delta = baseline_shift > 0) up-weights positive samples under off-policy
    data; meant for un-normalised advantages A = R - mean R (dr_grpo). = rec with the shift.
    Metrics: as rec.
    """
    return _regularised_reinforce(logp, old_logp, advantages, response_mask, baseline_shift=baseline_shift)
