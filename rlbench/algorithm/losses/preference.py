"""Pairwise and listwise preference losses on the responses of a group: DPO, IPO, SimPO, TRPA, INPO, PRO.

A group's graded responses define its preferences: y_w > y_l wherever r(y_w) > r(y_l) (equal rewards give
no pair). ``pairing`` chooses which pairs a group contributes (``preference_pairs``):

    best_worst   one pair, the first highest- against the first lowest-rewarded response
    all          every pair with different rewards
    adjacent     the ranking's neighbours: every response of a reward level against every response of the
                 next lower level
    any          every two responses, ties included (y_w: the higher reward, the earlier row on a tie), for
                 the losses that regress on reward differences (REBEL, CoPG, P3O: a tie is a target of 0)

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

from rlbench.algorithm.losses.common import sequence_mean, sequence_sum
from rlbench.algorithm.registry import POLICY_LOSSES

PAIRINGS = ("best_worst", "all", "adjacent", "any")

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
    """One group's (winner row, loser row) pairs (the pairings: the module's docstring). ``adjacent``: the group's distinct rewards sorted,
    v_1 > v_2 > ... > v_k; every response at level v_j against every response at level v_{j+1}."""
    if pairing == "best_worst":
        best = max(range(len(rows)), key=lambda k: (values[k], -k))
        worst = min(range(len(rows)), key=lambda k: (values[k], k))
        return [(rows[best], rows[worst])] if values[best] > values[worst] else []
    if pairing == "all":
        return [(rows[i], rows[j]) for i in range(len(rows)) for j in range(len(rows)) if values[i] > values[j]]
    if pairing == "any":
        return [(rows[i], rows[j]) if values[i] >= values[j] else (rows[j], rows[i])
                for i in range(len(rows)) for j in range(i + 1, len(rows))]
    levels = sorted(set(values), reverse=True)
    at = {level: [row for row, value in zip(rows, values) if value == level] for level in levels}
    return [(w, lo) for upper, lower in zip(levels, levels[1:]) for w in at[upper] for lo in at[lower]]


def sequence_log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Delta(y) = Sum_t m_t (log pi_theta - log pi_ref) [B]: DPO's implicit reward divided by beta."""
    return sequence_sum(logp - ref_logp, response_mask)


