"""Pieces added or fixed after a cross-check against verl's core_algos: Clip-Cov/KL-Cov token
counts, the k3 clamp, the abs and straight-through KL estimators, token_sum aggregation and the
truncated importance-sampling correction between sampler and trainer (and its rejected_tokens=drop,
sequence-level weights and batch normalisation).
Closed forms throughout, and one command-line run (slow)."""

import math

import pytest
import torch

from rlbench.algorithm import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from conftest import algorithm_from, smoke_cli_steps
from rlbench.algorithm.aggregation import token_sum
from rlbench.algorithm.kl import kl_abs, kl_k1, kl_k1_straight_through, kl_k3, kl_k3_straight_through
from rlbench.algorithm.losses import covariance_selection_count
from rlbench.algorithm.sampling_correction import (
    SamplingCorrection, batch_normalized_weights, sequence_importance_weights, truncated_importance_weights,
)
from rlbench.errors import ConfigError

F64 = torch.float64
PROMPTS, RESPONSES, TOKENS = 8, 4, 16  # a default-size batch: 512 response tokens


# --------------------------------------------------------------------------------------------
# Clip-Cov / KL-Cov select at least one token
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fraction, tokens, expected",
    [
        (2e-4, 512, 1),  # floor(0.1024) = 0 -> at least one
        (2e-4, 4999, 1),  # the largest batch at which floor() alone picked none
        (2e-4, 5000, 1),
        (2e-4, 10000, 2),
        (0.29, 100, 29),  # float-robust floor
        (0.2, 4, 1),
        (2e-4, 0, 0),  # nothing eligible
        (0.0, 512, 0),  # ratio 0 turns the selection off
    ],
)
def test_covariance_selection_count_closed_form(fraction, tokens, expected):
    assert covariance_selection_count(fraction, tokens) == expected


def default_batch(seed=0):
    """GRPO-like advantages (one per response, +-1) and log-probs spread over a few nats."""
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(PROMPTS * RESPONSES, generator=g) < 0.5).to(F64)
    advantages = (2 * rewards - 1)[:, None].expand(-1, TOKENS).clone()
    logp = -4 * torch.rand(PROMPTS * RESPONSES, TOKENS, generator=g, dtype=F64)
    old_logp = logp + 0.05 * torch.randn(logp.shape, generator=g, dtype=F64)
    return logp, old_logp, advantages, torch.ones_like(logp)


def gradient(loss_name, logp, old_logp, advantages, mask, **params):
    logp = logp.clone().requires_grad_(True)
    matrix, metrics = POLICY_LOSSES.get(loss_name)(logp, old_logp, advantages, mask, **params)
    matrix.sum().backward()
    return logp.grad, metrics


@pytest.mark.parametrize("old_shift", [None, 0.0], ids=["off_policy", "on_policy"])
def test_clip_cov_differs_from_ppo_clip_on_a_default_size_batch(old_shift):
    logp, old_logp, advantages, mask = default_batch()
    if old_shift is not None:
        old_logp = logp.clone()
    cov_grad, metrics = gradient("clip_cov", logp, old_logp, advantages, mask)  # presets' ratio 2e-4
    ppo_grad, _ = gradient("ppo_clip", logp, old_logp, advantages, mask)
    differs = (cov_grad != ppo_grad)
    assert differs.sum().item() == 1, "max(1, floor(2e-4 * 512)) = 1 token is detached"
    assert cov_grad[differs].item() == 0.0
    assert metrics["cov_detached_fraction"] == pytest.approx(1 / 512)


def test_kl_cov_differs_from_is_surrogate_on_a_default_size_batch():
    logp, old_logp, advantages, mask = default_batch()
    kl_grad, metrics = gradient("kl_cov", logp, old_logp, advantages, mask)  # ratio 2e-4, coef 0.1
    is_grad, _ = gradient("is_surrogate", logp, old_logp, advantages, mask)
    differs = (kl_grad - is_grad).abs() > 1e-12
    assert differs.sum().item() == 1
    # the penalty 0.1 |logp - old_logp| adds 0.1 sign(logp - old_logp) to that token's gradient
    sign = torch.sign(logp - old_logp)[differs]
    assert (kl_grad - is_grad)[differs].item() == pytest.approx(0.1 * sign.item())
    assert metrics["kl_cov_fraction"] == pytest.approx(1 / 512)


