"""Pairwise preference losses on the responses of a group: DPO, IPO, SimPO.

A group's graded responses define its preferences: y_w > y_l wherever r(y_w) > r(y_l) (equal rewards give
no pair). ``pairing`` chooses which pairs a group contributes (``preference_pairs``):

    best_worst   one pair, the first highest- against the first lowest-rewarded response
    all          every pair with different rewards
    adjacent     the ranking's neighbours: responses sorted by reward (stable), each against the next one
                 whose reward is lower

A group's loss is the mean of its pairs' losses; the objective is the mean over the optimizer batch's
groups, Sum_g mean_{p in g} l_p / N_groups (aggregation ``group_mean``; a group without a pair adds 0 and
still counts, as a zero-advantage group does under GRPO). The loss reads whole groups, so the trainer keeps
each group in one micro-batch and one mini-batch (``Needs.whole_groups``). Every loss returns its [B,T]
matrix with each pair's share l_p / P_g spread over the winner's tokens (over the loser's when the winner is
empty), so ``Sum_t`` of the matrix is the group loss and the gradient flows through both responses.

Sequence terms (m: the response mask, |y| = Sum_t m_t):

    Delta(y) = Sum_t m_t (log pi_theta(y_t | .) - log pi_ref(y_t | .))     the implicit reward / beta (DPO, IPO)
    s(y)     = (1/|y|) Sum_t m_t log pi_theta(y_t | .)                     the length-normalised log-likelihood (SimPO)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from rlbench.algorithm.registry import POLICY_LOSSES

PAIRINGS = ("best_worst", "all", "adjacent")

WHOLE_GROUPS = "it compares the responses of a group with each other, so a group must sit in one micro-batch"
GROUP_MEAN = ("a pairwise loss is a mean over groups of their pairs' mean loss; token or sequence means would "
              "weigh a pair by its responses' lengths",)


def preference_pairs(rewards: torch.Tensor, group_index: torch.Tensor, pairing: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(winners [P], losers [P], weights [P]): the rows of each preferred and dispreferred response, and 1/P_g
    with P_g the number of pairs of the pair's group. Within a group rows keep the batch order, so ties for
    the best or the worst go to the first such row (best_worst)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    winners: list[int] = []
    losers: list[int] = []
    weights: list[float] = []
    for group in torch.unique(group_index).tolist():
        rows = (group_index == group).nonzero().squeeze(-1).tolist()
        found = _group_pairs(rows, rewards[rows].tolist(), pairing)
        winners += [w for w, _ in found]
        losers += [lo for _, lo in found]
        weights += [1.0 / len(found)] * len(found) if found else []
    device = rewards.device
    return (torch.tensor(winners, dtype=torch.long, device=device), torch.tensor(losers, dtype=torch.long, device=device),
            torch.tensor(weights, dtype=torch.float32, device=device))


def _group_pairs(rows: list[int], values: list[float], pairing: str) -> list[tuple[int, int]]:
    """One group's (winner row, loser row) pairs. ``adjacent``: the group's distinct rewards sorted,
    v_1 > v_2 > ... > v_k; every response at level v_j against every response at level v_{j+1}."""
    if pairing == "best_worst":
        best = max(range(len(rows)), key=lambda k: (values[k], -k))
        worst = min(range(len(rows)), key=lambda k: (values[k], k))
        return [(rows[best], rows[worst])] if values[best] > values[worst] else []
    if pairing == "all":
        return [(rows[i], rows[j]) for i in range(len(rows)) for j in range(len(rows)) if values[i] > values[j]]
    levels = sorted(set(values), reverse=True)
    at = {level: [row for row, value in zip(rows, values) if value == level] for level in levels}
    return [(w, lo) for upper, lower in zip(levels, levels[1:]) for w in at[upper] for lo in at[lower]]


def sequence_log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Delta(y) = Sum_t m_t (log pi_theta - log pi_ref) [B]: DPO's implicit reward divided by beta."""
    return ((logp - ref_logp) * response_mask).sum(-1)


