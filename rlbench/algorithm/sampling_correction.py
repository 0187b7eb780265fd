"""Truncated importance sampling (TIS) between the sampling engine and the trainer.

Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS;
verl's ``rollout_is`` token-level truncated weights). A fast engine (vLLM) samples the rollout with
log-probs log pi_sampler that differ from the trainer's log pi_old for the same weights (different
kernels, precision, batching), so the rollout is slightly off-policy. Each token's policy loss is
weighted by the truncated ratio

    w_t = min(pi_old(o_t) / pi_sampler(o_t), C) = min(exp(old_logp_t - sampling_logp_t), C)

(no gradient), and l_t <- w_t l_t before aggregation. C (``cap``, default 2 as in the paper's
experiments) bounds the variance the correction adds.

Two more modes (``mode``), for the same ratio rho_t = pi_old / pi_sampler:

    mask    (masked importance sampling)  w_t = rho_t if low <= rho_t <= C else 0
    reject  (per-token rejection)         w_t = 1     if low <= rho_t <= C else 0

``low`` defaults to 1 / C. ``reject`` gives weight 0 to tokens whose sampler and trainer disagree too
much and leaves the others' loss as it is, so it composes with any loss. verl's ``rollout_is`` mask
mode and its token-level rejection sampling (``rollout_rs``, verl/trainer/ppo/rollout_corr_helper.py)
keep and reject the same tokens, but verl removes the rejected tokens from the response mask, so they
leave the aggregation's token count too; by default (``rejected_tokens: zero_weight``) they stay in
the count with weight 0, so under ``token_mean`` the gradient is verl's x N_kept / N_tok.
``rejected_tokens: drop`` (every mode but truncate) does what verl does: before the advantage, the tokens
outside [low, C] leave the batch's response mask (:meth:`SamplingCorrection.drop_rejected`), so every
aggregation counts only the kept ones (N_tok becomes N_kept), and the advantage, KL and entropy terms
see the reduced mask as verl's do. The rejection is decided once per step on the old log-probs (the
trainer stores them), the same set every epoch and micro-batch sees. On off-policy tokens (guidance traces, hinted
responses) pi_old is the stored behaviour log-prob, which is also what the sampler's log-probs hold,
so rho = 1 there: the correction never counts a trace twice.

verl's other ``rollout_rs`` modes are modes here too (:data:`DIVERGENCE_REJECTION_MODES`,
:func:`rejection_keep_mask`): ``token_k2``/``token_k3`` reject a token whose k2/k3 divergence exceeds
``threshold``; ``seq_sum_k1``/``seq_mean_k1`` reject a whole response whose summed / mean log-ratio,
exponentiated, lies outside [low, cap]; ``seq_{sum,mean,max}_{k2,k3}`` reject a response whose summed /
mean / largest token divergence exceeds ``threshold``. Kept tokens weigh 1, rejected ones 0, and
``rejected_tokens: drop`` takes them out of the mask as for ``reject``. The names are verl's
``SUPPORTED_ROLLOUT_RS_OPTIONS`` (its ``token_k1`` is ``reject``). verl's k1 statistic is -log rho, so its
``lower_upper`` bounds pi_rollout / pi_old; ``low`` and ``cap`` here bound rho itself, as every other mode's
do: verl's [a, b] is [1/b, 1/a] here (the same rule when low = 1 / cap, the default). verl chains several
options in one run; here a run takes one.

Two options follow verl's ``rollout_is`` weights (``compute_rollout_correction_weights`` in
verl/trainer/ppo/rollout_corr_helper.py), both for ``mode: truncate`` only, as verl has them only for
its truncated weights:

``level: sequence`` (default ``token``) gives each response one weight from the sum of its valid
tokens' log-ratios, w_i = min(exp(sum_t (old_logp_t - sampling_logp_t)), C) (the log sum clamped to
+-20 first), broadcast to the response's tokens and 0 on padding: the product of the token ratios,
truncated, not masked. verl has no geometric-mean weight level, so neither does this.

``normalize: true`` (default false) divides the truncated weights by their mean so that they average 1
(verl's ``rollout_is_batch_normalize``, applied after truncation, so a weight may exceed C): at token
level the mean over the valid tokens, at sequence level the mean of the response weights over the
responses with at least one valid token. A mean <= 1e-8 leaves the weights as they are. verl takes
the mean over the whole step's batch; here it is taken over the batch the loss sees, which is the
micro-batch when the optimizer batch is split. The metrics are those of the weights before the division.

``bypass: true`` (default false) is verl's ``rollout_correction.bypass_mode`` (its Rollout Correction
guide: "two policies, pi_old = pi_rollout"): pi_old is the rollout engine's log-probs (``sampling_logp``;
on off-policy tokens the stored behaviour log-probs, as always), the trainer's no-grad pass that would
recompute pi_old is skipped (it still runs when an entropy, a value or the previous policy is needed), and
the loss's ratio is pi_theta / pi_sampler from the first update on: the loss's own clip or trust region
then does the correction (verl's bypass + ``loss_type: ppo_clip``). The weights above compare pi_old with
pi_sampler, which are then the same, so they are 1 and not applied: ``mode``, ``low``,
``rejected_tokens``, ``level`` and ``normalize`` are refused with bypass (``cap`` is unused). verl's bypass
+ ``loss_type: reinforce`` with token-level truncated weights, -sg(min(pi_theta / pi_sampler, C)) A logp,
is ``loss=cispo_upper`` (``ratio_max`` = C) with bypass; its sequence-level variant has no counterpart.
The KL-in-reward term then reads pi_sampler as pi_old too, as verl's does. With one update per batch and
an engine whose log-probs equal the trainer's, bypass trains exactly as the default (tested bit for bit);
the engine's log-probs must be those of the distribution the trainer scores, so bypass is refused with
``rollout.top_p`` < 1.

``algorithm.sampling_correction: {cap: C}`` turns it on; absent (the default) it is off, and the
presets leave it off. With it on, a batch without ``sampling_logp`` is left unchanged (no-op). The
trainer passes ``sampling_logp`` = each Completion's ``logprobs`` (TrainBatch.sampling_logp). With
the HF engine the sampler *is* the trainer's model, so w = 1 up to the numerics of generation
(tests/test_rollout.py checks its log-probs against the training forward to 1e-4): the correction
is meant for the vLLM engine. Completion log-probs are those of the distribution actually sampled
from, after top-p; with top_p < 1 they exceed the trainer's (untruncated) log-probs and w < 1 on
every token, so use the correction with top_p = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlbench.algorithm.schedules import settings_from_block
from rlbench.errors import ConfigError

#: The truncation cap C of Yao et al. 2025 (their default).
DEFAULT_TIS_CAP = 2.0
SAMPLING_LOG_RATIO_LIMIT = 20.0


def truncated_importance_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """w_t = min(exp(old_logp_t - sampling_logp_t), cap), [B,T], no gradient. The log-ratio is
    clamped to +-20 first so that exp() stays finite."""
    with torch.no_grad():
        log_ratio = (old_logp - sampling_logp).clamp(-SAMPLING_LOG_RATIO_LIMIT, SAMPLING_LOG_RATIO_LIMIT)
        return torch.exp(log_ratio).clamp(max=cap)


def bounded_importance_weights(
    old_logp: torch.Tensor, sampling_logp: torch.Tensor, low: float, high: float, keep_ratio: bool
) -> torch.Tensor:
    """w_t = rho_t (``keep_ratio``, masked IS) or 1 (rejection) where low <= rho_t <= high, else 0;
    rho_t = exp(old_logp_t - sampling_logp_t), log-ratio clamped to +-20. [B,T], no gradient."""
    with torch.no_grad():
        ratio = torch.exp((old_logp - sampling_logp).clamp(-SAMPLING_LOG_RATIO_LIMIT, SAMPLING_LOG_RATIO_LIMIT))
        inside = ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
        return inside * ratio if keep_ratio else inside


def sequence_importance_weights(
    old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """w_i = min(exp(sum_t mask_t (old_logp_t - sampling_logp_t)), cap) per response, the log sum
    clamped to +-20, broadcast over its tokens and 0 on padding; [B,T], no gradient (verl's
    ``rollout_is: sequence``, verl/trainer/ppo/rollout_corr_helper.py)."""
    with torch.no_grad():
        log_ratio_sum = ((old_logp - sampling_logp) * mask).sum(dim=-1, keepdim=True)
        weight = torch.exp(log_ratio_sum.clamp(-SAMPLING_LOG_RATIO_LIMIT, SAMPLING_LOG_RATIO_LIMIT)).clamp(max=cap)
        return weight.expand_as(old_logp) * mask


def token_divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_sampler || pi_old) from log r_t = old_logp_t - sampling_logp_t on a
    token sampled from pi_sampler (Schulman 2020, "Approximating KL Divergence"):
    k2 = (log r)^2 / 2, k3 = r - 1 - log r; both are >= 0 and 0 exactly where r = 1."""
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown divergence estimator {estimator!r}; choose k2 or k3")


