"""KL-divergence estimators between the policy and a frozen reference, per token.

Schulman (2020), "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html). With
delta_t = logp_t - ref_logp_t and samples o_t ~ pi_theta, each k estimates KL(pi_theta || pi_ref):
    k1  = delta                        (unbiased, high variance, can be negative)
    abs = |delta|                      (biased; verl's ``abs``)
    k2  = delta^2 / 2                  (biased, low variance; its gradient is the true KL gradient
                                        for small delta)
    k3  = exp(-delta) + delta - 1      (unbiased, low variance, always >= 0; GRPO's choice)
    k1+, k3+, abs+                     value of k1 / k3 / abs, gradient of k2 (straight-through; verl's
                                        ``kl_penalty`` with a "+" suffix, verl/trainer/ppo/core_algos.py)

Every estimator takes (logp, ref_logp); k3 and k3+ also take ``clamp`` (``algorithm.kl.clamp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlbench.algorithm.advantages.common import _last_token_rewards
from rlbench.algorithm.registry import KL_ESTIMATORS
from rlbench.errors import ConfigError

KL_LOG_RATIO_LIMIT = 20.0
#: The value clamp verl applies to its ``low_var_kl`` (= k3) estimate; a choice for algorithm.kl.clamp.
VERL_LOW_VAR_KL_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp."""
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """abs = |logp - ref_logp| (verl's ``abs`` KL penalty; >= 0, biased; its gradient has
    magnitude 1 wherever logp != ref_logp)."""
    return (logp - ref_logp).abs()


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - ref_logp)^2 / 2."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1, with the log-ratio clamped to +-20, then

        k3 <- clamp(k3, -clamp, clamp)        when ``clamp`` is set (algorithm.kl.clamp)

    The default is no value clamp (clamp=None): k3 stays unbiased and the presets keep their
    numbers. verl's ``low_var_kl`` clamps the value to [-10, 10] (clamp=10, VERL_LOW_VAR_KL_CLAMP),
    which bounds the loss and zeroes the gradient of tokens whose k3 exceeds 10, i.e. where the
    policy has drifted more than ~e^11 from the reference on that token. Since k3 >= 0, only the
    upper bound can bind."""
    delta = (ref_logp - logp).clamp(-KL_LOG_RATIO_LIMIT, KL_LOG_RATIO_LIMIT)
    value = torch.exp(delta) - delta - 1.0
    if clamp is None:
        return value
    if clamp <= 0:
        raise ValueError(f"the k3 clamp must be > 0 (verl uses 10), got {clamp}")
    return value.clamp(-clamp, clamp)


def straight_through(value: torch.Tensor, gradient_carrier: torch.Tensor) -> torch.Tensor:
    """value's value with gradient_carrier's gradient: g + sg(v - g)."""
    return gradient_carrier + (value - gradient_carrier).detach()


@KL_ESTIMATORS.register("k1+")
def kl_k1_straight_through(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1+ = k2 + sg(k1 - k2): the value of k1, the gradient of k2 (verl's ``k1+``, also spelt
    ``kl+``). k2's gradient, (logp - ref_logp) grad logp, is an unbiased estimate of the gradient
    of KL(pi_theta || pi_ref) under on-policy sampling, whereas k1's own gradient (grad logp) has
    expectation 0; the logged value stays the unbiased k1."""
    return straight_through(kl_k1(logp, ref_logp), kl_k2(logp, ref_logp))