def test_zero_ratio_turns_the_covariance_selection_off():
    logp, old_logp, advantages, mask = default_batch()
    cov_grad, _ = gradient("clip_cov", logp, old_logp, advantages, mask, clip_cov_ratio=0.0)
    ppo_grad, _ = gradient("ppo_clip", logp, old_logp, advantages, mask)
    assert torch.equal(cov_grad, ppo_grad)


# --------------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------------


def test_k3_clamp_binds_only_above_the_bound():
    # ref - logp = 3: k3 = e^3 - 3 - 1 = 16.09 > 10;  ref - logp = 1: k3 = e - 2 = 0.718 < 10
    logp = torch.zeros(1, 2, dtype=F64)
    ref = torch.tensor([[3.0, 1.0]], dtype=F64)
    unclamped = [math.exp(3) - 4, math.exp(1) - 2]
    assert kl_k3(logp, ref)[0].tolist() == pytest.approx(unclamped)  # the default: no clamp
    assert kl_k3(logp, ref, clamp=10.0)[0].tolist() == pytest.approx([10.0, unclamped[1]])
    assert kl_k3(logp, ref, clamp=None).tolist() == kl_k3(logp, ref).tolist()
    with pytest.raises(ValueError, match="clamp must be > 0"):
        kl_k3(logp, ref, clamp=0.0)


def test_k3_clamp_zeroes_the_gradient_where_it_binds():
    logp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    kl_k3(logp, torch.tensor([[3.0, 1.0]], dtype=F64), clamp=10.0).sum().backward()
    # d k3 / d logp = 1 - exp(ref - logp) where unclamped
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1 - math.e])


def test_abs_estimator_closed_form():
    logp = torch.tensor([[-1.0, -3.0, -2.0]], dtype=F64)
    ref = torch.tensor([[-2.0, -1.0, -2.0]], dtype=F64)
    assert kl_abs(logp, ref).tolist() == [[1.0, 2.0, 0.0]]


@pytest.mark.parametrize(
    "estimator, value",
    [
        ("k1+", lambda d: d),
        ("k3+", lambda d: math.exp(-d) + d - 1),
        ("abs+", abs),
    ],
)
def test_straight_through_estimators_have_the_value_of_kx_and_the_gradient_of_k2(estimator, value):
    deltas = [0.5, -1.0, 2.0]  # logp - ref_logp
    ref = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64)
    logp = (ref + torch.tensor([deltas], dtype=F64)).requires_grad_(True)
    estimate = KL_ESTIMATORS.get(estimator)(logp, ref)
    assert estimate[0].tolist() == pytest.approx([value(d) for d in deltas])
    estimate.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx(deltas)  # d/dlogp (logp - ref)^2 / 2


def test_k3_plus_takes_the_clamp_on_its_value_only():
    logp = torch.zeros(1, 1, dtype=F64, requires_grad=True)
    ref = torch.full((1, 1), 3.0, dtype=F64)
    estimate = kl_k3_straight_through(logp, ref, clamp=10.0)
    assert estimate.item() == pytest.approx(10.0)
    estimate.sum().backward()
    assert logp.grad.item() == pytest.approx(-3.0)  # k2's gradient, logp - ref
    assert torch.equal(kl_k1_straight_through(logp.detach(), ref), kl_k1(logp.detach(), ref))


# --------------------------------------------------------------------------------------------
# token_sum aggregation
# --------------------------------------------------------------------------------------------


