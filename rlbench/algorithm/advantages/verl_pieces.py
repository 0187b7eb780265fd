"""verl's advantage-side pieces, re-implemented as pure functions: the optimal token baseline (and its
tool-integrated variant), GDPO's reward-decoupled normalisation and PF-PPO's reward-based batch
re-weighting. Each is documented with its equation and source; docs/algorithms.md ("verl's
advantage-side pieces") says how each maps to verl's name. The registered advantages
``optimal_token_baseline``, ``tir_optimal_token_baseline`` and ``gdpo`` select them from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlbench.algorithm.advantages.common import _token_rewards, _tokens, _valid, _whiten
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError

PF_PPO_METHODS = ("pow", "max_min", "max_random")


def _reward_to_go(token_rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """G_t = sum_{s >= t} r_s over the valid tokens of each row (float64, 0 where invalid)."""
    masked = torch.where(valid, token_rewards.to(torch.float64), 0.0)
    return torch.where(valid, masked.flip(-1).cumsum(-1).flip(-1), 0.0)


def path_variance_proxy(
    old_logp: torch.Tensor, sum_pi_squared: torch.Tensor, valid: torch.Tensor, is_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """W_t = sum_{j <= t, j valid} rho_j^2 ||s_j||^2 with ||s_j||^2 = 1 - 2 pi_j + sum_v pi(v)^2, the squared norm
    of the softmax score d log pi(o_j) / d logits = e_{o_j} - pi, and rho_j the rollout importance weight (1 when
    ``is_weights`` is None). float64 [B,T]; invalid tokens add nothing."""
    per_token = 1.0 - 2.0 * old_logp.to(torch.float64).exp() + sum_pi_squared.to(torch.float64)
    if is_weights is not None:
        per_token = per_token * is_weights.to(torch.float64) ** 2
    return torch.where(valid, per_token, 0.0).cumsum(-1)


def _weighted_group_baseline(
    returns: torch.Tensor, weights: torch.Tensor, present: torch.Tensor, group_index: torch.Tensor, epsilon: float
) -> torch.Tensor:
    """B[g, t] = sum_{i in g, present} G_i,t W_i,t / (sum_{i in g, present} W_i,t + epsilon), gathered to [B,T]."""
    index = group_index.long()
    groups = int(index.max().item()) + 1 if index.numel() else 0
    shape = (groups, returns.shape[1])
    w = torch.where(present, weights, 0.0)
    numerator = torch.zeros(shape, dtype=torch.float64, device=returns.device).index_add_(0, index, returns * w)
    denominator = torch.zeros(shape, dtype=torch.float64, device=returns.device).index_add_(0, index, w)
    return (numerator / (denominator + epsilon))[index]


def _zero_unique_tail(baseline: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """verl's handle_zero_tail: where a group's single longest response runs past the second-longest,
    its baseline on those positions is 0 (no other response gives an estimate there)."""
    baseline = baseline.clone()
    for group in group_index.unique():
        members = (group_index == group).nonzero(as_tuple=True)[0]
        if members.numel() < 2:
            continue
        ordered = lengths[members].sort(descending=True).values
        longest, second = int(ordered[0]), int(ordered[1])
        if longest > second:
            row = members[lengths[members] == longest][0]
            baseline[row, second:] = 0.0
    return baseline


OTB_POSITIONS = ("column", "trained")


def _compact(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Move each row's valid entries to the front, in order (float64, zero-padded)."""
    lengths = valid.sum(-1)
    out = torch.zeros(values.shape[0], int(lengths.max().item()) if lengths.numel() else 0, dtype=torch.float64,
                      device=values.device)
    for row in range(values.shape[0]):
        out[row, : int(lengths[row])] = values[row, valid[row]].to(torch.float64)
    return out


