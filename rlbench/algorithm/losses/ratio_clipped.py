"""PPO-style losses that clip (or otherwise bound) the per-token importance ratio: PPO-clip,
the unclipped IS surrogate, and the variants that change the clip range or what passes through it
(INTELLECT-2, CE-GPPO, AEPO, HAPO, PPO-EWMA, DPPO, DeGRPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlbench.algorithm.losses.common import (
    _count,
    _ppo_metrics,
    _ppo_terms,
    _ratio_metrics,
    _top_k_mask,
    log_ratio,
    masked_mean,
)
from rlbench.algorithm.registry import POLICY_LOSSES
from rlbench.errors import ConfigError


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
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv:1707.06347) with decoupled clip range (DAPO "clip-higher", Yu et al. 2025, "DAPO: An
    Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476) and optional dual
    clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning", arXiv:1912.09729).

        rho_t  = exp(logp_t - old_logp_t)                      (log-ratio clamped to +-20)
        l_t    = max(-A_t rho_t, -A_t clip(rho_t, 1 - clip_low, 1 + clip_high))
        l_t    = min(l_t, -A_t c)   where A_t < 0, if dual_clip = c (> 1)

    Metrics: clip_fraction (tokens where the clipped term is active), clip_fraction_low/high,
    approx_kl = mean(old_logp - logp), ratio_mean.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high, dual_clip)
    mask = response_mask.to(loss.dtype)
    return loss * mask, _ppo_metrics(lr, ratio, is_clipped, mask)


@POLICY_LOSSES.register("is_surrogate")
def is_surrogate_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The unclipped importance-sampled surrogate that TRPO maximises under its KL constraint
    (Schulman et al. 2015, "Trust Region Policy Optimization", arXiv:1502.05477, eq. 14; L^CPI of
    the PPO paper, arXiv:1707.06347, eq. 6):

        l_t = -rho_t A_t,    rho_t = exp(logp_t - old_logp_t)

    At rho = 1 its gradient is REINFORCE's. It has no trust region of its own: use it with
    ``algorithm.update.schedule=trpo`` (or a single on-policy step). Metrics: approx_kl, ratio_mean.
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    mask = response_mask.to(ratio.dtype)
    return -advantages * ratio * mask, _ratio_metrics(lr, ratio, mask)


@POLICY_LOSSES.register("intellect2", ratio_term="its cap delta on the ratio of negative-advantage tokens (two-sided clipping)")
def intellect2_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    delta: float = 4.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """INTELLECT-2 two-sided clipping (Prime Intellect Team 2025, "INTELLECT-2: A Reasoning Model
    Trained Through Globally Decentralized Reinforcement Learning", arXiv:2505.07291).

    The paper caps the *unclipped* ratio at delta in GRPO's surrogate (TRL's ``delta``):

        l_t = -min(min(rho_t, delta) A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t)

    For delta >= 1 + clip_high this is exactly ppo_clip's dual clip with c = delta
    (Ye et al. 2020, arXiv:1912.09729), l_t = min(ppo_l_t, -A_t delta) where A_t < 0: for A > 0
    the clipped branch (<= 1 + clip_high < delta) already wins, for A < 0 and rho > delta both
    forms give the constant -A delta (zero gradient). verl's ``clip_ratio_c`` is the same knob
   . So this is ppo_clip with dual_clip = delta; delta < 1 + clip_high would also
    cap positive-advantage tokens and is rejected. Metrics: as ppo_clip.
    """
    if delta < 1.0 + clip_high:
        raise ValueError(f"delta must be >= 1 + clip_high = {1.0 + clip_high}, got {delta}")
    return ppo_clip_loss(logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip=delta)


def _gradient_preserving_clip(
    lr: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    beta_low: float | None,
    beta_high: float | None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip whose clipped tokens keep a bounded gradient (shared by ce_gppo and aepo).

    With u_t = rho_t / sg(rho_t) (value 1, gradient grad logp_t):
        A < 0, rho < 1 - clip_low :  l = -beta_low  (1 - clip_low) A u     (if beta_low is not None)
        A > 0, rho > 1 + clip_high:  l = -beta_high (1 + clip_high) A u    (if beta_high is not None)
        otherwise                 :  l = ppo_clip's max(-A rho, -A clip(rho)), then min(l, -A c) where
                                     A < 0 if dual_clip = c (> 1; verl's clip_ratio_c)
    beta None keeps PPO's constant (zero-gradient) value on that side. The dual clip caps A < 0 tokens
    with rho > c; it is applied before the beta branches, which equals the released codes' min(-A c, l)
    after them whenever beta_low (1 - clip_low) <= c (0.5 x 0.8 <= 10 in CE-GPPO's scripts)."""
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high, dual_clip)
    unit = torch.exp(lr - lr.detach())
    if beta_low is not None:
        low = (advantages < 0) & (ratio < 1.0 - clip_low)
        loss = torch.where(low, -beta_low * (1.0 - clip_low) * advantages * unit, loss)
    if beta_high is not None:
        high = (advantages > 0) & (ratio > 1.0 + clip_high)
        loss = torch.where(high, -beta_high * (1.0 + clip_high) * advantages * unit, loss)
    return loss, is_clipped


