"""LSPO's length-aware sampler (prompt_sampler=lspo, rlbench/training/curricula.py): its prompt distribution
against the formula on a hand-made statistics table of mean response lengths."""

import numpy as np
import pytest

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.training.curricula import LengthExtremesOptions, length_extremes, make_prompt_sampler
from rlbench.training.prompt_stats import PromptStats, PromptStatsStore

from test_curricula import sampler_config

PROBLEMS = [Problem(str(i), f"q{i}", "a") for i in range(101)]


def length_table(lengths):
    """uid -> mean response length (2 attempts each; None: never seen)."""
    store = PromptStatsStore()
    for uid, length in lengths.items():
        if length is not None:
            store.stats[uid] = PromptStats(attempts=2, correct=1, length_sum=2 * length, last_seen=1)
    return store


def test_lspo_draws_uniformly_among_the_shortest_and_the_long_but_not_truncated():
    # prompts 0..99 have mean lengths 1..100; prompt 100 is unseen. Linear quantiles of 1..100:
    # Q(0.3) = 30.7, Q(0.65) = 65.35, Q(0.95) = 95.05 -> kept: lengths 1..30 and 66..95, and the unseen one
    store = length_table({**{str(i): i + 1 for i in range(100)}, "100": None})
    sampler = make_prompt_sampler(sampler_config({"name": "lspo", "lspo": {"low": 0.3, "high": 0.65, "max": 0.95}}),
                                  PROBLEMS, 0, store)
    kept = {str(length - 1) for length in [*range(1, 31), *range(66, 96)]} | {"100"}
    expected = np.array([1 / 61 if p.uid in kept else 0.0 for p in PROBLEMS])
    assert sampler.probabilities() == pytest.approx(expected)
    drawn = {p.uid for _ in range(40) for p in sampler.next(8)}
    assert drawn <= kept  # no prompt of middling or near-truncated length is drawn


def test_length_extremes_before_any_length_is_known_and_with_ties():
    options = LengthExtremesOptions()
    assert length_extremes([float("nan")] * 3, options).tolist() == [True, True, True]
    # all equal lengths: every quantile is that length, so all are kept
    assert length_extremes([5.0, 5.0, 5.0], options).tolist() == [True, True, True]


@pytest.mark.parametrize("block", [{"low": 0.7, "high": 0.65}, {"max": 1.5}, {"low": 0.0}])
def test_bad_lspo_quantiles_are_refused(block):
    with pytest.raises(ConfigError, match="0 < low < high < max <= 1"):
        make_prompt_sampler(sampler_config({"name": "lspo", "lspo": block}), PROBLEMS, 0, PromptStatsStore())


@pytest.mark.slow
def test_lspo_sampler_and_the_open_rs_recipe_run_from_the_cli(tmp_path):
    from conftest import smoke_cli_steps

    steps = smoke_cli_steps(tmp_path / "lspo", "prompt_sampler=lspo", "trainer.steps=3", "eval.before_training=false")
    assert len(steps) == 3
    steps = smoke_cli_steps(tmp_path / "open_rs", "algorithm=open_rs", "trainer.steps=1", "trainer.prompts_per_step=2",
                            "trainer.micro_batch_size=6", "eval.before_training=false")
    assert steps[0]["generated_responses"] == 2 * 6  # Open-RS's group of 6
    # the cosine reward replaces the grader's: every reward lies in [0.5, 1] (correct) or [-1, -0.5] (wrong)
    acc = steps[0]["accuracy"]
    assert 0.5 * acc - (1 - acc) <= steps[0]["reward_mean"] <= acc - 0.5 * (1 - acc)
