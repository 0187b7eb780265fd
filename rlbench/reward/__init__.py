"""Reward functions: score a completion against a reference answer."""

from rlbench.reward.math import (
    Grade,
    MathReward,
    answers_equivalent,
    canonical_answer,
    extract_answer,
)

__all__ = ["Grade", "MathReward", "answers_equivalent", "canonical_answer", "extract_answer"]