def check_dual_clip(params) -> None:
    """ConfigError on a dual-clip bound c <= 1 (it must lie above the ratio 1)."""
    if params.get("dual_clip") is not None and params["dual_clip"] <= 1.0:
        raise ConfigError(f"algorithm.loss.dual_clip must be > 1 (or null), got {params['dual_clip']}")


@POLICY_LOSSES.register("ce_gppo", paper_aggregation="token_mean",
                        ratio_term="its bounded gradients (beta_low, beta_high) on clipped tokens",
                        ratio_term_metric="clip_fraction", check_params=check_dual_clip)
def ce_gppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    beta_low: float = 0.5,
    beta_high: float = 1.0,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CE-GPPO gradient-preserving clipping (Su et al. 2025, "CE-GPPO: Coordinating Entropy via
    Gradient-Preserving Clipping Policy Optimization in Reinforcement Learning", arXiv:2509.20712).

    PPO zeroes the gradient of clipped tokens; CE-GPPO gives them a bounded one (sg = stop-grad):
        A_t < 0, rho_t < 1 - e_l:  J_t = beta_low  (1 - e_l) (rho_t / sg(rho_t)) A_t
        A_t > 0, rho_t > 1 + e_h:  J_t = beta_high (1 + e_h) (rho_t / sg(rho_t)) A_t
        otherwise             :  J_t = min(rho_t A_t, clip(rho_t, 1 - e_l, 1 + e_h) A_t)
        l_t = -J_t
    The clipped terms' gradient is beta (1 -+ e) A grad logp (not scaled by rho). beta = 1 keeps
    PPO's forward value; beta = 0 gives PPO's gradient (value 0 on clipped tokens). beta_low acts
    on negative tokens (exploitation, lowers entropy), beta_high on positive ones (exploration).
    dual_clip = c caps A < 0 tokens at -A c (the released compute_gppo_loss_general_beta applies
    verl's clip_ratio_c; the authors' scripts set 10). Metrics: as ppo_clip (clip_fraction = tokens
    in the clipped regions).
    """
    lr = log_ratio(logp, old_logp)
    loss, is_clipped = _gradient_preserving_clip(lr, advantages, clip_low, clip_high, beta_low, beta_high, dual_clip)
    mask = response_mask.to(loss.dtype)
    return loss * mask, _ppo_metrics(lr, torch.exp(lr), is_clipped, mask)


@dataclass(frozen=True)
class EntropyScale:
    """HAPO's token-entropy normaliser (arXiv:2509.16591), fitted on one batch and applicable to any
    entropies (the adaptive temperature applies the previous batch's to the next rollout):

        x = log max(H, 1e-6),   q = quantile_pivot(x over the fitted tokens)
        h = (x - q) / above  if x > q,   (x - q) / below  if x <= q,   clamped to [-1, 1]
    with ``above = max(x - q)`` and ``below = |min(x - q)|`` over the fitted tokens (1 when that side is
    empty). The paper also divides by std(x - q) first; that factor cancels in the rescaling."""

    pivot: float  # q
    above: float
    below: float

    @staticmethod
    def log_entropy(entropy: torch.Tensor) -> torch.Tensor:
        return torch.log(entropy.detach().clamp(min=1e-6))

    @classmethod
    def fit(cls, entropy: torch.Tensor, mask: torch.Tensor, pivot: float) -> "EntropyScale | None":
        """The scale of the tokens where ``mask > 0`` (None when there is none)."""
        valid = mask > 0
        if not valid.any():
            return None
        x = cls.log_entropy(entropy)[valid]
        q = torch.quantile(x.double(), pivot).to(x.dtype)
        centred = x - q
        above, below = centred[centred > 0], centred[centred < 0]
        return cls(
            float(q), float(above.max()) if above.numel() else 1.0, float(below.min().abs()) if below.numel() else 1.0
        )

    def __call__(self, entropy: torch.Tensor) -> torch.Tensor:
        """h in [-1, 1] for each entry of ``entropy`` (nats)."""
        centred = self.log_entropy(entropy) - self.pivot
        return torch.where(centred > 0, centred / self.above, centred / self.below).clamp(-1.0, 1.0)


def normalized_entropy(entropy: torch.Tensor, mask: torch.Tensor, pivot: float) -> torch.Tensor:
    """HAPO's in-batch normalised token entropy h in [-1, 1] (:class:`EntropyScale` fitted on the
    valid tokens and applied to them): one valid token attains +1 and one -1 (when both sides of the
    pivot are non-empty); padding gets 0."""
    with torch.no_grad():
        scale = EntropyScale.fit(entropy, mask, pivot)
        if scale is None:
            return torch.zeros_like(entropy)
        return torch.where(mask > 0, scale(entropy), torch.zeros_like(entropy))


def standardized_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """z = (H - mean H) / std H over the valid tokens (std with Bessel's correction; 1 where it is 0 or
    undefined), 0 on padding: AEPO's released entropy normalisation (verl core_algos.py,
    compute_policy_loss_entropy_balanced_clipping, github.com/RUC-NLPIR/ARPO AEPO/)."""
    with torch.no_grad():
        valid = mask > 0
        values = entropy[valid].double()
        if values.numel() == 0:
            return torch.zeros_like(entropy)
        std = values.std().item() if values.numel() > 1 else 0.0
        z = (entropy.double() - values.mean()) / (std if std > 0 else 1.0)
        return torch.where(valid, z, torch.zeros_like(z)).to(entropy.dtype)


AEPO_ENTROPY_NORMS = ("pivot", "zscore")


def check_aepo(params) -> None:
    """ConfigError on an unknown entropy normalisation or a dual-clip bound <= 1."""
    check_dual_clip(params)
    if params["entropy_norm"] not in AEPO_ENTROPY_NORMS:
        raise ConfigError(f"algorithm.loss.entropy_norm must be one of {AEPO_ENTROPY_NORMS}, got {params['entropy_norm']!r}")


@POLICY_LOSSES.register("aepo", ratio_term="its gradient kept on upper-clipped tokens (the stop-gradient clip; its "
                        "entropy-aware advantage acts at any ratio)", ratio_term_metric="clip_fraction_high",
                        check_params=check_aepo)
def aepo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    entropy_adv_coef: float = 0.1,
    entropy_pivot: float = 0.5,
    entropy_norm: str = "pivot",
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AEPO entropy-balanced policy optimisation, loss part (Dong et al. 2025, "Agentic
    Entropy-Balanced Policy Optimization", arXiv:2510.14545).

        A~_t = A_t (1 + entropy_adv_coef h_t)        entropy_norm "pivot": h = normalized_entropy(H, pivot) in [-1, 1]
                                                     entropy_norm "zscore": h = (H - mean H) / std H over the
                                                     valid tokens (the authors' release, with coefficient 0.2)
        A~_t > 0, rho_t > 1 + e_h:  l_t = -sg((1 + e_h) / rho_t) rho_t A~_t   (= -(1+e_h) A~ u_t)
        otherwise              :  l_t = ppo_clip's max(-A~ rho, -A~ clip(rho, 1 - e_l, 1 + e_h))
        A~_t < 0 (dual_clip = c):  l_t = min(l_t, -A~_t c)   (the release's clip_ratio_c, 3 in its scripts)
    The forward value equals ppo_clip's (with A~); the upper-clipped tokens keep the gradient
    -(1 + e_h) A~ grad logp instead of 0. This is ce_gppo's upper branch with beta_high = 1 and
    PPO's lower branch (shared helper ``_gradient_preserving_clip``). The rollout part of AEPO
    (entropy pre-monitoring, branch penalty) is not a loss. Reading of the paper: the
    "high-entropy clipped tokens" are the upper-clipped ones (A > 0, rho > 1 + e_h); no extra
    entropy gate is applied. The in-batch entropy normalisation is HAPO's (a design choice:
    the paper gives no formula for it); entropy_adv_coef = 0 gives the plain advantage.
    Metrics: as ppo_clip.
    """
    mask = response_mask.to(logp.dtype)
    if entropy_norm == "zscore":
        h = standardized_entropy(entropy, mask)
    elif entropy_norm == "pivot":
        h = normalized_entropy(entropy, mask, entropy_pivot)
    else:
        raise ValueError(f"aepo entropy_norm must be one of {AEPO_ENTROPY_NORMS}, got {entropy_norm!r}")
    adv = advantages * (1.0 + entropy_adv_coef * h)
    lr = log_ratio(logp, old_logp)
    loss, is_clipped = _gradient_preserving_clip(lr, adv, clip_low, clip_high, None, 1.0, dual_clip)
    return loss * mask, _ppo_metrics(lr, torch.exp(lr), is_clipped, mask)


