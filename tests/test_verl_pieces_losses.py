"""verl's loss and correction pieces (issue 33, point 4): DPPO's Binary-TV and Binary-KL losses
(Qi et al. 2026, arXiv:2602.04879; verl loss_mode=dppo_tv / dppo_kl) on hand-computed tokens, their
reductions to REINFORCE / PPO-clip at ratio 1 and to the unclipped IS surrogate and verl's own matrix
without a mask; and the sampling correction's bypass mode (verl's rollout_correction.bypass_mode)."""

import math
import time

import pytest
import torch
from conftest import algorithm_from
from test_trainer import completions, tiny_lm

from rlbench.algorithm import POLICY_LOSSES
from rlbench.algorithm.losses.divergence_trust_region import (
    DEFAULT_TRUNCATION,
    binary_kl,
    binary_total_variation,
)
from rlbench.algorithm.sampling_correction import SamplingCorrection
from rlbench.config.typed import typed_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.graders import training_grader
from rlbench.reward.math import Grade
from rlbench.rollout.groups import GradedGroups
from rlbench.training import step
from rlbench.training.batch import collate
from rlbench.training.forward import batch_outputs
from rlbench.validation import notice_inactive_terms, validate_config

F64 = torch.float64


def _gradient(loss_name, logp, old_logp, advantages, mask=None, **params):
    """The loss matrix (detached), d sum(l) / d logp and the metrics."""
    logp = logp.clone().requires_grad_(True)
    mask = torch.ones_like(logp) if mask is None else mask
    matrix, metrics = POLICY_LOSSES.get(loss_name)(logp, old_logp, advantages, mask, **params)
    matrix.sum().backward()
    return matrix.detach(), logp.grad, metrics


def _tokens(*rows):
    """(A, mu, pi) per token -> advantages, old_logp = log mu, logp = log pi, each [1, T] float64."""
    advantages, mu, pi = zip(*rows)
    as_row = lambda values: torch.tensor([values], dtype=F64)
    return as_row(advantages), torch.log(as_row(mu)), torch.log(as_row(pi))


# (A, mu = pi_old, pi) per token, and what DPPO-Binary-TV (delta 0.15, C 10) makes of it
TV_TOKENS = [
    (1.0, 0.5, 0.6),     # up by 0.1 <= 0.15: kept, rho 1.2           -> l = -1.2, dl/dlogp = -1.2
    (1.0, 0.5, 0.7),     # up by 0.2 > 0.15 with A > 0: masked          -> 0, 0
    (1.0, 0.01, 0.05),   # rare token, rho 5 (PPO would clip), up 0.04: kept -> -5, -5
    (-1.0, 0.9, 0.7),    # down by 0.2 with A < 0: masked               -> 0, 0
    (-1.0, 0.9, 0.8),    # down by 0.1: kept, rho 8/9                   -> 8/9, 8/9
    (-1.0, 0.3, 0.5),    # up by 0.2 against A < 0: never masked, rho 5/3 -> 5/3, 5/3
    (1.0, 0.001, 0.05),  # rho 50 > C = 10: weight 10, up 0.049: kept  -> -10, -10
]
TV_LOSS = [-1.2, 0.0, -5.0, 0.0, 8 / 9, 5 / 3, -10.0]


def test_dppo_tv_closed_form_value_gradient_and_metrics():
    advantages, old_logp, logp = _tokens(*TV_TOKENS)
    matrix, grad, metrics = _gradient("dppo_tv", logp, old_logp, advantages)
    assert matrix[0].tolist() == pytest.approx(TV_LOSS, rel=1e-12)
    assert grad[0].tolist() == pytest.approx(TV_LOSS, rel=1e-12)  # l = -M A w u: dl/dlogp = l since du/dlogp = u = 1
    assert metrics["dppo_masked_fraction"] == pytest.approx(2 / 7)
    assert metrics["dppo_truncated_fraction"] == pytest.approx(1 / 7)
    ratios = [pi / mu for _, mu, pi in TV_TOKENS]
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 7, rel=1e-12)


