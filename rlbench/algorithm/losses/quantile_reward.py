"""QRPO: Quantile Reward Policy Optimization (Matrenok, Moalla and Gulcehre 2025, arXiv:2507.08068).

A pointwise regression of each response's log-ratio onto its reward, made possible by replacing the reward
with its quantile under the reference policy, whose partition function is known in closed form (section 3):

    r_q(x, y) = F_ref(R(x, y))             the reward's quantile among K reference samples y'_k ~ pi_ref(. | x)
    Z_q(x)    = E_{y ~ pi_ref}[exp(r_q / beta)] = beta (exp(1/beta) - 1)      (r_q ~ U[0, 1] under pi_ref)
    l(x, y)   = (r_q(x, y) - beta log Z_q - beta log(pi_theta(y|x) / pi_ref(y|x)))^2

The loss is minimised at pi*(y|x) = pi_ref(y|x) exp(r_q(x, y) / beta) / Z_q (the KL-regularised optimum), from
any distribution of the trained responses: no pairs are needed to cancel Z. The paper's code writes
log Z = log beta + 1/beta (dropping the -1, its eq. 11); here log Z is the exact value, computed stably.

Ties. The paper's empirical CDF counts R(y'_k) <= R(y). With verifiable 0/1 rewards almost every comparison
is a tie, so that CDF gives every correct response the quantile 1 and every wrong one the share of wrong
references; ``ties: mid_rank`` (the default) counts a tie as a half, r_q = (#{R(y'_k) < R(y)} + #{=}/2) / K,
whose mean under the reference samples is 1/2 as for U[0, 1]; ``ties: at_most`` is the paper's count.

The reference set. Given ``reference_rewards`` [B, K] (row b: the rewards of K responses y'_k ~ pi_ref to
response b's prompt, the paper's setting; the trainer provides it with algorithm.qrpo.reference_samples = K > 0,
rlbench/training/reference_rewards.py), r_q is the reward's mid-rank among those K. Without it
(reference_samples 0), the K reference samples of a prompt are the responses of its group (``Needs.whole_groups``): online they are sampled by pi_old,
which is pi_ref only at the first step (the paper samples pi_ref once, before training); offline
(rollout=offline) from a file the base model generated they are pi_ref's samples as in the paper, and a
group holds at most rollout.n of them (K = the group's size). The group is the special case
reference_rewards[b] = the rewards of b's group (tests/test_qrpo_reference.py checks the equivalence).
"""

from __future__ import annotations

import math

import torch

from rlbench.algorithm.losses.common import sequence_sum
from rlbench.algorithm.losses.preference import (
    GROUP_MEAN,
    WHOLE_GROUPS,
    spread_pair_losses,
)
from rlbench.algorithm.registry import POLICY_LOSSES

TIES = ("mid_rank", "at_most")


def quantile_rewards(
    rewards: torch.Tensor, reference_rewards: torch.Tensor, ties: str = "mid_rank"
) -> torch.Tensor:
    """r_q [N]: each reward's empirical CDF value among ``reference_rewards`` [N, K] (row n: the K reference
    rewards of reward n's prompt). ``mid_rank``: (#{< r} + #{= r} / 2) / K; ``at_most``: #{<= r} / K."""
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")
    below = (reference_rewards < rewards[:, None]).to(torch.float64).sum(-1)
    equal = (reference_rewards == rewards[:, None]).to(torch.float64).sum(-1)
    count = reference_rewards.shape[-1]
    return ((below + (0.5 if ties == "mid_rank" else 1.0) * equal) / count).to(rewards.dtype)


def group_quantile_rewards(rewards: torch.Tensor, group_index: torch.Tensor, ties: str = "mid_rank") -> torch.Tensor:
    """r_q [B]: each response's quantile among its own group's rewards (the group as the K reference samples,
    the response itself included)."""
    quantiles = torch.empty_like(rewards)
    for group in torch.unique(group_index).tolist():
        rows = (group_index == group).nonzero().squeeze(-1)
        members = rewards[rows]
        quantiles[rows] = quantile_rewards(members, members.expand(len(rows), -1), ties)
    return quantiles


def log_uniform_partition(beta: float) -> float:
    """log Z_q = log E_{u ~ U[0,1]}[exp(u / beta)] = log(beta (exp(1/beta) - 1)), written as
    log beta + 1/beta + log(1 - exp(-1/beta)) so that it stays finite for a small beta."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    return math.log(beta) + 1.0 / beta + math.log1p(-math.exp(-1.0 / beta))


@POLICY_LOSSES.register("qrpo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def qrpo_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, beta: float = 0.01, ties: str = "mid_rank",
    reference_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """QRPO (arXiv:2507.08068, section 3, the identity transform and the squared loss) on every response of
    a group, the group's rewards being the reference samples of its quantiles (the module's docstring):

        l(y) = (r_q(y) - beta log Z_q - beta Delta(y))^2,   Delta(y) = Sum_t m_t (log pi_theta - log pi_ref)

    A group's loss is the mean over its responses. Metrics (means over this micro-batch's responses):
    ``quantile_reward`` (r_q) and ``qrpo_residual`` (r_q - beta log Z_q - beta Delta: above 0 where the policy
    still under-rates a response relative to its optimum). ``reference_rewards`` [B, K]: each response's own
    reference set (K samples of pi_ref for its prompt); None: its group's rewards."""
    if reference_rewards is None:
        quantiles = group_quantile_rewards(rewards, group_index, ties)
    else:
        if reference_rewards.dim() != 2 or reference_rewards.shape[0] != rewards.shape[0] or not reference_rewards.shape[1]:
            raise ValueError(f"reference_rewards must be [B, K] with B = {rewards.shape[0]} and K >= 1, "
                             f"got {tuple(reference_rewards.shape)}")
        quantiles = quantile_rewards(rewards, reference_rewards.to(rewards.dtype), ties)
    delta = sequence_sum(logp - ref_logp, response_mask)
    residuals = quantiles - beta * log_uniform_partition(beta) - beta * delta
    rows = torch.arange(len(rewards), device=logp.device)
    sizes = torch.bincount(group_index)[group_index].to(logp.dtype)
    matrix = spread_pair_losses(residuals**2, rows, rows, 1.0 / sizes, logp * 0, response_mask)
    if not quantiles.numel():
        return matrix, {}
    return matrix, {"quantile_reward": float(quantiles.mean().item()), "qrpo_residual": float(residuals.detach().mean().item())}
