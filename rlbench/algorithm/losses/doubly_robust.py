"""DRPO, doubly robust preference optimisation (Xu et al. 2025, "Doubly Robust Alignment for Large Language
Models", arXiv:2506.01183, section 4): maximise a doubly robust estimate of the *total preference* of pi over
the behaviour policy that produced the compared responses, minus beta KL(pi || pi_ref).

The target is psi(pi) = E_x E_{y ~ pi, y' ~ pi_b}[P(y > y' | x)] (pi_b: the policy the data were drawn from). On
ordered comparisons (y_a, y_b) of responses drawn from pi_b, with the observed preference z_ab in [0, 1]
(z_ba = 1 - z_ab) and a preference model g(y, y') ~ P(y > y'):

    psi_hat = mean_b [ E_{y ~ pi} g(y, y_b)                                 (direct method, Monte-Carlo over y)
                       + mean_{a != b} w(y_a) (z_ab - g(y_a, y_b)) ]        (importance-weighted residual)
    w(y)    = pi_theta(y) / pi_b(y)

With two responses this is the paper's estimator on the doubled pair (y_1, y_2, z), (y_2, y_1, 1 - z). It is
unbiased when g is the true preference (the residual has mean 0 whatever the weights) or when pi_b is the true
behaviour policy (the residual's weighted mean is E_{y ~ pi}[P - g], which corrects the direct method), not
only when both are right: ``tests/test_dr_preference.py`` checks both cases on a simulated bandit against the
direct method's bias.

On the runner's groups (``dr_preference``) the comparisons are every ordered pair of a group's responses; the
preference oracle is the verifiable reward, z_ab = 1[r_a > r_b] + 1/2 1[r_a = r_b]; the preference model is a
Bradley-Terry model on the rewards, g(y_a, y_b) = sigma((r_a - r_b) / T) (T -> 0 makes it the oracle, a large T
the uninformative 1/2), or, with ``algorithm.preference_model`` on an offline data set, the paper's learned model:
a Bradley-Terry reward model r_phi fitted on the data set's labelled pairs before the actor,
g(y_a, y_b) = sigma(r_phi(y_a) - r_phi(y_b)) (rlbench/training/preference_model.py); the direct method's Monte-Carlo
samples are the group's responses, weighted by pi_theta / pi_old (they were drawn by the sampling policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlbench.algorithm.kl import kl_k3
from rlbench.algorithm.losses.common import LOG_RATIO_LIMIT, sequence_sum
from rlbench.algorithm.losses.preference import (
    GROUP_MEAN,
    WHOLE_GROUPS,
    spread_pair_losses,
)
from rlbench.algorithm.registry import POLICY_LOSSES
from rlbench.errors import ConfigError

BEHAVIOURS = ("reference", "sampler")


def oracle_preferences(rewards: torch.Tensor) -> torch.Tensor:
    """z [n,n]: z_ab = 1 when r_a > r_b, 1/2 on a tie, 0 otherwise (the verifiable reward as the oracle)."""
    gap = rewards[:, None] - rewards[None, :]
    return (gap > 0).to(rewards.dtype) + 0.5 * (gap == 0).to(rewards.dtype)


def bradley_terry_preferences(rewards: torch.Tensor, temperature: float) -> torch.Tensor:
    """g [n,n]: g_ab = sigma((r_a - r_b) / T), the Bradley-Terry model on the rewards (g_ab + g_ba = 1)."""
    return torch.sigmoid((rewards[:, None] - rewards[None, :]) / temperature)


def doubly_robust_terms(
    direct: torch.Tensor, weights: torch.Tensor, labels: torch.Tensor, model: torch.Tensor
) -> torch.Tensor:
    """One comparison's doubly robust estimate of P(y ~ pi beats the comparator y_b):

        direct + w(y_a) (z_ab - g(y_a, y_b))

    ``direct``: E_{y ~ pi} g(y, y_b) (or its Monte-Carlo estimate); ``weights``: pi(y_a) / pi_b(y_a);
    ``labels``: z_ab; ``model``: g(y_a, y_b). Broadcasts; psi_hat is the mean over comparisons."""
    return direct + weights * (labels - model)


def clipped_ratio(log_ratio: torch.Tensor, clip: float | None) -> torch.Tensor:
    """w = min(exp(log_ratio), clip) with the gradient min(exp(log_ratio), clip) grad log_ratio: the clipped
    ratio enters as a constant times the score, as in the authors' code (DRPO4LLM: ``ratio_processing: clip``),
    so a clipped weight still moves its response's likelihood. ``clip`` None: no clip."""
    value = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    if clip is not None:
        value = value.clamp(max=clip)
    return value.detach() * (log_ratio - log_ratio.detach()).exp()


