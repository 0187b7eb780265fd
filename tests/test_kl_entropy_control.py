"""KL placement (loss | reward), the adaptive KL controller, the adaptive entropy coefficient and the
top-entropy token mask: closed forms on hand-built tensors, validation, and the runner path."""

import json

import pytest
import torch

import rlbench.runner as runner
from rlbench.config.typed import typed_config
from rlbench.reward.graders import training_grader
from rlbench.training.step import make_step_context
from conftest import algorithm_from
from rlbench.algorithm.entropy import AdaptiveEntropy, adaptive_entropy_coefficient, top_entropy_token_mask
from rlbench.algorithm.kl import (
    AdaptiveKL,
    adaptive_kl_coefficient,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalised_rewards,
    sequence_kl,
)
from rlbench.errors import ConfigError

NORMS = {"batch_tokens": 3, "batch_sequences": 2, "norm_length": 2}


def close(actual: torch.Tensor, expected) -> bool:
    return torch.allclose(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def _cfg(advantage="grpo", aggregation="token_mean", kl=None, **extra):
    cfg = {
        "name": "t", "advantage": {"name": advantage}, "loss": {"name": "ppo_clip"},
        "aggregation": {"name": aggregation}, "kl": kl or {"coef": 0.0},
    }
    cfg.update(extra)
    return cfg


# ---------------------------------------------------------------- KL estimators with padding


def test_kl_estimators_on_a_padded_matrix():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-2.0, -2.0], [-1.5, 0.0]])  # delta = logp - ref = [[1, 0], [1, 0]]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    e = torch.e
    assert sequence_kl(kl_k1(logp, ref), mask).tolist() == pytest.approx([1.0, 1.0])
    assert sequence_kl(kl_k2(logp, ref), mask).tolist() == pytest.approx([0.5, 0.5])
    assert sequence_kl(kl_k3(logp, ref), mask).tolist() == pytest.approx([1 / e, 1 / e])  # e^-1 + 1 - 1
    assert sequence_kl(kl_k3(logp, ref), torch.zeros(2, 2)).tolist() == [0.0, 0.0]  # zero-length responses


# ---------------------------------------------------------------- KL in the reward


def test_kl_penalised_rewards_closed_form():
    rewards = torch.tensor([1.0, 0.0, 2.0])
    kl = torch.tensor([[0.5, 1.0, 7.0], [2.0, 7.0, 7.0], [7.0, 7.0, 7.0]])  # 7 sits on padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row: zero-length
    sequence, token = kl_penalised_rewards(rewards, kl, mask, coef=0.1)
    assert sequence.tolist() == pytest.approx([1.0 - 0.15, 0.0 - 0.2, 2.0])
    assert close(token, [[-0.05, 1.0 - 0.1, 0.0], [0.0 - 0.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # the token rewards sum to the sequence reward wherever the response has tokens
    assert token.sum(-1)[:2].tolist() == pytest.approx(sequence[:2].tolist())


def test_kl_in_reward_feeds_sequence_and_token_level_estimators():
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0], [-1.0, -1.0]])  # k1 = [[1, 0], [0, 0]]
    rewards = torch.tensor([1.0, 1.0])
    groups = torch.tensor([0, 0])
    kl = {"coef": 0.5, "estimator": "k1", "placement": "reward"}
    grpo = algorithm_from(_cfg("dr_grpo", kl=kl))
    penalised, token_rewards, per_response = grpo.kl_reward_terms(rewards, mask, old, ref)
    assert penalised.tolist() == pytest.approx([0.5, 1.0]) and token_rewards is None
    assert per_response.tolist() == pytest.approx([1.0, 0.0])
    # Dr.GRPO on R' = [0.5, 1]: A = R' - mean = [-0.25, 0.25]
    adv = grpo.compute_advantages(penalised, groups, mask)
    assert close(adv, [[-0.25, -0.25], [0.25, 0.25]])

    rpp = algorithm_from(_cfg("reinforce_pp", kl=kl))
    seq, token_rewards, _ = rpp.kl_reward_terms(rewards, mask, old, ref)
    # r_t = [[-0.5, 1], [0, 1]]: return-to-go G = [[0.5, 1], [1, 1]], then batch whitening
    assert close(token_rewards, [[-0.5, 1.0], [0.0, 1.0]])
    adv = rpp.compute_advantages(seq, groups, mask, token_rewards=token_rewards)
    returns = torch.tensor([0.5, 1.0, 1.0, 1.0])
    expected = ((returns - returns.mean()) / (returns.std() + 1e-8)).reshape(2, 2)
    assert torch.allclose(adv, expected, atol=1e-6)
    # placement=loss: the rewards pass through and only the observed KL is returned
    in_loss = algorithm_from(_cfg(kl={"coef": 0.5, "estimator": "k1"}))
    same, none, observed = in_loss.kl_reward_terms(rewards, mask, old, ref)
    assert same is rewards and none is None and observed.tolist() == pytest.approx([1.0, 0.0])


