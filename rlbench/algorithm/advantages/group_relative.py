"""Estimators that compare the responses of one prompt with each other: GRPO, Dr.GRPO, Lite-PPO's
batch std, RLOO, OPO, GPG, pass@k, NGRPO, DRPO, polychromic (set-diversity) and DaGRPO's distinct-pair advantages.
"""

from __future__ import annotations

import itertools
import math

import torch

from rlbench.algorithm.advantages.common import _broadcast, _valid, group_mean_std, group_softmax
from rlbench.algorithm.registry import ADVANTAGES
from rlbench.errors import ConfigError


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


def distinct_pair_mask(scores: torch.Tensor, group_index: torch.Tensor, delta: float) -> torch.Tensor:
    """[B, B] bool: the pairs (i, j), i != j, of one group whose scores differ by at least ``delta``
    (DaGRPO's distinct pairs; symmetric)."""
    s = scores.to(torch.float64)
    same_group = group_index[:, None] == group_index[None, :]
    apart = (s[:, None] - s[None, :]).abs() >= delta - 1e-12
    not_self = ~torch.eye(s.shape[0], dtype=torch.bool, device=s.device)
    return same_group & apart & not_self


@ADVANTAGES.register("distinct_pairs")
def distinct_pairs_advantage(
    rewards: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor, delta: float = 0.1, epsilon: float = 1e-6
) -> torch.Tensor:
    """Distinctiveness-aware pairwise advantage (DaGRPO, Xie et al. 2025, arXiv:2512.06337: "mask sample
    pairs with low distinctiveness"; the paper's formula was not available, this is the design of
    docs/guidance.md built to match the abstract). With s_i the response's score (its reward, which a
    partial-credit reward makes fine-grained) and P_i = {j != i in the group : |s_i - s_j| >= delta}:

        A_i = (1 / |P_i|) sum_{j in P_i} (s_i - s_j) / (std_g(s) + epsilon),     A_i = 0 when P_i is empty

    Pairs closer than ``delta`` give no gradient to either member (with delta -> 0 and binary rewards A_i
    is +-1 / std for the two sides of a mixed group). std is GRPO's unbiased group std.
    """
    if delta < 0:
        raise ConfigError(f"algorithm.advantage.delta must be >= 0, got {delta}")
    scores = rewards.to(torch.float64)
    pairs = distinct_pair_mask(scores, group_index, delta).to(torch.float64)
    _, std, _ = group_mean_std(scores, group_index)
    count = pairs.sum(1)
    gaps = (pairs * (scores[:, None] - scores[None, :])).sum(1)
    advantage = torch.where(count > 0, gaps / count.clamp(min=1) / (std + epsilon), torch.zeros_like(scores))
    return _broadcast(advantage.float(), response_mask)


