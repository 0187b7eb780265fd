"""Estimators whose baseline is not the group mean of the batch: REINFORCE++ (batch baseline and
return-to-go), ReMax (greedy rollout), PVPO (reference model's mean reward), SPO (a per-prompt
value tracker); with the SPO tracker and the PVPO baseline cache that supply those baselines.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import torch

from rlbench.algorithm.advantages.common import (
    _broadcast,
    _return_to_go,
    _tokens,
    _valid,
    _whiten,
    group_mean_std,
)
from rlbench.algorithm.advantages.group_relative import _sequence_grpo
from rlbench.algorithm.registry import ADVANTAGES


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

    r_t = token_rewards: the paper's (section 2) r_t = 1[t = last token] r - beta KL_t with
    KL_t = log pi_old(y_t) - log pi_ref(y_t), which the trainer provides under algorithm.kl.placement=reward
    (``kl_penalised_rewards``, rlbench/algorithm/kl.py; the preset's setting); without them, the outcome
    reward on the last valid token (beta = 0: every token of response i gets G_t = r_i when gamma = 1).
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