def test_kl_in_reward_leaves_the_loss_free_of_kl():
    logp = torch.tensor([[-1.0, -2.0]])
    kwargs = dict(logp=logp, old_logp=logp, advantages=torch.zeros(1, 2), response_mask=torch.ones(1, 2),
                  norms=NORMS | {"batch_tokens": 2, "batch_sequences": 1}, ref_logp=torch.tensor([[-2.0, -2.0]]))
    in_loss = algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k1"}))
    in_reward = algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k1", "placement": "reward"}))
    assert in_loss.compute_loss(**kwargs)[0].item() == pytest.approx(0.05)
    loss, metrics = in_reward.compute_loss(**kwargs)
    assert loss.item() == pytest.approx(0.0) and "kl" not in metrics
    assert in_loss.needs_reference and in_reward.needs_reference
    assert in_reward.kl_in_reward and not in_reward.kl_in_loss and in_loss.kl_in_loss


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_no_reference_model_when_the_coefficient_is_zero(make_cfg, placement):
    algo = algorithm_from(_cfg(kl={"coef": 0.0, "placement": placement}))
    assert not algo.needs_reference and not algo.kl_in_reward and not algo.kl_in_loss
    assert not algo.needs_sampling_pass  # nothing to compute before the advantage either
    cfg = make_cfg("experiment=smoke", f"algorithm.kl.placement={placement}")
    model = torch.nn.Linear(2, 2)
    ctx = make_step_context(typed_config(cfg), algorithm_from(cfg.algorithm), model, None, None, torch.device("cpu"),
                            training_grader(typed_config(cfg)))
    assert ctx.reference is None
    with_kl = make_cfg("experiment=smoke", "algorithm.kl.coef=0.1", f"algorithm.kl.placement={placement}")
    ctx = make_step_context(typed_config(with_kl), algorithm_from(with_kl.algorithm), model, None, None, "cpu",
                            training_grader(typed_config(with_kl)))
    assert ctx.reference is not None and ctx.reference is not model


# ---------------------------------------------------------------- adaptive KL controller (Ziegler et al. 2019)


def test_adaptive_kl_coefficient_closed_form():
    # error = clip(KL/target - 1, -0.2, 0.2); beta' = beta (1 + error * n / horizon)
    assert adaptive_kl_coefficient(0.1, 6.0, 6.0, 100, 50) == pytest.approx(0.1)
    assert adaptive_kl_coefficient(0.1, 6.6, 6.0, 100, 50) == pytest.approx(0.1 * (1 + 0.1 * 0.5))
    assert adaptive_kl_coefficient(0.1, 60.0, 6.0, 100, 50) == pytest.approx(0.1 * 1.1)  # clipped at +0.2
    assert adaptive_kl_coefficient(0.1, 0.0, 6.0, 100, 50) == pytest.approx(0.1 * 0.9)  # clipped at -0.2
    with pytest.raises(ValueError, match="horizon"):
        adaptive_kl_coefficient(0.1, 0.0, 6.0, 10, 50)  # 1 - 0.2 * 5 = 0


