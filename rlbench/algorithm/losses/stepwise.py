"""SACPO: stepwise alignment for a constrained objective (Wachi et al. 2024, "Stepwise Alignment for Constrained
Language Model Policy Optimization", NeurIPS 2024, arXiv:2404.11049, section 4).

The constrained problem max_pi E[r] s.t. E[g] >= b has, for a Lagrange multiplier lambda, the KL-regularised
optimum pi* ∝ pi_ref exp((r + lambda g) / beta). The paper's key identity: pi* is the optimum of the second
objective *from the first's optimum*, pi* ∝ pi_r exp(g / (beta / lambda)) with pi_r ∝ pi_ref exp(r / beta). So
the alignment is done in two stages, each a plain DPO:

    stage 1   pi_r = DPO(pi_ref, pairs by r, beta)
    stage 2   pi*  = DPO(pi_r,   pairs by g, beta / lambda)     (pi_r is stage 2's reference)

For RLVR, r is correctness (the run's graded reward: stage 1's pairs are the group's pairs by reward, as
``dpo``'s) and g is brevity among the correct responses (stage 2's pairs: within a group, two responses whose
reward reaches ``min_reward``, the shorter preferred; an incorrect response is in no pair).

The stage is the step input ``reference_stage``: 1 while the reference is the initial policy, 2 from
``algorithm.reincarnate_at`` on, where the runner makes the policy the reference (rlbench.training.step.reincarnate;
the new reference is saved in checkpoints and restored on resume).
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.preference import GROUP_MEAN, WHOLE_GROUPS, dpo_loss
from rlbench.algorithm.registry import POLICY_LOSSES


def stage_beta(beta: float, lam: float, reference_stage: int) -> float:
    """SACPO's KL strength of a stage: beta in stage 1, beta / lambda in stage 2 (arXiv:2404.11049, section 4)."""
    if lam <= 0:
        raise ValueError(f"SACPO's lambda must be > 0, got {lam}")
    if reference_stage not in (1, 2):
        raise ValueError(f"SACPO has stages 1 and 2, got reference_stage={reference_stage}")
    return beta if reference_stage == 1 else beta / lam


def brevity_preferences(
    rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor, min_reward: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B], groups [B]): the second objective g as a ranking for ``preference_pairs``. g = minus the
    response's length, compared only among the responses of a group whose reward reaches ``min_reward``; every
    other response is moved to a group of its own (a group of one gives no pair)."""
    values = -response_mask.sum(-1).to(rewards.dtype)
    correct = rewards >= min_reward
    apart = int(group_index.max().item()) + 1 + torch.arange(group_index.numel(), device=group_index.device)
    return values, torch.where(correct, group_index, apart)


@POLICY_LOSSES.register("sacpo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def sacpo_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, reference_stage: int = 1, beta: float = 0.1, lam: float = 1.0,
    pairing: str = "all", min_reward: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SACPO's DPO of the current stage (module docstring):

        stage 1   l = -log sigma(beta (Delta(y_w) - Delta(y_l))),            y_w: the higher reward
        stage 2   l = -log sigma((beta / lambda) (Delta(y_w) - Delta(y_l))),  y_w: the shorter of two correct

    Delta(y) = Sum_t (log pi_theta - log pi_ref) against the stage's reference. The metric ``sacpo_stage`` says
    which stage trained."""
    scale = stage_beta(beta, lam, int(reference_stage))
    if reference_stage == 1:
        matrix, metrics = dpo_loss(logp, ref_logp, response_mask, rewards, group_index, scale, pairing)
    else:
        values, groups = brevity_preferences(rewards, response_mask, group_index, min_reward)
        matrix, metrics = dpo_loss(logp, ref_logp, response_mask, values, groups, scale, pairing)
    return matrix, {**metrics, "sacpo_stage": float(reference_stage)}
