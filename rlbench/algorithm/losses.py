"""Policy losses: per-token loss matrices, aggregated separately (see aggregation.py).

Inputs offered by the trainer (a function declares the ones it needs; the registry passes nothing
else):
    logp           [B,T]  log pi_theta(o_t | q, o_<t), with gradient
    old_logp       [B,T]  log pi_old of the policy that sampled the batch (no gradient; equals
                          logp.detach() when the batch is used for one on-policy update)
    advantages     [B,T]  per-token advantages
    response_mask  [B,T]  1 on response tokens
    entropy        [B,T]  per-token entropy of the current policy (no gradient)
    ref_logp       [B,T]  log pi_ref, only when a reference model is loaded
    progress       float  fraction of training done, in [0, 1] (annealed schedules)
    sampling_logp  [B,T]  log-probs under the rollout engine (train/inference-mismatch corrections)
  Introduced by this module (optional unless a loss's signature has no default for them):
    prox_logp      [B,T]  log-probs under the *proximal* policy of decoupled PPO (ppo_ewma; no
                          gradient). Provided by the trainer: an EWMA copy of the weights, or the
                          policy recomputed just before the current update (AReaL style)
    generator      torch.Generator  random stream for clip_cov's random token selection, seeded
                          from the run seed and advanced by the trainer; None -> deterministic
                          selection (documented in clip_cov)
    control_mask   [B,T]  1 on "control" tokens (degrpo, e.g. Thinkless' <short>/<think>); None ->
                          the first response token of each row

Every loss returns (loss_matrix [B,T], metrics): the matrix is zero on padding, metrics are python
floats (masked token means of this micro-batch unless stated). Log-ratios are clamped to +-20
before exponentiation (``log_ratio``), so every ratio is finite.

Each loss declares the composition constraints the config validator enforces where it is
registered (``POLICY_LOSSES.register(name, aggregation=..., advantage_level=..., ...)``, see
registry.Needs), e.g. that gspo's matrix only gives the paper's objective under
``seq_mean_token_mean`` aggregation.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.registry import POLICY_LOSSES

LOG_RATIO_LIMIT = 20.0


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(m * v) / max(sum(m), 1)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


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


def covariance_selection_count(fraction: float, valid_tokens: int) -> int:
    """How many tokens Clip-Cov / KL-Cov act on (Cui et al. 2025, arXiv:2505.22617, sec. 4):

        k = max(1, floor(fraction * N_valid))   if fraction > 0 and N_valid > 0,   else 0

    The paper's ratio is a fraction of the batch's tokens; at its 2e-4 floor() alone gives 0 for
    any batch under 5,000 tokens, which would make both losses identical to their base loss. The
    authors' released code (and verl's ``compute_policy_loss_clip_cov`` / ``_kl_cov``) takes
    max(1, ...), so at least one token is selected whenever any is eligible; fraction = 0 turns
    the selection off."""
    if fraction <= 0 or valid_tokens <= 0:
        return 0
    return max(1, _count(fraction, valid_tokens))


def _top_k_mask(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the k highest ``scores`` among ``candidates`` (ties: lower flat index first)."""
    chosen = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    k = min(int(k), int(candidates.sum().item()))
    if k > 0:
        flat = torch.where(candidates, scores.detach(), torch.full_like(scores, -torch.inf)).flatten()
        order = torch.sort(flat, descending=True, stable=True).indices
        chosen[order[:k]] = True
    return chosen.view_as(candidates)