@KL_ESTIMATORS.register("k3+")
def kl_k3_straight_through(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """k3+ = k2 + sg(k3 - k2): the value of k3 (with the optional ``clamp`` of :func:`kl_k3`), the
    gradient of k2 (verl's ``k3+`` / ``low_var_kl+``); why k2's gradient: see kl_k1_straight_through."""
    return straight_through(kl_k3(logp, ref_logp, clamp), kl_k2(logp, ref_logp))


@KL_ESTIMATORS.register("abs+")
def kl_abs_straight_through(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """abs+ = k2 + sg(abs - k2): the value of |logp - ref_logp|, the gradient of k2 (verl's ``abs+``:
    its ``kl_penalty`` gives any estimator but k2 the k2 gradient when the name ends in "+");
    why k2's gradient: see kl_k1_straight_through."""
    return straight_through(kl_abs(logp, ref_logp), kl_k2(logp, ref_logp))


# --------------------------------------------------------------------------------------------
# A per-response factor of the loss's KL term
# --------------------------------------------------------------------------------------------

#: The curriculum labels a response may carry (a prompt sampler's difficulty buckets: prompt_sampler=clpo).
DIFFICULTY_LABELS = ("hard", "medium", "easy")


def difficulty_kl_scale(labels: Sequence[str | None], scales: Mapping[str, float]) -> torch.Tensor:
    """CLPO's difficulty-aware (dynamic) KL regularisation (Zhang et al. 2025, "CLPO: Curriculum Learning meets
    Policy Optimization for LLM Reasoning", arXiv:2509.25004 v1; the authors' release, github.com/csuking/CLPO
    @ cb77b56, verl/workers/actor/dp_actor.py kl_in_loss_scale and verl/trainer/ppo/ray_trainer.py's labels):

        L   = L_pg + beta * aggregate_{i,t}( s_i * k_{i,t}(logp, ref_logp) )
        s_i = scales[label_i]                  (1 for a response without a label)

    label_i is the curriculum's difficulty of response i's problem (hard, medium, easy: the clpo sampler's
    buckets of the step's pass rate; a rewrite carries its origin's bucket). The release's values are
    s = 0.5 for hard responses and 1 otherwise (scripts/clpo_qwen3_8b.sh: kl_loss_coef_hard_scale=0.5,
    kl_loss_coef_nonhard_scale=1.0, kl_loss_coef=0.001): the policy may move further from the reference on
    the problems it fails. Returns s [B] (float32)."""
    unknown = {label for label in labels if label is not None and label not in scales}
    if unknown:
        raise ValueError(f"difficulty labels {sorted(unknown)} have no KL scale (scales: {sorted(scales)})")
    return torch.tensor([1.0 if label is None else float(scales[label]) for label in labels], dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Where the KL term acts, and how its coefficient moves
# --------------------------------------------------------------------------------------------

#: ``algorithm.kl.placement``: ``loss`` adds beta * aggregate(k) to the loss (GRPO, Shao et al.
#: 2024); ``reward`` subtracts beta * k_t from the reward before the advantage (PPO-RLHF, Ziegler
#: et al. 2019; verl's ``use_kl_in_reward``).
KL_PLACEMENTS = ("loss", "reward")
ADAPTIVE_KL_ERROR_LIMIT = 0.2


def sequence_kl(kl_matrix: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """KL of each response, sum_t m_t k_t ([B]); a zero-length response has KL 0."""
    return (kl_matrix * response_mask).sum(-1)


def kl_penalised_rewards(
    rewards: torch.Tensor, kl_matrix: torch.Tensor, response_mask: torch.Tensor, coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty placed in the reward (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", arXiv:1909.08593, sec. 2.2; Ouyang et al. 2022, InstructGPT, eq. 2).

    With k_t the KL estimate between the sampling policy and the reference at response token t
    (k(old_logp, ref_logp); no gradient) and R the outcome reward of the response:

        r_t = 1[t = last token] R - beta k_t                      token rewards   [B,T]
        R'  = sum_t r_t = R - beta sum_t k_t                      sequence reward [B]

    A sequence-level estimator (grpo, rloo, ...) reads R'; a token-level one (reinforce_pp, gae,
    remax, pvpo: those with a ``token_rewards`` input) reads r_t, so that its return-to-go
    G_t = sum_{s>=t} r_s only charges the KL of the tokens at and after t, as in REINFORCE++
    (Hu 2025, arXiv:2501.03262) and verl's ``apply_kl_penalty``. Padding gets r_t = 0; a
    zero-length response keeps R' = R and has no token rewards.
    """
    penalty = coef * (kl_matrix.to(torch.float64) * response_mask)
    token_rewards = _last_token_rewards(rewards, response_mask) - penalty
    return rewards.to(torch.float64) - penalty.sum(-1), token_rewards


def adaptive_kl_coefficient(coef: float, observed_kl: float, target: float, horizon: float, n_steps: int) -> float:
    """The adaptive KL controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
    Preferences", arXiv:1909.08593, sec. 2.2), as in their code and verl's AdaptiveKLController:

        e      = clip(KL / KL_target - 1, -0.2, 0.2)
        beta' = beta (1 + e * n_steps / horizon)

    KL is the observed KL of the batch (here: the mean over responses of the summed per-token
    estimate between the sampling policy and the reference, Ziegler's per-sample KL) and n_steps the
    number of samples since the last update (the batch size). beta grows while the KL is above the
    target and shrinks while it is below, by at most 20% x n_steps / horizon per update. The paper's
    values are KL_target = 6 nats (sentiment) and horizon = 10000.
    """
    error = min(max(observed_kl / target - 1.0, -ADAPTIVE_KL_ERROR_LIMIT), ADAPTIVE_KL_ERROR_LIMIT)
    multiplier = 1.0 + error * n_steps / horizon
    if multiplier <= 0:
        raise ValueError(
            f"adaptive KL multiplier {multiplier} <= 0: horizon={horizon} is too small for {n_steps} samples per "
            f"update; use a horizon above {ADAPTIVE_KL_ERROR_LIMIT * n_steps}"
        )
    return coef * multiplier


@dataclass(frozen=True)
class AdaptiveKL:
    """``algorithm.kl.adaptive``: {target, horizon} of :func:`adaptive_kl_coefficient`."""

    target: float
    horizon: float

    @classmethod
    def from_config(cls, node: Any) -> "AdaptiveKL":
        params = {key: value for key, value in dict(node).items() if value is not None}  # null: left out
        unknown = set(params) - {"target", "horizon"}
        if unknown or not {"target", "horizon"} <= set(params):
            raise ConfigError(
                f"algorithm.kl.adaptive takes exactly {{target, horizon}} (Ziegler et al. 2019: target=6, "
                f"horizon=10000); got {sorted(params)}"
            )
        settings = cls(float(params["target"]), float(params["horizon"]))
        if settings.target <= 0 or settings.horizon <= 0:
            raise ConfigError(f"algorithm.kl.adaptive.target and .horizon must be > 0, got {settings}")
        return settings

    def check_batch(self, n_steps: int) -> None:
        """Refuse a horizon under which one update could drive beta to zero or below."""
        if self.horizon <= ADAPTIVE_KL_ERROR_LIMIT * n_steps:
            raise ConfigError(
                f"algorithm.kl.adaptive.horizon={self.horizon} must exceed 0.2 x the {n_steps} responses of a "
                f"batch, or one update can drive the KL coefficient to zero or below"
            )

    def next_coefficient(self, coef: float, observed_kl: float, n_steps: int) -> float:
        return adaptive_kl_coefficient(coef, observed_kl, self.target, self.horizon, n_steps)
