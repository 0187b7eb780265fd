"""Closed-form checks of every algorithm piece on hand-built tensors."""

import math
import re

import pytest
import torch

from conftest import algorithm_from, compose_config

from rlbench.algorithm import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, Algorithm
from rlbench.algorithm.advantages import dr_grpo_advantage, grpo_advantage, group_mean_std
from rlbench.algorithm.aggregation import seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm, token_mean
from rlbench.algorithm.kl import kl_k1, kl_k2, kl_k3
from rlbench.algorithm.losses import ppo_clip_loss
from rlbench.config.schema import AlgorithmConfig, KLConfig, TokenMaskConfig, UpdateConfig
from rlbench.config.typed import algorithm_settings, typed_config
from rlbench.errors import ConfigError

# Two groups of four: [1,0,0,0] has mean 1/4 and unbiased std exactly 1/2; [1,1,1,1] is all-equal.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
MASK = torch.tensor([[1, 1, 0]] * 8, dtype=torch.float32)


def test_group_mean_std_closed_form():
    mean, std, count = group_mean_std(REWARDS, GROUPS)
    assert torch.allclose(mean, torch.tensor([0.25] * 4 + [1.0] * 4, dtype=torch.float64))
    assert torch.allclose(std, torch.tensor([0.5] * 4 + [0.0] * 4, dtype=torch.float64))
    assert count.tolist() == [4.0] * 8


def test_grpo_advantage_hand_values():
    adv = grpo_advantage(REWARDS, GROUPS, MASK, epsilon=0.0)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0])
    assert torch.allclose(adv[:, 0], expected)
    assert torch.allclose(adv[:, 1], expected)
    assert torch.all(adv[:, 2] == 0), "padding must carry no advantage"


def test_grpo_epsilon_enters_denominator():
    adv = grpo_advantage(REWARDS, GROUPS, MASK, epsilon=0.5)
    assert torch.allclose(adv[0, 0], torch.tensor(0.75 / 1.0))


def test_dr_grpo_advantage_has_no_std_division():
    adv = dr_grpo_advantage(REWARDS, GROUPS, MASK)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    assert torch.allclose(adv[:, 0], expected)


def test_grpo_low_variance_group_keeps_exact_scale():
    # verl's vectorized GRPO returned +-0.005 here (variance floor); the exact value is +-0.6195.
    rewards = torch.tensor([1.0, 1.00001], dtype=torch.float64)
    adv = grpo_advantage(rewards, torch.tensor([0, 0]), torch.ones(2, 1), epsilon=1e-6)
    std = math.sqrt(2 * (5e-6) ** 2)
    assert adv[0, 0].item() == pytest.approx(-5e-6 / (std + 1e-6), rel=1e-4)
    assert adv[1, 0].item() == pytest.approx(5e-6 / (std + 1e-6), rel=1e-4)


def test_singleton_and_all_wrong_groups_get_zero_advantage():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.7])
    groups = torch.tensor([0, 1, 1, 2])
    for fn in (grpo_advantage, dr_grpo_advantage):
        adv = fn(rewards, groups, torch.ones(4, 2))
        assert torch.all(adv == 0)


def test_variable_group_sizes():
    rewards = torch.tensor([1.0, 0.0, 2.0, 4.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    adv = dr_grpo_advantage(rewards, groups, torch.ones(5, 1))[:, 0]
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 2.0, -2.0]))


