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
Every estimator returns advantages of shape [B,T], zero on padding. Helpers that are not
advantage estimators (``gae_returns``, ``value_loss``, ``discounted_returns``, the SPO tracker and
the PVPO baseline cache) live at the end of the module and are not registered.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Hashable, Mapping, Sequence

import torch

from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


def group_mean_std(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element group statistics.

    For element i in group g with n_g members: mean_g = (1/n_g) sum_j v_j and the unbiased
    std_g = sqrt( sum_j (v_j - mean_g)^2 / (n_g - 1) ) (0 for singleton groups). Returns
    (mean, std, count), each gathered back to shape [B]. Variance is computed from centred
    values, so near-equal rewards (e.g. [1, 1.00001]) keep their exact std.
    """
    group_index = group_index.long()
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    values = values.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, group_index, torch.ones_like(values)
    )
    total = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, group_index, values)
    mean = (total / count.clamp(min=1))[group_index]
    centred_sq = (values - mean) ** 2
    sq_total = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, group_index, centred_sq
    )
    var = sq_total / (count - 1).clamp(min=1)
    std = var.sqrt()[group_index]
    return mean, std, count[group_index]


def _broadcast(sequence_advantage: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return sequence_advantage.to(response_mask.dtype if response_mask.is_floating_point() else torch.float32)[
        :, None
    ] * response_mask


@ADVANTAGES.register("grpo")
def grpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Group-relative advantage of GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3).

        A_i = (r_i - mean_g(r)) / (std_g(r) + epsilon)      (scale_by_std=True)
        A_i =  r_i - mean_g(r)                               (scale_by_std=False: Dr.GRPO)

    std is the unbiased group std. Groups of one response, and groups whose rewards are all equal,
    carry no relative information and get A = 0. The advantage is broadcast to every response token.
    """
    mean, std, count = group_mean_std(rewards, group_index)
    centred = rewards.to(torch.float64) - mean
    if scale_by_std:  # all-equal groups have centred == 0: keep them 0 even when epsilon == 0
        advantage = torch.where(std > 0, centred / (std + epsilon), torch.zeros_like(centred))
    else:
        advantage = centred
    advantage = torch.where(count > 1, advantage, torch.zeros_like(advantage))
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantage(rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

        A_i = r_i - mean_g(r)

    The std division of GRPO is dropped because it up-weights prompts that are too easy or too hard
    (question-level difficulty bias). Singleton groups get A = 0.
    """
    return grpo_advantage(rewards, group_index, response_mask, scale_by_std=False)


# =================================================================================================
# Estimator zoo. Shared conventions (every function below follows them):
#   * group statistics come from ``group_mean_std`` (mean, unbiased std, 0 for singleton groups);
#   * "whitening" is (x - mean) / (std + epsilon) over the valid entries of the whole batch, with
#     the unbiased std; a batch whose entries are all equal whitens to 0 (never 0/0);
#   * an all-zero mask row (zero-length response) still counts as a response in group statistics
#     (it has a reward) but receives no advantage, and it carries no tokens into token statistics;
#   * a sequence-level advantage is broadcast with ``_broadcast``; a token-level one goes through
#     ``_tokens``. Arithmetic is float64, the output dtype is that of ``_broadcast``.
# =================================================================================================


def _valid(response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask > 0


def _tokens(token_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A [B,T] advantage in the output dtype, exactly 0 on padding (also where the input is NaN)."""
    dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    cleaned = torch.where(_valid(response_mask), token_values.to(torch.float64), 0.0)
    return cleaned.to(dtype) * response_mask


def _sequence_grpo(
    rewards: torch.Tensor, group_index: torch.Tensor, epsilon: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO's (or, without std, Dr.GRPO's) per-response advantage [B]: ``grpo_advantage`` on one token."""
    one_token = torch.ones(rewards.shape[0], 1, dtype=torch.float64, device=rewards.device)
    return grpo_advantage(rewards, group_index, one_token, epsilon=epsilon, scale_by_std=scale_by_std)[:, 0]


def _whiten(values: torch.Tensor, valid: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(x - mean) / (std + epsilon) over the entries where ``valid`` (unbiased std); 0 elsewhere.

    All-equal (or single) valid entries give 0. Works for [B] (responses) and [B,T] (tokens).
    """
    values = values.to(torch.float64).contiguous()
    out = torch.zeros_like(values)
    flat = values[valid]
    if flat.numel() == 0:
        return out
    mean, std, _ = group_mean_std(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))
    out[valid] = torch.where(std > 0, (flat - mean) / (std + epsilon), torch.zeros_like(flat))
    return out


def _last_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] float64 token rewards with r_i on the last valid token of response i (none if empty)."""
    valid = _valid(response_mask)
    batch, length = valid.shape
    positions = torch.arange(length, device=valid.device).expand(batch, length)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(batch, length, dtype=torch.float64, device=valid.device)
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    out[rows, last[rows]] = rewards.to(torch.float64)[rows]
    return out


def _backward_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1}, backwards over valid tokens.

    Invalid positions (padding, or tool-output tokens inside a multi-turn response) are skipped:
    V_{t+1} and A_{t+1} belong to the next *valid* token, the value after the last valid token is 0
    (terminal), and invalid positions get 0. With V = 0 and lam = 1 this is the discounted
    return-to-go G_t = r_t + gamma G_{t+1}.
    """
    rewards = token_rewards.to(torch.float64)
    values = values.to(torch.float64)
    batch, length = valid.shape
    advantages = torch.zeros(batch, length, dtype=torch.float64, device=valid.device)
    next_value = torch.zeros(batch, dtype=torch.float64, device=valid.device)
    next_advantage = torch.zeros_like(next_value)
    for t in range(length - 1, -1, -1):
        here = valid[:, t]
        advantage = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_advantage = torch.where(here, advantage, next_advantage)
        next_value = torch.where(here, values[:, t], next_value)
    return advantages


