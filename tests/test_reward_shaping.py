"""Reward shaping: closed forms, composition, and the runner path."""

import json
import math

import pytest
import torch

import rlbench.runner as runner
from conftest import algorithm_from
from rlbench.errors import ConfigError
from rlbench.algorithm.shaping import (
    R1_TEMPLATE,
    apply_shaping,
    cosine_length_reward,
    dapo_overlong_penalty,
    format_reward,
    thinkless_mode_reward,
)


def test_dapo_overlong_penalty_closed_form():
    # L_max = 10, L_cache = round(0.2 * 10) = 2, so no penalty up to 8 tokens, linear over 9..10
    lengths = torch.tensor([0, 2, 8, 9, 10, 10])
    finished = torch.tensor([True, True, True, True, True, False])
    penalty = dapo_overlong_penalty(lengths, finished, max_length=10, cache_fraction=0.2)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError):
        dapo_overlong_penalty(lengths, finished, max_length=10, cache_fraction=0.0)


def _algorithm(shaping):
    return algorithm_from({
        "name": "t", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
        "aggregation": {"name": "token_mean"}, "reward_shaping": shaping,
    })


def _inputs(lengths, finished=None, correct=None, texts=None, first_tokens=None, max_length=4):
    lengths = torch.tensor(lengths)
    size = len(lengths)
    return {
        "response_lengths": lengths,
        "finished": torch.tensor(finished if finished is not None else [True] * size),
        "max_length": max_length,
        "correct": torch.tensor(correct if correct is not None else [True] * size),
        "group_index": torch.zeros(size, dtype=torch.long),
        "response_texts": texts if texts is not None else [""] * size,
        "first_tokens": first_tokens if first_tokens is not None else [""] * size,
    }


def test_algorithm_adds_shaping_terms_and_validates_them():
    algo = _algorithm([{"name": "dapo_overlong", "cache_fraction": 0.5}])
    shaped = algo.shape_rewards(torch.tensor([1.0, 1.0, 0.0]), _inputs([1, 3, 4]))
    assert shaped.tolist() == pytest.approx([1.0, 0.5, -1.0])
    outcome = torch.tensor([0.25])
    assert _algorithm([]).shape_rewards(outcome, _inputs([1])) is outcome
    with pytest.raises(ConfigError, match="cache_frac"):
        _algorithm([{"name": "dapo_overlong", "cache_frac": 0.5}])
    with pytest.raises(ConfigError, match="unknown reward shaping 'nope'"):
        _algorithm([{"name": "nope"}])
    # impossible values are refused at validation, not at the first training step
    with pytest.raises(ConfigError, match="dapo_overlong.*cache_fraction"):
        _algorithm([{"name": "dapo_overlong", "cache_fraction": 0.0}])


def test_dapo_preset_applies_the_overlong_penalty_in_the_runner(make_cfg, tmp_path):
    cfg = make_cfg("experiment=smoke", "algorithm=dapo", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false", "trainer.steps=1")
    assert [s.name for s in cfg.algorithm.reward_shaping] == ["dapo_overlong"]
    runner.run(cfg)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the tiny random model never emits EOS within 8 tokens: every response is truncated -> -1
    assert step["truncated_rate"] == 1.0 and step["reward_shaping_mean"] == pytest.approx(-1.0)


# ---------------------------------------------------------------- cosine length reward (Yeo et al. 2025)


def test_cosine_length_reward_closed_form():
    # L = 4: p = 0, 0.5, 1 and beyond (clamped to 1); (1 + cos(pi p)) / 2 = 1, 0.5, 0, 0
    lengths = [0, 2, 4, 6]
    right = cosine_length_reward(torch.tensor(lengths), torch.tensor([True] * 4), torch.tensor([True] * 4), 4)
    wrong = cosine_length_reward(torch.tensor(lengths), torch.tensor([False] * 4), torch.tensor([True] * 4), 4)
    assert right.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.5])
    assert wrong.tolist() == pytest.approx([-1.0, -0.75, -0.5, -0.5])
    # p = 1/4: shape = (1 + cos(pi/4)) / 2
    shape = (1 + math.cos(math.pi / 4)) / 2
    one = cosine_length_reward(torch.tensor([1]), torch.tensor([True]), torch.tensor([True]), 4)
    assert one.item() == pytest.approx(0.5 + 0.5 * shape)
    # length_scale overrides the budget; truncated responses get truncated_reward when it is set
    scaled = cosine_length_reward(
        torch.tensor([2, 2]), torch.tensor([True, True]), torch.tensor([True, False]), 100,
        length_scale=2, truncated_reward=-10.0,
    )
    assert scaled.tolist() == pytest.approx([0.5, -10.0])
    with pytest.raises(ValueError, match="length_scale"):
        cosine_length_reward(torch.tensor([1]), torch.tensor([True]), torch.tensor([True]), 4, length_scale=0)