def optimal_token_baseline_advantage(
    token_rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    positions: str = "column",
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """Optimal token baseline (verl ``optimal_token_baseline`` with positions="column" and its tool-integrated
    variant ``tir_optimal_token_baseline`` with positions="trained"; verl PR #3849; the optimal constant
    baseline of Greensmith, Bartlett & Baxter 2004, JMLR 5, "Variance reduction techniques for gradient
    estimates in reinforcement learning", sec. 3.3, applied per token position).

    With G_i,t the reward-to-go of response i at token t and W_i,t the cumulative path-variance proxy
    (``path_variance_proxy``; scaled by rho_i,t^2 when rollout importance weights ``is_weights`` are given),
    the baseline of token position t in prompt group g is

        B_g,t = sum_{i in g} G_i,t W_i,t / (sum_{i in g} W_i,t + epsilon),      A_i,t = G_i,t - B_g,t

    the constant that minimises sum_i W_i,t (G_i,t - b)^2, i.e. the variance of the score-function estimator
    (G - b) * s when E[||s||^2 | G] is W. Only tokens with response_mask 1 enter a sum.

    positions="column": token t of every response in the group shares B_g,t (t the raw column).
    positions="trained" (multi-turn, tool-integrated): observation (tool-output) tokens carry
    response_mask 0 and are removed first, so position k is "the k-th token the policy generated" in
    every response; observation tokens enter neither G's positions, W, nor B, and get A = 0.

    Choices where verl differs or has a quirk:
      * a prompt group with one response (with a trained token) gets A = 0 (rlbench's convention for
        every group-relative estimator: one sample gives no baseline); verl returns A = G for it;
      * handle_zero_tail=True (verl's current default): the positions of the group's unique longest
        response beyond the second-longest get B = 0, so A = G there instead of A ~ 0 (the baseline of a
        single sample is the sample itself).
    """
    if epsilon < 0:
        raise ConfigError(f"algorithm.advantage.epsilon must be >= 0, got {epsilon}")
    if positions not in OTB_POSITIONS:
        raise ConfigError(f"algorithm.advantage.positions must be one of {OTB_POSITIONS}, got {positions!r}")
    valid = _valid(response_mask)
    returns = _reward_to_go(token_rewards, valid)
    weights = path_variance_proxy(old_logp, sum_pi_squared, valid, is_weights)
    if positions == "column":
        advantage = optimal_token_baseline_from_returns(returns, weights, valid, group_index, handle_zero_tail, epsilon)
        return _tokens(advantage, response_mask)
    lengths = valid.sum(-1)
    returns, weights = _compact(returns, valid), _compact(weights, valid)
    compact_valid = torch.arange(returns.shape[1], device=returns.device)[None, :] < lengths[:, None]
    advantage_compact = optimal_token_baseline_from_returns(returns, weights, compact_valid, group_index,
                                                            handle_zero_tail, epsilon)
    advantage = torch.zeros(valid.shape, dtype=torch.float64, device=valid.device)
    for row in range(valid.shape[0]):
        advantage[row, valid[row]] = advantage_compact[row, : int(lengths[row])]
    return _tokens(advantage, response_mask)


def optimal_token_baseline_from_returns(
    returns: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, group_index: torch.Tensor,
    handle_zero_tail: bool, epsilon: float,
) -> torch.Tensor:
    """A = G - B with B the W-weighted group mean of G per position (float64 [B,T]); responses with no
    valid token do not count towards their group's size."""
    baseline = _weighted_group_baseline(returns, weights, valid, group_index, epsilon)
    lengths = valid.sum(-1)
    if handle_zero_tail:
        baseline = _zero_unique_tail(baseline, lengths, group_index)
    index = group_index.long()
    members = torch.zeros(int(index.max().item()) + 1, dtype=torch.long, device=index.device).index_add_(
        0, index, (lengths > 0).long())[index]
    return torch.where((members > 1)[:, None] & valid, returns - baseline, 0.0)


def _check_otb_params(params: dict[str, Any]) -> None:
    if params["epsilon"] < 0:
        raise ConfigError(f"algorithm.advantage.epsilon must be >= 0, got {params['epsilon']}")


@ADVANTAGES.register("optimal_token_baseline", advantage_level="token", check_params=_check_otb_params)
def otb_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """verl's ``optimal_token_baseline`` (PR #3849): ``optimal_token_baseline_advantage`` with
    positions="column",

        W_i,t = sum_{j <= t} (1 - 2 pi_old(o_i,j) + sum_v pi_old(v)^2),   G_i,t = sum_{s >= t} r_i,s
        A_i,t = G_i,t - sum_{k in g} G_k,t W_k,t / (sum_{k in g} W_k,t + epsilon)

    r = token_rewards (the KL-in-reward penalty), else the outcome reward on the last trained token;
    pi_old and sum_pi_squared come from the sampling pass. No rollout importance weights (rho = 1)."""
    token_rewards = _token_rewards(rewards, response_mask, token_rewards)
    return optimal_token_baseline_advantage(token_rewards, group_index, response_mask, old_logp, sum_pi_squared,
                                            positions="column", handle_zero_tail=handle_zero_tail, epsilon=epsilon)


@ADVANTAGES.register("tir_optimal_token_baseline", advantage_level="token", check_params=_check_otb_params)
def tir_otb_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """verl's ``tir_optimal_token_baseline`` (the tool-integrated variant of PR #3849):
    ``optimal_token_baseline_advantage`` with positions="trained": observation tokens (response mask 0,
    rollout=multi_turn) are removed before the positions are aligned, so the baseline of position k is
    over the k-th generated token of every response of the group; observation tokens get A = 0. Without
    observation tokens it equals ``optimal_token_baseline``."""
    token_rewards = _token_rewards(rewards, response_mask, token_rewards)
    return optimal_token_baseline_advantage(token_rewards, group_index, response_mask, old_logp, sum_pi_squared,
                                            positions="trained", handle_zero_tail=handle_zero_tail, epsilon=epsilon)


def gdpo_advantage(
    reward_components: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    component_weights: list[float] | None = None,
    epsilon: float = 1e-6,
    batch_whiten: bool = True,
) -> torch.Tensor:
    """GDPO, Group reward-Decoupled normalisation Policy Optimisation (Liu et al. 2026, arXiv:2601.05242,
    sec. 3; verl ``gdpo``). ``reward_components`` is [B, K], one column per reward component (e.g.
    correctness, format, a shaping term); each is normalised within its prompt group *separately*, then
    combined and whitened over the batch:

        A_i^(k) = (r_i^(k) - mean_g(r^(k))) / (std_g(r^(k)) + epsilon)       (GRPO on component k)
        A_i     = whiten_batch( sum_k w_k A_i^(k) )                           (batch_whiten=True, verl's default)

    GRPO instead normalises sum_k r^(k), where the component with the largest spread dominates. With one
    component and batch_whiten=False GDPO is GRPO exactly. w_k defaults to 1.
    """
    if reward_components.dim() != 2:
        raise ConfigError(f"GDPO needs reward components of shape [B, K], got {tuple(reward_components.shape)}")
    count = reward_components.shape[1]
    weights = [1.0] * count if component_weights is None else list(component_weights)
    if len(weights) != count:
        raise ConfigError(f"GDPO: {len(weights)} component weights for {count} reward components")
    ones = torch.ones(reward_components.shape[0], 1, dtype=torch.float64, device=reward_components.device)
    combined = sum(
        weight * grpo_advantage(reward_components[:, k], group_index, ones, epsilon=epsilon).to(torch.float64)[:, 0]
        for k, weight in enumerate(weights)
    )
    if batch_whiten:
        combined = _whiten(combined, _valid(response_mask).any(-1), epsilon)
    return _tokens(combined[:, None].expand_as(response_mask), response_mask)


@ADVANTAGES.register("gdpo")
def gdpo_outcome_shaping_advantage(
    rewards: torch.Tensor,
    outcome: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    outcome_weight: float = 1.0,
    shaping_weight: float = 1.0,
    epsilon: float = 1e-6,
    batch_whiten: bool = True,
) -> torch.Tensor:
    """GDPO (``gdpo_advantage``) over the two reward components a step has: the graders' reward
    (``outcome``) and the algorithm's reward shaping (``rewards - outcome``), weighted by
    ``outcome_weight`` and ``shaping_weight``. Without reward shaping the shaping component is 0 in
    every group and GDPO is the batch-whitened GRPO advantage of the outcome."""
    outcome = outcome.to(rewards.device, torch.float64)
    components = torch.stack([outcome, rewards.to(torch.float64) - outcome], dim=1)
    return gdpo_advantage(components, group_index, response_mask, [outcome_weight, shaping_weight], epsilon,
                          batch_whiten)


def pf_ppo_weights(rewards: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """PF-PPO's sampling weights over the batch's responses (Zhang et al. 2024, "Policy Filtration in
    RLHF to Fine-Tune LLM for Code Generation", arXiv:2409.06957, sec. 4; verl ``algorithm.pf_ppo``):

        pow:        w_i = |r_i|^weight_pow
        max_min:    w_i = 1 if r_i is the batch's maximum or minimum reward, else 0   (the paper's BoN+WoN)
        max_random: w_i = 0.4 if r_i is the batch's maximum, else 0.1                (the paper's BR)

    The weights are unnormalised; ``pf_ppo_resample`` draws the batch from them.
    """
    r = rewards.to(torch.float64)
    if method == "pow":
        return r.abs() ** weight_pow
    if method == "max_min":
        return ((r == r.max()) | (r == r.min())).to(torch.float64)
    if method == "max_random":
        return torch.where(r == r.max(), 0.4, 0.1).to(torch.float64)
    raise ConfigError(f"algorithm.pf_ppo.method must be one of {PF_PPO_METHODS}, got {method!r}")


def pf_ppo_resample(
    rewards: torch.Tensor, generator: torch.Generator, method: str = "pow", weight_pow: float = 2.0
) -> torch.Tensor:
    """Indices [B] of the re-sampled batch: B draws with replacement, P(i) = w_i / sum_j w_j (``pf_ppo_weights``),
    using ``generator`` (seed it from the run's seed: the same seed gives the same batch). A batch whose
    weights are all 0 (e.g. every reward 0 under pow) is kept as it is."""
    weights = pf_ppo_weights(rewards, method, weight_pow)
    if not bool((weights > 0).any()):
        return torch.arange(rewards.shape[0], device=rewards.device)
    return torch.multinomial(weights, rewards.shape[0], replacement=True, generator=generator)


PF_PPO_METHODS = ("pow", "max_min", "max_random")


@dataclass(frozen=True)
class PolicyFiltration:
    """``algorithm.pf_ppo``: PF-PPO's filter of the trained batch (``pf_ppo_resample``), applied after the
    advantages and before the update; the draws come from the run's mini-batch stream (saved with checkpoints)."""

    method: str = "pow"
    weight_pow: float = 2.0

    @classmethod
    def from_config(cls, node: Any) -> "PolicyFiltration | None":
        from rlbench.algorithm.schedules import settings_from_block

        return None if node is None else settings_from_block(cls, node, "algorithm.pf_ppo")

    def check(self) -> None:
        if self.method not in PF_PPO_METHODS:
            raise ConfigError(f"algorithm.pf_ppo.method={self.method!r} is unknown; choose one of {list(PF_PPO_METHODS)}")
        if self.weight_pow < 0:
            raise ConfigError(f"algorithm.pf_ppo.weight_pow must be >= 0, got {self.weight_pow}")

    def rows(self, rewards: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The re-sampled batch's row indices [B]."""
        return pf_ppo_resample(rewards, generator, self.method, self.weight_pow)