def group_estimate(
    policy: torch.Tensor, sampler: torch.Tensor, behaviour: torch.Tensor, labels: torch.Tensor,
    model: torch.Tensor, clip: float | None,
) -> torch.Tensor:
    """psi_hat of a group (module docstring) from its responses' sequence log-likelihoods [..., n] under pi_theta,
    the sampling policy and the behaviour policy of the weights, the labels z [..., n, n] and the model g
    [..., n, n] (entry [a, b]: y_a against y_b). Leading dimensions are independent groups."""
    n = policy.shape[-1]
    others = 1.0 - torch.eye(n, dtype=labels.dtype, device=labels.device)  # [a, b]: a != b
    mc = clipped_ratio(policy - sampler, clip)
    direct = (mc[..., :, None] * model * others).sum(-2) / (n - 1)  # [..., b]: mean_{k != b} rho_k g(y_k, y_b)
    weights = clipped_ratio(policy - behaviour, clip)[..., :, None]
    terms = doubly_robust_terms(direct[..., None, :], weights, labels, model)  # [..., a, b]
    return (terms * others).sum((-2, -1)) / (n * (n - 1))


def check_dr_preference(params: Mapping[str, Any]) -> None:
    """ConfigError on a knob of ``dr_preference`` out of its range (before the model loads, and in the loss)."""
    if params["behaviour"] not in BEHAVIOURS:
        raise ConfigError(f"algorithm.loss.behaviour must be one of {BEHAVIOURS}, got {params['behaviour']!r}")
    if params["preference_temperature"] <= 0:
        raise ConfigError(f"algorithm.loss.preference_temperature must be > 0, got {params['preference_temperature']}")
    if params["is_clip"] is not None and params["is_clip"] <= 0:
        raise ConfigError(f"algorithm.loss.is_clip must be > 0 (a large value: no clip), got {params['is_clip']}")
    if params["beta"] < 0:
        raise ConfigError(f"algorithm.loss.beta must be >= 0, got {params['beta']}")


@POLICY_LOSSES.register("dr_preference", aggregation="group_mean", whole_groups=WHOLE_GROUPS, conflicts=GROUP_MEAN,
                        check_params=check_dr_preference)
def dr_preference_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor,
    rewards: torch.Tensor, group_index: torch.Tensor, beta: float = 0.04, preference_temperature: float = 1.0,
    behaviour: str = "reference", is_clip: float | None = 2.5, off_policy: torch.Tensor | None = None,
    preference_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRPO (Xu et al. 2025, arXiv:2506.01183, section 4) on each group (module docstring):

        l_group = -psi_hat + beta mean_k sg(rho_k) sum_t k3(log pi_theta, log pi_ref)(y_k)

    ``behaviour``: the policy pi_b in the weights w = pi_theta / pi_b: ``reference`` (the paper: the data come
    from pi_ref; offline files generated by the base model) or ``sampler`` (pi_old, the policy that sampled an
    online group). ``preference_temperature``: T of the Bradley-Terry preference model on the rewards.
    ``is_clip``: the weights' upper clip (the authors' code: 2.5; a large value or None: none). The KL is the k3
    estimate on the group's responses, as in the authors' code (there: fresh samples of pi), each response's
    weighted by its detached Monte-Carlo weight rho (1 on an online group's first update; offline it estimates
    KL(pi || pi_ref) under pi, not under the file's pi_ref). A group of one response has no comparison and adds
    0. A response the sampling policy did not draw (``off_policy``: rollout=offline, whose log-prob under pi_old
    is unknown) is taken as drawn by pi_ref, the paper's setting (a file the base model generated), in both
    weights. ``preference_scores`` [B] (algorithm.preference_model: r_phi of a Bradley-Terry model fitted on the
    offline data's pairs, rlbench/training/preference_model.py): the preference model is then
    g_ab = sigma(r_phi(y_a) - r_phi(y_b)), the paper's learned model, instead of the one on the labels."""
    check_dr_preference({"behaviour": behaviour, "preference_temperature": preference_temperature, "is_clip": is_clip,
                         "beta": beta})
    policy, sampler, reference = (sequence_sum(x, response_mask) for x in (logp, old_logp, ref_logp))
    if off_policy is not None:
        sampler = torch.where(sequence_sum(off_policy, response_mask) > 0, reference, sampler)
    kl = sequence_sum(kl_k3(logp, ref_logp), response_mask)
    carriers: list[int] = []
    losses: list[torch.Tensor] = []
    estimates: list[float] = []
    for group in torch.unique(group_index).tolist():
        rows = (group_index == group).nonzero().squeeze(-1)
        if rows.numel() < 2:
            continue
        r = rewards[rows].to(logp.dtype)
        model = (bradley_terry_preferences(r, preference_temperature) if preference_scores is None
                 else bradley_terry_preferences(preference_scores[rows].to(logp.dtype), 1.0))
        psi = group_estimate(policy[rows], sampler[rows], (reference if behaviour == "reference" else sampler)[rows],
                             oracle_preferences(r), model, is_clip)
        on_pi = clipped_ratio(policy[rows] - sampler[rows], is_clip).detach()  # the KL is an expectation under pi
        losses.append(-psi + beta * (on_pi * kl[rows]).mean())
        lengths = response_mask[rows].sum(-1)
        carriers.append(int(rows[int(torch.argmax((lengths > 0).to(torch.int64)))]))
        estimates.append(float(psi.detach()))
    if not losses:
        return logp * 0, {}
    carrier = torch.tensor(carriers, dtype=torch.long, device=logp.device)
    ones = torch.ones(len(carriers), device=logp.device)
    matrix = spread_pair_losses(torch.stack(losses), carrier, carrier, ones, logp * 0, response_mask)
    return matrix, {"dr_preference_estimate": sum(estimates) / len(estimates)}