def _random_k_mask(candidates: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Bool mask of k ``candidates`` drawn uniformly without replacement from ``generator``."""
    chosen = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    index = candidates.flatten().nonzero().squeeze(-1)
    k = min(int(k), index.numel())
    if k > 0:
        perm = torch.randperm(index.numel(), generator=generator, device=generator.device).to(index.device)
        chosen[index[perm[:k]]] = True
    return chosen.view_as(candidates)


def _covariance(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token centred covariance term (A_t - mean A)(logp_t - mean logp), means over valid
    tokens of this micro-batch, no gradient (Cui et al. 2025, arXiv:2505.22617)."""
    with torch.no_grad():
        return (advantages - masked_mean(advantages, mask)) * (logp.detach() - masked_mean(logp.detach(), mask))


# --------------------------------------------------------------------------------------------
# PPO family
# --------------------------------------------------------------------------------------------


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


@POLICY_LOSSES.register("intellect2")
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
    (anchors §3.4). So this is ppo_clip with dual_clip = delta; delta < 1 + clip_high would also
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip whose clipped tokens keep a bounded gradient (shared by ce_gppo and aepo).

    With u_t = rho_t / sg(rho_t) (value 1, gradient grad logp_t):
        A < 0, rho < 1 - clip_low :  l = -beta_low  (1 - clip_low) A u     (if beta_low is not None)
        A > 0, rho > 1 + clip_high:  l = -beta_high (1 + clip_high) A u    (if beta_high is not None)
        otherwise                 :  l = ppo_clip's max(-A rho, -A clip(rho))
    beta None keeps PPO's constant (zero-gradient) value on that side."""
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    unit = torch.exp(lr - lr.detach())
    if beta_low is not None:
        low = (advantages < 0) & (ratio < 1.0 - clip_low)
        loss = torch.where(low, -beta_low * (1.0 - clip_low) * advantages * unit, loss)
    if beta_high is not None:
        high = (advantages > 0) & (ratio > 1.0 + clip_high)
        loss = torch.where(high, -beta_high * (1.0 + clip_high) * advantages * unit, loss)
    return loss, is_clipped


@POLICY_LOSSES.register("ce_gppo", paper_aggregation="token_mean")
def ce_gppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    beta_low: float = 0.5,
    beta_high: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CE-GPPO gradient-preserving clipping (Su et al. 2025, "CE-GPPO: Coordinating Entropy via
    Gradient-Preserving Clipping Policy Optimization in Reinforcement Learning", arXiv:2509.20712;
    methods-b M10).

    PPO zeroes the gradient of clipped tokens; CE-GPPO gives them a bounded one (sg = stop-grad):
        A_t < 0, rho_t < 1 - e_l:  J_t = beta_low  (1 - e_l) (rho_t / sg(rho_t)) A_t
        A_t > 0, rho_t > 1 + e_h:  J_t = beta_high (1 + e_h) (rho_t / sg(rho_t)) A_t
        otherwise             :  J_t = min(rho_t A_t, clip(rho_t, 1 - e_l, 1 + e_h) A_t)
        l_t = -J_t
    The clipped terms' gradient is beta (1 -+ e) A grad logp (not scaled by rho). beta = 1 keeps
    PPO's forward value; beta = 0 gives PPO's gradient (value 0 on clipped tokens). beta_low acts
    on negative tokens (exploitation, lowers entropy), beta_high on positive ones (exploration).
    Metrics: as ppo_clip (clip_fraction = tokens in the clipped regions).
    """
    lr = log_ratio(logp, old_logp)
    loss, is_clipped = _gradient_preserving_clip(lr, advantages, clip_low, clip_high, beta_low, beta_high)
    mask = response_mask.to(loss.dtype)
    return loss * mask, _ppo_metrics(lr, torch.exp(lr), is_clipped, mask)


def normalized_entropy(entropy: torch.Tensor, mask: torch.Tensor, pivot: float) -> torch.Tensor:
    """HAPO's in-batch normalised token entropy h in [-1, 1] (arXiv:2509.16591; methods-b M11.1).

        x_t = log max(H_t, 1e-6),   q = quantile_pivot(x over valid tokens)
        h_t = (x_t - q) / max_{x>q}(x - q)  if x_t > q,   (x_t - q) / |min_{x<q}(x - q)|  if x_t < q
    The paper also divides by std(x - q) first; that factor cancels in the rescaling. One valid
    token attains +1 and one -1 (when both sides are non-empty); padding gets 0."""
    with torch.no_grad():
        valid = mask > 0
        h = torch.zeros_like(entropy)
        if not valid.any():
            return h
        x = torch.log(entropy.detach().clamp(min=1e-6))
        centred = x - torch.quantile(x[valid].double(), pivot).to(x.dtype)
        positive = valid & (centred > 0)
        negative = valid & (centred < 0)
        if positive.any():
            h = torch.where(positive, centred / centred[positive].max(), h)
        if negative.any():
            h = torch.where(negative, centred / centred[negative].min().abs(), h)
        return h


@POLICY_LOSSES.register("aepo")
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """AEPO entropy-balanced policy optimisation, loss part (Dong et al. 2025, "Agentic
    Entropy-Balanced Policy Optimization", arXiv:2510.14545; methods-a §30, methods-b M36).

        A~_t = A_t (1 + entropy_adv_coef h_t)        h = normalized_entropy(H, pivot) in [-1, 1]
        A~_t > 0, rho_t > 1 + e_h:  l_t = -sg((1 + e_h) / rho_t) rho_t A~_t   (= -(1+e_h) A~ u_t)
        otherwise              :  l_t = ppo_clip's max(-A~ rho, -A~ clip(rho, 1 - e_l, 1 + e_h))
    The forward value equals ppo_clip's (with A~); the upper-clipped tokens keep the gradient
    -(1 + e_h) A~ grad logp instead of 0. This is ce_gppo's upper branch with beta_high = 1 and
    PPO's lower branch (shared helper ``_gradient_preserving_clip``). The rollout part of AEPO
    (entropy pre-monitoring, branch penalty) is not a loss. Reading of the docs: the
    "high-entropy clipped tokens" are the upper-clipped ones (A > 0, rho > 1 + e_h); no extra
    entropy gate is applied. The in-batch entropy normalisation is HAPO's (a design choice:
    the reference docs give no formula); entropy_adv_coef = 0 gives the plain advantage.
    Metrics: as ppo_clip.
    """
    mask = response_mask.to(logp.dtype)
    adv = advantages * (1.0 + entropy_adv_coef * normalized_entropy(entropy, mask, entropy_pivot))
    lr = log_ratio(logp, old_logp)
    loss, is_clipped = _gradient_preserving_clip(lr, adv, clip_low, clip_high, None, 1.0)
    return loss * mask, _ppo_metrics(lr, torch.exp(lr), is_clipped, mask)


@POLICY_LOSSES.register("hapo", paper_aggregation="token_mean")
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
    arXiv:2509.16591; methods-b M11 steps 1, 4, 5, 6).

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
    for policy optimization", arXiv:2110.00641; methods-b M03).

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


@POLICY_LOSSES.register("dppo")
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
    in Policy Optimization Methods", arXiv:2310.20380; methods-b M04).

        l_t = keep_t * ppo_clip_t(rho, A, e_l, e_h)
        rule "ratio_deviation":    keep_t = |rho_t - 1| <= drop_threshold   (Sample Dropout,
                                   Lin et al. 2023, arXiv:2302.02299)
        rule "surrogate_variance": drop the floor(drop_fraction * N) valid tokens with the largest
                                   (rho_t A_t - mean(rho A))^2, i.e. the largest contributions to
                                   the empirical variance of the surrogate rho A
    The paper's exact per-token bound is not in the reference docs (methods-b: "verify"), so
    "surrogate_variance" is a design stand-in built on the stated idea (Var[rho A] grows
    quadratically with the surrogate). Dropped tokens get zero loss and gradient; they still
    count in the aggregation's normaliser. At rho = 1 "ratio_deviation" drops nothing.
    Metrics: as ppo_clip, dropped_fraction.
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    mask = response_mask.to(loss.dtype)
    valid = mask > 0
    with torch.no_grad():
        if rule == "ratio_deviation":
            keep = (ratio - 1.0).abs() <= drop_threshold
        elif rule == "surrogate_variance":
            surrogate = ratio * advantages
            score = (surrogate - masked_mean(surrogate, mask)) ** 2
            keep = ~_top_k_mask(score, valid, _count(drop_fraction, valid.sum().item()))
        else:
            raise ValueError(f"dppo rule must be 'ratio_deviation' or 'surrogate_variance', got {rule!r}")
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
    When to Think", arXiv:2505.13379; methods-b M12).

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


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    generator: torch.Generator | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617, sec. 4).

        Cov_t = (A_t - mean A)(logp_t - mean logp)                 (valid tokens, no gradient)
        candidates = valid tokens not clipped by PPO with clip_cov_lb < Cov_t < clip_cov_ub
        S = max(1, floor(clip_cov_ratio * N_valid)) candidates (fewer if there are fewer
            candidates; none if clip_cov_ratio = 0), see covariance_selection_count
        l_t = sg(ppo_clip_t) for t in S,   ppo_clip_t otherwise
    The selected tokens keep their loss value but get zero gradient (the paper "detaches" them).
    Selection: uniformly at random from ``generator`` when the trainer passes one (reproducible
    from the run seed); with generator=None it is deterministic: the S candidates with the
    largest covariance (ties by position). Means and N_valid are over this micro-batch.
    Metrics: as ppo_clip, cov_detached_fraction.
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    loss, is_clipped = _ppo_terms(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    mask = response_mask.to(loss.dtype)
    valid = mask > 0
    cov = _covariance(advantages, logp, mask)
    candidates = valid & ~is_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = covariance_selection_count(clip_cov_ratio, int(valid.sum().item()))
    selected = _random_k_mask(candidates, k, generator) if generator is not None else _top_k_mask(cov, candidates, k)
    loss = torch.where(selected, loss.detach(), loss)
    metrics = _ppo_metrics(lr, ratio, is_clipped, mask)
    metrics["cov_detached_fraction"] = masked_mean(selected.to(mask.dtype), mask).item()
    return loss * mask, metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617, sec. 4).

        Cov_t as in clip_cov;  S = the max(1, floor(kl_cov_ratio * N_valid)) valid tokens of largest
            Cov (none if kl_cov_ratio = 0), see covariance_selection_count
        l_t = -A_t rho_t + ppo_kl_coef |logp_t - old_logp_t| [t in S]      (no ratio clipping)
    Deterministic (top-k, ties by position). The penalty's gradient is 0 at rho = 1.
    Metrics: approx_kl, ratio_mean, kl_cov_fraction.
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    mask = response_mask.to(ratio.dtype)
    valid = mask > 0
    selected = _top_k_mask(
        _covariance(advantages, logp, mask), valid, covariance_selection_count(kl_cov_ratio, int(valid.sum().item()))
    )
    loss = -advantages * ratio + ppo_kl_coef * lr.abs() * selected
    return loss * mask, _ratio_metrics(lr, ratio, mask, kl_cov_fraction=selected)


# --------------------------------------------------------------------------------------------
# sequence-level ratios: GSPO, GMPO
# --------------------------------------------------------------------------------------------


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
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071;
    methods-b M08).

        s_i = exp( (1/|o_i|) sum_t m_it (logp_it - old_logp_it) )   (geometric mean of token ratios)
        A_i = (1/|o_i|) sum_t m_it A_it                              (the sequence advantage)
        J   = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - e_l, 1 + e_h) A_i)

    Every valid token of response i carries l_i = -min(...), so ``seq_mean_token_mean``
    aggregation returns (1/N_seq) sum_i l_i = -J: the preset MUST use it, with sequence-level
    advantages (declared at registration). Clipping removes whole sequences. Metrics: as ppo_clip, with
    s_i as the ratio (clip_fraction counts the tokens of clipped sequences).
    """
    return _gspo(logp, old_logp, advantages, response_mask, clip_low, clip_high, token_level=False)


@POLICY_LOSSES.register("gspo_token", paper_aggregation="seq_mean_token_mean")
def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071,
    §4.3; methods-b M08).

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
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673; anchors
    §2.2 ``geo_mean``).

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