@POLICY_LOSSES.register("hapo", paper_aggregation="token_mean",
                        ratio_term="its entropy-adaptive clip range (its advantage redistribution acts at ratio 1 too)",
                        ratio_term_metric="clip_fraction")
def hapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_alpha: float = 1.0,
    adv_beta: float = 1.0,
    entropy_pivot: float = 0.8,
    dual_clip: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """HAPO loss: asymmetric adaptive clipping + differential advantage redistribution (Liu et al.
    2025, "From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature",
    arXiv:2509.16591).

        h_t = normalized_entropy(H, entropy_pivot) in [-1, 1]
        e_l' = e_l (1 - alpha min(h_t, 0)),   e_h' = e_h (1 + alpha max(h_t, 0))
        N_t  = (1 - e_l'/2) < rho_t < (1 + e_h'/2)                    (neutral zone)
        A^ent = A (1 + beta h_t);   A'_t = A^ent if (h_t > 0) != N_t else A
               (high entropy: A^ent outside N; low entropy: A^ent inside N)
        l_t = ppo_clip(rho, A', 1 - e_l', 1 + e_h', dual_clip)
    The token-level group-average advantage (TLGA) and the adaptive sampling temperature are
    HAPO's advantage and rollout parts, not this loss. At rho = 1 (inside N) the gradient is
    -A (1 + beta min(h, 0)) grad logp. Entropy statistics are over this micro-batch's valid tokens.
    Metrics: as ppo_clip, plus redistributed_fraction (tokens with h != 0 using A^ent).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = response_mask.to(logp.dtype)
    h = normalized_entropy(entropy, mask, entropy_pivot)
    eps_low = clip_low * (1.0 - clip_alpha * h.clamp(max=0))
    eps_high = clip_high * (1.0 + clip_alpha * h.clamp(min=0))
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    with torch.no_grad():
        neutral = (ratio > 1.0 - eps_low / 2) & (ratio < 1.0 + eps_high / 2)
        redistribute = ((h > 0) != neutral) & (h != 0)  # at h = 0, A^ent = A
    adv = torch.where(redistribute, advantages * (1.0 + adv_beta * h), advantages)
    loss, is_clipped = _ppo_terms(ratio, adv, 1.0 - eps_low, 1.0 + eps_high, dual_clip)
    metrics = _ppo_metrics(lr, ratio, is_clipped, mask)
    metrics["redistributed_fraction"] = masked_mean(redistribute.to(mask.dtype), mask).item()
    return loss * mask, metrics


@POLICY_LOSSES.register("ppo_ewma")
def ppo_ewma_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    prox_logp: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weight_max: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO with a proximal policy (Hilton, Cobbe & Schulman 2021, "Batch size-invariance
    for policy optimization", arXiv:2110.00641).

        w_t = sg(pi_prox / pi_old) = exp(prox_logp - old_logp)    (optionally min(w, is_weight_max))
        r_t = pi_theta / pi_prox   = exp(logp - prox_logp)
        l_t = w_t max(-A r_t, -A clip(r_t, 1 - e_l, 1 + e_h))
    old_logp is the behaviour policy (the one that sampled the data, used only for the
    off-policy correction w); prox_logp is the policy the trust region is measured against (an
    EWMA of the weights, or the policy just before this update). prox_logp = old_logp gives
    ppo_clip exactly; w never carries gradient. Metrics: as ppo_clip (ratios to pi_prox),
    is_weight_mean.
    """
    weight = torch.exp(log_ratio(prox_logp, old_logp)).detach()
    if is_weight_max is not None:
        weight = weight.clamp(max=is_weight_max)
    lr = log_ratio(logp, prox_logp.detach())
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    mask = response_mask.to(loss.dtype)
    metrics = _ppo_metrics(lr, ratio, is_clipped, mask)
    metrics["is_weight_mean"] = masked_mean(weight, mask).item()
    return weight * loss * mask, metrics


