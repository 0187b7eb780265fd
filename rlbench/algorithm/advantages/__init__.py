"""Advantage estimators: rewards of a batch of responses -> per-token advantages.

An estimator declares the inputs it reads by name in its signature (rewards [B], group_index [B],
response_mask [B,T], and optionally entropy, old_logp, values, baseline_rewards, tree_nodes, ...): each
is an ``advantage`` entry of rlbench.algorithm.step_inputs.STEP_INPUTS, with its shape, meaning and
producer (tabled in docs/algorithms.md).

Every estimator returns advantages of shape [B,T], zero on padding; an estimator whose advantage
varies along a response registers with ``advantage_level="token"`` (registry.Needs).

The estimators are split by family: group_relative (compare a prompt's responses), baselines
(batch, greedy-rollout, reference-model and tracker baselines, with the SPO tracker and PVPO
baseline cache), entropy_shaped, value_based (GAE, the critic's returns and value loss), tree (TreePO's
and TreeRPO's tree advantages) and vine (VinePPO's Monte-Carlo step values); common
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