# --------------------------------------------------------------------------------------------
# other ratio-based surrogates
# --------------------------------------------------------------------------------------------


@POLICY_LOSSES.register("sapo", paper_aggregation="seq_mean_token_mean")
def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO soft gate (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347;
    anchors §2.2/§3.3, where verl and TRL agree).

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


@POLICY_LOSSES.register("spo_simple")
def spo_simple_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Simple Policy Optimization (Xie et al. 2024, "Simple Policy Optimization", arXiv:2401.16025;
    methods-b M05).

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


@POLICY_LOSSES.register("m2po", paper_aggregation="token_mean")
def m2po_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    m2_threshold: float = 0.04,
) -> tuple[torch.Tensor, dict[str, float]]:
    """M2PO second-moment trust region, masking variant (Zheng, Zhao & Chen 2025, "Prosperity
    before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161;
    methods-a §9).

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


@POLICY_LOSSES.register("mdpo")
def mdpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    progress: float,
    step_size: float = 1.0,
    min_step_size: float = 0.01,
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy MDPO (Tomar et al. 2020, "Mirror Descent Policy Optimization", arXiv:2005.09814;
    methods-b M06).

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


# --------------------------------------------------------------------------------------------
# REINFORCE family: -w A logp with a stop-gradient weight w
# --------------------------------------------------------------------------------------------


def _weighted_reinforce(
    logp: torch.Tensor, advantages: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """l_t = -sg(w_t) A_t logp_t  (w = 1 when None): gradient -w A grad logp."""
    loss = -advantages * logp
    return loss if weight is None else weight.detach() * loss


@POLICY_LOSSES.register("reinforce")
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
    "cispo_upper", ratio_level="token", paper_aggregation="token_mean", conflicts=CISPO_TOKEN_RATIO_ONLY
)
def cispo_upper_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ratio_max: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO with an upper cap only, TRL's semantics (MiniMax 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585; anchors §3.3).

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
    "cispo_two_sided", ratio_level="token", paper_aggregation="token_mean", conflicts=CISPO_TOKEN_RATIO_ONLY
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
    Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585; anchors §2.2).

        l_t = -sg(clip(rho_t, 1 - clip_low, 1 + clip_high)) A_t logp_t
    The paper's r^ = clip(r, 1 - e_low^IS, 1 + e_high^IS); it effectively leaves the lower bound
    open (cispo_upper). Equals cispo_upper whenever every ratio lies in
    [1 - clip_low, min(1 + clip_high, ratio_max)]. Metrics: as cispo_upper.
    """
    return _cispo(logp, old_logp, advantages, response_mask, 1.0 - clip_low, 1.0 + clip_high)


