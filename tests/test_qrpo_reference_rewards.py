"""QRPO's K reference rewards per prompt: sampled once, cached on disk by identity, read back without sampling."""

import pytest
import torch

from rlbench.algorithm.losses.quantile_reward import quantile_rewards
from rlbench.errors import ConfigError
from rlbench.training.reference_rewards import (
    ReferenceRewardCache,
    check_reference_samples,
    reference_rewards_identity,
)

SAMPLING = {"temperature": 1.0, "max_new_tokens": 8, "seed": 3}


def counting_sampler(samples):
    calls = []

    def sample(prompts):
        calls.append(list(prompts))
        return [[float(len(prompt) + k) for k in range(samples)] for prompt in prompts]

    return sample, calls


def test_second_run_reads_the_cache_without_sampling(tmp_path):
    path = tmp_path / "ref_rewards.json"
    identity = reference_rewards_identity("model-a", 2, SAMPLING, "math")
    sample, calls = counting_sampler(2)
    first = ReferenceRewardCache(identity, path).rewards(["ab", "abc", "ab"], sample)
    assert calls == [["ab", "abc"]]  # each distinct prompt sampled once
    assert first.tolist() == [[2.0, 3.0], [3.0, 4.0], [2.0, 3.0]]
    again = ReferenceRewardCache(identity, path)
    second = again.rewards(["abc", "ab"], sample)
    assert len(calls) == 1 and again.sampled == 0
    assert second.tolist() == [[3.0, 4.0], [2.0, 3.0]]


@pytest.mark.parametrize("changed", [
    reference_rewards_identity("model-b", 2, SAMPLING, "math"),
    reference_rewards_identity("model-a", 3, SAMPLING, "math"),
    reference_rewards_identity("model-a", 2, {**SAMPLING, "temperature": 0.7}, "math"),
    reference_rewards_identity("model-a", 2, SAMPLING, "code"),
])
def test_another_identity_resamples(tmp_path, changed):
    path = tmp_path / "ref_rewards.json"
    sample, _first_calls = counting_sampler(2)
    ReferenceRewardCache(reference_rewards_identity("model-a", 2, SAMPLING, "math"), path).rewards(["x"], sample)
    resample, recalls = counting_sampler(changed["samples"])
    ReferenceRewardCache(changed, path).rewards(["x"], resample)
    assert recalls == [["x"]]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_reference_samples_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="reference_samples"):
        check_reference_samples(bad)


def test_wrong_sampler_width_is_refused():
    cache = ReferenceRewardCache(reference_rewards_identity("m", 3, SAMPLING, "math"))
    with pytest.raises(ValueError, match="expected 3"):
        cache.rewards(["p"], lambda prompts: [[0.0, 1.0]])


def test_cached_rewards_give_the_closed_form_quantiles():
    """Reference rewards [0, 1, 1, 2]: r=1 has 1 below and 2 equal -> mid-rank (1 + 2/2)/4 = 0.5; r=3 -> 1."""
    cache = ReferenceRewardCache(reference_rewards_identity("m", 4, SAMPLING, "math"))
    reference = cache.rewards(["p", "p"], lambda prompts: [[0.0, 1.0, 1.0, 2.0]] * len(prompts))
    quantiles = quantile_rewards(torch.tensor([1.0, 3.0], dtype=torch.float64), reference)
    assert quantiles.tolist() == pytest.approx([0.5, 1.0])


def test_reference_rewards_row_field_survives_select_and_micro_batches():
    """A [B, K] row field is indexed by row only: TrainBatch.select's response trimming leaves its K columns."""
    from rlbench.training.batch import TrainBatch, micro_batches

    rows, prompt, response = 4, 2, 3
    reference = torch.arange(rows * 5, dtype=torch.float64).reshape(rows, 5)
    batch = TrainBatch(
        input_ids=torch.zeros(rows, prompt + response, dtype=torch.long),
        attention_mask=torch.ones(rows, prompt + response, dtype=torch.long),
        response_mask=torch.tensor([[1.0, 0, 0]] * rows),
        prompt_width=prompt, group_index=torch.tensor([0, 0, 1, 1]), reference_rewards=reference)
    for chunk in micro_batches(torch.arange(rows), 2):
        picked = batch.select(chunk)
        assert picked.response_mask.shape[1] == 1  # the token columns were trimmed
        assert torch.equal(picked.reference_rewards, reference[chunk])