def rejection_keep_mask(
    mode: str, old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
    low: float, high: float, threshold: float | None,
) -> torch.Tensor:
    """1 where a token is kept, 0 where it is rejected, [B,T], no gradient, for verl's ``rollout_rs``
    modes (verl/trainer/ppo/rollout_corr_helper.py), with log r_t = old_logp_t - sampling_logp_t
    clamped to +-20 and m_t the response mask:

        token_k2 / token_k3     keep t   iff  k(log r_t) <= threshold
        seq_sum_k1              keep i   iff  low <= exp(sum_t m_t log r_t) <= high
        seq_mean_k1             keep i   iff  low <= exp(sum_t m_t log r_t / sum_t m_t) <= high
        seq_sum_k2 / _k3        keep i   iff  sum_t m_t k(log r_t) <= threshold
        seq_mean_k2 / _k3       keep i   iff  sum_t m_t k(log r_t) / sum_t m_t <= threshold
        seq_max_k2 / _k3        keep i   iff  max_{t: m_t=1} k(log r_t) <= threshold

    with k the k2 or k3 estimator of :func:`token_divergence`. A sequence-level decision is
    broadcast to the response's tokens; padding (m_t = 0) is always 0."""
    with torch.no_grad():
        valid = mask.to(old_logp.dtype)
        log_ratio = (old_logp - sampling_logp).clamp(-SAMPLING_LOG_RATIO_LIMIT, SAMPLING_LOG_RATIO_LIMIT) * valid
        scope, _, estimator = mode.rpartition("_")
        if estimator == "k1":
            total = log_ratio.sum(dim=-1, keepdim=True)
            if scope == "seq_mean":
                total = total / valid.sum(dim=-1, keepdim=True).clamp(min=1)
            ratio = torch.exp(total.clamp(-SAMPLING_LOG_RATIO_LIMIT, SAMPLING_LOG_RATIO_LIMIT))
            return ((ratio >= low) & (ratio <= high)).to(valid.dtype).expand_as(valid) * valid
        if threshold is None:
            raise ValueError(f"rejection mode {mode!r} needs a threshold")
        divergence = token_divergence(log_ratio, estimator) * valid
        if scope == "token":
            statistic = divergence
        elif scope == "seq_sum":
            statistic = divergence.sum(dim=-1, keepdim=True)
        elif scope == "seq_mean":
            statistic = divergence.sum(dim=-1, keepdim=True) / valid.sum(dim=-1, keepdim=True).clamp(min=1)
        elif scope == "seq_max":
            statistic = divergence.amax(dim=-1, keepdim=True)
        else:
            raise ValueError(f"unknown rejection mode {mode!r}; choose one of {list(DIVERGENCE_REJECTION_MODES)}")
        return (statistic <= threshold).to(valid.dtype).expand_as(valid) * valid