CLIP_MODES = ("none", "one_side", "two_side")
WEIGHTINGS = ("none", "importance")


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
    reg_coef: float = 0.0,
    baseline_shift: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The REC family (see rec_loss): -w M (A + delta) logp + (tau/2)(logp - old_logp)^2."""
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    adv = advantages + baseline_shift
    with torch.no_grad():
        if clip_mode == "one_side":
            keep = ~(((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low)))
        elif clip_mode == "two_side":
            keep = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
        else:
            keep = torch.ones_like(ratio, dtype=torch.bool)
        weight = keep * (ratio if weighting == "importance" else 1.0)
    loss = _weighted_reinforce(logp, adv, weight) + 0.5 * reg_coef * lr**2
    mask = response_mask.to(ratio.dtype)
    return loss * mask, _ratio_metrics(lr, ratio, mask, masked_fraction=~keep)


@POLICY_LOSSES.register("rec", paper_aggregation="seq_mean_token_sum")
def rec_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_mode: str = "none",
    weighting: str = "none",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    reg_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REC, off-policy group-relative REINFORCE (Yao et al. 2025, "Group-Relative REINFORCE Is
    Secretly an Off-Policy Algorithm: Demystifying Some Myths About GRPO and Its Friends",
    arXiv:2509.24203; methods-b M25).

        l_t = -w_t M_t A_t logp_t + (reg_coef / 2) (logp_t - old_logp_t)^2
        M (clip_mode): none | one_side: drop A>0 & rho>1+e_h and A<0 & rho<1-e_l (the tokens PPO
                       freezes) | two_side: drop rho outside [1-e_l, 1+e_h]
        w (weighting): none -> 1 | importance -> sg(rho)
    The paper's A = R_i - mean R (no std: pair with the dr_grpo advantage) and divides by the
    batch size (seq_mean_token_sum). The "ring" mask and advantage-based weighting of the
    paper are not implemented (their definitions are not in the reference docs). With
    on-policy data every variant has the REINFORCE gradient. Metrics: approx_kl, ratio_mean,
    masked_fraction.
    """
    return _regularised_reinforce(
        logp, old_logp, advantages, response_mask,
        clip_mode=clip_mode, weighting=weighting, clip_low=clip_low, clip_high=clip_high, reg_coef=reg_coef,
    )


@POLICY_LOSSES.register("opmd")
def opmd_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """OPMD as regularised REINFORCE (Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement Learning
    with LLMs", arXiv:2501.12599; in the REC form of arXiv:2509.24203, methods-b M25).

        l_t = -A_t logp_t + (tau / 2) (logp_t - old_logp_t)^2
    The regulariser is per token (the docs write it on log-probs without fixing token vs
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
    Learning: Balancing positive and negative rewards", arXiv:2506.20520; methods-b M25).

        A'_t = R_i - (mean R - delta) = A_t + delta,    l_t = -A'_t logp_t
    A lowered baseline (delta = baseline_shift > 0) up-weights positive samples under off-policy
    data; meant for un-normalised advantages A = R - mean R (dr_grpo). = rec with the shift.
    Metrics: as rec.
    """
    return _regularised_reinforce(logp, old_logp, advantages, response_mask, baseline_shift=baseline_shift)