def test_dppo_tv_thresholds_are_one_sided_and_separate():
    # delta_high binds A > 0 tokens only, delta_low A <= 0 tokens only
    advantages, old_logp, logp = _tokens((1.0, 0.5, 0.7), (-1.0, 0.9, 0.7))
    matrix, _, _ = _gradient("dppo_tv", logp, old_logp, advantages, delta_low=0.25, delta_high=0.15)
    assert matrix[0].tolist() == pytest.approx([0.0, 0.7 / 0.9])
    matrix, _, _ = _gradient("dppo_tv", logp, old_logp, advantages, delta_low=0.15, delta_high=0.25)
    assert matrix[0].tolist() == pytest.approx([-1.4, 0.0])


def test_binary_divergences_match_their_definitions_and_torch():
    mu = torch.tensor([0.5, 0.5, 0.01, 0.9, 0.3], dtype=F64)
    pi = torch.tensor([0.6, 0.7, 0.05, 0.7, 0.5], dtype=F64)
    tv = binary_total_variation(torch.log(pi), torch.log(mu))
    assert tv.tolist() == pytest.approx((pi - mu).tolist(), abs=1e-15)
    # TV between the binary distributions {o_t, not o_t}: (|pi - mu| + |(1 - pi) - (1 - mu)|) / 2
    assert tv.abs().tolist() == pytest.approx(((pi - mu).abs() + ((1 - pi) - (1 - mu)).abs()).div(2).tolist())
    expected = torch.distributions.kl_divergence(torch.distributions.Bernoulli(probs=mu), torch.distributions.Bernoulli(probs=pi))
    assert torch.allclose(binary_kl(torch.log(pi), torch.log(mu)), expected, atol=1e-7)  # verl's 1e-8 inside the log
    # by hand: mu 0.5 -> pi 0.6 and 0.7
    assert binary_kl(torch.log(pi[:2]), torch.log(mu[:2])).tolist() == pytest.approx(
        [0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4), 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)], rel=1e-6
    )


def test_dppo_kl_closed_form_masks_by_divergence_and_direction():
    rows = [
        (1.0, 0.5, 0.6),    # KL 0.0204 <= 0.05: kept, rho 1.2
        (1.0, 0.5, 0.7),    # KL 0.0872 > 0.05, moved up with A > 0: masked
        (1.0, 0.9, 0.5),    # KL 0.51 but moved down against A > 0: kept, rho 5/9
        (-1.0, 0.9, 0.5),   # the same token with A < 0: masked
        (-1.0, 0.3, 0.6),   # KL 0.19, moved up against A < 0: kept, rho 2
        (1.0, 0.001, 0.05), # KL 0.046: kept; rho 50 truncated to C = 10
    ]
    advantages, old_logp, logp = _tokens(*rows)
    expected = [-1.2, 0.0, -5 / 9, 0.0, 2.0, -10.0]
    matrix, grad, metrics = _gradient("dppo_kl", logp, old_logp, advantages)
    assert matrix[0].tolist() == pytest.approx(expected, rel=1e-12)
    assert grad[0].tolist() == pytest.approx(expected, rel=1e-12)
    assert metrics["dppo_masked_fraction"] == pytest.approx(2 / 6)
    by_hand = 0.001 * math.log(0.001 / 0.05) + 0.999 * math.log(0.999 / 0.95)  # 0.0463 <= 0.05: the rare token stays
    assert binary_kl(logp, old_logp)[0, 5].item() == pytest.approx(by_hand, rel=1e-6)


def _random_batch(seed=0, spread=0.05):
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(8, 12, generator=g, dtype=F64)
    logp = -3 * torch.rand(8, 12, generator=g, dtype=F64)
    old_logp = (logp + spread * torch.randn(8, 12, generator=g, dtype=F64)).clamp(max=-1e-3)  # probabilities < 1
    mask = (torch.rand(8, 12, generator=g) < 0.8).to(F64)
    return logp, old_logp, advantages, mask


@pytest.mark.parametrize("loss_name", ["dppo_tv", "dppo_kl"])
def test_dppo_at_ratio_one_is_reinforce_and_ppo_clip(loss_name):
    logp, _, advantages, mask = _random_batch()
    matrix, grad, metrics = _gradient(loss_name, logp, logp.detach(), advantages, mask)
    ppo_matrix, ppo_grad, _ = _gradient("ppo_clip", logp, logp.detach(), advantages, mask)
    reinforce_logp = logp.clone().requires_grad_(True)
    POLICY_LOSSES.get("reinforce")(reinforce_logp, advantages, mask)[0].sum().backward()
    reinforce_grad = reinforce_logp.grad
    assert metrics["dppo_masked_fraction"] == 0.0
    assert torch.equal(grad, ppo_grad) and torch.equal(grad, reinforce_grad)
    assert torch.equal(matrix, ppo_matrix)  # value -A at ratio 1, as PPO's


