"""Advantage estimators: rewards of a batch of responses -> per-token advantages.

Inputs offered by the trainer (a function declares the ones it needs):
    rewards           [B]    scalar outcome reward of each response
    group_index       [B]    long, responses sharing a prompt share an index (0..G-1); sizes may differ
    response_mask     [B,T]  1 on response tokens, 0 on padding (a row may be all zero)
    entropy           [B,T]  per-token entropy of the sampling policy (no gradient)
    old_logp          [B,T]  per-token log-probs of the sampling policy
    values            [B,T]  critic values V(s_t) of each response token (gae)
    baseline_rewards  [B]    reward of a baseline for each response's prompt: the greedy rollout's
                             reward (remax) or the reference model's mean reward (pvpo)
    token_rewards     [B,T]  optional per-token rewards (e.g. outcome at EOS minus a KL-in-reward
                             penalty); when absent, the outcome reward sits on the last valid token
  introduced with the estimator zoo (the trainer must provide them when the estimator asks):
    tracker_baseline  [B]    float, SPO value tracker's pre-update success estimate p_hat(x) of each
                             response's prompt (``SPOTracker.baseline(uids)``)                  (spo)
    answer_keys       [B]    long, class id of each response's final answer (equal ids = same
                             answer; e.g. a hash of the extracted answer)                (polychromic)
    diversity         [B,B]  float in [0,1], pairwise dissimilarity of responses (only entries
                             within a group are read; alternative to answer_keys)        (polychromic)
    correct           [B]    bool, the grader's verdict on each response                  (drpo)
    max_length        int    the generation budget, rollout.max_new_tokens                 (drpo)
Every estimator returns advantages of shape [B,T], zero on padding; an estimator whose advantage
varies along a response registers with ``advantage_level="token"`` (registry.Needs).

The estimators are split by family: group_relative (compare a prompt's responses), baselines
(batch, greedy-rollout, reference-model and tracker baselines, with the SPO tracker and PVPO
baseline cache), entropy_shaped, value_based (GAE, the critic's returns and value loss); common
holds the shared helpers and conventions. Every public name is re-exported here.
"""

from __future__ import annotations

from rlbench.algorithm.advantages.common import group_mean_std
from rlbench.algorithm.advantages.group_relative import (
    grpo_advantage,
    dr_grpo_advantage,
    batch_std_advantage,
    rloo_advantage,
    opo_advantage,
    gpg_advantage,
    passk_advantage,
    ngrpo_advantage,
    drpo_length_weights,
    drpo_advantage,
    polychromic_advantage,
)
from rlbench.algorithm.advantages.baselines import (
    reinforce_pp_returns,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    pvpo_advantage,
    spo_advantage,
    spo_tracker_init,
    spo_tracker_update,
    SPOTracker,
    PVPOBaselineCache,
)
from rlbench.algorithm.advantages.entropy_shaped import edge_grpo_advantage, gtpo_advantage, grpo_s_advantage
from rlbench.algorithm.advantages.value_based import gae_advantage, gae_returns, value_loss

from rlbench.algorithm.registry import import_family_modules

import_family_modules(__name__, __path__)  # a piece in a new module registers without editing this file

__all__ = [
    "PVPOBaselineCache",
    "SPOTracker",
    "batch_std_advantage",
    "dr_grpo_advantage",
    "drpo_advantage",
    "drpo_length_weights",
    "edge_grpo_advantage",
    "gae_advantage",
    "gae_returns",
    "gpg_advantage",
    "group_mean_std",
    "grpo_advantage",
    "grpo_s_advantage",
    "gtpo_advantage",
    "ngrpo_advantage",
    "opo_advantage",
    "passk_advantage",
    "polychromic_advantage",
    "pvpo_advantage",
    "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage",
    "reinforce_pp_returns",
    "remax_advantage",
    "rloo_advantage",
    "spo_advantage",
    "spo_tracker_init",
    "spo_tracker_update",
    "value_loss",
]
