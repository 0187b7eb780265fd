"""A toy reward for learning tests with tiny random models (no language ability needed)."""

from __future__ import annotations

from typing import Sequence

from rlbench.reward.math import Grade


class EvenTokenReward:
    """r = (number of response tokens with an even token id) / (response length); 0 for an empty
    response. A random policy scores about 0.5 and any policy-gradient method can push it towards
    1 in a few steps, so "the reward rises" is a cheap end-to-end check that an algorithm learns.
    ``correct`` means r >= threshold. The reference answer is ignored.
    """

    def __init__(self, threshold: float = 0.75) -> None:
        self.threshold = float(threshold)
        self.failures = 0

    def __call__(self, completion: str, reference: str, response_ids: Sequence[int] = ()) -> Grade:
        ids = list(response_ids)
        reward = sum(1 for t in ids if t % 2 == 0) / len(ids) if ids else 0.0
        return Grade(correct=reward >= self.threshold, extracted=None, reward=reward, format_ok=bool(ids))