def mean_log_likelihood(logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """s(y) = (1/|y|) Sum_t m_t log pi_theta [B] (an empty response: 0)."""
    return sequence_mean(logp, response_mask)


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


PairLoss = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def pairwise_matrix(
    pair_loss: PairLoss, logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, pairing: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The shared body of the pairwise losses: the micro-batch's pairs (``preference_pairs``), each pair's
    (loss, margin) from ``pair_loss(winner rows, loser rows)``, the spread matrix and the pair metrics."""
    winners, losers, weights = preference_pairs(rewards, group_index, pairing)
    losses, margins = pair_loss(winners, losers)
    matrix = spread_pair_losses(losses, winners, losers, weights, logp * 0, response_mask)
    return matrix, _pair_metrics(margins.detach())


def bradley_terry(margins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(-log sigma(m), m): the Bradley-Terry negative log-likelihood of a pair whose logit margin is m."""
    return -F.logsigmoid(margins), margins


@POLICY_LOSSES.register("dpo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def dpo_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
    group_index: torch.Tensor, beta: float = 0.1, pairing: str = "best_worst",
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7) on a group's pairs, online (the pairs are the step's
    own graded responses) or from a file (rollout=offline):

        l(y_w, y_l) = -log sigma(beta (Delta(y_w) - Delta(y_l)))

    beta is the strength of the implied KL to pi_ref (the paper's 0.1)."""
    delta = sequence_log_ratio(logp, ref_logp, response_mask)
    return pairwise_matrix(lambda w, lo: bradley_terry(beta * (delta[w] - delta[lo])),
                           logp, response_mask, rewards, group_index, pairing)


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

    def pair_loss(w: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        margins = delta[w] - delta[lo]
        return (margins - target) ** 2, margins

    return pairwise_matrix(pair_loss, logp, response_mask, rewards, group_index, pairing)


@POLICY_LOSSES.register("simpo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def simpo_loss(
    logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor, group_index: torch.Tensor,
    beta: float = 2.0, gamma: float = 1.0, pairing: str = "best_worst",
) -> tuple[torch.Tensor, dict[str, float]]:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6): reference-free, the implicit reward is the
    length-normalised log-likelihood, with a target margin gamma:

        l(y_w, y_l) = -log sigma(beta s(y_w) - beta s(y_l) - gamma)

    No reference model is loaded. The reported margin is beta (s(y_w) - s(y_l)). With beta 1 and gamma 0 it
    is the contrastive policy score of An et al. 2023 ("Direct Preference-based Policy Optimization without Reward
    Modeling", NeurIPS 2023) for LMs, with the distance d(pi, y) = -s(y) (algorithm=contrastive_scoring)."""
    s = mean_log_likelihood(logp, response_mask)

    def pair_loss(w: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        margins = beta * (s[w] - s[lo])
        return -F.logsigmoid(margins - gamma), margins

    return pairwise_matrix(pair_loss, logp, response_mask, rewards, group_index, pairing)


@POLICY_LOSSES.register("trpa", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def trpa_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor,
    rewards: torch.Tensor, group_index: torch.Tensor, beta_win: float = 0.1, beta_lose: float = 0.1,
    kl_coef: float = 0.0, pairing: str = "adjacent",
) -> tuple[torch.Tensor, dict[str, float]]:
    """TRPA (Su et al. 2025, arXiv:2504.04524, section 3): preference levels from rule-based checks (here the
    graded reward's levels: format and answer checks are terms of the reward), pairs across levels, and a
    preference loss whose trust region is pi_old, with Kahneman-Tversky anisotropic weights (KTPO):

        l(y_w, y_l) = -log sigma(beta_w log(pi_theta/pi_old)(y_w) - beta_l log(pi_theta/pi_old)(y_l))
                      + lambda (KL(y_w) + KL(y_l)) / 2,       KL(y) = sum_t k3(log pi_theta, log pi_ref)

    With beta_w = beta_l, pi_old = pi_ref and lambda = 0 it is online DPO (tests/test_preference.py)."""
    from rlbench.algorithm.kl import kl_k3

    old = sequence_log_ratio(logp, old_logp, response_mask)
    kl = (kl_k3(logp, ref_logp) * response_mask).sum(-1)

    def pair_loss(w: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        margins = beta_win * old[w] - beta_lose * old[lo]
        return -F.logsigmoid(margins) + kl_coef * (kl[w] + kl[lo]) / 2, margins

    return pairwise_matrix(pair_loss, logp, response_mask, rewards, group_index, pairing)


@POLICY_LOSSES.register("inpo", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN,
                        rounds="the OMD step's pi_t, the policy the round started from")
def inpo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor,
    rewards: torch.Tensor, group_index: torch.Tensor, eta: float = 1.0, tau: float = 0.1, pairing: str = "all",
) -> tuple[torch.Tensor, dict[str, float]]:
    """INPO (Zhang et al. 2024, arXiv:2407.00617, section 4): online mirror descent towards the Nash policy of
    the preference game, pi_{t+1} proportional to pi_t^(1 - eta tau) pi_ref^(eta tau) exp(eta P(y > pi_t)), as a
    squared loss on pairs sampled from pi_t (here pi_old, the policy that sampled the batch):

        h(y_w, y_l) = log(pi_theta(y_w)/pi_theta(y_l)) - eta tau log(pi_ref(y_w)/pi_ref(y_l))
                      - (1 - eta tau) log(pi_t(y_w)/pi_t(y_l))
        l = (h - eta / 2)^2

    The loss vanishes at the OMD step's closed form. The paper runs T rounds of sampling then several epochs;
    here a round is a batch (algorithm.update.epochs passes over it with pi_t = pi_old frozen), or
    algorithm.update.round_steps batches with pi_t a frozen copy of the policy (rlbench/training/rounds.py)."""
    policy, reference, sampler = (sequence_sum(x, response_mask) for x in (logp, ref_logp, old_logp))
    mix = eta * tau

    def pair_loss(w: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = (policy[w] - policy[lo]) - mix * (reference[w] - reference[lo]) - (1 - mix) * (sampler[w] - sampler[lo])
        return (h - eta / 2) ** 2, h

    return pairwise_matrix(pair_loss, logp, response_mask, rewards, group_index, pairing)


def plackett_luce_terms(s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """PRO's ranking loss of one group (responses sorted by reward, best first; s: their scores, r: their
    rewards): -sum_k log [exp(s_k / T_k^k) / sum_{i >= k} exp(s_i / T_k^i)] over the positions k with a lower
    reward after them, T_k^i = 1 / (r_k - r_i) for i > k, T_k^k = min_{i > k} T_k^i; a response tied with r_k
    is left out of position k's candidates (its temperature would be infinite)."""
    total = s.new_zeros(())
    for k in range(len(s)):
        lower = r < r[k]
        if not bool(lower.any()):
            continue
        gaps = r[k] - r[lower]  # 1 / T_k^i
        logits = torch.cat([(s[k] * gaps.max()).reshape(1), s[lower] * gaps])  # T_k^k = min T = 1 / max gap
        total = total - torch.log_softmax(logits, dim=0)[0]
    return total


@POLICY_LOSSES.register("pro", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN)
def pro_loss(
    logp: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor, group_index: torch.Tensor,
    sft_coef: float = 0.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PRO (Song et al. 2023, arXiv:2306.17492, section 3): a listwise Plackett-Luce loss over the group's
    ranking by reward, on the length-normalised log-likelihoods s(y), with dynamic temperatures from the reward
    gaps (``plackett_luce_terms``), plus an SFT term on the best response:

        l_group = -sum_k log [exp(s(y^k)/T_k^k) / sum_{i>=k} exp(s(y^i)/T_k^i)] + sft_coef NLL(y^1)

    NLL(y) = -s(y) (the paper's length-normalised SFT term). Reference-free. With two responses and equal
    temperatures it is Bradley-Terry on s plus SFT. The reported margin is s(best) - s(worst)."""
    s = mean_log_likelihood(logp, response_mask)
    carriers: list[int] = []
    losses: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []
    for group in torch.unique(group_index).tolist():
        rows = (group_index == group).nonzero().squeeze(-1)
        order = rows[torch.argsort(rewards[rows], descending=True, stable=True)]
        if rewards[order[0]] == rewards[order[-1]]:
            continue  # a tied group has no ranking
        losses.append(plackett_luce_terms(s[order], rewards[order]) - sft_coef * s[order[0]])
        carriers.append(int(order[0]))
        margins.append((s[order[0]] - s[order[-1]]).detach())
    if not losses:
        return logp * 0, {}
    best = torch.tensor(carriers, dtype=torch.long, device=logp.device)
    ones = torch.ones(len(carriers), device=logp.device)
    matrix = spread_pair_losses(torch.stack(losses), best, best, ones, logp * 0, response_mask)
    return matrix, _pair_metrics(torch.stack(margins))
