"""Covariance-selected losses of Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning
for Reasoning Language Models" (arXiv:2505.22617, sec. 4): Clip-Cov and KL-Cov act on the few
tokens whose advantage/log-prob covariance is largest.
"""

from __future__ import annotations

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
    Selection: S is drawn uniformly without replacement among the candidates from ``generator``, as
    in the paper (and verl's randperm over the band's tokens). The trainer provides it (the step
    input ``generator``: one per micro-batch, seeded from the run's seed, the step and the
    micro-batch, rlbench.utils.loss_generator), so a run repeats bit for bit and a resumed run equals
    the uninterrupted one. Called without a generator (generator=None) the pick is deterministic:
    the S candidates with the largest covariance (ties by position). Means and N_valid are over
    this micro-batch.
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


@POLICY_LOSSES.register("kl_cov", ratio_term="its |log ratio| penalty on the high-covariance tokens",
                        ratio_term_metric="kl_cov_penalty")
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
    Metrics: approx_kl, ratio_mean, kl_cov_fraction, kl_cov_penalty (mean over valid tokens of the
    penalty ppo_kl_coef |log rho| [t in S]: 0 while every ratio is 1).
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    mask = response_mask.to(ratio.dtype)
    valid = mask > 0
    selected = _top_k_mask(
        _covariance(advantages, logp, mask), valid, covariance_selection_count(kl_cov_ratio, int(valid.sum().item()))
    )
    penalty = ppo_kl_coef * lr.abs() * selected
    metrics = _ratio_metrics(lr, ratio, mask, kl_cov_fraction=selected)
    metrics["kl_cov_penalty"] = masked_mean(penalty.detach(), mask).item()
    return (-advantages * ratio + penalty) * mask, metrics