def test_token_sum_closed_form_and_micro_batch_additivity():
    matrix = torch.tensor([[1.0, 2.0, 5.0], [3.0, 7.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert token_sum(matrix, mask).item() == 1 + 2 + 3 + 7 + 9
    assert (token_sum(matrix[:1], mask[:1]) + token_sum(matrix[1:], mask[1:])).item() == token_sum(matrix, mask).item()
    assert "token_sum" in AGGREGATIONS


# --------------------------------------------------------------------------------------------
# truncated importance sampling between sampler and trainer
# --------------------------------------------------------------------------------------------


def test_truncated_importance_weights_closed_form():
    old = torch.log(torch.tensor([[0.3, 0.2, 0.5]], dtype=F64))
    sampler = torch.log(torch.tensor([[0.1, 0.4, 0.5]], dtype=F64))
    # ratios 3, 0.5, 1 -> min(., 2)
    assert truncated_importance_weights(old, sampler, cap=2.0)[0].tolist() == pytest.approx([2.0, 0.5, 1.0])
    assert truncated_importance_weights(old, sampler, cap=4.0)[0].tolist() == pytest.approx([3.0, 0.5, 1.0])


def _cfg(**extra):
    cfg = {
        "name": "test", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
        "aggregation": {"name": "token_mean"}, "kl": {"coef": 0.0, "estimator": "k3"},
    }
    cfg.update(extra)
    return cfg


def _loss(algorithm, sampling_logp):
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0]], dtype=F64)
    loss, metrics = algorithm.compute_loss(
        logp=logp, old_logp=logp.detach(), advantages=advantages, response_mask=torch.ones(1, 3, dtype=F64),
        norms={"batch_tokens": 3, "batch_sequences": 1, "norm_length": 3}, sampling_logp=sampling_logp,
    )
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_sampling_correction_weights_the_policy_loss_per_token():
    corrected = algorithm_from(_cfg(sampling_correction={"cap": 2.0}))
    sampler = torch.tensor([[-1.0 - math.log(3), -2.0 + math.log(2), -0.5]], dtype=F64)  # w = 2 (capped), 0.5, 1
    loss, grad, metrics = _loss(corrected, sampler)
    # at ratio 1: l_t = -A_t w_t, token mean over 3 tokens
    assert loss == pytest.approx(-(2.0 + 0.5 + 1.0) / 3)
    assert grad[0].tolist() == pytest.approx([-2.0 / 3, -0.5 / 3, -1.0 / 3])
    assert metrics["sampling_weight_mean"] == pytest.approx(3.5 / 3)
    assert metrics["sampling_weight_capped_fraction"] == pytest.approx(1 / 3)


def test_sampling_correction_is_a_no_op_without_sampler_logprobs_or_config():
    plain = _loss(algorithm_from(_cfg()), None)
    sampler = torch.tensor([[-3.0, -3.0, -3.0]], dtype=F64)
    absent = _loss(algorithm_from(_cfg(sampling_correction={"cap": 2.0})), None)  # HF engine: no sampler logp
    assert absent[0] == plain[0] and torch.equal(absent[1], plain[1]) and "sampling_weight_mean" not in absent[2]
    unconfigured = _loss(algorithm_from(_cfg()), sampler)
    assert unconfigured[0] == plain[0] and torch.equal(unconfigured[1], plain[1])


def test_sampling_correction_config():
    assert algorithm_from(_cfg()).sampling_correction is None
    assert algorithm_from(_cfg(sampling_correction={})).sampling_correction == SamplingCorrection(2.0)
    with pytest.raises(ConfigError, match=r"algorithm.sampling_correction has no key\(s\) \['capp'\]"):
        algorithm_from(_cfg(sampling_correction={"capp": 2.0}))
    with pytest.raises(ConfigError, match="must be > 0"):
        algorithm_from(_cfg(sampling_correction={"cap": 0.0}))



# rho = pi_old / pi_sampler per token: 1, 3 (above cap 2), 1, 1/4 (below low 1/2): tokens 1 and 3 rejected
REJECT_LOGP = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], dtype=F64)
REJECT_SAMPLER = REJECT_LOGP - torch.log(torch.tensor([[1.0, 3.0, 1.0, 0.25]], dtype=F64))
REJECT_ADV = torch.tensor([[1.0, -1.0, 2.0, 0.5]], dtype=F64)


def _token_mean_loss(algorithm, mask, sampling_logp):
    """Loss and d/dlogp at ratio 1 under token_mean with N_tok = the mask's tokens."""
    logp = REJECT_LOGP.clone().requires_grad_(True)
    tokens = int(mask.sum().item())
    loss, metrics = algorithm.compute_loss(
        logp=logp, old_logp=logp.detach(), advantages=REJECT_ADV, response_mask=mask,
        norms={"batch_tokens": tokens, "batch_sequences": 1, "norm_length": 4}, sampling_logp=sampling_logp,
    )
    loss.backward()
    return loss.item(), logp.grad, metrics


