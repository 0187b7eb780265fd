"""D3S, dynamic dual-level down-sampling (Wang et al. 2025, arXiv:2509.22115;
rlbench/algorithm/downsampling.py): the variance-maximising sample subset, the |A| H token mask, the
schedule, the refusals before the model loads, and through the runner: the kept responses follow the
schedule and, with the schedule at its end, a run equals GRPO step for step."""

import json
import math

import pytest
import torch

from conftest import algorithm_from
from rlbench.algorithm.downsampling import (
    DownSampling,
    advantage_entropy_score,
    sequence_advantages,
    variance_maximising_subset,
)
from rlbench.algorithm.entropy import top_score_token_mask
from rlbench.algorithm.schedules import ramp
from rlbench.validation import validate_config
from rlbench.errors import ConfigError
from rlbench.training.batch import TrainBatch, batch_norms, kept_responses
from rlbench.training.step import TIMING_METRICS


def _algorithm(loss="ppo_clip", advantage="grpo", aggregation="seq_mean_token_mean", **extra):
    cfg = {"name": "t", "advantage": {"name": advantage}, "loss": {"name": loss},
           "aggregation": {"name": aggregation}, "kl": {"coef": 0.0}}
    cfg.update(extra)
    return algorithm_from(cfg)


def kept(advantages, fraction, groups=None):
    a = torch.tensor(advantages)
    g = torch.zeros(len(advantages), dtype=torch.long) if groups is None else torch.tensor(groups)
    return sorted(a[variance_maximising_subset(a, g, fraction)].tolist())


# ---------------------------------------------------------------- sample level


def test_the_subset_is_the_extremes_of_the_advantages():
    # A = [-2, -1, 0, 1, 2], k = ceil(0.4 * 5) = 2: the highest and the lowest
    assert kept([-2.0, -1.0, 0.0, 1.0, 2.0], 0.4) == [-2.0, 2.0]
    # k = 3: ceil(3/2) = 2 highest, floor(3/2) = 1 lowest
    assert kept([0.0, 2.0, -1.0, 1.0, -2.0], 0.6) == [-2.0, 1.0, 2.0]
    assert kept([0.0, 2.0, -1.0, 1.0, -2.0], 1.0) == [-2.0, -1.0, 0.0, 1.0, 2.0]
    # the kept pair has the largest variance of all pairs of the group
    values = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
    best = max(torch.stack([values[i], values[j]]).var().item() for i in range(5) for j in range(i + 1, 5))
    assert torch.tensor([-2.0, 2.0]).var().item() == best