def test_adaptive_kl_settings_are_validated():
    assert AdaptiveKL.from_config({"target": 6, "horizon": 10000}) == AdaptiveKL(6.0, 10000.0)
    for bad in ({"target": 6}, {"target": 6, "horizon": 10, "rate": 1}, {"target": 0, "horizon": 10}):
        with pytest.raises(ConfigError, match="algorithm.kl.adaptive"):
            AdaptiveKL.from_config(bad)
    with pytest.raises(ConfigError, match="stays 0"):
        algorithm_from(_cfg(kl={"coef": 0.0, "adaptive": {"target": 6, "horizon": 100}}))
    with pytest.raises(ConfigError, match="placement=middle"):
        algorithm_from(_cfg(kl={"coef": 0.1, "placement": "middle"}))
    algo = algorithm_from(_cfg(kl={"coef": 0.1, "adaptive": {"target": 6, "horizon": 10}}))
    with pytest.raises(ConfigError, match="horizon=10.0 must exceed"):
        algo.check_batch_size(50)
    algo.check_batch_size(49)


def test_adaptive_kl_moves_the_coefficient_used_in_the_loss():
    algo = algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k1", "adaptive": {"target": 1.0, "horizon": 10}}))
    algo.update_coefficients(observed_kl=2.0, observed_entropy=None, n_steps=5)  # error +0.2: x1.1
    assert algo.kl_coefficient == pytest.approx(0.11)
    logp = torch.tensor([[-1.0, -2.0]])
    loss, _ = algo.compute_loss(
        logp=logp, old_logp=logp, advantages=torch.zeros(1, 2), response_mask=torch.ones(1, 2),
        norms=NORMS | {"batch_tokens": 2, "batch_sequences": 1}, ref_logp=torch.tensor([[-2.0, -2.0]]),
    )
    assert loss.item() == pytest.approx(0.11 * 0.5)
    # each from_config starts from the configured coefficient again
    assert algorithm_from(_cfg(kl={"coef": 0.1, "adaptive": {"target": 1.0, "horizon": 10}})).kl_coefficient == 0.1
    fixed = algorithm_from(_cfg(kl={"coef": 0.1}))
    fixed.update_coefficients(observed_kl=5.0, observed_entropy=5.0, n_steps=5)
    assert fixed.kl_coefficient == 0.1 and fixed.entropy_coefficient == 0.0


# ---------------------------------------------------------------- adaptive entropy coefficient (Skywork-OR1)


def test_adaptive_entropy_coefficient_closed_form():
    # below (or at) the target: up by delta; above: down by delta; clipped to [min, max]
    assert adaptive_entropy_coefficient(0.01, 0.1, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)
    assert adaptive_entropy_coefficient(0.01, 0.2, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)
    assert adaptive_entropy_coefficient(0.01, 0.3, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.005)
    assert adaptive_entropy_coefficient(0.002, 0.3, 0.2, 0.005, 0.0, 1.0) == 0.0
    assert adaptive_entropy_coefficient(0.998, 0.1, 0.2, 0.005, 0.0, 1.0) == 1.0


def test_adaptive_entropy_in_the_algorithm_and_its_gate():
    algo = algorithm_from(_cfg(entropy_coef=0.0, entropy_adaptive={"target": 0.5, "delta": 0.01}))
    assert algo.uses_entropy_bonus and algo.entropy_coefficient == 0.0
    algo.update_coefficients(None, observed_entropy=0.4, n_steps=4)
    algo.update_coefficients(None, observed_entropy=0.3, n_steps=4)
    assert algo.entropy_coefficient == pytest.approx(0.02)
    # the coefficient multiplies the aggregated entropy in the loss
    logp = torch.zeros(1, 2)
    entropy = torch.tensor([[1.0, 3.0]])
    loss, _ = algo.compute_loss(logp=logp, old_logp=logp, advantages=torch.zeros(1, 2), response_mask=torch.ones(1, 2),
                                norms=NORMS | {"batch_tokens": 2, "batch_sequences": 1}, entropy=entropy)
    assert loss.item() == pytest.approx(-0.02 * 2.0)
    gated = algorithm_from(_cfg(entropy_coef=0.1, entropy_adaptive={"target": 0.5, "gate": True}))
    assert gated.entropy_coefficient == 0.1  # no observation yet: open
    gated.update_coefficients(None, observed_entropy=0.9, n_steps=4)
    assert gated.coefficients.entropy == pytest.approx(0.095) and gated.entropy_coefficient == 0.0
    gated.update_coefficients(None, observed_entropy=0.1, n_steps=4)
    assert gated.entropy_coefficient == pytest.approx(0.1)
    for bad in ({"delta": 0.1}, {"target": 0.2, "lr": 0.1}, {"target": 0.2, "delta": 0.0},
                {"target": 0.2, "min_coef": 0.5, "max_coef": 0.1}):
        with pytest.raises(ConfigError, match="algorithm.entropy_adaptive"):
            AdaptiveEntropy.from_config(bad)