def test_cosine_length_reward_is_monotone_in_length():
    lengths = torch.arange(0, 11)
    right = cosine_length_reward(lengths, torch.ones(11, dtype=torch.bool), torch.ones(11, dtype=torch.bool), 10)
    wrong = cosine_length_reward(lengths, torch.zeros(11, dtype=torch.bool), torch.ones(11, dtype=torch.bool), 10)
    assert torch.all(right[1:] < right[:-1]) and torch.all(wrong[1:] > wrong[:-1])
    assert torch.all(right > wrong)


# ---------------------------------------------------------------- format reward (DeepSeek-R1)


def test_format_reward_checks_the_r1_template():
    texts = [
        "<think>add 2 and 3</think> <answer>5</answer>",
        "<think>multi\nline</think>\n<answer>5</answer>\n",
        "<answer>5</answer>",                       # no reasoning block
        "<think>x</think><answer>5</answer> extra",  # trailing text
        "",                                          # zero-length response
    ]
    assert format_reward(texts).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert format_reward(texts[:1], weight=0.5).tolist() == [0.5]
    assert format_reward(["boxed 5", ""], pattern=r".*boxed.*").tolist() == [1.0, 0.0]
    assert R1_TEMPLATE.startswith(r"\s*<think>")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_reward(["x"], pattern="(")
    with pytest.raises(ConfigError, match="format.*regular expression"):
        _algorithm([{"name": "format", "pattern": "("}])


# ---------------------------------------------------------------- Thinkless mode reward


def test_thinkless_mode_reward_table():
    correct = torch.tensor([True, True, False, False, True, True])
    first = ["<short>", "<think>", "<short>", "<think>", "The", ""]
    reward = thinkless_mode_reward(correct, first)
    # correct & short 1.0, correct & think 0.5, wrong -1 in both modes; no control token = think
    assert reward.tolist() == pytest.approx([1.0, 0.5, -1.0, -1.0, 0.5, 0.5])
    custom = thinkless_mode_reward(correct[:2], first[:2], short_token="<think>", short_correct=2.0, think_correct=0.0)
    assert custom.tolist() == pytest.approx([0.0, 2.0])
    with pytest.raises(ValueError, match="first tokens"):
        thinkless_mode_reward(correct, first[:2])


def test_whole_reward_shapers_replace_the_outcome_and_terms_add_to_it():
    outcome = torch.tensor([1.0, 0.0])
    inputs = _inputs([1, 4], finished=[True, False], correct=[True, False], first_tokens=["<short>", "<think>"])
    # thinkless replaces the grader's reward; the overlong term (cache 0.5 of 4) is added on top
    shaped = apply_shaping(outcome, [("thinkless_mode", {}), ("dapo_overlong", {"cache_fraction": 0.5})], inputs)
    assert shaped.tolist() == pytest.approx([1.0 + 0.0, -1.0 - 1.0])
    # a term alone keeps the outcome
    assert apply_shaping(outcome, [("dapo_overlong", {"cache_fraction": 0.5})], inputs).tolist() == pytest.approx(
        [1.0, -1.0]
    )
    with pytest.raises(ConfigError, match="keep at most one"):
        _algorithm([{"name": "thinkless_mode"}, {"name": "cosine_length"}])


def test_thinkless_preset_runs_and_scores_every_response_with_the_mode_table(make_cfg, tmp_path):
    cfg = make_cfg("experiment=smoke", "algorithm=thinkless", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false", "trainer.steps=1", "trainer.prompts_per_step=4")
    runner.run(cfg)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # no response starts with <short> (not a token of this vocabulary): correct -> 0.5, wrong -> -1
    acc = step["accuracy"]
    assert step["reward_mean"] == pytest.approx(0.5 * acc - (1 - acc))
    assert step["kl_coef"] == pytest.approx(0.001) and "kl" in step