def test_ppo_clip_hand_values_and_gradients():
    ratio = torch.tensor([[0.5, 1.0, 1.5, 0.5, 5.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0]])
    old = torch.zeros(1, 5)
    logp = ratio.log().requires_grad_(True)
    mask = torch.ones(1, 5)
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # unclipped: -A r ; clipped: -A clip(r); loss = max of the two
    assert torch.allclose(loss, torch.tensor([[-0.5, 1.0, -1.2, 0.8, 5.0]]))
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where the unclipped term is active, 0 where the clipped one is
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 1.0, 0.0, 0.0, 5.0]]))
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["clip_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["clip_fraction_low"] == pytest.approx(1 / 5)


def test_ppo_clip_asymmetric_and_dual_clip():
    ratio = torch.tensor([[1.25, 1.25, 5.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss, _ = ppo_clip_loss(ratio.log(), torch.zeros(1, 3), adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # 1.25 < 1.28 is not clipped for A>0; for A<0 the max picks the unclipped 1.25; dual clip caps 5 at 3
    assert torch.allclose(loss, torch.tensor([[-1.25, 1.25, 3.0]]))
    with pytest.raises(ValueError):
        ppo_clip_loss(ratio.log(), torch.zeros(1, 3), adv, torch.ones(1, 3), dual_clip=1.0)


def test_ppo_clip_extreme_ratio_is_finite_and_padding_is_zero():
    logp = torch.tensor([[100.0, -100.0, 3.0]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([[-1.0, 1.0, 7.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.isfinite(loss).all()
    assert loss[0, 2] == 0


LOSS_MATRIX = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_aggregations_hand_values():
    assert token_mean(LOSS_MATRIX, AGG_MASK, batch_tokens=3).item() == pytest.approx(2.0)
    assert seq_mean_token_mean(LOSS_MATRIX, AGG_MASK, batch_sequences=2).item() == pytest.approx((1.5 + 3.0) / 2)
    assert seq_mean_token_sum(LOSS_MATRIX, AGG_MASK, batch_sequences=2).item() == pytest.approx(3.0)
    assert seq_mean_token_sum_norm(LOSS_MATRIX, AGG_MASK, batch_sequences=2, norm_length=4).item() == pytest.approx(0.75)


def test_aggregation_zero_length_response_contributes_nothing():
    matrix = torch.tensor([[1.0, 1.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert seq_mean_token_mean(matrix, mask, batch_sequences=2).item() == pytest.approx(0.5)
    assert token_mean(matrix, mask, batch_tokens=2).item() == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregation_split_into_micro_batches_sums_to_full(name):
    torch.manual_seed(0)
    matrix = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    norms = {"batch_tokens": int(mask.sum()), "batch_sequences": 6, "norm_length": 5}
    inputs = lambda rows: {"loss_matrix": matrix[rows], "response_mask": mask[rows], **norms}
    full = AGGREGATIONS.call(name, inputs(slice(0, 6)), {})
    parts = sum(AGGREGATIONS.call(name, inputs(slice(i, i + 2)), {}) for i in range(0, 6, 2))
    assert torch.allclose(full, parts)


def test_kl_estimators_closed_form():
    logp = torch.tensor([0.0])
    ref = torch.tensor([math.log(0.5)])
    d = math.log(2.0)
    assert kl_k1(logp, ref).item() == pytest.approx(d)
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * d * d)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 + d - 1.0)
    same = torch.tensor([-1.3, -0.2])
    for fn in (kl_k1, kl_k2, kl_k3):
        assert torch.allclose(fn(same, same), torch.zeros(2))


def test_kl_k3_is_unbiased_estimate_of_true_kl():
    # Categorical p (policy) and q (reference); E_{x~p}[k3] = KL(p||q) exactly.
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    true_kl = (p * (p / q).log()).sum()
    expected_k3 = (p * kl_k3(p.log(), q.log())).sum()
    expected_k1 = (p * kl_k1(p.log(), q.log())).sum()
    assert expected_k3.item() == pytest.approx(true_kl.item(), rel=1e-5)
    assert expected_k1.item() == pytest.approx(true_kl.item(), rel=1e-5)


def _cfg(advantage="grpo", aggregation="seq_mean_token_mean", **extra):
    cfg = {
        "name": "test",
        "advantage": {"name": advantage},
        "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
        "aggregation": {"name": aggregation},
        "kl": {"coef": 0.0, "estimator": "k3"},
    }
    cfg.update(extra)
    return cfg


def test_grpo_loss_equals_hand_formula_and_reinforce_gradient():
    algo = algorithm_from(_cfg())
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = algo.compute_advantages(rewards, groups, mask)
    torch.manual_seed(1)
    logp = (-torch.rand(4, 3)).requires_grad_(True)
    loss, _ = algo.compute_loss(
        logp=logp, old_logp=logp.detach(), advantages=adv, response_mask=mask,
        norms={"batch_tokens": 9, "batch_sequences": 4, "norm_length": 3},
    )
    loss.backward()
    # At ratio 1 the loss value is -(1/N) sum_i A_i and its gradient is the REINFORCE gradient
    a = adv[:, 0]
    assert loss.item() == pytest.approx(-(a.sum() / 4).item(), abs=1e-6)
    expected_grad = -(a[:, None] / mask.sum(-1, keepdim=True)) * mask / 4
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)


def test_dr_grpo_loss_constant_normaliser():
    algo = algorithm_from(_cfg("dr_grpo", "seq_mean_token_sum_norm"))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = algo.compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = algo.compute_loss(
        logp=logp, old_logp=logp.detach(), advantages=adv, response_mask=mask,
        norms={"batch_tokens": 4, "batch_sequences": 2, "norm_length": 8},
    )
    loss.backward()
    # A = [0.5, -0.5]; per-token gradient -A/(N_seq * L) regardless of response length
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5, -0.5], [0.5, 0, 0]]) / 16)
    assert loss.item() == pytest.approx(-(3 * 0.5 - 0.5) / 16)


def test_kl_term_added_to_loss():
    algo = algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k1"}, aggregation="token_mean"))
    mask = torch.ones(1, 2)
    logp = torch.tensor([[-1.0, -2.0]])
    loss, metrics = algo.compute_loss(
        logp=logp, old_logp=logp, advantages=torch.zeros(1, 2), response_mask=mask,
        norms={"batch_tokens": 2, "batch_sequences": 1, "norm_length": 2}, ref_logp=torch.tensor([[-2.0, -2.0]]),
    )
    assert metrics["kl"] == pytest.approx(0.5)
    assert loss.item() == pytest.approx(0.05)
    assert algo.needs_reference and not algorithm_from(_cfg()).needs_reference


def test_unknown_piece_and_parameter_are_config_errors():
    with pytest.raises(ConfigError, match="unknown advantage estimator 'nope'.*grpo"):
        algorithm_from(_cfg(advantage="nope"))
    bad = _cfg()
    bad["loss"]["clip_hgih"] = 0.3
    with pytest.raises(ConfigError, match="clip_hgih"):
        algorithm_from(bad)
    with pytest.raises(ConfigError, match="KL estimator"):
        algorithm_from(_cfg(kl={"coef": 0.1, "estimator": "k9"}))


@pytest.mark.parametrize("path", [("name",), ("entropy_coef",), ("kl",), ("kl", "coef"), ("kl", "placement"),
                                  ("update", "minibatches"), ("update", "schedule"), ("token_mask",), ("critic",)])
def test_a_missing_key_is_an_error_not_a_default(path):
    """Algorithm.from_config writes no default of its own: the schema's are filled once (algorithm_settings),
    and a mapping without one of its keys is refused, naming the key."""
    settings = algorithm_settings(_cfg())
    node = settings
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(ConfigError, match=re.escape(f"algorithm.{'.'.join(path)} is missing")):
        Algorithm.from_config(settings)


def test_the_filled_defaults_are_the_schemas():
    """Every key the test leaves out takes the schema's default; the nodes kl, update and token_mask, left
    out, take their schema node's defaults; a given node keeps its values and gets the rest."""
    settings = algorithm_settings({"advantage": {"name": "grpo"}, "kl": {"coef": 0.1}})
    assert settings["name"] == AlgorithmConfig().name and settings["entropy_coef"] == AlgorithmConfig().entropy_coef
    assert settings["kl"] == {**KLConfig().__dict__, "coef": 0.1, "adaptive": None}
    assert settings["update"] == {**UpdateConfig().__dict__, "sfpo": None, "trpo": None}
    assert settings["token_mask"] == TokenMaskConfig().__dict__ and settings["critic"] is None


@pytest.mark.parametrize("preset", ["grpo", "ppo", "sfpo", "d3s", "dapo", "remix"])
def test_the_typed_config_and_the_composed_node_build_the_same_algorithm(preset, tmp_path):
    """The run builds the algorithm from the typed config; a composed cfg.algorithm (tests, scripts) gives the same."""
    cfg = compose_config(["experiment=smoke", f"algorithm={preset}"], tmp_path / "run")
    assert Algorithm.from_config(algorithm_settings(typed_config(cfg).algorithm)) == algorithm_from(cfg.algorithm)


def test_group_relative_flag_comes_from_the_estimator():
    assert algorithm_from(_cfg()).group_relative
    assert algorithm_from(_cfg("dr_grpo")).group_relative


def test_registry_rejects_conflicting_registration():
    with pytest.raises(ValueError):
        ADVANTAGES.register("grpo")(lambda rewards: rewards)
    assert "ppo_clip" in POLICY_LOSSES and "k3" in KL_ESTIMATORS


def test_token_level_advantages_are_declared_at_registration():
    token_level = {name for name in ADVANTAGES.names() if ADVANTAGES.needs(name).token_level_advantage}
    assert token_level == {"reinforce_pp", "gae", "gigpo", "gtpo", "gtpo_turn", "treerpo", "vine", "poad", "at_grpo", "arpo_hard", "oprl",
                           "optimal_token_baseline", "tir_optimal_token_baseline"}


def test_a_new_piece_declares_its_needs_in_one_place():
    from rlbench.algorithm.registry import Registry

    registry = Registry("test loss", reader="loss")

    @registry.register("seq_only", aggregation="seq_mean_token_mean", conflicts=("why",))
    def seq_only(logp, scale: float = 1.0):
        return logp * scale

    assert registry.needs("seq_only").aggregation == "seq_mean_token_mean"
    with pytest.raises(ConfigError, match=r"has no parameter\(s\) \['scal'\]; it takes: \['scale'\]"):
        registry.validate_params("seq_only", {"scal": 2.0})