# ---------------------------------------------------------------- top-entropy token mask (Wang et al. 2025)


def test_top_entropy_mask_keeps_the_top_fraction_of_valid_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.3, 0.8, 0.2, 9.0]])  # 9.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    # 6 valid tokens, rho = 0.3 -> k = ceil(1.8) = 2: the entropies 0.9 and 0.8
    kept = top_entropy_token_mask(entropy, mask, 0.3)
    assert kept.tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]
    assert top_entropy_token_mask(entropy, mask, 0.5).tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]  # k = 3
    assert top_entropy_token_mask(entropy, mask, 1.0).tolist() == mask.tolist()
    # ties at the threshold are kept; a batch without valid tokens keeps nothing
    assert top_entropy_token_mask(torch.ones(2, 3), torch.ones(2, 3), 0.2).sum() == 6
    assert top_entropy_token_mask(entropy, torch.zeros(2, 4), 0.2).sum() == 0
    # 0.3 * 10 = 3.0000000000000004 must not become 4
    assert top_entropy_token_mask(torch.arange(10.0)[None], torch.ones(1, 10), 0.3).sum() == 3
    with pytest.raises(ValueError):
        top_entropy_token_mask(entropy, mask, 0.0)


def test_masked_tokens_get_no_policy_gradient_but_keep_the_normaliser():
    algo = algorithm_from(_cfg(token_mask={"top_entropy_quantile": 0.5}))
    mask = torch.ones(2, 2)
    weights = algo.token_weights(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), mask)
    assert weights.tolist() == [[0, 1], [1, 0]]
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    logp = torch.zeros(2, 2, requires_grad=True)
    loss, _ = algo.compute_loss(logp=logp, old_logp=logp.detach(), advantages=advantages, response_mask=mask,
                                norms={"batch_tokens": 4, "batch_sequences": 2, "norm_length": 2},
                                token_weights=weights)
    loss.backward()
    # token_mean over all 4 tokens; at ratio 1 the gradient is -A m / 4 on kept tokens, 0 elsewhere
    assert close(logp.grad, [[0.0, -0.25], [0.25, 0.0]])
    assert algorithm_from(_cfg()).token_weights(None, mask) is None
    for bad in ({"top_entropy_quantile": 1.5}, {"top_entropy_quantile": 0.0}, {"quantile": 0.2}):
        with pytest.raises(ConfigError, match="token_mask"):
            algorithm_from(_cfg(token_mask=bad))


# ---------------------------------------------------------------- through the runner


def test_controllers_and_mask_run_through_the_runner(make_cfg, tmp_path):
    batch = 2 * 2  # smoke: prompts_per_step * n
    cfg = make_cfg(
        "experiment=smoke", "logger=files", "trainer.save_model=false", "eval.before_training=false",
        "eval.limit=1", "eval.n=1", "eval.k=[1]", "reward=even_tokens", "algorithm=reinforce_pp", "algorithm.kl.coef=0.1", "algorithm.kl.placement=reward",
        "algorithm.kl.adaptive={target: 0.5, horizon: 100}",
        "algorithm.entropy_adaptive={target: 100.0, delta: 0.01}",
        "algorithm.token_mask={top_entropy_quantile: 0.5}",
    )
    runner.run(cfg)
    first, second = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert first["kl_coef"] == pytest.approx(0.1) and first["kl_sequence"] == pytest.approx(0.0, abs=1e-6)
    # step 1 samples from the reference itself (KL 0 < target): beta shrinks by 0.2 * 4 / 100
    assert second["kl_coef"] == pytest.approx(0.1 * adaptive_kl_coefficient(1.0, first["kl_sequence"], 0.5, 100, batch))
    assert second["kl_sequence"] > 0  # the policy has moved away from the reference
    # entropy below the target 100 nats: the coefficient rises by delta each step
    assert (first["entropy_coef"], second["entropy_coef"]) == pytest.approx((0.0, 0.01))
    assert 0.5 <= first["token_mask_kept"] < 1.0