@pytest.mark.parametrize("loss_name", ["dppo_tv", "dppo_kl"])
def test_dppo_without_mask_or_truncation_is_the_unclipped_is_surrogate(loss_name):
    # |pi - mu| <= 1 and the binary KL of these tokens < 50: delta beyond them masks nothing; C beyond every ratio
    logp, old_logp, advantages, mask = _random_batch(spread=1.0)
    matrix, grad, metrics = _gradient(loss_name, logp, old_logp, advantages, mask, delta_low=50.0, delta_high=50.0, truncation=1e9)
    is_matrix, is_grad, _ = _gradient("is_surrogate", logp, old_logp, advantages, mask)
    assert metrics["dppo_masked_fraction"] == 0.0 and metrics["dppo_truncated_fraction"] == 0.0
    assert torch.allclose(matrix, is_matrix, rtol=1e-12, atol=0) and torch.allclose(grad, is_grad, rtol=1e-12, atol=0)


def _verl_dppo_tv_matrix(logp, old_logp, advantages, delta, clip_ratio_c):
    """verl's dppo_tv loss matrix (compute_policy_loss_dppo_tv, re-derived): -A sg(min(rho, c)) logp M."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20)).clamp(max=clip_ratio_c).detach()
    change = (torch.exp(logp) - torch.exp(old_logp)).detach()
    valid = torch.where(advantages > 0, change <= delta, change >= -delta).to(logp.dtype)
    return -advantages * ratio * logp * valid


def test_dppo_tv_has_verls_gradient_and_the_papers_value():
    """We chose the value -M A min(rho, C) (the paper's surrogate, so policy_loss reports it) over verl's
    -M A sg(min(rho, C)) logp (not a surrogate estimate); the gradients are equal, and without a mask the
    gradient is cispo_upper's with ratio_max = C (verl's matrix is CISPO's with a mask)."""
    logp, old_logp, advantages, mask = _random_batch(spread=1.0)
    matrix, grad, metrics = _gradient("dppo_tv", logp, old_logp, advantages, mask)
    assert 0.0 < metrics["dppo_masked_fraction"] < 1.0 and metrics["dppo_truncated_fraction"] > 0.0
    verl_logp = logp.clone().requires_grad_(True)
    verl = _verl_dppo_tv_matrix(verl_logp, old_logp, advantages, 0.15, DEFAULT_TRUNCATION) * mask
    verl.sum().backward()
    assert torch.allclose(grad, verl_logp.grad, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(matrix, verl.detach())
    _, free_grad, _ = _gradient("dppo_tv", logp, old_logp, advantages, mask, delta_low=2.0, delta_high=2.0)
    _, cispo_grad, _ = _gradient("cispo_upper", logp, old_logp, advantages, mask, ratio_max=DEFAULT_TRUNCATION)
    assert torch.allclose(free_grad, cispo_grad, rtol=1e-12, atol=1e-15)


def test_dppo_truncation_default_is_the_authors_not_verls_dual_clip_default():
    """verl reads C from clip_ratio_c, whose config default is 3.0 (the dual-clip bound), although its
    code's fallback (20) and comment (section 5.4: a large C avoids the truncation's bias) ask for a large
    one, and its DPPO example sets 10000. We default to the authors' 10 (sail-sg/Stable-RL): a token with
    rho = 5 keeps weight 5, where a verl run with the config default would weigh it 3."""
    assert DEFAULT_TRUNCATION == 10.0
    advantages, old_logp, logp = _tokens((1.0, 0.01, 0.05))
    _, grad, _ = _gradient("dppo_tv", logp, old_logp, advantages)
    assert grad.item() == pytest.approx(-5.0)
    _, grad_verl_default, _ = _gradient("dppo_tv", logp, old_logp, advantages, truncation=3.0)
    assert grad_verl_default.item() == pytest.approx(-3.0)
    with pytest.raises(ValueError, match="must be > 1"):
        _gradient("dppo_tv", logp, old_logp, advantages, truncation=1.0)


@pytest.mark.parametrize("loss_name", ["dppo_tv", "dppo_kl"])
def test_dppo_losses_compose_and_declare_their_ratio_term(loss_name):
    algorithm = algorithm_from({"name": "test", "advantage": {"name": "grpo"}, "loss": {"name": loss_name},
                                "aggregation": {"name": "seq_mean_token_sum_norm"}})
    assert algorithm.loss.name == loss_name
    needs = POLICY_LOSSES.needs(loss_name)
    assert needs.ratio_level == "token" and needs.ratio_term_metric == "dppo_masked_fraction"
    assert POLICY_LOSSES.get("dppo") is not POLICY_LOSSES.get(loss_name)  # D-PPO (dropout) is another loss


# --------------------------------------------------------------------------------------------
# bypass mode: pi_old is the rollout engine's log-probs (verl's rollout_correction.bypass_mode)
# --------------------------------------------------------------------------------------------

BYPASS = "algorithm.sampling_correction={bypass: true}"


class PadTokenizer:
    pad_token_id = 0


class WeightSyncEngine:
    """The engine as the step meets it after the rollout (the groups are given): it takes the weights."""

    def __init__(self):
        self.syncs = 0

    def sync_weights(self, model):
        self.syncs += 1


def _graded_with_engine_logprobs(model, temperature, micro_batch_size, shift=0.0):
    """test_trainer's groups, graded with rewards that differ within each group, whose engine log-probs
    are the trainer's own for the same weights (minus ``shift``): an engine that agrees with the trainer."""
    groups = completions(seed=3)
    trainer_logp = batch_outputs(model, collate(groups, 0), micro_batch_size, temperature).logp
    flat = [c for group in groups for c in group]
    for row, completion in enumerate(flat):
        completion.logprobs = (trainer_logp[row, : len(completion.response_ids)] - shift).tolist()
    rewards = [float(i % 2) for i in range(len(flat))]
    grades = [Grade(correct=bool(r), extracted=None, reward=r, format_ok=True) for r in rewards]
    return GradedGroups([Problem(str(g), "q", "a") for g in range(len(groups))], groups, grades,
                        torch.tensor(rewards), torch.tensor(rewards), torch.ones(len(flat), dtype=torch.bool),
                        list(range(len(groups))))


def _learn_once(make_cfg, monkeypatch, *overrides, shift=0.0):
    """One learn_step of GRPO (ppo_clip) on the tiny Llama from the same weights and groups; returns the
    step's metrics, the weights after it and how often the no-grad pass that recomputes pi_old ran."""
    cfg = make_cfg("experiment=smoke", "algorithm=grpo", *overrides)
    config = typed_config(cfg)
    model = tiny_lm(seed=0)
    ctx = step.make_step_context(config, algorithm_from(cfg.algorithm), model, PadTokenizer(), WeightSyncEngine(),
                                 torch.device("cpu"), training_grader(config))
    graded = _graded_with_engine_logprobs(model, ctx.temperature, ctx.micro_batch_size, shift)
    passes = []
    counted = step.batch_outputs

    def counting_batch_outputs(*args, **kwargs):
        passes.append(1)
        return counted(*args, **kwargs)

    monkeypatch.setattr(step, "batch_outputs", counting_batch_outputs)
    metrics = step.learn_step(ctx, graded, {}, 0.0, 0.0, started=time.perf_counter(), generation_cost={})
    return metrics, [p.detach().clone() for p in model.parameters()], len(passes)


def _same_training(a, b):
    timing = {"generate_s", "update_s", "step_s", "tokens_per_s", "peak_memory_mb"}
    same_metrics = {k: v for k, v in a[0].items() if k not in timing} == {k: v for k, v in b[0].items() if k not in timing}
    return same_metrics and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("epochs", [1, 2], ids=["one_update", "two_epochs"])
def test_bypass_skips_the_old_logprob_pass_and_equals_the_default_when_engine_and_trainer_agree(make_cfg, monkeypatch, epochs):
    update = f"algorithm.update.epochs={epochs}"
    default = _learn_once(make_cfg, monkeypatch, update)
    bypass = _learn_once(make_cfg, monkeypatch, update, BYPASS)
    # one update per batch: pi_old is the detached current policy, no pass; two epochs: one pass recomputes it
    assert default[2] == (0 if epochs == 1 else 1)
    assert bypass[2] == 0  # bypass never recomputes pi_old
    assert default[0]["policy_loss"] != 0.0 and (epochs > 1 or default[0]["ratio_mean"] == 1.0)
    assert _same_training(default, bypass)  # bit for bit: the engine's log-probs are the trainer's


def test_bypass_takes_the_engines_logprobs_as_pi_old(make_cfg, monkeypatch):
    # the engine's log-probs 0.1 below the trainer's: under bypass every first-update ratio is e^0.1 (inside
    # ppo_clip's [0.8, 1.2]); without bypass one update per batch has ratio 1 and ignores the engine
    bypass = _learn_once(make_cfg, monkeypatch, BYPASS, shift=0.1)
    default = _learn_once(make_cfg, monkeypatch, shift=0.1)
    assert bypass[0]["ratio_mean"] == pytest.approx(math.exp(0.1), rel=1e-5)
    assert default[0]["ratio_mean"] == 1.0
    assert bypass[0]["policy_loss"] == pytest.approx(default[0]["policy_loss"] * math.exp(0.1), rel=1e-5)
    assert bypass[2] == 0 and "sampling_weight_mean" not in bypass[0]  # the weights pi_old / pi_sampler are 1, not applied


def test_bypass_config():
    base = {"name": "t", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}, "aggregation": {"name": "token_mean"}}
    default = algorithm_from({**base, "sampling_correction": {}})
    assert default.sampling_correction.bypass is False and not default.bypasses_old_logp
    several_updates = {**base, "update": {"epochs": 2}}
    assert algorithm_from(several_updates).needs_sampling_pass
    bypass = algorithm_from({**several_updates, "sampling_correction": {"bypass": True}})
    assert bypass.bypasses_old_logp and bypass.needs_old_logp and not bypass.needs_sampling_pass
    kl_in_reward = algorithm_from({**base, "kl": {"coef": 0.1, "placement": "reward"}, "sampling_correction": {"bypass": True}})
    assert not kl_in_reward.needs_sampling_pass  # its pi_old is the engine's too
    entropy = algorithm_from({**several_updates, "advantage": {"name": "edge_grpo"}, "sampling_correction": {"bypass": True}})
    assert "entropy" in entropy.advantage_inputs and entropy.needs_sampling_pass  # the pass still runs for entropies
    for inert in ({"mode": "reject"}, {"low": 0.5}, {"normalize": True}, {"level": "sequence"}):
        with pytest.raises(ConfigError, match=r"bypass=true takes pi_old from the rollout engine.*cispo_upper"):
            algorithm_from({**base, "sampling_correction": {"bypass": True, **inert}})
    with pytest.raises(ConfigError, match="bypass must be true or false"):
        SamplingCorrection(bypass="yes").check()
    SamplingCorrection(bypass=True).check_rollout(1.0)
    SamplingCorrection().check_rollout(0.9)  # the weights alone are allowed with top-p (their docstring says why not)
    with pytest.raises(ConfigError, match=r"bypass=true needs rollout.top_p=1 \(got 0.9\)"):
        SamplingCorrection(bypass=True).check_rollout(0.9)


def test_bypass_is_refused_with_top_p_before_the_run(make_cfg):
    validate_config(make_cfg("experiment=smoke", BYPASS))
    with pytest.raises(ConfigError, match="needs rollout.top_p=1"):
        validate_config(make_cfg("experiment=smoke", BYPASS, "rollout.top_p=0.9"))


def test_the_inactive_term_notice_knows_bypass(make_cfg):
    def notice(*overrides):
        cfg = make_cfg("experiment=smoke", "algorithm/loss=dppo_tv", *overrides)
        return notice_inactive_terms(typed_config(cfg), algorithm_from(cfg.algorithm))

    assert "loss 'dppo_tv'" in notice()  # one update per batch on fresh data: every ratio 1
    assert "loss 'dppo_tv'" in notice(BYPASS)  # the HF engine samples with the trainer's weights and kernels
    assert notice(BYPASS, "rollout.engine=vllm") is None  # pi_theta / pi_vllm is off 1 from the first update