@pytest.mark.parametrize("mode", ["reject", "mask"])
def test_dropped_rejected_tokens_leave_the_token_count(mode):
    block = {"cap": 2.0, "mode": mode}
    zero_weight = algorithm_from(_cfg(sampling_correction=block))
    drop = algorithm_from(_cfg(sampling_correction={**block, "rejected_tokens": "drop"}))
    assert zero_weight.sampling_correction.rejected_tokens == "zero_weight"  # the default: today's behaviour
    full = torch.ones(1, 4, dtype=F64)
    kept, dropped = drop.sampling_correction.drop_rejected(full, REJECT_LOGP, REJECT_SAMPLER)
    assert kept.tolist() == [[1.0, 0.0, 1.0, 0.0]] and dropped == {"sampling_dropped_fraction": 0.5}
    # zero_weight: l_t = -A_t on kept tokens, 0 on rejected, / N_tok = 4;  drop: the same sum / N_kept = 2
    loss_zero, grad_zero, _ = _token_mean_loss(zero_weight, full, REJECT_SAMPLER)
    loss_drop, grad_drop, _ = _token_mean_loss(drop, kept, REJECT_SAMPLER)
    assert loss_zero == pytest.approx(-(1.0 + 2.0) / 4) and loss_drop == pytest.approx(-(1.0 + 2.0) / 2)
    assert grad_zero[0].tolist() == pytest.approx([-1.0 / 4, 0.0, -2.0 / 4, 0.0])
    assert torch.allclose(grad_drop, grad_zero * 4 / 2)  # x N_tok / N_kept
    # ... and drop is the plain loss on the kept tokens only
    loss_kept, grad_kept, _ = _token_mean_loss(algorithm_from(_cfg()), kept, None)
    assert loss_drop == pytest.approx(loss_kept) and torch.allclose(grad_drop, grad_kept)


def test_dropping_rejected_tokens_stores_old_logprobs_and_is_refused_where_nothing_is_rejected():
    drop = algorithm_from(_cfg(sampling_correction={"mode": "reject", "rejected_tokens": "drop"}))
    assert drop.drops_rejected_tokens and drop.needs_old_logp and drop.needs_sampling_pass
    assert not algorithm_from(_cfg(sampling_correction={"mode": "reject"})).drops_rejected_tokens
    with pytest.raises(ConfigError, match="rejected_tokens=drop needs mode mask or reject"):
        algorithm_from(_cfg(sampling_correction={"rejected_tokens": "drop"}))
    with pytest.raises(ConfigError, match=r"rejected_tokens='dorp' is unknown"):
        algorithm_from(_cfg(sampling_correction={"mode": "reject", "rejected_tokens": "dorp"}))

# two responses, the second padded after 2 tokens; token log-ratios log(rho_t), padding's made huge
SEQ_RATIO_LOGS = torch.tensor([[0.1, 0.2, -0.4], [0.3, 0.2, 50.0]], dtype=F64)
SEQ_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
SEQ_SAMPLER = torch.full((2, 3), -1.0, dtype=F64)
SEQ_OLD = SEQ_SAMPLER + SEQ_RATIO_LOGS


def test_sequence_level_weights_are_the_truncated_product_of_the_token_ratios():
    old = SEQ_OLD.clone().requires_grad_(True)
    weights = sequence_importance_weights(old, SEQ_SAMPLER, SEQ_MASK, cap=1.5)
    # response 0: exp(0.1 + 0.2 - 0.4) = exp(-0.1); response 1: exp(0.5) = 1.6487 -> cap 1.5; padding 0
    assert not weights.requires_grad
    assert torch.allclose(weights, torch.tensor([[math.exp(-0.1)] * 3, [1.5, 1.5, 0.0]], dtype=F64))
    setting = SamplingCorrection(1.5, level="sequence")
    assert torch.equal(setting.weights(SEQ_OLD, SEQ_SAMPLER, SEQ_MASK), weights)
    assert torch.allclose(setting.weights(SEQ_OLD[:1], SEQ_SAMPLER[:1]), weights[:1])  # no mask: every token valid
    # level token (the default) is unchanged: min(rho_t, cap) per token
    token = SamplingCorrection(1.5).weights(SEQ_OLD, SEQ_SAMPLER, SEQ_MASK)
    assert torch.equal(token, truncated_importance_weights(SEQ_OLD, SEQ_SAMPLER, 1.5))
    assert torch.equal(SamplingCorrection(1.5).normalized(token, SEQ_MASK), token)  # normalize off: as they are


