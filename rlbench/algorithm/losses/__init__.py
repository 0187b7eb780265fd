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
    log_probs      [B,T,V] full-vocabulary log pi_theta(. | q, o_<t), with gradient; computed only for a
                          loss that declares it (otr)
    response_ids   [B,T]  the response token ids o_t (with log_probs)
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
    aepo_loss,
    hapo_loss,
    ppo_ewma_loss,
    dppo_loss,
    degrpo_loss,
    exgrpo_loss,
)
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
    "opmd_loss",
    "ppo_clip_loss",
    "ppo_ewma_loss",
    "rec_loss",
    "reinforce_loss",
    "sapo_loss",
    "sequence_mean",
    "spo_simple_loss",
]