def mean_log_likelihood(logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """s(y) = (1/|y|) Sum_t m_t log pi_theta [B] (an empty response: 0)."""
    return (logp * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)


def spread_pair_losses(
    pair_losses: torch.Tensor, winners: torch.Tensor, losers: torch.Tensor, weights: torch.Tensor,
    base: torch.Tensor, response_mask: torch.Tensor,
) -> torch.Tensor:
    """The [B,T] matrix of the pairs' weighted losses w_p l_p, each spread evenly over its winner's tokens
    (its loser's when the winner has none): Sum_t of a row pair's share is w_p l_p, so the matrix's masked
    sum is Sum_g mean_{p in g} l_p. ``base`` (e.g. logp * 0) keeps a micro-batch without a pair in the graph."""
    lengths = response_mask.sum(-1)
    carrier = torch.where(lengths[winners] > 0, winners, losers)
    per_row = torch.zeros(response_mask.shape[0], dtype=base.dtype, device=base.device)
    per_row = per_row.index_add(0, carrier, (weights.to(base.dtype) * pair_losses).to(base.dtype))
    return base + per_row[:, None] * response_mask / lengths.clamp(min=1)[:, None]


def _pair_metrics(margins: torch.Tensor) -> dict[str, float]:
    """This micro-batch's pairs: the share ranked right (margin > 0) and the mean margin (none without a pair)."""
    if margins.numel() == 0:
        return {}
    return {"preference_accuracy": float((margins > 0).float().mean().item()), "preference_margin": float(margins.mean().item())}


def _pairwise(
    margin_of: torch.Tensor, logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, pairing: str, pair_loss: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The shared body: pairs of the micro-batch's groups, each pair's margin from the per-response
    ``margin_of`` [B] terms, its loss ``pair_loss(margin)``, the spread matrix and the metrics."""
    winners, losers, weights = preference_pairs(rewards, group_index, pairing)
    margins = margin_of[winners] - margin_of[losers]
    losses = pair_loss(margins)
    matrix = spread_pair_losses(losses, winners, losers, weights, logp * 0, response_mask)
    return matrix, _pair_metrics(margins.detach())


@POLICY_LOSSES.register("dpo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def dpo_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, beta: float = 0.1, pairing: str = "best_worst",
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7) on a group's pairs, online (the pairs are the step's
    own graded responses):

        l(y_w, y_l) = -log sigma(beta (Delta(y_w) - Delta(y_l)))

    beta is the strength of the implied KL to pi_ref (the paper's 0.1)."""
    delta = sequence_log_ratio(logp, ref_logp, response_mask)
    return _pairwise(beta * delta, logp, response_mask, rewards, group_index, pairing, lambda m: -F.logsigmoid(m))


@POLICY_LOSSES.register("ipo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def ipo_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, tau: float = 0.1, pairing: str = "best_worst",
) -> tuple[torch.Tensor, dict[str, float]]:
    """IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17): a squared loss that regresses the log-ratio
    difference onto a fixed target, so it does not drive it to infinity on deterministic preferences:

        l(y_w, y_l) = (Delta(y_w) - Delta(y_l) - 1 / (2 tau))^2

    The reported margin is Delta(y_w) - Delta(y_l) (its optimum is 1 / (2 tau))."""
    delta = sequence_log_ratio(logp, ref_logp, response_mask)
    target = 1.0 / (2.0 * tau)
    return _pairwise(delta, logp, response_mask, rewards, group_index, pairing, lambda m: (m - target) ** 2)


@POLICY_LOSSES.register("simpo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def simpo_loss(
    logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor, group_index: torch.Tensor,
    beta: float = 2.0, gamma: float = 1.0, pairing: str = "best_worst",
) -> tuple[torch.Tensor, dict[str, float]]:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6): reference-free, the implicit reward is the
    length-normalised log-likelihood, with a target margin gamma:

        l(y_w, y_l) = -log sigma(beta s(y_w) - beta s(y_l) - gamma)

    No reference model is loaded. The reported margin is beta (s(y_w) - s(y_l))."""
    s = mean_log_likelihood(logp, response_mask)
    return _pairwise(beta * s, logp, response_mask, rewards, group_index, pairing, lambda m: -F.logsigmoid(m - gamma))