def test_batch_normalised_weights_average_one_over_the_valid_positions():
    token_setting = SamplingCorrection(1.5, normalize=True)
    raw = token_setting.weights(SEQ_OLD, SEQ_SAMPLER, SEQ_MASK)
    token = token_setting.normalized(raw, SEQ_MASK)
    # token level: divided by the mean over the 5 valid tokens; the capped padding token does not count
    valid_mean = (math.exp(0.1) + math.exp(0.2) + math.exp(-0.4) + math.exp(0.3) + math.exp(0.2)) / 5
    assert torch.allclose(token, raw / valid_mean)
    assert ((token * SEQ_MASK).sum() / SEQ_MASK.sum()).item() == pytest.approx(1.0, abs=1e-12)
    # sequence level: the mean of the 2 response weights, not of their 5 tokens; an empty response is ignored
    mask = torch.cat([SEQ_MASK, torch.zeros(1, 3, dtype=F64)])
    old = torch.cat([SEQ_OLD, SEQ_SAMPLER[:1] + 3.0])
    sampler = torch.cat([SEQ_SAMPLER, SEQ_SAMPLER[:1]])
    sequence_setting = SamplingCorrection(1.5, level="sequence", normalize=True)
    sequence = sequence_setting.normalized(sequence_setting.weights(old, sampler, mask), mask)
    response_mean = (math.exp(-0.1) + 1.5) / 2
    expected = torch.tensor([[math.exp(-0.1) / response_mean] * 3, [1.5 / response_mean] * 2 + [0.0], [0.0] * 3], dtype=F64)
    assert torch.allclose(sequence, expected)
    assert sequence[:2, 0].mean().item() == pytest.approx(1.0, abs=1e-12)
    # a zero mean leaves the weights as they are
    zeros = torch.zeros(2, 3, dtype=F64)
    assert torch.equal(batch_normalized_weights(zeros, SEQ_MASK, "token"), zeros)


def test_normalised_sequence_weights_reach_the_policy_loss():
    algorithm = algorithm_from(_cfg(sampling_correction={"cap": 1.5, "level": "sequence", "normalize": True}))
    logp = SEQ_OLD.clone().requires_grad_(True)
    advantages = torch.ones(2, 3, dtype=F64)
    loss, metrics = algorithm.compute_loss(
        logp=logp, old_logp=SEQ_OLD, advantages=advantages, response_mask=SEQ_MASK,
        norms={"batch_tokens": 5, "batch_sequences": 2, "norm_length": 3}, sampling_logp=SEQ_SAMPLER,
    )
    loss.backward()
    response_mean = (math.exp(-0.1) + 1.5) / 2
    weights = [math.exp(-0.1) / response_mean, 1.5 / response_mean]
    # at ratio 1: l_t = -A_t w_i, token mean over the 5 valid tokens
    assert loss.item() == pytest.approx(-(3 * weights[0] + 2 * weights[1]) / 5)
    expected_grad = torch.tensor([[-weights[0] / 5] * 3, [-weights[1] / 5] * 2 + [0.0]], dtype=F64)
    assert torch.allclose(logp.grad, expected_grad)
    # the metrics are the weights' before the division: 2 of 5 tokens at the cap
    assert metrics["sampling_weight_capped_fraction"] == pytest.approx(2 / 5)
    assert metrics["sampling_weight_mean"] == pytest.approx((3 * math.exp(-0.1) + 2 * 1.5) / 5)


def test_level_and_normalize_config():
    default = algorithm_from(_cfg(sampling_correction={})).sampling_correction
    assert default.level == "token" and default.normalize is False  # today's behaviour
    with pytest.raises(ConfigError, match=r"level='sequense' is unknown"):
        algorithm_from(_cfg(sampling_correction={"level": "sequense"}))
    with pytest.raises(ConfigError, match="normalize must be true or false"):
        algorithm_from(_cfg(sampling_correction={"normalize": "yes"}))
    for mode in ("mask", "reject"):
        with pytest.raises(ConfigError, match="level=sequence needs mode truncate"):
            algorithm_from(_cfg(sampling_correction={"mode": mode, "level": "sequence"}))
        with pytest.raises(ConfigError, match="normalize=true needs mode truncate"):
            algorithm_from(_cfg(sampling_correction={"mode": mode, "normalize": True}))