def test_each_group_keeps_its_own_subset_and_ties_break_by_position():
    a = torch.tensor([0.5, -0.5, 1.5, -1.5, 3.0, 3.0, -3.0, -3.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    keep = variance_maximising_subset(a, g, 0.5)  # k = 2 per group
    assert keep.tolist() == [False, False, True, True, True, False, False, True]
    # cross-group (one group over the batch): k = ceil(0.25 * 8) = 2 of all eight
    assert variance_maximising_subset(a, torch.zeros_like(g), 0.25).tolist() == [False] * 4 + [True, False, False, True]
    with pytest.raises(ValueError):
        variance_maximising_subset(a, g, 0.0)


def test_the_sequence_advantage_is_the_mean_over_valid_tokens():
    advantages = torch.tensor([[1.0, 1.0, 9.0], [2.0, 4.0, 6.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert sequence_advantages(advantages, mask).tolist() == [1.0, 4.0, 0.0]


# ---------------------------------------------------------------- token level


def test_the_token_mask_keeps_exactly_ceil_q_n_tokens_by_abs_advantage_times_entropy():
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0]])
    entropy = torch.tensor([[0.1, 0.4, 0.3, 5.0], [0.02, 0.3, 0.25, 5.0]])  # 5.0 on padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    score = advantage_entropy_score(advantages, entropy)
    assert torch.allclose(score, torch.tensor([[0.1, 0.4, 0.3, 5.0], [0.04, 0.6, 0.5, 10.0]]))
    for q in (0.1, 0.3, 0.5, 0.7, 1.0):  # six distinct scores on valid tokens
        weights = top_score_token_mask(score, mask, q)
        assert weights.sum().item() == math.ceil(q * 6)
        assert (weights * (1 - mask)).sum() == 0
    # ceil(0.5 * 6) = 3: the scores 0.6, 0.5 and 0.4
    assert top_score_token_mask(score, mask, 0.5).tolist() == [[0, 1, 0, 0], [0, 1, 1, 0]]
    # the entropy carries no gradient into the mask's score
    h = entropy.clone().requires_grad_(True)
    assert not advantage_entropy_score(advantages, h).requires_grad


def test_apply_ranks_only_the_kept_responses_tokens():
    settings = DownSampling(samples=0.5, tokens=0.5)
    advantages = torch.tensor([[1.0, 1.0], [0.1, 0.1], [-0.1, -0.1], [-1.0, -1.0]])
    entropy = torch.tensor([[0.2, 0.1], [9.0, 9.0], [9.0, 9.0], [0.3, 0.4]])
    mask = torch.ones(4, 2)
    keep, weights = settings.apply(advantages, torch.zeros(4, dtype=torch.long), mask, entropy, progress=0.0)
    assert keep.tolist() == [True, False, False, True]
    # 4 kept tokens, q = 0.5 -> the 2 highest |A| H among them (0.4, 0.3), never the dropped responses'
    assert weights.tolist() == [[0, 0], [0, 0], [0, 0], [1, 1]]
    with pytest.raises(ValueError, match="entropies"):
        settings.apply(advantages, torch.zeros(4, dtype=torch.long), mask, None, progress=0.0)


# ---------------------------------------------------------------- schedule


def test_ramp_values():
    assert ramp(0.0, 0.5, 1.0) == 0.5
    assert ramp(0.25, 0.5, 1.0) == 0.625
    assert ramp(0.5, 0.5, 0.5) == 1.0 and ramp(0.9, 0.5, 0.5) == 1.0
    assert ramp(0.25, 0.2, 0.5) == pytest.approx(0.6)
    assert ramp(0.5, 0.5, 1.0, "cosine") == pytest.approx(0.75)
    assert ramp(0.25, 0.5, 1.0, "cosine") == pytest.approx(0.5 + 0.5 * (1 - math.cos(math.pi / 4)) / 2)
    assert ramp(1.0, 0.3, 1.0, "cosine") == 1.0
    with pytest.raises(ValueError):
        ramp(0.5, 0.5, 1.0, "step")


def test_at_the_schedule_end_every_response_and_token_is_trained():
    settings = DownSampling(samples=0.25, tokens=0.1, schedule="cosine", horizon=0.5)
    assert settings.fractions(0.0) == (0.25, 0.1)
    assert settings.fractions(0.5) == (1.0, 1.0)
    advantages = torch.randn(6, 3)
    keep, weights = settings.apply(advantages, torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, 3), None, progress=0.75)
    assert keep.all() and weights is None


def test_kept_responses_drop_whole_sequences_from_the_loss_normaliser():
    batch = TrainBatch(
        input_ids=torch.arange(12).view(4, 3), attention_mask=torch.ones(4, 3, dtype=torch.long),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]]), prompt_width=1,
        group_index=torch.tensor([0, 0, 1, 1]), advantages=torch.tensor([[1.0, 1.0], [2.0, 0.0], [3.0, 3.0], [4.0, 0.0]]),
    )
    assert kept_responses(batch) is batch
    batch.sample_keep = torch.tensor([True, True, True, True])
    assert kept_responses(batch) is batch
    batch.sample_keep = torch.tensor([True, False, False, True])
    sub = kept_responses(batch)
    assert sub.advantages.tolist() == [[1.0, 1.0], [4.0, 0.0]] and sub.group_index.tolist() == [0, 1]
    assert batch_norms(sub, torch.arange(sub.size), 2) == {"batch_tokens": 3, "batch_sequences": 2, "batch_groups": 2, "norm_length": 2,
                                                           # no verdicts in this batch: no correct response
                                                           "correct_batch_tokens": 0, "correct_batch_sequences": 0,
                                                           "correct_batch_groups": 0}


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("downsampling, message", [
    ({"samples": 0.0}, r"downsampling.samples must be in \(0, 1\]"),
    ({"tokens": 1.5}, r"downsampling.tokens must be in \(0, 1\]"),
    ({"horizon": 0.0}, r"downsampling.horizon must be in \(0, 1\]"),
    ({"schedule": "step"}, "downsampling.schedule=step is unknown"),
    ({"scope": "prompt"}, "downsampling.scope=prompt is unknown"),
    ({"ratio": 0.5}, r"no key\(s\) \['ratio'\]"),
])
def test_bad_settings_are_refused(downsampling, message):
    with pytest.raises(ConfigError, match=message):
        _algorithm(downsampling=downsampling)