def _sequence_grpo(
    rewards: torch.Tensor, group_index: torch.Tensor, epsilon: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO's (or, without std, Dr.GRPO's) per-response advantage [B]: ``grpo_advantage`` on one token."""
    one_token = torch.ones(rewards.shape[0], 1, dtype=torch.float64, device=rewards.device)
    return grpo_advantage(rewards, group_index, one_token, epsilon=epsilon, scale_by_std=scale_by_std)[:, 0]


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
    """Max-minus-second pass@k advantage (verl's ``grpo_passk``, which cites arXiv:2503.19595). The
    analytic pass@k advantages of Chen et al. 2025 ("Pass@k Training ...", arXiv:2508.10751) are
    a different method and are not this.

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
    positive = correct.bool()
    logits = torch.where(positive, -response_lengths.to(torch.float64) / (max_length * temperature), -math.inf)
    return group_softmax(logits, group_index)


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
    Decoupled Reward Policy Optimization", arXiv:2510.04474), in a GRPO-compatible form:

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
    from the paper (to be verified against it).
    """
    if temperature <= 0 or negative_advantage < 0:
        raise ValueError(f"drpo needs temperature > 0 and negative_advantage >= 0, got {temperature}, {negative_advantage}")
    lengths = _valid(response_mask).sum(-1)
    weights = drpo_length_weights(correct, group_index, lengths, max_length, temperature)
    positive = correct.bool()
    count = torch.zeros_like(weights).index_add_(0, group_index.long(), positive.to(torch.float64))[group_index.long()]
    advantage = torch.where(positive, count * weights, -float(negative_advantage))
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("dmpo")
def dmpo_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float = 0.1,
    baseline: bool = True,
) -> torch.Tensor:
    """The weights of DMPO's distribution-matching objective (Zhu et al. 2025, "Enhancing Reasoning
    for Diffusion LLMs via Distribution Matching Policy Optimization", arXiv:2510.08233), in the
    model-agnostic form for an autoregressive policy.

    DMPO minimises the cross-entropy from the reward-tilted policy pi*(y|x) ∝ pi_old(y|x) exp(R(y)/alpha)
    to pi_theta. With the G responses of a prompt sampled from pi_old, the self-normalised importance
    weights of pi* are w_i = softmax_i(R_i / alpha), and the loss of one prompt is

        L = - sum_i (w_i - b) log pi_theta(y_i | x),     b = 1/G  (the weight baseline; baseline=False: b = 0)

    Returned per response: A_i = G (w_i - b), so that with ``loss=reinforce`` (l_t = -A_t logp_t) and
    ``aggregation=seq_mean_token_sum`` the batch loss is L averaged over prompts exactly (G / B = 1 / prompts);
    ``seq_mean_token_mean`` divides each log-likelihood by the response length (the paper's
    length-normalised variant). Special cases: rewards all equal in a group -> A = 0 (no gradient, the
    baseline's purpose); alpha -> inf -> A -> 0; alpha -> 0 with a unique best response and
    baseline=False -> A = G on it and 0 elsewhere (cross-entropy on the best response, i.e. SFT).
    The weights of a group sum to 1, so sum_i A_i = 0 with the baseline.
    """
    if alpha <= 0:
        raise ConfigError(f"dmpo's alpha (reward temperature) must be > 0, got {alpha}")
    _, _, count = group_mean_std(rewards, group_index)
    weights = group_softmax(rewards.to(torch.float64) / alpha, group_index)
    advantage = count * weights - (1.0 if baseline else 0.0)
    return _broadcast(advantage.float(), response_mask)


@ADVANTAGES.register("hapo_tlga")
def hapo_tlga_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
    fallback_threshold: float = 5.0,
) -> torch.Tensor:
    """HAPO's Token-Level Group Average (Liu et al. 2025, "From Uniform to Heterogeneous: Tailoring
    Policy Optimization to Every Token's Nature", arXiv:2509.16591, sec. 3; the released
    ``compute_hapo_outcome_advantage``, starriver030515/HAPO). Each response's reward is repeated on
    each of its |o_i| tokens and the group statistics are over those tokens:

        mu_tok    = sum_j |o_j| r_j / sum_j |o_j|                            (OPO's length-weighted baseline)
        sigma_tok = sqrt( sum_j |o_j| (r_j - mu_tok)^2 / sum_j |o_j| )        (population std over tokens)
        A_i       = (r_i - mu_tok) / (sigma_tok + epsilon)

    A long response weighs its reward in the group's statistics by its length: {r = 1 with 10 tokens,
    r = 0 with 30} has mu_tok = 0.25 (GRPO's mean: 0.5). A group in which some |A_i| >= fallback_threshold
    (a rare reward among many tokens) takes GRPO's advantage instead (the paper's smoothing). The
    released code also tests the padding positions of its [B, T] score matrix against the threshold
    (there the normalised value of a zero reward); only response tokens are tested here. Groups of one
    response, all-equal rewards and groups without tokens get A = 0.
    """
    if fallback_threshold <= 0:
        raise ConfigError(f"hapo_tlga fallback_threshold must be > 0, got {fallback_threshold}")
    index = group_index.long()
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    values = rewards.to(torch.float64)
    lengths = _valid(response_mask).sum(dim=1).to(torch.float64)

    def per_group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, index, x)[index]

    tokens = per_group_sum(lengths)
    has_tokens = tokens > 0
    mean = torch.where(has_tokens, per_group_sum(lengths * values) / tokens.clamp(min=1), 0.0)
    std = torch.where(has_tokens, (per_group_sum(lengths * (values - mean) ** 2) / tokens.clamp(min=1)).sqrt(), 0.0)
    centred = values - mean
    tlga = torch.where(std > 0, centred / (std + epsilon), torch.zeros_like(centred))
    too_large = ((tlga.abs() >= fallback_threshold) & (lengths > 0)).to(torch.float64)
    fallback = per_group_sum(too_large) > 0
    advantage = torch.where(fallback, _sequence_grpo(rewards, group_index, epsilon), tlga)
    _, _, count = group_mean_std(values, group_index)
    advantage = torch.where((count > 1) & has_tokens, advantage, torch.zeros_like(advantage))
    return _broadcast(advantage.float(), response_mask)