# --------------------------------------------------------------------------------------------
# algorithm.kl.clamp and the new estimators through the composition
# --------------------------------------------------------------------------------------------


def test_kl_clamp_reaches_the_estimator_and_default_is_unclamped():
    logp, ref = torch.zeros(1, 1), torch.full((1, 1), 3.0)
    assert algorithm_from(_cfg()).kl_matrix(logp, ref).item() == pytest.approx(math.exp(3) - 4)
    clamped = algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k3", "clamp": 10.0}))
    assert clamped.kl_matrix(logp, ref).item() == pytest.approx(10.0)
    plus = algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k3+", "clamp": 10.0}))
    assert plus.kl_matrix(logp, ref).item() == pytest.approx(10.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "abs", "k1+", "abs+"])
def test_kl_clamp_is_refused_for_estimators_without_one(estimator):
    with pytest.raises(ConfigError, match="no parameter"):
        algorithm_from(_cfg(kl={"coef": 0.1, "estimator": estimator, "clamp": 10.0}))


def test_kl_clamp_must_be_positive():
    with pytest.raises(ConfigError, match="kl.clamp must be > 0"):
        algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k3", "clamp": -1.0}))


@pytest.mark.parametrize("estimator", ["abs", "k1+", "k3+", "abs+"])
def test_new_estimators_are_selectable(estimator):
    algorithm = algorithm_from(_cfg(kl={"coef": 0.1, "estimator": estimator}))
    assert algorithm.kl_matrix(torch.zeros(1, 1), torch.zeros(1, 1)).item() == 0.0


def test_the_trainer_batch_carries_the_sampler_logprobs():
    from rlbench.rollout.engines.base import Completion
    from rlbench.training.batch import collate

    batch = collate([[Completion(0, (1, 2), [3, 4, 5], [-0.5, -1.0, -1.5], True), Completion(0, (1,), [6], [-2.0], True)]], 0)
    assert batch.sampling_logp.tolist() == [[-0.5, -1.0, -1.5], [-2.0, 0.0, 0.0]]  # zero on padding
    assert batch.select(torch.tensor([1])).sampling_logp.tolist() == [[-2.0]]


def test_every_aggregation_has_a_yaml():
    from pathlib import Path

    directory = Path(__file__).resolve().parents[1] / "conf" / "algorithm" / "aggregation"
    assert sorted(p.stem for p in directory.glob("*.yaml")) == AGGREGATIONS.names()


def test_a_loss_that_reads_sampling_logp_receives_it(monkeypatch):
    from rlbench.algorithm.registry import Needs

    seen = {}

    def reads_sampler(logp, advantages, response_mask, sampling_logp):
        seen["sampling_logp"] = sampling_logp
        return -advantages * logp * response_mask, {}

    monkeypatch.setitem(POLICY_LOSSES._functions, "reads_sampler", reads_sampler)
    monkeypatch.setitem(POLICY_LOSSES._needs, "reads_sampler", Needs())
    algorithm = algorithm_from(_cfg(loss={"name": "reads_sampler"}))  # validation: the trainer provides it
    sampler = torch.tensor([[-3.0, -3.0, -3.0]], dtype=F64)
    _loss(algorithm, sampler)
    assert seen["sampling_logp"] is sampler


@pytest.mark.slow
def test_the_trainer_drops_the_tokens_zero_weight_rejects(tmp_path):
    # top_p < 1: the sampler's log-probs are those of the truncated distribution, so rho = the kept mass < 1;
    # low = 0.93 rejects the tokens where it is below 0.93. Same seed, same first-step rollouts.
    def run(rejected_tokens):
        block = f"{{cap: 2.0, low: 0.93, mode: reject, rejected_tokens: {rejected_tokens}}}"
        return smoke_cli_steps(tmp_path / rejected_tokens, f"algorithm.sampling_correction={block}", "rollout.top_p=0.9",
                               "trainer.steps=1", "eval.before_training=false")[0]

    zero_weight, drop = run("zero_weight"), run("drop")
    assert "sampling_dropped_fraction" not in zero_weight
    assert drop["sampling_dropped_fraction"] == pytest.approx(zero_weight["sampling_rejected_fraction"])
    assert drop["sampling_dropped_fraction"] > 0
