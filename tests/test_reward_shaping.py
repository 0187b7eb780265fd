"""Reward shaping: closed forms, composition, and the runner path."""

import json

import pytest
import torch

import rlbench.runner as runner
from rlbench.algorithm import Algorithm
from rlbench.errors import ConfigError
from rlbench.reward.shaping import dapo_overlong_penalty


def test_dapo_overlong_penalty_closed_form():
    # L_max = 10, L_cache = round(0.2 * 10) = 2, so no penalty up to 8 tokens, linear over 9..10
    lengths = torch.tensor([0, 2, 8, 9, 10, 10])
    finished = torch.tensor([True, True, True, True, True, False])
    penalty = dapo_overlong_penalty(lengths, finished, max_length=10, cache_fraction=0.2)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError):
        dapo_overlong_penalty(lengths, finished, max_length=10, cache_fraction=0.0)


def _algorithm(shaping):
    return Algorithm.from_config({
        "name": "t", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
        "aggregation": {"name": "token_mean"}, "reward_shaping": shaping,
    })


def test_algorithm_adds_shaping_terms_and_validates_them():
    algo = _algorithm([{"name": "dapo_overlong", "cache_fraction": 0.5}])
    bonus = algo.shape_rewards(torch.tensor([1, 3, 4]), torch.tensor([True, True, True]), max_length=4)
    assert bonus.tolist() == pytest.approx([0.0, -0.5, -1.0])
    assert _algorithm([]).shape_rewards(torch.tensor([1]), torch.tensor([True]), 4) is None
    with pytest.raises(ConfigError, match="cache_frac"):
        _algorithm([{"name": "dapo_overlong", "cache_frac": 0.5}])
    with pytest.raises(ConfigError, match="unknown reward shaping 'nope'"):
        _algorithm([{"name": "nope"}])


def test_dapo_preset_applies_the_overlong_penalty_in_the_runner(make_cfg, tmp_path):
    cfg = make_cfg("experiment=smoke", "algorithm=dapo", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false", "trainer.steps=1")
    assert [s.name for s in cfg.algorithm.reward_shaping] == ["dapo_overlong"]
    runner.run(cfg)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the tiny random model never emits EOS within 8 tokens: every response is truncated -> -1
    assert step["truncated_rate"] == 1.0 and step["reward_shaping_mean"] == pytest.approx(-1.0)