def batch_normalized_weights(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The weights divided by their mean: over the valid tokens (``level`` token) or over the
    responses with a valid token, one weight each (sequence); unchanged when that mean is <= 1e-8
    (verl's ``rollout_is_batch_normalize``, verl/trainer/ppo/rollout_corr_helper.py)."""
    with torch.no_grad():
        if level == "token":
            mean = (weights * mask).sum() / mask.sum().clamp(min=1)
        else:
            valid = mask.sum(dim=-1)
            response_weight = (weights * mask).sum(dim=-1) / valid.clamp(min=1)
            has_tokens = (valid > 0).to(weights.dtype)
            mean = (response_weight * has_tokens).sum() / has_tokens.sum().clamp(min=1)
        return weights / mean if mean > 1e-8 else weights


#: verl's ``rollout_rs`` rejection modes beyond per-token k1 (``reject``); each keeps a token or a
#: whole response with weight 1 and rejects it with weight 0 (:func:`rejection_keep_mask`).
DIVERGENCE_REJECTION_MODES = (
    "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
MODES = ("truncate", "mask", "reject") + DIVERGENCE_REJECTION_MODES
#: One weight per token, or one per response from the sum of its log-ratios (truncate only).
LEVELS = ("token", "sequence")
#: What a token outside [low, cap] becomes under mask / reject: weight 0 in the count, or out of the mask.
REJECTED_TOKENS = ("zero_weight", "drop")


@dataclass(frozen=True)
class SamplingCorrection:
    """``algorithm.sampling_correction``: {cap, mode, low, rejected_tokens, level, normalize, bypass}:
    :func:`truncated_importance_weights` (mode truncate; :func:`sequence_importance_weights` at
    ``level`` sequence) or :func:`bounded_importance_weights` (mask, reject); ``rejected_tokens`` says
    whether a rejected token keeps its place in the token count (zero_weight) or leaves it (drop);
    ``normalize`` divides the truncated weights by their batch mean (:func:`batch_normalized_weights`);
    ``bypass`` takes pi_old from the rollout engine instead of recomputing it (verl's bypass mode)."""

    cap: float = DEFAULT_TIS_CAP
    mode: str = "truncate"
    low: float | None = None
    rejected_tokens: str = "zero_weight"
    level: str = "token"
    normalize: bool = False
    bypass: bool = False
    threshold: float | None = None

    @classmethod
    def from_config(cls, node: Any) -> SamplingCorrection | None:
        return None if node is None else settings_from_block(cls, node, "algorithm.sampling_correction")

    def check(self) -> None:
        if self.cap <= 0:
            raise ConfigError(f"algorithm.sampling_correction.cap must be > 0 (Yao et al. 2025: 2.0), got {self.cap}")
        if self.mode not in MODES:
            raise ConfigError(f"algorithm.sampling_correction.mode={self.mode!r} is unknown; choose one of {list(MODES)}")
        if self.low is not None and not 0 <= self.low <= self.cap:
            raise ConfigError(f"algorithm.sampling_correction.low must lie in [0, cap], got {self.low}")
        needs_threshold = self.mode in DIVERGENCE_REJECTION_MODES and not self.mode.endswith("_k1")
        if needs_threshold and (self.threshold is None or self.threshold < 0):
            raise ConfigError(f"algorithm.sampling_correction.mode={self.mode} needs threshold >= 0 (the largest "
                              f"divergence kept; verl's rollout_rs_threshold), got {self.threshold}")
        if not needs_threshold and self.threshold is not None:
            raise ConfigError(f"algorithm.sampling_correction.threshold is read only by the k2/k3 rejection modes "
                              f"{[m for m in DIVERGENCE_REJECTION_MODES if not m.endswith('_k1')]}, not {self.mode}")
        if self.rejected_tokens not in REJECTED_TOKENS:
            raise ConfigError(f"algorithm.sampling_correction.rejected_tokens={self.rejected_tokens!r} is unknown; "
                              f"choose one of {list(REJECTED_TOKENS)}")
        if self.drops_rejected and self.mode == "truncate":
            raise ConfigError("algorithm.sampling_correction.rejected_tokens=drop needs mode mask or reject "
                              "(truncate rejects no token)")
        if self.level not in LEVELS:
            raise ConfigError(f"algorithm.sampling_correction.level={self.level!r} is unknown; choose one of {list(LEVELS)}")
        if not isinstance(self.normalize, bool):
            raise ConfigError(f"algorithm.sampling_correction.normalize must be true or false, got {self.normalize!r}")
        for name, changed in (("level=sequence", self.level != "token"), ("normalize=true", self.normalize)):
            if changed and self.mode != "truncate":
                raise ConfigError(f"algorithm.sampling_correction.{name} needs mode truncate "
                                  "(verl has sequence-level and batch-normalised weights only for its truncated IS)")
        if not isinstance(self.bypass, bool):
            raise ConfigError(f"algorithm.sampling_correction.bypass must be true or false, got {self.bypass!r}")
        inert = [name for name, changed in (
            ("mode", self.mode != "truncate"), ("low", self.low is not None), ("rejected_tokens", self.drops_rejected),
            ("threshold", self.threshold is not None),
            ("level", self.level != "token"), ("normalize", self.normalize),
        ) if changed]
        if self.bypass and inert:
            raise ConfigError(f"algorithm.sampling_correction.bypass=true takes pi_old from the rollout engine, so the "
                              f"weights pi_old / pi_sampler are all 1 and {inert} would change nothing; drop them "
                              "(truncated weights on pi_theta / pi_sampler, verl's bypass with loss_type reinforce: "
                              "algorithm/loss=cispo_upper)")

    def check_rollout(self, top_p: float) -> None:
        """Bypass takes the engine's log-probs as pi_old: they must score the distribution the trainer scores."""
        if self.bypass and top_p < 1.0:
            raise ConfigError(f"algorithm.sampling_correction.bypass=true needs rollout.top_p=1 (got {top_p}): the "
                              "engine's log-probs are those of the top-p truncated distribution, above the trainer's, "
                              "so every ratio pi_theta / pi_old would start below 1")

    @property
    def drops_rejected(self) -> bool:
        """Rejected tokens leave the response mask (verl's rejection sampling) instead of weighing 0."""
        return self.rejected_tokens == "drop"

    def drop_rejected(
        self, response_mask: torch.Tensor, old_logp: torch.Tensor, sampling_logp: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The response mask without the tokens whose ratio lies outside [low, cap], and the share of
        the trained tokens dropped (``sampling_dropped_fraction``)."""
        inside = self.kept_tokens(old_logp, sampling_logp, response_mask)
        kept = response_mask * inside.to(response_mask.dtype)
        dropped = 1.0 - float(kept.sum().item()) / max(float(response_mask.sum().item()), 1.0)
        return kept, {"sampling_dropped_fraction": dropped}

    def kept_tokens(self, old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """1 on the tokens that mode mask / reject / a ``rollout_rs`` mode keeps, 0 on the rejected ones."""
        if self.mode in DIVERGENCE_REJECTION_MODES:
            return rejection_keep_mask(self.mode, old_logp, sampling_logp, mask, self.lower_bound, self.cap, self.threshold)
        return bounded_importance_weights(old_logp, sampling_logp, self.lower_bound, self.cap, keep_ratio=False)

    @property
    def lower_bound(self) -> float:
        """The lowest ratio kept by mask and reject: ``low``, else 1 / cap."""
        return self.low if self.low is not None else 1.0 / self.cap

    def weights(
        self, old_logp: torch.Tensor, sampling_logp: torch.Tensor | None, mask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The per-token weights for this batch before :meth:`normalized`, or None when there is
        nothing to correct; ``mask`` (default: every token valid) says which tokens a response's
        sequence-level weight sums over."""
        if sampling_logp is None or self.bypass:  # bypass: pi_old is pi_sampler, the weights are 1
            return None
        if self.level == "sequence":
            valid = torch.ones_like(old_logp) if mask is None else mask.to(old_logp.dtype)
            return sequence_importance_weights(old_logp, sampling_logp, valid, self.cap)
        if self.mode == "truncate":
            return truncated_importance_weights(old_logp, sampling_logp, self.cap)
        if self.mode in DIVERGENCE_REJECTION_MODES:
            valid = torch.ones_like(old_logp) if mask is None else mask.to(old_logp.dtype)
            return self.kept_tokens(old_logp, sampling_logp, valid)
        return bounded_importance_weights(old_logp, sampling_logp, self.lower_bound, self.cap, keep_ratio=self.mode == "mask")

    def normalized(self, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The weights divided by their batch mean with ``normalize``, else as they are."""
        return batch_normalized_weights(weights, mask.to(weights.dtype), self.level) if self.normalize else weights

    def metrics(self, weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """The share of trained tokens at the cap (truncate) or rejected (mask, reject)."""
        hit = weights >= self.cap if self.mode == "truncate" else weights == 0
        key = "sampling_weight_capped_fraction" if self.mode == "truncate" else "sampling_rejected_fraction"
        return {key: float(((hit.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)).item())}
