"""OPRL: Online Process Reward Learning (Liu et al. 2025, "Online Process Reward Learning for Agentic
Reinforcement Learning", arXiv:2509.19199, section 3): an implicit process reward model (PRM) pi_phi, trained
online with a trajectory-level DPO loss on outcome-ranked pairs, whose step rewards give step-level advantages
added to GRPO's episode-level ones.

The pure pieces of the method; the PRM itself (its model, optimizer and online update) is the run's
(rlbench/training/online_prm.py). A step k is an agent turn (``step_index``, rollout=multi_turn):

    r_phi(s_k, a_k) = beta sum_{t in a_k} [log pi_phi(t | .) - log pi_ref(t | .)]         (implicit step reward)
    L_phi = -log sigma( sum_k r_phi(tau+_k) - sum_k r_phi(tau-_k) ),  R(tau+) > R(tau-)     (trajectory DPO)
    A_{i,k} = A^E_i + omega A^S_{i,k}                                                       (advantage)

Observation tokens (step_index -1) belong to no step: they add nothing to r_phi and get advantage 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlbench.algorithm.advantages.common import _tokens
from rlbench.algorithm.advantages.gigpo import anchor_advantages, spread_over_turns, turn_table
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.registry import ADVANTAGES


def step_tokens(step_index: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: the policy's trained tokens that belong to a step (observation tokens and padding excluded)."""
    return (response_mask > 0) & (step_index >= 0)


def trajectory_implicit_rewards(prm_logp: torch.Tensor, ref_logp: torch.Tensor, step_index: torch.Tensor,
                                response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """[B] sum_k r_phi(s_k, a_k) = beta (log pi_phi(tau) - log pi_ref(tau)) over the trajectory's action tokens: the
    step rewards telescope to DPO's trajectory-level implicit reward. Keeps the gradient of ``prm_logp``."""
    inside = step_tokens(step_index, response_mask)
    return float(beta) * torch.where(inside, prm_logp - ref_logp.to(prm_logp.dtype), 0.0).sum(-1)


def step_implicit_rewards(prm_logp: torch.Tensor, ref_logp: torch.Tensor, step_index: torch.Tensor,
                          response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """[B,T] float64: every token of step k carries r_phi(s_k, a_k) = beta sum_{t in a_k} (log pi_phi - log pi_ref),
    the sum over that step's tokens; 0 on observation tokens and padding (the ``step_process_rewards`` input)."""
    inside = step_tokens(step_index, response_mask)
    ratio = torch.where(inside, (prm_logp.double() - ref_logp.double()), 0.0)
    out = torch.zeros_like(ratio)
    for row in range(ratio.shape[0]):
        for step in step_index[row][inside[row]].unique().tolist():
            here = inside[row] & (step_index[row] == step)
            out[row][here] = float(beta) * ratio[row][here].sum()
    return out


def outcome_pairs(rewards: torch.Tensor, group_index: torch.Tensor) -> list[tuple[int, int]]:
    """Every (winner, loser) pair of rows of one group with R(winner) > R(loser) (the paper's tau+, tau-)."""
    values, groups = rewards.tolist(), group_index.tolist()
    return [(i, j) for i in range(len(values)) for j in range(len(values))
            if groups[i] == groups[j] and values[i] > values[j]]


def implicit_dpo_loss(trajectory_rewards: torch.Tensor, pairs: list[tuple[int, int]], normaliser: int | None = None) -> torch.Tensor:
    """The PRM's trajectory-level DPO loss -log sigma(R_phi(tau+) - R_phi(tau-)), summed over ``pairs`` (rows of
    ``trajectory_rewards``, :func:`trajectory_implicit_rewards`) and divided by ``normaliser`` (default: their number;
    a caller splitting the pairs over micro-batches passes the total)."""
    if not pairs:
        return trajectory_rewards.sum() * 0.0
    winners = torch.tensor([w for w, _ in pairs], device=trajectory_rewards.device)
    losers = torch.tensor([lo for _, lo in pairs], device=trajectory_rewards.device)
    margins = trajectory_rewards[winners] - trajectory_rewards[losers]
    return -F.logsigmoid(margins).sum() / float(normaliser or len(pairs))


@ADVANTAGES.register("oprl", advantage_level="token")
def oprl_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    step_index: torch.Tensor,
    step_process_rewards: torch.Tensor,
    omega: float = 1.0,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """OPRL's advantage (Liu et al. 2025, arXiv:2509.19199, section 3): episode-level GRPO plus omega times the
    normalised implicit step reward.

    A^E_i = GRPO over the group's episodes of the outcome reward (``rewards``, :func:`grpo_advantage`);
    A^S_{i,k} = (r_phi(s_k, a_k) - mu_S) / sigma_S, with mu_S, sigma_S the mean and unbiased std of r_phi over every
    step of every episode of the group (``step_process_rewards``, the online PRM's; GiGPO's
    :func:`anchor_advantages` with one anchor per group); every token of step k of episode i gets
    A_{i,k} = A^E_i + omega A^S_{i,k} (omega 1; GiGPO's composition), observation tokens 0. omega = 0 is GRPO."""
    episode = grpo_advantage(rewards, group_index, response_mask, epsilon=epsilon, scale_by_std=scale_by_std)
    steps = step_index.cpu()
    table = turn_table(steps, steps, step_process_rewards.cpu(), response_mask.cpu())
    groups = group_index.tolist()
    keys = [(groups[row], 0) for row, turns in enumerate(table) for _ in turns]
    places = [(row, turn) for row, turns in enumerate(table) for turn, _, _ in turns]
    values = [value for turns in table for _, _, value in turns]
    step = spread_over_turns(places, anchor_advantages(keys, values, epsilon, scale_by_std), steps)
    out = episode.to(torch.float64) + float(omega) * step.to(response_mask.device)
    return _tokens(out, response_mask)