def test_compositions_d3s_cannot_take_are_refused():
    with pytest.raises(ConfigError, match="forms one importance ratio per response"):
        _algorithm(loss="gspo", downsampling={"tokens": 0.5})
    _algorithm(loss="gspo", downsampling={"tokens": 1.0})  # the sample level alone is fine
    _algorithm(loss="gspo_token", downsampling={"tokens": 0.5})
    with pytest.raises(ConfigError, match="set one of them"):
        _algorithm(downsampling={}, token_mask={"top_entropy_quantile": 0.2})
    with pytest.raises(ConfigError, match="not group-relative; use algorithm.downsampling.scope=batch"):
        _algorithm(advantage="gae", critic={"coef": 0.5}, downsampling={})
    _algorithm(advantage="gae", critic={"coef": 0.5}, downsampling={"scope": "batch"})


def test_refusals_come_before_the_model_loads(make_cfg):
    # rollout.n = 2: samples = 0.5 keeps one response, no variance to maximise (the preset's rollout_n is 4,
    # so experiment=smoke, whose n is a preset's rollout_n, runs it)
    with pytest.raises(ConfigError, match=r"keeps k = ceil\(0.5 \* 2\) = 1"):
        validate_config(make_cfg("experiment=smoke", "algorithm=d3s", "rollout.n=2"))
    assert make_cfg("experiment=smoke", "algorithm=d3s").rollout.n == 4
    validate_config(make_cfg("experiment=smoke", "algorithm=d3s"))
    with pytest.raises(ConfigError, match=r"from trainer.stages at step 3: .*keeps k = ceil\(0.5 \* 2\) = 1"):
        validate_config(make_cfg("experiment=smoke", "algorithm=d3s", "rollout.n=4", "algorithm.downsampling.samples=0.5",
                                 "trainer.steps=4", "trainer.stages=[{at:3,rollout.n:2}]"))
    with pytest.raises(ConfigError, match="forms one importance ratio per response"):
        validate_config(make_cfg("experiment=smoke", "algorithm=d3s", "rollout.n=4", "algorithm/loss=gspo",
                                 "algorithm/aggregation=seq_mean_token_mean"))
    with pytest.raises(ConfigError, match="downsampling.tokens"):
        validate_config(make_cfg("experiment=smoke", "algorithm=d3s", "rollout.n=4", "algorithm.downsampling.tokens=0"))


# ---------------------------------------------------------------- through the runner


def run_metrics(tmp_path, name, *overrides):
    from conftest import compose_config
    from rlbench.runner import run

    run(compose_config(["experiment=smoke", "eval.before_training=false", "logger=files", *overrides], tmp_path / name))
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_kept_responses_follow_the_schedule_and_reach_the_base_algorithm(tmp_path):
    # 2 prompts x 4 responses, 3 steps, horizon 0.5: progress 0, 1/3, 2/3 -> f = 0.5, 5/6, 1 -> k = 2, 4, 4
    rows = run_metrics(tmp_path, "d3s", "algorithm=d3s", "rollout.n=4", "trainer.steps=3", "algorithm.downsampling.horizon=0.5")
    assert [r["trained_responses"] for r in rows] == [4.0, 8.0, 8.0]
    # tokens: q = 0.5 of the kept responses' tokens at the first step, every token at the last
    assert 0 < rows[0]["trainable_tokens"] < rows[2]["trainable_tokens"] and "token_mask_kept" not in rows[2]


@pytest.mark.slow
def test_with_the_schedule_at_its_end_d3s_equals_grpo_step_for_step(tmp_path):
    grpo = run_metrics(tmp_path, "grpo", "algorithm=grpo", "rollout.n=4", "trainer.steps=3")
    d3s = run_metrics(tmp_path, "d3s", "algorithm=d3s", "rollout.n=4", "trainer.steps=3",
                      "algorithm.downsampling.samples=1.0", "algorithm.downsampling.tokens=1.0")
    for a, b in zip(grpo, d3s, strict=True):
        assert b["trained_responses"] == 8.0
        assert {k: v for k, v in a.items() if k not in TIMING_METRICS} == \
               {k: v for k, v in b.items() if k not in TIMING_METRICS | {"trained_responses"}}
