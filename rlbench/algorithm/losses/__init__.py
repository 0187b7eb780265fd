"""Policy losses: per-token loss matrices, aggregated separately (see aggregation.py).

A loss declares the inputs it reads by name in its signature (logp, old_logp, advantages,
response_mask [B,T], and optionally entropy, ref_logp, progress, sampling_logp, off_policy, prox_logp,
log_probs [B,T,V], generator, ...): each is a ``loss`` entry of rlbench.algorithm.step_inputs.STEP_INPUTS,
with its shape, meaning and producer (tabled in docs/algorithms.md); the registry passes nothing else.
``generator`` (a loss's random draws, clip_cov's) is a fresh torch.Generator per micro-batch that the
trainer derives from the run's seed, the step and the micro-batch's index (rlbench.utils.loss_generator),
never advanced from one step to the next and never checkpointed; a loss called without one must still
work (clip_cov then picks deterministically).

Every loss returns (loss_matrix [B,T], metrics): the matrix is zero on padding, metrics are python
floats (masked token means of this micro-batch unless stated). Log-ratios are clamped to +-20
before exponentiation (``log_ratio``), so every ratio is finite.

Each loss declares the composition constraints the config validator enforces where it is
registered (``POLICY_LOSSES.register(name, aggregation=..., advantage_level=..., ...)``, see
registry.Needs), e.g. that gspo's matrix only gives the paper's objective under
``seq_mean_token_mean`` aggregation.

The losses are split by family: ratio_clipped (PPO and its clip variants), covariance (Clip-Cov,
KL-Cov), sequence_level (GSPO, GMPO), soft_trust_region (SAPO, SPO, M2PO, MDPO) and
weighted_reinforce (REINFORCE, CISPO, REC, OPMD, AsymRE); common holds the shared helpers. Every
public name is re-exported here.
"""

from __future__ import annotations

from rlbench.algorithm.losses.common import LOG_RATIO_LIMIT, masked_mean, sequence_mean, log_ratio
from rlbench.algorithm.losses.ratio_clipped import (
    ppo_clip_loss,
    is_surrogate_loss,
    intellect2_loss,
    ce_gppo_loss,
    normalized_entropy,
    standardized_entropy,
    aepo_loss,
    hapo_loss,
    ppo_ewma_loss,
    dppo_loss,
    degrpo_loss,
)
from rlbench.algorithm.losses.off_policy import exgrpo_loss
from rlbench.algorithm.losses.covariance import covariance_selection_count, clip_cov_loss, kl_cov_loss
from rlbench.algorithm.losses.sequence_level import gspo_loss, gspo_token_loss, gmpo_loss
from rlbench.algorithm.losses.soft_trust_region import sapo_loss, spo_simple_loss, m2po_loss, mdpo_loss
from rlbench.algorithm.losses.weighted_reinforce import (
    reinforce_loss,
    CISPO_TOKEN_RATIO_ONLY,
    cispo_upper_loss,
    cispo_two_sided_loss,
    CLIP_MODES,
    WEIGHTINGS,
    rec_loss,
    opmd_loss,
    asymre_loss,
)

from rlbench.algorithm.registry import import_family_modules

import_family_modules(__name__, __path__)  # a piece in a new module registers without editing this file

__all__ = [
    "CISPO_TOKEN_RATIO_ONLY",
    "CLIP_MODES",
    "LOG_RATIO_LIMIT",
    "WEIGHTINGS",
    "aepo_loss",
    "asymre_loss",
    "ce_gppo_loss",
    "cispo_two_sided_loss",
    "cispo_upper_loss",
    "clip_cov_loss",
    "covariance_selection_count",
    "degrpo_loss",
    "exgrpo_loss",
    "dppo_loss",
    "gmpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "hapo_loss",
    "intellect2_loss",
    "is_surrogate_loss",
    "kl_cov_loss",
    "log_ratio",
    "m2po_loss",
    "masked_mean",
    "mdpo_loss",
    "normalized_entropy",
    "standardized_entropy",
    "opmd_loss",
    "ppo_clip_loss",
    "ppo_ewma_loss",
    "rec_loss",
    "reinforce_loss",
    "sapo_loss",
    "sequence_mean",
    "spo_simple_loss",
]
