"""HAPO's entropy-adaptive sampling temperature (``rollout=adaptive_temperature``; Liu et al. 2025,
"From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature",
arXiv:2509.16591, the adaptive temperature of section 3).

At every decoding step each row samples at its own temperature

    T_t = T * (1 + tau * h_t),     h_t = scale(H_t) in [-1, 1]

where ``H_t`` is the entropy of the row's next-token distribution at the run's temperature ``T`` and
``scale`` is HAPO's entropy normaliser (:class:`rlbench.algorithm.losses.ratio_clipped.EntropyScale`:
log-entropy centred on its ``entropy_pivot`` quantile, each side divided by its extreme) fitted on the
entropies of the tokens sampled at the *previous* step. Uncertain tokens are sampled hotter, confident
ones colder. The first step has no statistics yet and samples at ``T`` (as the authors' code does:
its vLLM sampler receives the statistics of the previous step's old-log-prob pass, none at step 1).
The statistics are the strategy's state (``state_dict``), so a resumed run continues exactly.

Training: the loss compares the policy at the run's temperature ``T`` (the adaptive temperature
changes how the rollout explores, not the policy being trained), as the authors' code does; like
top-p, the adaptation is a sampling-side warp whose ratio is taken at ``T``.

With ``tau = 0`` the strategy samples exactly what ``rollout=iid`` samples (same seed, same tokens).

Engines: the transform is the engine's logits transform (rlbench/rollout/engines/base.py), so both engines run
it: the HF engine in its decoding loop, the vLLM engine as a V1 logits processor on the same raw
logits before temperature and top-p (rlbench/rollout/engines/vllm_logits.py). On vLLM the recorded entropies
may include a few prompt positions of chunked prefills (that module's docstring); the per-row
temperature of every sampled token is the same rule.

Configuration (conf/rollout/adaptive_temperature.yaml):

    strategy: adaptive_temperature
    adaptive_temperature:
      tau: 0.05            # temperature_tau of the authors' recipe
      entropy_pivot: 0.8   # the quantile the log-entropy is centred on (the recipe's entropy_pivot)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rlbench.algorithm.losses.ratio_clipped import EntropyScale
from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class AdaptiveTemperatureOptions:
    """The ``rollout.adaptive_temperature`` block."""

    tau: float = 0.05
    entropy_pivot: float = 0.8


def temperature_factors(entropy: torch.Tensor, scale: EntropyScale | None, tau: float) -> torch.Tensor:
    """``1 + tau * scale(entropy)`` per entry (all ones without a scale): T_t / T."""
    if scale is None:
        return torch.ones_like(entropy)
    return 1.0 + tau * scale(entropy)


def entropy_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The entropy (nats) of ``softmax(logits / temperature)`` per row of ``logits`` ``[rows, V]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class AdaptiveTemperatureTransform:
    """The engine's logits transform (rlbench.rollout.engines.base.LogitsTransform): divides each row's logits
    by its factor ``1 + tau * h_t`` (the engine then divides by ``T``) and records the entropies of the
    sampled steps (every row it sees samples a response token)."""

    def __init__(self, scale: EntropyScale | None, tau: float, temperature: float):
        self.scale, self.tau, self.temperature = scale, tau, temperature
        self.entropies: list[torch.Tensor] = []
        self.factors: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        entropy = entropy_at(logits, self.temperature)
        self.entropies.append(entropy.cpu())
        if self.scale is None:
            return logits
        factors = temperature_factors(entropy, self.scale, self.tau)
        self.factors.append(factors.cpu())
        return logits / factors[:, None]


@register_strategy("adaptive_temperature")
class AdaptiveTemperatureRollout(RolloutStrategy):
    """i.i.d. groups sampled at HAPO's per-token temperature (module docstring)."""

    def __init__(self, setup: RolloutSetup, tau: float, entropy_pivot: float):
        self.setup, self.tau, self.entropy_pivot = setup, tau, entropy_pivot
        self.scale: EntropyScale | None = None  # fitted on the previous step's sampled tokens

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        options = strategy_options(rollout, "adaptive_temperature", AdaptiveTemperatureOptions)
        tau, pivot = float(options.tau), float(options.entropy_pivot)
        if not (math.isfinite(tau) and 0.0 <= tau < 1.0):
            raise ConfigError(
                f"rollout.adaptive_temperature.tau must be in [0, 1) (T_t = T (1 + tau h), h in [-1, 1], must stay "
                f"positive), got {options.tau}; the authors use 0.05"
            )
        if not 0.0 <= pivot <= 1.0:
            raise ConfigError(f"rollout.adaptive_temperature.entropy_pivot is a quantile in [0, 1], got {options.entropy_pivot}")
        if float(rollout.temperature) <= 0:
            raise ConfigError(
                "rollout=adaptive_temperature adapts the sampling temperature; greedy decoding (rollout.temperature=0) "
                "has none: set rollout.temperature > 0"
            )
        return {"tau": tau, "entropy_pivot": pivot}

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup = self.setup
        transform = AdaptiveTemperatureTransform(self.scale, self.tau, setup.params.temperature)
        params = dataclasses.replace(setup.params, logits_transform=transform)
        groups = setup.sampler(problems, setup.n, params, setup.generator)
        metrics = {"adaptive_temperature_active": float(self.scale is not None)}
        if transform.factors:
            factors = torch.cat(transform.factors)
            metrics.update(
                adaptive_temperature_mean=float(factors.mean()) * setup.params.temperature,
                adaptive_temperature_min=float(factors.min()) * setup.params.temperature,
                adaptive_temperature_max=float(factors.max()) * setup.params.temperature,
            )
        if transform.entropies:
            entropies = torch.cat(transform.entropies)
            self.scale = EntropyScale.fit(entropies, torch.ones_like(entropies), self.entropy_pivot)
        return groups, metrics

    def state_dict(self) -> dict[str, Any]:
        return {"scale": None if self.scale is None else dataclasses.asdict(self.scale)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = None if state["scale"] is None else EntropyScale(**state["scale"])
