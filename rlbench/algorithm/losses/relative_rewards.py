"""Losses on reward *differences* between two responses to the same prompt: REBEL, CoPG, P3O.

They take every two responses of a group (``pairing: any``, ties included: a tie is a target of 0) and are
invariant to a constant added to every reward of a prompt. Like the preference losses (preference.py) they
read a group at once (``Needs.whole_groups``) and are a mean over groups of their pairs' mean loss
(aggregation ``group_mean``). L(y) = sum_t m_t log pi(y_t | .) is a response's log-likelihood under the policy
named by its subscript (theta: now, t / old: the sampling policy, ref: the reference).
"""

from __future__ import annotations

import torch

from rlbench.algorithm.losses.common import LOG_RATIO_LIMIT, sequence_sum
from rlbench.algorithm.losses.preference import GROUP_MEAN, WHOLE_GROUPS, pairwise_matrix
from rlbench.algorithm.registry import POLICY_LOSSES

P3O_CLIPS = ("separate", "joint")


@POLICY_LOSSES.register("rebel", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN,
                        rounds="pi_t, the policy the iteration's regression starts from")
def rebel_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, eta: float = 1.0, pairing: str = "any",
) -> tuple[torch.Tensor, dict[str, float]]:
    """REBEL (Gao et al. 2024, arXiv:2404.16767, eq. 1 / Algorithm 1): regress the difference of the two
    responses' log-ratio changes against pi_t (pi_old: the sampling policy, or with algorithm.update.round_steps
    the round's frozen copy, rlbench/training/rounds.py) onto their reward difference:

        l(y, y') = ((1/eta) [(L_theta - L_t)(y) - (L_theta - L_t)(y')] - (R(y) - R(y')))^2

    It is 0 where the log-ratio differences equal eta (R(y) - R(y')); its minimiser is pi_t exp(eta R)
    (normalised per prompt). The reported margin is the regressed term (1/eta)[...]."""
    change = sequence_sum(logp - old_logp, response_mask)

    def pair_loss(w: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        predicted = (change[w] - change[lo]) / eta
        return (predicted - (rewards[w] - rewards[lo])) ** 2, predicted

    return pairwise_matrix(pair_loss, logp, response_mask, rewards, group_index, pairing)


@POLICY_LOSSES.register("copg", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def copg_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, beta: float = 0.1, pairing: str = "any",
) -> tuple[torch.Tensor, dict[str, float]]:
    """CoPG (Flet-Berliac et al. 2024, arXiv:2406.19185, section 3): an off-policy policy gradient without
    importance sampling, with the other response of the pair as its baseline. With the regularised reward
    R_theta(y) = R(y) - beta (L_theta - L_ref)(y), its gradient

        g = (R_theta(y) - R_theta(y')) grad (L_theta(y) - L_theta(y'))

    is minus the gradient of the squared loss

        l(y, y') = (1/(2 beta)) (R(y) - R(y') - beta [(L_theta - L_ref)(y) - (L_theta - L_ref)(y')])^2,

    which this function returns (tests/test_preference.py checks g against autograd). Its optimum is
    pi_ref exp(R / beta), from any behaviour policy. The reported margin is R_theta(y) - R_theta(y')."""
    drift = sequence_sum(logp - ref_logp, response_mask)

    def pair_loss(w: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = (rewards[w] - rewards[lo]) - beta * (drift[w] - drift[lo])
        return residual**2 / (2 * beta), residual

    return pairwise_matrix(pair_loss, logp, response_mask, rewards, group_index, pairing)


@POLICY_LOSSES.register("p3o", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def p3o_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, clip_eps: float = 0.2, clip: str = "separate", pairing: str = "any",
) -> tuple[torch.Tensor, dict[str, float]]:
    """P3O (Wu et al. 2023, arXiv:2310.00212, section 4): a trajectory-wise policy gradient on the reward
    difference of two responses, with PPO's clip on their sequence ratios rho = exp(L_theta - L_old):

        separate:  J = min(1/2 D (rho_1 - rho_2), 1/2 D (clip(rho_1, 1 +- eps) - clip(rho_2, 1 +- eps)))
        joint:     J = min(1/2 D rho_12, 1/2 D clip(rho_12, 1 +- eps)),   rho_12 = rho_1 / rho_2

    with D = R(y_1) - R(y_2); the loss is -J. Adding c(x) to both rewards leaves it unchanged; at rho = 1 its
    gradient is -1/2 D grad (L_1 - L_2). (The joint variant follows the reading "clip rho_1 / rho_2"; the
    separate one is the paper's main algorithm.) The reported margin is D."""
    if clip not in P3O_CLIPS:
        raise ValueError(f"clip must be one of {P3O_CLIPS}, got {clip!r}")
    log_rho = sequence_sum(logp - old_logp, response_mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)

    def pair_loss(w: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gap = rewards[w] - rewards[lo]
        if clip == "separate":
            rho_w, rho_l = log_rho[w].exp(), log_rho[lo].exp()
            plain = 0.5 * gap * (rho_w - rho_l)
            clipped = 0.5 * gap * (rho_w.clamp(1 - clip_eps, 1 + clip_eps) - rho_l.clamp(1 - clip_eps, 1 + clip_eps))
        else:
            rho = (log_rho[w] - log_rho[lo]).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
            plain, clipped = 0.5 * gap * rho, 0.5 * gap * rho.clamp(1 - clip_eps, 1 + clip_eps)
        return -torch.minimum(plain, clipped), gap

    return pairwise_matrix(pair_loss, logp, response_mask, rewards, group_index, pairing)
