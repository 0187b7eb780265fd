"""Critic-based advantages (PPO's GAE) and the critic's regression targets and loss.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.advantages.common import _backward_gae, _token_rewards, _tokens, _valid, _whiten
from rlbench.algorithm.registry import ADVANTAGES


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
