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


# ---------------------------------------------------------------- wired into the step (algorithm.qrpo.reference_samples)

def _qrpo_context(tmp_path, *overrides):
    """QRPO's step context on the tiny model (seed 0) with ``overrides``, its run folder ``tmp_path``."""
    from conftest import algorithm_from, compose_config
    from rlbench.config.typed import typed_config
    from rlbench.model import load_policy
    from rlbench.reward.graders import training_grader
    from rlbench.rollout import make_engine
    from rlbench.training import step

    cfg = compose_config(["experiment=smoke", "algorithm=qrpo", *overrides], tmp_path)
    config = typed_config(cfg)
    cpu = torch.device("cpu")
    model, tokenizer = load_policy(config.model, device=cpu, dtype=torch.float32, seed=cfg.seed, cache_dir=cfg.cache_dir)
    return step.make_step_context(config, algorithm_from(cfg.algorithm), model, tokenizer,
                                  make_engine(config.rollout, model, tokenizer, cpu), cpu, training_grader(config))


def _problems():
    from rlbench.dataset.base import Problem

    return [Problem(f"p{i}", f"What is {i} + 2?", str(i + 2)) for i in range(3)]


def _step(ctx, problems):
    from rlbench.training import step

    seen = []
    metrics = step.train_step(ctx, problems, observe=seen.append)
    return metrics, seen[0]


def test_the_step_reads_k_reference_rewards_per_prompt_and_leaves_the_policy_stream_alone(tmp_path):
    """K = 3: every trained response gets its prompt's 3 pi_ref rewards (graded by the run's reward), the quantile
    is taken among them; the policy's random stream and its rollout are those of the run without reference samples."""
    with_reference = _qrpo_context(tmp_path / "k3", "algorithm.qrpo.reference_samples=3")
    without = _qrpo_context(tmp_path / "k0", "algorithm.qrpo.reference_samples=0")
    problems = _problems()
    metrics, graded = _step(with_reference, problems)
    plain_metrics, plain = _step(without, problems)
    assert [[c.response_ids for c in g] for g in graded.groups] == [[c.response_ids for c in g] for g in plain.groups]
    assert torch.equal(with_reference.rollout_generator.get_state(), without.rollout_generator.get_state())
    assert with_reference.reference_rewards.cache.sampled == 3 and without.reference_rewards is None
    assert metrics["generated_responses"] == plain_metrics["generated_responses"]  # pi_ref's samples are not the step's
    rows = with_reference.reference_rewards.rows(graded)  # from the cache now
    assert rows.shape == (sum(len(g) for g in graded.groups), 3) and with_reference.reference_rewards.cache.sampled == 3
    sizes = [len(g) for g in graded.groups]
    assert all(torch.equal(r, rows[0]) for r in rows[: sizes[0]])  # one row per prompt, repeated over its group
    expected = quantile_rewards(graded.rewards.double(), rows.double()).mean()
    assert metrics["quantile_reward"] == pytest.approx(float(expected), abs=1e-6)


def test_a_prompts_reference_samples_do_not_depend_on_the_others_nor_on_the_cache(tmp_path):
    """Each prompt's K samples come from its own seed: drawn alone or beside other prompts, now or in a second run
    reading the same cache file (which samples nothing), they are the same rewards."""
    cache = tmp_path / "shared.json"
    ctx = _qrpo_context(tmp_path / "a", "algorithm.qrpo.reference_samples=4", f"algorithm.qrpo.reference_cache={cache}")
    problems = _problems()
    together = ctx.reference_rewards.sample(problems)
    alone = ctx.reference_rewards.sample(problems[1:2])
    assert alone[0] == together[1]
    assert len(set(map(tuple, together))) > 1 or len(set(together[0])) > 1  # the samples vary (not a constant)
    _step(ctx, problems)
    second = _qrpo_context(tmp_path / "b", "algorithm.qrpo.reference_samples=4", f"algorithm.qrpo.reference_cache={cache}")
    _, graded = _step(second, problems)
    assert second.reference_rewards.cache.sampled == 0
    assert second.reference_rewards.rows(graded)[0].tolist() == together[0]


@pytest.mark.parametrize("overrides, message", [
    (["algorithm=qrpo", "algorithm.qrpo.reference_samples=-1"], "reference_samples"),
    (["algorithm=grpo", "+algorithm.qrpo.reference_samples=2"], "only the losses \\['qrpo'\\]"),
    (["algorithm=qrpo", "algorithm.qrpo.reference_samples=2", "model/lora=default"], "model.lora"),
    (["algorithm=qrpo", "algorithm.qrpo.reference_samples=2", "reward=brpo"], "reward.judge"),
])
def test_bad_reference_sample_settings_are_refused_before_loading(make_cfg, overrides, message):
    from rlbench.validation import validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", *overrides))


@pytest.mark.slow
def test_cli_run_samples_each_prompt_once_and_writes_the_cache_in_the_run_folder(tmp_path):
    from conftest import smoke_cli_steps

    steps = smoke_cli_steps(tmp_path, "algorithm=qrpo", "algorithm.qrpo.reference_samples=2", "trainer.steps=2")
    assert len(steps) == 2 and all(0.0 <= s["quantile_reward"] <= 1.0 for s in steps)
    import json

    stored = json.loads(next(tmp_path.rglob("reference_rewards.json")).read_text())
    assert stored["identity"]["samples"] == 2 and stored["entries"]
    assert all(len(row) == 2 for row in stored["entries"].values())
    log = next(tmp_path.rglob("rlbench.log")).read_text()
    assert "QRPO reference set:" in log and "x 2 pi_ref samples" in log
