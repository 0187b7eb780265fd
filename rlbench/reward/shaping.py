"""Reward shaping: per-response terms added to the outcome reward before advantages are computed.

Inputs offered by the trainer (a function declares the ones it needs):
    response_lengths  [B]   number of response tokens
    finished          [B]   bool, True when the response ended with EOS, False when truncated
    max_length        int   the generation budget (rollout.max_new_tokens)
Every function returns a [B] float tensor that is added to the rewards.
"""

from __future__ import annotations

import torch

from rlbench.algorithm.registry import Registry

REWARD_SHAPING = Registry("reward shaping")
SHAPING_INPUTS = {"response_lengths", "finished", "max_length"}


@REWARD_SHAPING.register("dapo_overlong")
def dapo_overlong_penalty(
    response_lengths: torch.Tensor, finished: torch.Tensor, max_length: int, cache_fraction: float = 0.2
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", arXiv:2503.14476, eq. 13). With L_max = max_length and the punishment
    interval L_cache = round(cache_fraction * L_max):

        R_len(y) = 0                                  if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                                 if |y| > L_max

    A response truncated at the budget (no EOS) would have exceeded L_max and gets -1. The paper
    uses L_max = 20480 and L_cache = 4096, hence the default fraction 0.2.
    """
    if not 0 < cache_fraction <= 1:
        raise ValueError(f"cache_fraction must be in (0, 1], got {cache_fraction}")
    cache = max(1, round(cache_fraction * max_length))
    expected = max_length - cache
    lengths = response_lengths.to(torch.float32)
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), (expected - lengths) / cache)
    return torch.where(finished.bool(), penalty, torch.full_like(lengths, -1.0))
