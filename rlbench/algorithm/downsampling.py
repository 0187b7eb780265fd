"""D3S, dynamic dual-level down-sampling (Wang et al. 2025, "Learning More with Less: A Dynamic
Dual-Level Down-Sampling Framework for Efficient Policy Optimization", arXiv:2509.22115).

The advantages are computed on the full groups; then a step trains on a subset of them:

    samples  of each group's G responses (scope=group, the paper's intra-group variant D3S-I) or of
             the batch's B responses (scope=batch, its cross-group variant), the k_t = ceil(f_t G)
             that maximise the variance of the advantages (:func:`variance_maximising_subset`);
             the others contribute no token and no sequence to the loss
    tokens   of the kept responses' tokens, the top q_t fraction by |A_{i,t}| H_{i,t}
             (:func:`advantage_entropy_score`, H detached) get a policy gradient
    schedule f_t and q_t rise with the training progress from ``samples`` and ``tokens`` to exactly 1
             at ``horizon`` (schedules.ramp, linear or cosine): aggressive down-sampling early, the
             base algorithm, unchanged, from the horizon on

Configuration (``algorithm.downsampling``; null: off):

    samples: 0.5       # f_0 = k_0 / G at the first step, in (0, 1]
    tokens: 0.5        # q_0 at the first step, in (0, 1]
    schedule: linear   # linear | cosine
    horizon: 1.0       # the progress at which both reach 1, in (0, 1]
    scope: group       # group (intra-group) | batch (cross-group)

The schedule's shape and its start values are not verified against the paper (its abstract says only
that the schedule "starts with aggressive down-sampling ... and gradually relaxes"): see
conf/paper/d3s.yaml.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlbench.algorithm.entropy import top_score_token_mask
from rlbench.algorithm.schedules import RAMP_SHAPES, ramp, settings_from_block
from rlbench.errors import ConfigError

SCOPES = ("group", "batch")


def kept_count(fraction: float, size: int) -> int:
    """k = ceil(fraction * size), at most ``size`` (rounded first: 0.3 * 10 is 3.0000000000000004)."""
    return min(size, math.ceil(round(fraction * size, 9)))


def variance_maximising_subset(advantages: torch.Tensor, group_index: torch.Tensor, fraction: float) -> torch.Tensor:
    """D3S's sample level (arXiv:2509.22115, sample-level down-sampling): in each group of size G
    keep the k = ceil(fraction G) responses that maximise the variance of their advantages A_i [B],

        S* = the ceil(k/2) highest A_i  and  the floor(k/2) lowest A_i

    (the extremes: for a fixed k a variance-maximising subset is made of the top and the bottom of the
    sorted advantages; the even split is the greedy choice). The paper shows Var(A) of the kept set is
    positively correlated with an upper bound of the policy-gradient norm. Ties are broken by position
    (a stable sort), so the choice is deterministic. E.g. A = [-2, -1, 0, 1, 2], k = 2 keeps {-2, 2}.
    Returns the keep mask [B] (bool)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the kept sample fraction must be in (0, 1], got {fraction}")
    keep = torch.zeros(advantages.shape[0], dtype=torch.bool, device=advantages.device)
    for group in torch.unique(group_index):
        rows = (group_index == group).nonzero().squeeze(-1)
        size = rows.numel()
        k = kept_count(fraction, size)
        order = torch.sort(advantages[rows], descending=True, stable=True).indices
        keep[rows[order[: (k + 1) // 2]]] = True
        keep[rows[order[size - k // 2 :]]] = True
    return keep


def advantage_entropy_score(advantages: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """D3S's token score (arXiv:2509.22115, token-level down-sampling): s_{i,t} = |A_{i,t}| H_{i,t},
    high where the token matters to the update and the policy is uncertain. H is detached. [B,T]"""
    return advantages.detach().abs() * entropy.detach()


def sequence_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One advantage per response [B]: the mean over its valid tokens (A_i itself for a group-relative
    estimator, whose advantage is constant along a response); 0 for a response without tokens."""
    mask = response_mask.to(advantages.dtype)
    return (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@dataclass(frozen=True)
class DownSampling:
    """``algorithm.downsampling`` (see the module docstring)."""

    samples: float = 0.5
    tokens: float = 0.5
    schedule: str = "linear"
    horizon: float = 1.0
    scope: str = "group"

    @classmethod
    def from_config(cls, node: Any) -> "DownSampling | None":
        return None if node is None else settings_from_block(cls, node, "algorithm.downsampling")

    def check(self) -> None:
        for key in ("samples", "tokens", "horizon"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(
                    f"algorithm.downsampling.{key} must be in (0, 1] (1 keeps everything), got {value}"
                )
        if self.schedule not in RAMP_SHAPES:
            raise ConfigError(f"algorithm.downsampling.schedule={self.schedule} is unknown; choose one of {RAMP_SHAPES}")
        if self.scope not in SCOPES:
            raise ConfigError(
                f"algorithm.downsampling.scope={self.scope} is unknown; choose group (intra-group) or batch (cross-group)"
            )

    def check_sizes(self, group_size: int, responses: int) -> None:
        """The first step keeps k_0 = ceil(samples * n) of a group (of the batch with scope=batch):
        a subset of fewer than 2 responses has no advantage variance to maximise."""
        size = group_size if self.scope == "group" else responses
        k = kept_count(self.samples, size)
        if k < 2:
            raise ConfigError(
                f"algorithm.downsampling.samples={self.samples} keeps k = ceil({self.samples} * {size}) = {k} of "
                f"{'each group' if self.scope == 'group' else 'the batch'}'s {size} responses at the first step; the "
                f"variance of fewer than 2 advantages is 0. Raise samples to >= {2 / size:.3g} or rollout.n"
            )

    @property
    def masks_tokens(self) -> bool:
        """True when some step keeps less than every token (the token level needs entropies)."""
        return self.tokens < 1

    def fractions(self, progress: float) -> tuple[float, float]:
        """(f_t, q_t): the kept sample and token fractions at this progress."""
        return (ramp(progress, self.samples, self.horizon, self.schedule),
                ramp(progress, self.tokens, self.horizon, self.schedule))

    def apply(
        self,
        advantages: torch.Tensor,
        group_index: torch.Tensor,
        response_mask: torch.Tensor,
        entropy: torch.Tensor | None,
        progress: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keep [B] bool, token weights [B,T] or None) of one step. The advantages are the full
        groups'; the token mask ranks the kept responses' tokens only. At f_t = q_t = 1 every response
        is kept and the token weights are None: the base algorithm."""
        sample_fraction, token_fraction = self.fractions(progress)
        if sample_fraction < 1:
            groups = group_index if self.scope == "group" else torch.zeros_like(group_index)
            keep = variance_maximising_subset(sequence_advantages(advantages, response_mask), groups, sample_fraction)
        else:
            keep = torch.ones(advantages.shape[0], dtype=torch.bool, device=advantages.device)
        if token_fraction >= 1:
            return keep, None
        if entropy is None:
            raise ValueError("D3S's token level needs the sampling policy's entropies")
        kept_mask = response_mask * keep[:, None].to(response_mask.dtype)
        return keep, top_score_token_mask(advantage_entropy_score(advantages, entropy), kept_mask, token_fraction)
