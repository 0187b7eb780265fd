"""Losses whose importance ratio is formed per response: GSPO (and GSPO-token) and GMPO. Their
matrices give the papers' objectives only under ``seq_mean_token_mean`` aggregation (declared at
registration).
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.common import _ppo_metrics, _ppo_terms, _ratio_metrics, log_ratio, sequence_mean
from rlbench.algorithm.registry import POLICY_LOSSES

#: GSPO's term that acts only off ratio 1 (registry.Needs.ratio_term).
SEQUENCE_RATIO_TERM = ("its sequence-level ratio and clip (at ratio 1 the gradient is GRPO's with seq_mean_token_mean "
                       "aggregation)")


def _gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    token_level: bool,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (sequence ratio, sequence advantage) or GSPO-token (see gspo_loss)."""
    mask = response_mask.to(logp.dtype)
    seq_log_ratio = sequence_mean(log_ratio(logp, old_logp), mask)[:, None]
    if token_level:
        lr = seq_log_ratio.detach() + logp - logp.detach()
        adv = advantages
    else:
        lr = seq_log_ratio.expand_as(logp)
        adv = sequence_mean(advantages, mask)[:, None]
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, adv, 1.0 - clip_low, 1.0 + clip_high)
    return loss * mask, _ppo_metrics(lr, ratio, is_clipped, mask)


@POLICY_LOSSES.register(
    "gspo",
    ratio_term=SEQUENCE_RATIO_TERM,
    ratio_term_metric="clip_fraction",
    aggregation="seq_mean_token_mean",
    paper_aggregation="seq_mean_token_mean",
    advantage_level="sequence",
    ratio_level="sequence",
    conflicts=(
        "aggregation other than seq_mean_token_mean: each token carries its sequence's loss, so "
        "token_mean/seq_mean_token_sum would weight sequences by length",
        "token-level advantages: GSPO uses one advantage per response (use gspo_token)",
    ),
)
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

        s_i = exp( (1/|o_i|) sum_t m_it (logp_it - old_logp_it) )   (geometric mean of token ratios)
        A_i = (1/|o_i|) sum_t m_it A_it                              (the sequence advantage)
        J   = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - e_l, 1 + e_h) A_i)

    Every valid token of response i carries l_i = -min(...), so ``seq_mean_token_mean``
    aggregation returns (1/N_seq) sum_i l_i = -J: the preset MUST use it, with sequence-level
    advantages (declared at registration). Clipping removes whole sequences. Metrics: as ppo_clip, with
    s_i as the ratio (clip_fraction counts the tokens of clipped sequences).
    """
    return _gspo(logp, old_logp, advantages, response_mask, clip_low, clip_high, token_level=False)


@POLICY_LOSSES.register("gspo_token", paper_aggregation="seq_mean_token_mean", ratio_term=SEQUENCE_RATIO_TERM,
                        ratio_term_metric="clip_fraction")
def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071,
    §4.3).

        s_it = sg(s_i) * pi_theta(o_it) / sg(pi_theta(o_it)) = exp(sg(log s_i) + logp_it - sg(logp_it))
        l_it = max(-A_it s_it, -A_it clip(s_it, 1 - e_l, 1 + e_h))
    Same value as GSPO; grad s_it = s_i grad logp_it. When A_it = A_i within each response, the
    gradient under ``seq_mean_token_mean`` equals GSPO's; it also accepts token-level
    advantages. The paper's objective averages per sequence (seq_mean_token_mean).
    Metrics: as gspo.
    """
    return _gspo(logp, old_logp, advantages, response_mask, clip_low, clip_high, token_level=True)


@POLICY_LOSSES.register(
    "gmpo",
    ratio_term="its geometric-mean sequence ratio and log-ratio clip (at ratio 1 the gradient is GRPO's with "
               "seq_mean_token_mean aggregation)",
    ratio_term_metric="clip_fraction",
    aggregation="seq_mean_token_mean",
    paper_aggregation="seq_mean_token_mean",
    advantage_level="sequence",
    ratio_level="sequence",
    conflicts=(
        "aggregation other than seq_mean_token_mean: each token carries its sequence's loss",
        "token-level advantages: GMPO's geometric mean uses one advantage per response",
    ),
)
def gmpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673;
    verl's ``geo_mean``).

        J_i = sgn(A_i) (prod_t |min(rho_t A_i, clip(rho_t, e^-e_l, e^e_h) A_i)|)^(1/|o_i|)
            = A_i exp( (1/|o_i|) sum_t c_t ),
        c_t = min(log rho_t, e_h) if A_i > 0,   max(log rho_t, -e_l) if A_i < 0   (sign-aware clip)
    clip_low/clip_high are bounds on the LOG-ratio. A_i = per-sequence mean of the advantages.
    Every valid token of response i carries -J_i, so the preset MUST aggregate with
    ``seq_mean_token_mean`` and use sequence-level advantages (declared at registration), giving the
    paper's (1/G) sum_i -J_i. Clipped tokens drop out of the gradient.
    Metrics: approx_kl, ratio_mean (sequence ratios), clip_fraction (clipped tokens).
    """
    mask = response_mask.to(logp.dtype)
    lr = log_ratio(logp, old_logp)
    adv = sequence_mean(advantages, mask)[:, None]
    clipped_lr = torch.where(adv > 0, lr.clamp(max=clip_high), lr.clamp(min=-clip_low))
    seq_ratio = torch.exp(sequence_mean(clipped_lr, mask))[:, None]
    loss = (-adv * seq_ratio).expand_as(logp)
    metrics = _ratio_metrics(lr, seq_ratio.expand_as(logp), mask, clip_fraction=(clipped_lr != lr) & (adv != 0))
    return loss * mask, metrics
