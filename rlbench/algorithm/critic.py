"""The critic of PPO: a value head on the policy's last hidden state, and its regression target.

Design: the value head is one linear layer ``V(s_t) = w . h_t + b`` on the final (post-norm) hidden
state ``h_t`` of the policy backbone, i.e. PPO's shared-parameter actor-critic (Schulman et al.
2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347, eq. 9):

    L = L_policy + c_v * L_value (- c_H * H)

The value loss reaches the backbone through ``h_t`` (weighted by ``c_v``). Here (``model: shared``, the
default) the critic is one vector of hidden_size + 1 numbers, trained by the same optimizer steps as the
policy. ``model: separate`` is the critic of LLM PPO implementations (verl, OpenRLHF): the same head on a
copy of the initial policy (rlbench.algorithm.value_model.ValueModel) with its own AdamW and learning rate
``lr``, at the cost of a second model and its optimizer state (rlbench/training/critic_model.py); V_t, the
targets and the clipped value loss are the same.

Position convention: ``h_t`` is the hidden state at the column whose logits predict response token
t, the state *before* token t is generated. So ``V_t`` values the prefix (prompt, o_<t). This is the
state GAE's ``delta_t = r_t + gamma V_{t+1} - V_t`` needs.

The head starts at zero (w = 0, b = 0): V = 0 before training, the initial advantage is the
plain GAE return, and the head does not move the backbone until it has learnt something. Only the
policy is saved at the end of a run; the critic (head or model) is discarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rlbench.algorithm.advantages import gae_returns
from rlbench.algorithm.advantages.poad import poad_returns
from rlbench.algorithm.schedules import settings_from_block
from rlbench.errors import ConfigError

# The advantage estimators that read a critic, each with the value targets it trains the critic on
# (its gamma and lam define them). POAD's targets also read the turn of every token (step_index).
CRITIC_RETURNS = {"gae": gae_returns, "poad": poad_returns}
CRITIC_ADVANTAGE = "gae"


CRITIC_MODELS = ("shared", "separate")


@dataclass(frozen=True)
class CriticSettings:
    """``algorithm.critic``: ``coef`` is c_v, the weight of the value loss in the objective. ``clip``
    is PPO's value-clipping range; null turns clipping off. ``model``: shared (the value head on the
    policy) or separate (a value model of its own, with its own AdamW at ``lr``; null: trainer.lr)."""

    coef: float = 0.5
    clip: float | None = 0.2
    model: str = "shared"
    lr: float | None = None

    @property
    def separate(self) -> bool:
        return self.model == "separate"

    @classmethod
    def from_config(cls, node: Any) -> "CriticSettings | None":
        """None when ``algorithm.critic`` is absent or null (no value head)."""
        return None if node is None else settings_from_block(cls, node, "algorithm.critic")

    def check(self) -> None:
        if self.coef <= 0:
            raise ConfigError(
                f"algorithm.critic.coef must be > 0 (got {self.coef}); remove algorithm.critic to run without a value head"
            )
        if self.clip is not None and self.clip <= 0:
            raise ConfigError(f"algorithm.critic.clip must be > 0 or null (no clipping), got {self.clip}")
        if self.model not in CRITIC_MODELS:
            raise ConfigError(f"algorithm.critic.model must be one of {', '.join(CRITIC_MODELS)}, got {self.model!r}")
        if self.lr is not None and not self.separate:
            raise ConfigError(
                f"algorithm.critic.lr={self.lr} is the separate critic's learning rate; the shared value head trains "
                "with the policy's optimizer at trainer.lr: set algorithm.critic.model=separate or remove algorithm.critic.lr"
            )
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"algorithm.critic.lr must be > 0 (or null: trainer.lr), got {self.lr}")


class ValueHead(torch.nn.Module):
    """V(s_t) = w . h_t + b on the policy's final hidden states [B,T,H] -> [B,T] (float32)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.float()).squeeze(-1)


def make_value_head(model: torch.nn.Module) -> ValueHead:
    """A zero-initialised value head sized for ``model.config.hidden_size``, on the model's device."""
    device = next(model.parameters()).device
    return ValueHead(int(model.config.hidden_size)).to(device)


def value_targets(
    advantage_params: Mapping[str, Any],
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    advantage: str = CRITIC_ADVANTAGE,
    step_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The critic's regression target R_t = A_t^GAE(gamma, lam) + V_t (the lambda-return), computed
    with the gae estimator's own gamma and lam and the values V of the sampling policy
    (``gae_returns``; Schulman et al. 2015, arXiv:1506.02438), from the same per-token rewards as
    the advantages (``token_rewards``: the KL placed in the reward, RTO's dense reward). 0 on padding.
    ``advantage`` = poad gives POAD's boundary-aware targets (``poad_returns``, needs ``step_index``)."""
    params = {k: advantage_params[k] for k in ("gamma", "lam") if k in advantage_params}
    if advantage == "poad":
        return poad_returns(rewards, values, response_mask, step_index, token_rewards, **params)
    return CRITIC_RETURNS[advantage](rewards, values, response_mask, token_rewards, **params)