def _dppo_ratio_term(params) -> str | None:
    """The rules ratio_deviation and variance_bound drop only tokens whose ratio left 1;
    surrogate_variance drops at ratio 1 too."""
    rule = params.get("rule", "ratio_deviation")
    if rule == "surrogate_variance":
        return None
    if rule == "variance_bound":
        return "its dropout of the tokens whose importance-sampling term (rho - 1) A lowers the variance bound's correlation term (rule variance_bound)"
    return "its dropout of tokens whose ratio left [1 - drop_threshold, 1 + drop_threshold] (rule ratio_deviation)"


@POLICY_LOSSES.register("dppo", ratio_term=_dppo_ratio_term, ratio_term_metric="dropped_fraction")
def dppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    rule: str = "ratio_deviation",
    drop_threshold: float = 0.3,
    drop_fraction: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """D-PPO: PPO-clip with the samples that inflate the surrogate's variance dropped (Xie et al.
    2023, "Dropout Strategy in Reinforcement Learning: Limiting the Surrogate Objective Variance
    in Policy Optimization Methods", arXiv:2310.20380).

        l_t = keep_t * ppo_clip_t(rho, A, e_l, e_h)
        rule "variance_bound":     x_t = (rho_t - 1) A_t, what importance sampling adds to the surrogate
                                   (rho A = A + x). Over the N valid tokens, with S = sum_t x_t,
                                       Var(x) = S^2 (N - 1) / N^2 - C / N,   C = sum_{i != j} x_i x_j
                                   (from (sum x)^2 = sum x^2 + C): the variance grows quadratically
                                   with the surrogate S and falls as the cross-sample (correlation)
                                   term C grows. Dropping token t changes C by -2 c_t, c_t = x_t (S - x_t),
                                   so of the tokens with c_t < 0 the floor(drop_fraction * N) with the
                                   smallest c_t are dropped (the paper's rule: keep the samples that
                                   maximise the correlation term of its variance bound). At rho = 1
                                   every c_t = 0 and nothing is dropped
        rule "ratio_deviation":    keep_t = |rho_t - 1| <= drop_threshold   (Sample Dropout,
                                   Lin et al. 2023, arXiv:2302.02299)
        rule "surrogate_variance": drop the floor(drop_fraction * N) valid tokens with the largest
                                   (x_t - mean(x))^2 (rlbench's earlier stand-in)
    variance_bound follows the paper's derivation as summarised (its bound in terms of the
    correlation term); its exact per-sample statistic and dropout rate were not read in the full
    text. Dropped tokens get zero loss and gradient; they still count in the aggregation's
    normaliser. At rho = 1 "variance_bound" and "ratio_deviation" drop nothing. Metrics: as ppo_clip,
    dropped_fraction.
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    mask = response_mask.to(loss.dtype)
    valid = mask > 0
    with torch.no_grad():
        if rule == "ratio_deviation":
            keep = (ratio - 1.0).abs() <= drop_threshold
        elif rule == "variance_bound":
            excess = torch.where(valid, (ratio - 1.0) * advantages, 0.0).double()
            share = excess * (excess.sum() - excess)
            keep = ~_top_k_mask(-share, valid & (share < 0), _count(drop_fraction, valid.sum().item()))
        elif rule == "surrogate_variance":
            surrogate = ratio * advantages
            score = (surrogate - masked_mean(surrogate, mask)) ** 2
            keep = ~_top_k_mask(score, valid, _count(drop_fraction, valid.sum().item()))
        else:
            raise ValueError(f"dppo rule must be 'variance_bound', 'ratio_deviation' or 'surrogate_variance', got {rule!r}")
    metrics = _ppo_metrics(lr, ratio, is_clipped, mask)
    metrics["dropped_fraction"] = masked_mean((~keep).to(mask.dtype), mask).item()
    return loss * keep * mask, metrics


@POLICY_LOSSES.register(
    "degrpo",
    aggregation="seq_mean_token_sum",
    paper_aggregation="seq_mean_token_sum",
    conflicts=(
        "aggregation other than seq_mean_token_sum: the matrix is already normalised per "
        "response (alpha/|C_i| on control tokens, 1/|R_i| on the rest)",
    ),
)
def degrpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    control_mask: torch.Tensor | None = None,
    alpha: float = 0.001,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled GRPO, control token vs response (Fang, Ma & Wang 2025, "Thinkless: LLM Learns
    When to Think", arXiv:2505.13379).

    With l_t = ppo_clip's per-token loss, C_i the control tokens of response i (control_mask, or
    its first response token) and R_i the other response tokens, the objective is

        L = (1/N_seq) sum_i [ alpha mean_{t in C_i} l_t + mean_{t in R_i} l_t ]

    returned as the matrix  l_t (alpha [t in C_i] / |C_i| + [t in R_i] / |R_i|), so the preset
    MUST aggregate with ``seq_mean_token_sum`` (declared at registration). The control token's
    gradient is alpha A grad logp at ratio 1, independent of the response length (plain GRPO
    dilutes it by 1/|o_i|). Deviation: the released code token-means the response part over the
    whole batch (sum_{i,t in R} l / sum_i |R_i|) instead of per response; the two agree when all
    responses have the same length; the per-response form keeps micro-batch invariance.
    Metrics: as ppo_clip, control_loss (mean over control tokens).
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    mask = response_mask.to(loss.dtype)
    if control_mask is None:
        control = ((mask.cumsum(-1) == 1) & (mask > 0)).to(mask.dtype)
    else:
        control = control_mask.to(mask.dtype) * mask
    rest = mask - control
    weight = alpha * control / control.sum(-1, keepdim=True).clamp(min=1) + rest / rest.sum(-1, keepdim=True).clamp(min=1)
    metrics = _ppo_metrics(lr, ratio, is_clipped, mask)
    metrics["control_loss"] = masked_mean(loss.detach(), control).item()
    return loss * weight * mask, metrics