def _token_rewards(
    rewards: torch.Tensor, response_mask: torch.Tensor, token_rewards: torch.Tensor | None
) -> torch.Tensor:
    """The trainer's per-token rewards if given (padding ignored), else the outcome on the last token."""
    if token_rewards is None:
        return _last_token_rewards(rewards, response_mask)
    return torch.where(_valid(response_mask), token_rewards.to(torch.float64), 0.0)


def _return_to_go(
    rewards: torch.Tensor, response_mask: torch.Tensor, token_rewards: torch.Tensor | None, gamma: float
) -> torch.Tensor:
    valid = _valid(response_mask)
    per_token = _token_rewards(rewards, response_mask, token_rewards)
    return _backward_gae(per_token, torch.zeros_like(per_token), valid, gamma, 1.0)


def reinforce_pp_returns(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Un-whitened REINFORCE++ return-to-go (the quantity ``reinforce_pp`` whitens).

        G_t = r_t + gamma G_{t+1}    over the valid tokens of each response (0 after the last one)

    r_t = token_rewards, or the outcome reward on the last valid token. With gamma = 1 and an
    outcome-only reward, G_t = r_i on every token of response i.
    """
    return _tokens(_return_to_go(rewards, response_mask, token_rewards, gamma), response_mask)


@ADVANTAGES.register("batch_std")
def batch_std_advantage(
    rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor, epsilon: float = 1e-6
) -> torch.Tensor:
    """Lite PPO advantage: group mean, batch std (Liu et al. 2025, "Part I: Tricks or Traps? A Deep
    Dive into RL for LLM Reasoning", arXiv:2508.08221).

        A_i = (r_i - mean_g(r)) / (std_batch(r) + epsilon)

    std_batch is the unbiased std of the B outcome rewards, the same estimator GRPO uses for its
    group std, so a batch made of one group gives exactly ``grpo``. Singleton groups and a batch
    whose rewards are all equal get A = 0.
    """
    mean, _, count = group_mean_std(rewards, group_index)
    _, batch_std, _ = group_mean_std(rewards, torch.zeros_like(group_index))
    centred = rewards.to(torch.float64) - mean
    advantage = torch.where((batch_std > 0) & (count > 1), centred / (batch_std + epsilon), 0.0)
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("rloo")
def rloo_advantage(rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantage (Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs", arXiv:2402.14740).

        A_i = r_i - (1 / (n_g - 1)) sum_{j != i} r_j  =  n_g / (n_g - 1) * (r_i - mean_g(r))

    Singleton groups have no other response to form a baseline from: A = 0 (the choice of verl's
    ``rloo_vectorized`` and of ``grpo``; verl's ``rloo`` returns r_i instead).
    """
    mean, _, count = group_mean_std(rewards, group_index)
    scale = count / (count - 1).clamp(min=1)
    advantage = torch.where(count > 1, scale * (rewards.to(torch.float64) - mean), 0.0)
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("reinforce_pp", advantage_level="token")
def reinforce_pp_advantage(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", arXiv:2501.03262).

        G_t = r_t + gamma G_{t+1}                    (``reinforce_pp_returns``)
        A_t = (G_t - mean(G)) / (std(G) + epsilon)   mean, unbiased std over all valid batch tokens

    r_t = token_rewards (the paper puts a per-token KL penalty there: r_t = 1[t = EOS] r - beta KL_t),
    or the outcome reward on the last valid token when the trainer has no token rewards.
    """
    returns = _return_to_go(rewards, response_mask, token_rewards, gamma)
    return _tokens(_whiten(returns, _valid(response_mask), epsilon), response_mask)


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantage(
    rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor, epsilon: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025, "REINFORCE++ ...", arXiv:2501.03262): group mean baseline,
    then global batch whitening.

        a_i = r_i - mean_g(r)                        (Dr.GRPO; singleton groups give 0)
        A_t = (a_i - mean(a)) / (std(a) + epsilon)   mean, unbiased std over all valid batch tokens
    """
    centred = _sequence_grpo(rewards, group_index, scale_by_std=False)
    valid = _valid(response_mask)
    return _tokens(_whiten(centred[:, None].expand(valid.shape), valid, epsilon), response_mask)


def _baseline_subtracted(
    rewards: torch.Tensor,
    baseline_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    divisor: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_t = (G_t - b_i) / divisor_i with G_t the undiscounted return-to-go (``remax`` and ``pvpo``)."""
    returns = _return_to_go(rewards, response_mask, token_rewards, 1.0)
    advantage = returns - baseline_rewards.to(torch.float64)[:, None]
    if divisor is not None:
        advantage = advantage / divisor[:, None]
    return _tokens(advantage, response_mask)


@ADVANTAGES.register("remax")
def remax_advantage(
    rewards: torch.Tensor,
    baseline_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models", arXiv:2310.10505).

        A_t = G_t - r(x, y_greedy),   G_t = sum_{k >= t} r_k  (= r_i for an outcome-only reward)

    baseline_rewards holds the reward of the greedy rollout of each response's prompt (the trainer
    generates it). No normalisation.
    """
    return _baseline_subtracted(rewards, baseline_rewards, response_mask, token_rewards)


@ADVANTAGES.register("pvpo")
def pvpo_advantage(
    rewards: torch.Tensor,
    baseline_rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    scale_by_std: bool = False,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """PVPO static value anchor (Feng et al. 2025, "PVPO: Pre-Estimated Value-Based Policy
    Optimization for Agentic Reasoning", arXiv:2508.21104).

        A_i = r_i - V_ref(x)                            (scale_by_std=False)
        A_i = (r_i - V_ref(x)) / (std_g(r) + epsilon)   (scale_by_std=True, only where std_g > 0)

    V_ref(x) (baseline_rewards) is the mean reward of reference-model rollouts of the prompt,
    pre-computed and refreshed every N_ref steps (``PVPOBaselineCache``). Unlike GRPO, all-correct
    or all-wrong groups keep a signal whenever V_ref differs from their reward; with the std flag
    such groups (std_g = 0) are left unscaled rather than divided by epsilon.
    """
    divisor = None
    if scale_by_std:
        _, std, _ = group_mean_std(rewards, group_index)
        divisor = torch.where(std > 0, std + epsilon, torch.ones_like(std))
    return _baseline_subtracted(rewards, baseline_rewards, response_mask, divisor=divisor)


@ADVANTAGES.register("opo")
def opo_advantage(rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """OPO length-weighted optimal baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward
    Baseline", arXiv:2505.23585).

        b_g = sum_{j in g} |o_j| r_j / sum_{j in g} |o_j|,     A_i = r_i - b_g

    |o_j| is the number of valid tokens. A group whose responses are all empty falls back to the
    plain mean; singleton groups get A = 0.
    """
    lengths = _valid(response_mask).sum(dim=1).to(torch.float64)
    values = rewards.to(torch.float64)
    weighted_mean, _, count = group_mean_std(lengths * values, group_index)
    mean_length, _, _ = group_mean_std(lengths, group_index)
    plain_mean, _, _ = group_mean_std(values, group_index)
    safe_length = torch.where(mean_length > 0, mean_length, torch.ones_like(mean_length))
    baseline = torch.where(mean_length > 0, weighted_mean / safe_length, plain_mean)
    advantage = torch.where(count > 1, values - baseline, 0.0)
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("gpg")
def gpg_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float | None = None,
    alpha_denominator: str = "nonzero_reward",
) -> torch.Tensor:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546).

        A_i = alpha (r_i - mean_g(r)),     alpha = B / max(1, M)     (alpha=None)

    M counts the responses of the batch with r_i != 0 (alpha_denominator="nonzero_reward", verl's
    choice) or those in groups with a non-zero reward std (="informative": B - M is the number of
    zero-advantage responses, the paper's gradient-correction reading). A number given as ``alpha``
    overrides the adaptive value (verl ignores its alpha argument). Singleton groups get 0.
    """
    if alpha is None:
        if alpha_denominator == "nonzero_reward":
            counted = int((rewards != 0).sum().item())
        elif alpha_denominator == "informative":
            _, std, count = group_mean_std(rewards, group_index)
            counted = int(((std > 0) & (count > 1)).sum().item())
        else:
            raise ConfigError(
                f"gpg alpha_denominator must be 'nonzero_reward' or 'informative', not {alpha_denominator!r}"
            )
        alpha = rewards.shape[0] / max(1, counted)
    return float(alpha) * dr_grpo_advantage(rewards, group_index, response_mask)


@ADVANTAGES.register("passk")
def passk_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Max-minus-second pass@k advantage (verl's ``grpo_passk``, which cites arXiv:2503.19595; the
    reference docs give no title). The analytic pass@k advantages of Chen et al. 2025 ("Pass@k
    Training ...", arXiv:2508.10751) are not specified in the reference docs and are not this.

        A_i = (r_max,g - r_2nd,g) / (std_g(r) + epsilon)   for i = the first argmax of group g
        A_i = 0                                            for every other response

    Only the best response gets credit: the pass@k (max) objective's marginal value of response i
    is how much the group maximum would drop without it. Ties give 0; singleton groups give 0;
    scale_by_std=False drops the division. With binary rewards, only groups with exactly one
    success carry signal.
    """
    values = rewards.to(torch.float64)
    index = group_index.long()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    position = torch.arange(values.shape[0], device=values.device)
    lowest = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=values.device)
    group_max = lowest.scatter_reduce(0, index, values, reduce="amax")[index]
    candidates = torch.where(values == group_max, position, values.shape[0])
    first = torch.full((num_groups,), values.shape[0], device=values.device).scatter_reduce(
        0, index, candidates, reduce="amin"
    )[index]
    is_top = position == first
    rest = torch.where(is_top, -math.inf, values)
    second = lowest.scatter_reduce(0, index, rest, reduce="amax")[index]
    _, std, count = group_mean_std(values, index)
    gap = torch.where(is_top & (count > 1), group_max - second, 0.0)
    if scale_by_std:
        gap = torch.where(std > 0, gap / (std + epsilon), 0.0)
    return _broadcast(gap.float(), response_mask)


@ADVANTAGES.register("ngrpo")
def ngrpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    max_reward: float = 1.0,
    num_virtual: int = 1,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """NGRPO advantage calibration (Nan et al. 2025, "NGRPO: Negative-enhanced Group Relative Policy
    Optimization", arXiv:2509.18851).

        mu'_g, sigma'_g = mean, unbiased std of {r_j : j in g} + num_virtual copies of max_reward
        A_i = (r_i - mu'_g) / (sigma'_g + epsilon)

    The virtual maximum-reward samples enter only the statistics. All-wrong groups now get negative
    advantages (G=8, all 0: A = -1/3 each); all-correct groups (every r = max_reward) get 0.
    num_virtual=0 is exactly ``grpo``.
    """
    index = group_index.long()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    virtual_index = torch.arange(num_groups, device=index.device).repeat_interleave(int(num_virtual))
    virtual = torch.full((virtual_index.shape[0],), float(max_reward), dtype=torch.float64, device=index.device)
    values = rewards.to(torch.float64)
    mean, std, _ = group_mean_std(torch.cat([values, virtual]), torch.cat([index, virtual_index]))
    mean, std = mean[: values.shape[0]], std[: values.shape[0]]
    advantage = torch.where(std > 0, (values - mean) / (std + epsilon), 0.0)
    return _broadcast(advantage.float(), response_mask)


def _mean_entropy(entropy: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked mean token entropy [B] float64, non-empty [B] bool); the entropy is detached."""
    valid = _valid(response_mask)
    lengths = valid.sum(dim=1)
    total = torch.where(valid, entropy.detach().to(torch.float64), 0.0).sum(dim=1)
    return total / lengths.clamp(min=1), lengths > 0


@ADVANTAGES.register("edge_grpo")
def edge_grpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    epsilon: float = 1e-4,
    entropy_floor: float = 1e-6,
) -> torch.Tensor:
    """EDGE-GRPO entropy-driven advantage (Zhang et al. 2025, "EDGE-GRPO: Entropy-Driven GRPO with
    Guided Error Correction for Advantage Diversity", arXiv:2507.21848).

        A_i = [(r_i - mean_g(r)) / (std_g(r) + epsilon)] / (H_i / H_batch)

    H_i is the masked mean token entropy of response i (detached; floored at entropy_floor) and
    H_batch the mean of H_i over the non-empty responses of the batch. Confident (low-entropy)
    responses get larger |A|: confident-correct gain, confident-wrong are punished harder. Equal
    entropies give ``grpo``. Empty responses get 0. (The Guided Error Correction half of the paper
    is a rollout change, not an advantage.)
    """
    base = _sequence_grpo(rewards, group_index, epsilon)
    mean_entropy, nonempty = _mean_entropy(entropy, response_mask)
    batch_entropy = mean_entropy[nonempty].mean() if bool(nonempty.any()) else mean_entropy.new_tensor(0.0)
    advantage = torch.where(nonempty, base * batch_entropy / mean_entropy.clamp(min=entropy_floor), 0.0)
    return _broadcast(advantage.float(), response_mask)


def _entropy_shaped_rewards(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    entropy: torch.Tensor,
    alive: torch.Tensor,
    outcome_weight: float,
    success_threshold: float,
    entropy_floor: float,
) -> torch.Tensor:
    """GTPO / GRPO-S shaped rewards over K columns (K = T tokens, or 1 mean entropy per response).

    For each group g and column k, O+ (r_i > success_threshold) and O- (the rest), restricted to
    entries alive at k, and d_k = the number of alive members of the same set:
        share+_{i,k} = H_{i,k} / sum_{j in O+} H_{j,k} * d_k
        share-_{i,k} = (1/H_{i,k}) / sum_{j in O-} (1/H_{j,k}) * d_k
        r~+ = w r_i + (1 - w) share+,      r~- = -w - (1 - w) share-          (w = outcome_weight)
    Entries not alive get share 1 (neutral). Uniform entropies give share 1 everywhere, i.e.
    r~+ = w r_i + 1 - w and r~- = -1.
    """
    index = group_index.long()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    entropy = entropy.detach().to(torch.float64).clamp(min=entropy_floor)
    values = rewards.to(torch.float64)[:, None].expand_as(entropy)
    success = values > success_threshold
    score = torch.where(success, entropy, 1.0 / entropy)
    shares = torch.ones_like(entropy)
    for members in (success & alive, ~success & alive):
        weight = members.to(torch.float64)
        zeros = torch.zeros(num_groups, entropy.shape[1], dtype=torch.float64, device=entropy.device)
        total = zeros.index_add(0, index, score * weight)[index]
        alive_count = zeros.index_add(0, index, weight)[index]
        share = score * alive_count / torch.where(total > 0, total, torch.ones_like(total))
        shares = torch.where(members, share, shares)
    bonus = (1.0 - outcome_weight) * shares
    return torch.where(success, outcome_weight * values + bonus, -outcome_weight - bonus)


@ADVANTAGES.register("gtpo", advantage_level="token")
def gtpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    outcome_weight: float = 0.5,
    success_threshold: float = 0.5,
    epsilon: float = 1e-6,
    entropy_floor: float = 1e-6,
) -> torch.Tensor:
    """GTPO token-level entropy-weighted rewards (Tan et al. 2025, "GTPO and GRPO-S: Token and
    Sequence-Level Reward Shaping with Policy Entropy", arXiv:2508.04349).

        correct i (r_i > success_threshold), token t:
            r~_{i,t} = a1 r_i + a2 * H_{i,t} / sum_{k in O+, alive at t} H_{k,t} * d_t
        wrong i:
            r~_{i,t} = -a1 - a2 * (1/H_{i,t}) / sum_{k in O-, alive at t} (1/H_{k,t}) * d_t
        A_{i,t} = (r~_{i,t} - mean_g(r~)) / (std_g(r~) + epsilon)

    a1 = outcome_weight, a2 = 1 - a1; d_t = the number of responses of the same set and group that
    are alive (valid) at position t; the entropy is detached and floored at entropy_floor. mean_g
    and std_g (unbiased) run over all valid tokens of the group's responses. High-entropy tokens of
    correct responses gain most; low-entropy tokens of wrong responses lose most. Uniform entropies
    give r~ = a1 r + a2 for correct and -1 for wrong tokens, hence GRPO's sign pattern. Empty
    responses have no tokens and so do not enter the statistics (unlike GRPO's, where they count).
    Needs a token-level policy loss (not GSPO).
    """
    valid = _valid(response_mask)
    shaped = _entropy_shaped_rewards(
        rewards, group_index, entropy, valid, outcome_weight, success_threshold, entropy_floor
    )
    token_groups = group_index.long()[:, None].expand(valid.shape)[valid]
    flat = shaped[valid]
    advantage = torch.zeros_like(shaped)
    if flat.numel():
        mean, std, _ = group_mean_std(flat, token_groups)
        advantage[valid] = torch.where(std > 0, (flat - mean) / (std + epsilon), torch.zeros_like(flat))
    return _tokens(advantage, response_mask)


@ADVANTAGES.register("grpo_s")
def grpo_s_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    outcome_weight: float = 0.5,
    success_threshold: float = 0.5,
    epsilon: float = 1e-6,
    entropy_floor: float = 1e-6,
) -> torch.Tensor:
    """GRPO-S sequence-level entropy-weighted rewards (Tan et al. 2025, "GTPO and GRPO-S: Token and
    Sequence-Level Reward Shaping with Policy Entropy", arXiv:2508.04349).

        correct i:  r^_i = b1 r_i + b2 * H_i / sum_{k in O+} H_k * |O+|
        wrong i:    r^_i = -b1 - b2 * (1/H_i) / sum_{k in O-} (1/H_k) * |O-|
        A_i = (r^_i - mean_g(r^)) / (std_g(r^) + epsilon)       (GRPO on r^)

    b1 = outcome_weight, b2 = 1 - b1; H_i is the masked mean token entropy (detached, floored);
    O+/O- are taken within the group, excluding empty responses (which get the neutral share 1).
    Uniform entropies with 0/1 rewards give r^ = 2r - 1, i.e. ``grpo`` (exactly when epsilon=0).
    """
    mean_entropy, nonempty = _mean_entropy(entropy, response_mask)
    shaped = _entropy_shaped_rewards(
        rewards, group_index, mean_entropy[:, None], nonempty[:, None], outcome_weight, success_threshold, entropy_floor
    )[:, 0]
    return _broadcast(_sequence_grpo(shaped, group_index, epsilon).float(), response_mask)


def _set_diversity(
    members: torch.Tensor,
    sets: torch.Tensor,
    set_rewards: torch.Tensor,
    answer_keys: torch.Tensor | None,
    diversity: torch.Tensor | None,
    success_threshold: float,
) -> torch.Tensor:
    """d(S) for each of the M sets [M,n] (local indices into ``members``); see ``polychromic``."""
    size = sets.shape[1]
    if diversity is not None:
        if size < 2:
            return torch.zeros(sets.shape[0], dtype=torch.float64, device=sets.device)
        local = diversity.to(torch.float64)[members][:, members]
        pairs = local[sets[:, :, None], sets[:, None, :]]
        upper = torch.ones(size, size, dtype=torch.bool, device=sets.device).triu(1)
        return pairs[:, upper].mean(dim=-1)
    keys = answer_keys.long()[members][sets]
    correct = set_rewards > success_threshold
    same = keys[:, :, None] == keys[:, None, :]
    earlier = torch.ones(size, size, dtype=torch.bool, device=sets.device).tril(-1)
    seen_before = (same & correct[:, None, :] & earlier).any(dim=-1)
    return (correct & ~seen_before).sum(dim=-1).to(torch.float64) / size


@ADVANTAGES.register("polychromic")
def polychromic_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    answer_keys: torch.Tensor | None = None,
    diversity: torch.Tensor | None = None,
    diversity_from: str = "answer_keys",
    set_size: int = 4,
    max_sets: int = 70,
    seed: int | None = None,
    success_threshold: float = 0.5,
    poly_coef: float = 1.0,
    grpo_coef: float = 0.0,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Polychromic set-level advantage (Hamid et al. 2025, "Polychromic Objectives for
    Reinforcement Learning", arXiv:2509.25424), with sets formed inside each prompt group (the
    prompt is the vine state).

        f_poly(S) = mean_{i in S} r_i * d(S)                 S: subsets of size n of group g
        b_g       = mean_S f_poly(S)
        A_i       = grpo_coef * A_i^GRPO + poly_coef * mean_{S containing i} (f_poly(S) - b_g)

    d(S) (diversity_from):
      * "answer_keys": (number of distinct answer_keys among the successful members of S, i.e.
        r > success_threshold) / n -- distinct correct final answers;
      * "diversity":   mean of diversity[i, j] over the pairs {i, j} of S (pairwise dissimilarity
        in [0, 1], e.g. 1 - embedding cosine).
    n = min(set_size, n_g). All C(n_g, n) subsets are used when there are at most max_sets,
    otherwise max_sets random subsets (torch.Generator seeded with ``seed``; None = global RNG).
    Groups of one response, and groups where every set scores the same (e.g. identical responses),
    get 0. Responses in no sampled set get 0. Sum_S (f_poly(S) - b_g) = 0 by construction.
    """
    if diversity_from not in ("answer_keys", "diversity"):
        raise ConfigError(f"polychromic diversity_from must be 'answer_keys' or 'diversity', not {diversity_from!r}")
    source = answer_keys if diversity_from == "answer_keys" else diversity
    if source is None:
        raise ConfigError(f"polychromic with diversity_from={diversity_from!r} needs the trainer input '{diversity_from}'")
    if set_size < 1 or max_sets < 1:
        raise ConfigError("polychromic set_size and max_sets must be >= 1")
    values = rewards.to(torch.float64)
    index = group_index.long()
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
    poly = torch.zeros_like(values)
    for group in torch.unique(index).tolist():
        members = (index == group).nonzero(as_tuple=True)[0]
        group_size = members.numel()
        size = min(int(set_size), group_size)
        if group_size < 2:
            continue
        if math.comb(group_size, size) <= max_sets:
            sets = torch.tensor(list(itertools.combinations(range(group_size), size)), dtype=torch.long)
        else:
            sets = torch.rand(int(max_sets), group_size, generator=generator).argsort(dim=1)[:, :size]
        sets = sets.to(values.device)
        set_rewards = values[members][sets]
        d = _set_diversity(
            members,
            sets,
            set_rewards,
            answer_keys if diversity_from == "answer_keys" else None,
            diversity if diversity_from == "diversity" else None,
            success_threshold,
        )
        centred = set_rewards.mean(dim=-1) * d
        centred = centred - centred.mean()
        contains = torch.zeros(sets.shape[0], group_size, dtype=torch.float64, device=values.device)
        contains.scatter_(1, sets, 1.0)
        poly[members] = (contains * centred[:, None]).sum(dim=0) / contains.sum(dim=0).clamp(min=1)
    advantage = poly_coef * poly
    if grpo_coef:
        advantage = advantage + grpo_coef * _sequence_grpo(rewards, group_index, epsilon)
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("spo")
def spo_advantage(
    rewards: torch.Tensor,
    tracker_baseline: torch.Tensor,
    response_mask: torch.Tensor,
    normalize: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """SPO single-stream advantage (Xu & Ding 2025, "Single-stream Policy Optimization",
    arXiv:2509.13232).

        a_i = r_i - p_hat(x_i)                        p_hat: SPO value tracker, *before* this update
        A_i = (a_i - mean_B(a)) / (std_B(a) + epsilon) over the B responses (normalize=True)

    tracker_baseline [B] comes from ``SPOTracker.baseline(uids)``; the trainer updates the tracker
    after the policy step (``SPOTracker.update``). Group-free: works with one response per prompt.
    A batch whose a_i are all equal (or B = 1) gets 0 when normalised.
    """
    centred = rewards.to(torch.float64) - tracker_baseline.to(torch.float64)
    if normalize:
        centred = _whiten(centred, torch.ones_like(centred, dtype=torch.bool), epsilon)
    return _broadcast(centred.float(), response_mask)


def drpo_length_weights(
    correct: torch.Tensor,
    group_index: torch.Tensor,
    response_lengths: torch.Tensor,
    max_length: int,
    temperature: float,
) -> torch.Tensor:
    """DRPO's weights over the correct responses of each group (``drpo``): with the length reward
    r_L(y) = -|y| / L_max and P_g the correct responses of group g,

        w_i = exp(r_L(y_i) / lambda) / sum_{j in P_g} exp(r_L(y_j) / lambda)     for i in P_g; 0 otherwise

    the closed-form optimum of max_w sum_i w_i r_L(y_i) - lambda KL(w || uniform over P_g). Each
    group's weights sum to 1 over its correct responses (0 for a group without any). Float64 [B].
    """
    index = group_index.long()
    positive = correct.bool()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    logits = torch.where(positive, -response_lengths.to(torch.float64) / (max_length * temperature), -math.inf)
    group_max = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=logits.device).scatter_reduce(
        0, index, logits, reduce="amax"
    )
    shifted = torch.where(positive, torch.exp(logits - group_max[index]), 0.0)
    total = torch.zeros(num_groups, dtype=torch.float64, device=logits.device).index_add_(0, index, shifted)
    return torch.where(positive, shifted / total[index].clamp(min=1e-300), 0.0)


@ADVANTAGES.register("drpo")
def drpo_advantage(
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    correct: torch.Tensor,
    max_length: int,
    temperature: float = 0.1,
    negative_advantage: float = 1.0,
) -> torch.Tensor:
    """Decoupled length reward of DRPO (Li, Chen, Lin & Yang 2025, "DRPO: Efficient Reasoning via
    Decoupled Reward Policy Optimization", arXiv:2510.04474), in the GRPO-compatible form of the
    reference docs (methods-b M48, "recommended first implementation"):

        A_i = |P_g| w_i        for correct i   (w: ``drpo_length_weights``, normalised among the
                                                group's correct answers only; always > 0)
        A_j = -c               for wrong j     (c = negative_advantage)

    Length enters only through the weights among correct answers, so a correct-but-long answer is
    never pushed down (GRPO on a length-penalised reward can give it a negative advantage: the
    failure DRPO fixes). That is why this is an advantage estimator, not a reward term: any
    baseline over the whole group would mix the two signals again. lambda = ``temperature`` tilts
    towards short answers; lambda -> inf gives A = 1 to every correct answer. All-wrong groups get
    -c everywhere; a singleton group gets 1 or -c. Deviation: the paper's discriminative (DisCO)
    objective with its tau-smoothed negative term is not implemented, and lambda = 0.1 is not taken
    from the paper (the reference docs leave it to be verified).
    """
    if temperature <= 0 or negative_advantage < 0:
        raise ValueError(f"drpo needs temperature > 0 and negative_advantage >= 0, got {temperature}, {negative_advantage}")
    lengths = _valid(response_mask).sum(-1)
    weights = drpo_length_weights(correct, group_index, lengths, max_length, temperature)
    positive = correct.bool()
    count = torch.zeros_like(weights).index_add_(0, group_index.long(), positive.to(torch.float64))[group_index.long()]
    advantage = torch.where(positive, count * weights, -float(negative_advantage))
    return _broadcast(advantage.float(), response_mask)


def _gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    per_token = _token_rewards(rewards, response_mask, token_rewards)
    return _backward_gae(per_token, values, _valid(response_mask), gamma, lam)


@ADVANTAGES.register("gae", advantage_level="token")
def gae_advantage(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """Generalized Advantage Estimation (Schulman et al. 2015, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", arXiv:1506.02438), as used by PPO (arXiv:1707.06347).

        delta_t = r_t + gamma V_{t+1} - V_t,     A_t = delta_t + gamma lam A_{t+1}

    computed backwards over the valid tokens (masked positions inside a response are skipped, the
    value after the last valid token is 0), then optionally whitened over all valid batch tokens.
    r_t = token_rewards, or the outcome reward on the last valid token. gamma = lam = 1 gives
    A_t = R - V_t. The value target is ``gae_returns`` (always from the un-whitened A).
    """
    advantages = _gae(rewards, values, response_mask, token_rewards, gamma, lam)
    if whiten:
        advantages = _whiten(advantages, _valid(response_mask), epsilon)
    return _tokens(advantages, response_mask)


def gae_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> torch.Tensor:
    """Value-regression target of PPO/GAE (Schulman et al. 2015, arXiv:1506.02438): R_t = A_t + V_t
    with the un-whitened GAE advantage A_t; 0 on padding. Not an advantage estimator."""
    advantages = _gae(rewards, values, response_mask, token_rewards, gamma, lam)
    return _tokens(advantages + values.to(torch.float64), response_mask)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
) -> torch.Tensor:
    """Clipped value loss of PPO (Schulman et al. 2017, arXiv:1707.06347), per token [B,T]:

        L_t = 0.5 max( (V_t - R_t)^2, (clip(V_t, V_old,t - c, V_old,t + c) - R_t)^2 )

    clip=None gives 0.5 (V_t - R_t)^2. 0 on padding; aggregate it like a policy loss matrix.
    Gradients flow through ``values`` only where the chosen branch depends on it.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        loss = 0.5 * unclipped
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        loss = 0.5 * torch.maximum(unclipped, (clipped_values - returns) ** 2)
    return torch.where(mask > 0, loss, torch.zeros_like(loss))


def spo_tracker_init(successes: float, num_samples: float, rho_min: float = 0.875) -> tuple[float, float]:
    """SPO tracker state (value, weight) from an offline estimate of s successes in N samples
    (Xu & Ding 2025, arXiv:2509.13232):

        N_init = 1 / (1 - rho_min),  alpha = N_init (s + 0.5) / (N + 1),  beta = N_init (N - s + 0.5) / (N + 1)
        value = alpha / (alpha + beta) = (s + 0.5) / (N + 1),  weight = alpha + beta = N_init

    N = 0 gives the uninformative Beta(0.5, 0.5): (0.5, 1.0).
    """
    if num_samples <= 0:
        return 0.5, 1.0
    return (successes + 0.5) / (num_samples + 1), 1.0 / (1.0 - rho_min)


def spo_tracker_update(
    prev_value: Any,
    prev_weight: Any,
    reward: Any,
    kl: Any,
    rho_min: float = 0.875,
    rho_max: float = 0.96,
    d_half: float = 0.06,
    rho: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of SPO's KL-adaptive Beta value tracker (Xu & Ding 2025, "Single-stream Policy
    Optimization", arXiv:2509.13232). Element-wise on tensors or floats.

    The state (value p, weight n) is Beta(alpha = p n, beta = (1 - p) n):
        rho    = clip(2^(-kl / d_half), rho_min, rho_max)     (or the constant ``rho``)
        alpha' = rho alpha + r,      beta' = rho beta + (1 - r)
        n'     = rho n + 1,          p' = alpha' / n'

    kl is the policy-change proxy D: the masked mean |logp_old - logp_now| on the prompt's previous
    stored response (0 on a first visit). Example: (0.5, 1) with r = 1 and rho = 0.5 gives
    Beta(1.25, 0.25), i.e. (5/6, 1.5).
    """
    value = torch.as_tensor(prev_value, dtype=torch.float64)
    weight = torch.as_tensor(prev_weight, dtype=torch.float64)
    reward = torch.as_tensor(reward, dtype=torch.float64)
    kl = torch.as_tensor(kl, dtype=torch.float64)
    if rho is None:
        decay = torch.clamp(torch.pow(2.0, -kl / d_half), rho_min, rho_max)
    else:
        decay = torch.full_like(kl, float(rho))
    alpha = decay * weight * value + reward
    new_weight = decay * weight + 1.0
    return alpha / new_weight, new_weight


class SPOTracker:
    """Per-prompt SPO value tracker: the state behind ``spo``'s ``tracker_baseline`` input.

    Keyed by prompt uid. ``baseline(uids)`` before the policy step, ``update(uids, rewards, kls)``
    after it; ``sampling_weights`` gives SPO's prioritised-sampling weights sqrt(p(1-p)) + 0.05.
    Save ``state_dict()`` with the checkpoint.
    """

    def __init__(self, rho_min: float = 0.875, rho_max: float = 0.96, d_half: float = 0.06, rho: float | None = None):
        self.rho_min, self.rho_max, self.d_half, self.rho = rho_min, rho_max, d_half, rho
        self._state: dict[Hashable, tuple[float, float]] = {}

    def __contains__(self, uid: Hashable) -> bool:
        return uid in self._state

    def __len__(self) -> int:
        return len(self._state)

    def initialise(self, uid: Hashable, successes: float, num_samples: float) -> None:
        """Seed a prompt from an offline estimate (``spo_tracker_init``)."""
        self._state[uid] = spo_tracker_init(successes, num_samples, self.rho_min)

    def state_of(self, uid: Hashable) -> tuple[float, float]:
        """(value, weight); an unseen prompt is Beta(0.5, 0.5) = (0.5, 1.0)."""
        return self._state.get(uid, (0.5, 1.0))

    def baseline(self, uids: Sequence[Hashable]) -> torch.Tensor:
        return torch.tensor([self.state_of(uid)[0] for uid in uids], dtype=torch.float32)

    def update(self, uids: Sequence[Hashable], rewards: Sequence[float], kls: Sequence[float] | None = None) -> None:
        """Apply ``spo_tracker_update`` in order (a uid seen twice in a batch is updated twice)."""
        rewards = [float(r) for r in rewards]
        kls = [0.0] * len(rewards) if kls is None else [float(k) for k in kls]
        if not len(uids) == len(rewards) == len(kls):
            raise ValueError("SPOTracker.update needs one reward (and kl) per uid")
        for uid, reward, kl in zip(uids, rewards, kls):
            value, weight = self.state_of(uid)
            new_value, new_weight = spo_tracker_update(
                value, weight, reward, kl, self.rho_min, self.rho_max, self.d_half, self.rho
            )
            self._state[uid] = (float(new_value), float(new_weight))

    def sampling_weights(self, uids: Sequence[Hashable], exploration: float = 0.05) -> torch.Tensor:
        value = self.baseline(uids).to(torch.float64)
        return (value * (1 - value)).sqrt() + exploration

    def state_dict(self) -> dict[str, Any]:
        return {"entries": {uid: list(state) for uid, state in self._state.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._state = {uid: (float(v), float(w)) for uid, (v, w) in state["entries"].items()}


class PVPOBaselineCache:
    """Reference-model mean reward per prompt uid: the static anchor behind ``pvpo``'s
    ``baseline_rewards`` (Feng et al. 2025, arXiv:2508.21104).

    ``put`` the rewards of the M reference rollouts of a prompt (at a training step), ``baseline``
    gathers V_ref for a batch, ``stale`` says when a prompt is due for a refresh (every
    ``refresh_every`` steps; None = never), ``in_band`` is the pre-sampling filter
    (keep low < accuracy < high).
    """

    def __init__(self, refresh_every: int | None = None):
        self.refresh_every = refresh_every
        self._entries: dict[Hashable, tuple[float, int, int]] = {}  # uid -> (mean, count, step)

    def __contains__(self, uid: Hashable) -> bool:
        return uid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, uid: Hashable, reference_rewards: Sequence[float], step: int = 0) -> None:
        rewards = [float(r) for r in reference_rewards]
        if not rewards:
            raise ValueError(f"PVPOBaselineCache.put needs at least one reference reward for {uid!r}")
        self._entries[uid] = (sum(rewards) / len(rewards), len(rewards), int(step))

    def mean(self, uid: Hashable) -> float:
        return self._entries[uid][0]

    def baseline(self, uids: Sequence[Hashable]) -> torch.Tensor:
        missing = [uid for uid in uids if uid not in self._entries]
        if missing:
            raise KeyError(f"no reference-model baseline cached for prompt uid(s) {missing[:5]}")
        return torch.tensor([self._entries[uid][0] for uid in uids], dtype=torch.float32)

    def stale(self, uid: Hashable, step: int) -> bool:
        if uid not in self._entries:
            return True
        return self.refresh_every is not None and step - self._entries[uid][2] >= self.refresh_every

    def in_band(self, uid: Hashable, low: float = 0.0, high: float = 1.0) -> bool:
        return low < self.mean(uid) < high

    def state_dict(self) -> dict[str, Any]:
        return {"refresh_every": self.refresh_every, "entries": {k: list(v) for k, v in self._entries.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.refresh_every = state.get("refresh_every", self.refresh_every)
        self._entries = {k: (float(m), int(c), int(s)) for k, (m, c, s) in state["entries"].items()}
