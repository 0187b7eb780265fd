"""Update schedules: how one batch's loss becomes parameter changes.

    standard  ``epochs`` passes over ``minibatches`` splits, one optimizer step each (PPO style)
    sfpo      K fast passes, reposition back toward the start, one slow pass (SFPO)
    trpo      one natural-gradient step that satisfies a KL bound, found by line search (TRPO)

The proximal policy of decoupled PPO (the ``ppo_ewma`` loss) is an EWMA of the weights, updated after
every optimizer step of any schedule except trpo.

Also here: :func:`ramp`, a value that rises with the training progress to 1 (D3S's down-sampling
fractions, rlbench/algorithm/downsampling.py).

``algorithm.update`` holds ``schedule`` plus a block of settings named after it
(``algorithm.update.sfpo`` / ``algorithm.update.trpo``). This module holds the settings and the pure
math: conjugate gradient, the trust-region step size, interpolation, the debiased EWMA and SFPO's
entropy switch. ``rlbench.training.update_schedules`` applies them to a model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from rlbench.errors import ConfigError

SCHEDULES = ("standard", "sfpo", "trpo", "none")  # none: no parameter update (training_free_grpo)
RAMP_SHAPES = ("linear", "cosine")


@dataclass(frozen=True)
class SFPOSettings:
    """Slow-Fast Policy Optimization (Wang et al. 2025, arXiv:2510.04072). The defaults are the
    released scripts' values: sfpo_inner_steps=3, sfpo_step_size=0.8, zscore_w=30,
    zscore_threshold=1.0."""

    fast_steps: int = 3  # K fast passes over the batch before repositioning
    alpha: float = 0.8  # reposition theta~ = theta_0 + alpha (theta_K - theta_0)
    entropy_window: int = 30  # steps of entropy history the z-score is computed over
    entropy_z: float | None = 1.0  # z >= this switches SFPO off for good; null: never switch

    def check(self) -> None:
        if self.fast_steps < 0:
            raise ConfigError(f"algorithm.update.sfpo.fast_steps must be >= 0, got {self.fast_steps}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"algorithm.update.sfpo.alpha must be in [0, 1], got {self.alpha}")
        if self.entropy_window < 2:
            raise ConfigError(f"algorithm.update.sfpo.entropy_window must be >= 2, got {self.entropy_window}")


@dataclass(frozen=True)
class TRPOSettings:
    """Trust Region Policy Optimization (Schulman et al. 2015, arXiv:1502.05477). The defaults
    follow Spinning Up: delta = 0.01, 10 CG iterations, damping 0.1, backtracking factor 0.8, at most 10 tries.

    The Fisher-vector products use the whole batch. OpenAI Baselines' TRPO subsamples every 5th
    sample for them, but on a language model that leaves the embedding rows of the other
    responses' tokens with only the damping as curvature, and on the toy task almost every step then
    failed the line search."""

    max_kl: float = 0.01  # delta: bound on the token-mean KL(pi_old || pi_new)
    cg_iters: int = 10
    damping: float = 0.1  # F + damping I, keeps CG well posed where the Fisher is singular
    backtrack: float = 0.8  # the step is scaled by backtrack^j, j = 0, 1, ...
    line_search_steps: int = 10

    def check(self) -> None:
        if self.max_kl <= 0:
            raise ConfigError(f"algorithm.update.trpo.max_kl must be > 0, got {self.max_kl}")
        if self.cg_iters < 1 or self.line_search_steps < 1:
            raise ConfigError("algorithm.update.trpo.cg_iters and line_search_steps must be >= 1")
        if self.damping < 0:
            raise ConfigError(f"algorithm.update.trpo.damping must be >= 0, got {self.damping}")
        if not 0.0 < self.backtrack < 1.0:
            raise ConfigError(f"algorithm.update.trpo.backtrack must be in (0, 1), got {self.backtrack}")


SCHEDULE_SETTINGS = {"sfpo": SFPOSettings, "trpo": TRPOSettings}


def schedule_from_config(name: str, update: Mapping[str, Any]) -> tuple[str, SFPOSettings | TRPOSettings | None]:
    """(schedule name, its settings) from ``algorithm.update`` and its ``schedule`` ``name``. A settings
    block for a schedule that is not selected is refused, so that it cannot be silently ignored."""
    name = str(name)
    if name not in SCHEDULES:
        raise ConfigError(f"algorithm.update.schedule={name} is unknown; choose one of {', '.join(SCHEDULES)}")
    for other in SCHEDULE_SETTINGS:
        if other != name and update.get(other) is not None:
            raise ConfigError(
                f"algorithm.update.{other} is set but algorithm.update.schedule={name}; "
                f"set algorithm.update.schedule={other} or remove the block (~algorithm.update.{other})"
            )
    if name not in SCHEDULE_SETTINGS:
        return name, None
    return name, settings_from_block(SCHEDULE_SETTINGS[name], update.get(name), f"algorithm.update.{name}")


def settings_from_block(cls: type, node: Mapping[str, Any] | None, key: str) -> Any:
    """A frozen settings dataclass with a ``check()`` built from the config block ``key``: a key the
    class has no field for is a ConfigError naming the ones it takes; then the settings check themselves."""
    node = dict(node or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(node) - known
    if unknown:
        raise ConfigError(f"{key} has no key(s) {sorted(unknown)}; it takes {sorted(known)}")
    settings = cls(**node)
    settings.check()
    return settings


# --------------------------------------------------------------------------------------------------
# TRPO math
# --------------------------------------------------------------------------------------------------


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, iterations: int, residual_tol: float = 1e-10
) -> torch.Tensor:
    """Solve A x = b for a symmetric positive-definite A given only x -> A x (Hestenes & Stiefel
    1952), as TRPO does with the Fisher matrix (Schulman et al. 2015, arXiv:1502.05477, App. C):

        x_0 = 0, r_0 = p_0 = b
        a_k = r_k.r_k / p_k.A p_k,  x_{k+1} = x_k + a_k p_k,  r_{k+1} = r_k - a_k A p_k
        p_{k+1} = r_{k+1} + (r_{k+1}.r_{k+1} / r_k.r_k) p_k

    It stops early once r.r < residual_tol. In exact arithmetic it is exact after n iterations for
    an n-dimensional A.
    """
    x = torch.zeros_like(b)
    r = b.clone()
    p = b.clone()
    rr = torch.dot(r, r)
    for _ in range(iterations):
        if rr.item() < residual_tol:
            break
        ap = matvec(p)
        alpha = rr / torch.dot(p, ap)
        x += alpha * p
        r -= alpha * ap
        rr_next = torch.dot(r, r)
        p = r + (rr_next / rr) * p
        rr = rr_next
    return x


def trust_region_scale(direction_fisher_norm: float, max_kl: float) -> float:
    """The largest beta with the quadratic KL model 0.5 (beta s)^T F (beta s) = delta, i.e.
    beta = sqrt(2 delta / s^T F s) (TRPO, arXiv:1502.05477 App. C). Returns 0 if s^T F s <= 0."""
    if not direction_fisher_norm > 0:
        return 0.0
    return math.sqrt(2.0 * max_kl / direction_fisher_norm)


# --------------------------------------------------------------------------------------------------
# SFPO math
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def interpolate_(params: Iterable[torch.Tensor], start: Sequence[torch.Tensor], alpha: float) -> None:
    """SFPO's reposition, in place: theta <- theta_0 + alpha (theta_K - theta_0), where ``params``
    hold theta_K and ``start`` holds theta_0 (Slow-Fast Policy Optimization, arXiv:2510.04072)."""
    for param, begin in zip(params, start):
        param.copy_(begin + alpha * (param - begin))


def entropy_zscore(history: Sequence[float], window: int) -> float | None:
    """z = (H_last - mean(H_w)) / (std(H_w) + 1e-9) over the last ``window`` entries H_w (population
    std), or None while fewer than ``window`` entries exist (SFPO's entropy switch, released code)."""
    if len(history) < window:
        return None
    recent = torch.tensor(list(history[-window:]), dtype=torch.float64)
    return float((recent[-1] - recent.mean()) / (recent.std(unbiased=False) + 1e-9))


class SFPOSwitch:
    """SFPO's fallback rule: entropies of past steps are kept; before a step, a z-score of the
    latest one >= ``entropy_z`` turns SFPO off for the rest of training, and later steps run the
    standard schedule."""

    def __init__(self, window: int, threshold: float | None):
        self.window = window
        self.threshold = threshold
        self.history: list[float] = []
        self.stopped = False

    def observe(self, entropy: float) -> None:
        self.history.append(float(entropy))

    def active(self) -> bool:
        """Checks the rule on the history so far; once it fires, SFPO stays off."""
        if not self.stopped and self.threshold is not None:
            z = entropy_zscore(self.history, self.window)
            self.stopped = z is not None and z >= self.threshold
        return not self.stopped

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "stopped": self.stopped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.stopped = [float(h) for h in state["history"]], bool(state["stopped"])


# --------------------------------------------------------------------------------------------------
# the proximal policy of decoupled PPO
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def ewma_update_(
    average: Iterable[torch.Tensor], current: Iterable[torch.Tensor], total_weight: float, decay: float
) -> float:
    """One step of the debiased EWMA of the weights (Hilton, Cobbe & Schulman 2021, "Batch
    size-invariance for policy optimization", arXiv:2110.00641):

        W_n = beta W_{n-1} + 1,   theta_prox,n = (beta W_{n-1} theta_prox,n-1 + theta_n) / W_n

    starting from W_0 = 1, theta_prox,0 = theta_0. This gives theta_prox,n = sum_k beta^(n-k) theta_k /
    sum_k beta^(n-k): no bias toward theta_0, and beta = 0 tracks the latest weights. In place on
    ``average``; returns W_n.
    """
    new_total = decay * total_weight + 1.0
    keep = decay * total_weight / new_total
    for avg, now in zip(average, current):
        avg.mul_(keep).add_(now, alpha=1.0 / new_total)
    return new_total


# --------------------------------------------------------------------------------------------------
# values that change with the training progress
# --------------------------------------------------------------------------------------------------


def ramp(progress: float, start: float, horizon: float, shape: str = "linear") -> float:
    """A value that rises from ``start`` at progress 0 to exactly 1 at progress >= ``horizon``:

        x = min(progress / horizon, 1)
        linear: start + (1 - start) x
        cosine: start + (1 - start) (1 - cos(pi x)) / 2

    ``progress`` is the fraction of training done before the step (0 at the first step,
    (S - 1) / S at the last of S steps, rlbench.training.loop), so ``horizon`` < 1 leaves the last
    steps at 1."""
    if shape not in RAMP_SHAPES:
        raise ValueError(f"ramp shape must be one of {RAMP_SHAPES}, got {shape!r}")
    if not horizon > 0:
        raise ValueError(f"ramp horizon must be > 0, got {horizon}")
    x = min(max(float(progress) / horizon, 0.0), 1.0)
    if x >= 1.0:
        return 1.0
    rise = x if shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * x))
    return start + (1.0 - start) * rise
