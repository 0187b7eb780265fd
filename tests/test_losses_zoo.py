"""Closed-form checks of the policy-loss zoo (rlbench/algorithm/losses/) on hand-built tensors.

Conventions: old_logp = -1 everywhere unless stated, logp = old_logp + log(rho) so each token's
ratio is the number written in the comment; gradients are d(sum of the loss matrix)/d logp
unless an aggregation is named. All hand computations are in the comments.
"""

import inspect
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlbench.algorithm import AGGREGATIONS, POLICY_LOSSES
from rlbench.algorithm.aggregation import seq_mean_token_mean, seq_mean_token_sum
from rlbench.algorithm.registry import Needs
from rlbench.algorithm.losses import (
    normalized_entropy,
    ppo_clip_loss,
    sequence_mean,
    standardized_entropy,
)
from rlbench.algorithm.losses.weighted_reinforce import advantage_weighted, check_rec, rec_keep_mask
from rlbench.errors import ConfigError

LOSS_DIR = Path(__file__).resolve().parents[1] / "conf" / "algorithm" / "loss"
ZOO = [
    "ppo_clip", "gspo", "gspo_token", "gmpo", "cispo_upper", "cispo_two_sided", "soft_sapo", "reinforce",
    "clip_cov", "kl_cov", "ce_gppo", "spo_simple", "m2po", "intellect2", "mdpo", "ppo_ewma", "dppo",
    "hapo", "aepo", "degrpo", "rec", "opmd", "asymre", "is_surrogate",
]
TRAINER_INPUTS = {
    "logp", "old_logp", "advantages", "response_mask", "entropy", "ref_logp", "progress",
    "sampling_logp", "prox_logp", "generator", "control_mask",
}
F64 = torch.float64
OLD = -1.0


def yaml_params(name):
    cfg = OmegaConf.to_container(OmegaConf.load(LOSS_DIR / f"{name}.yaml"))
    assert cfg.pop("name") == name
    return cfg


def ratio_logp(ratios, dtype=F64):
    """Leaf logp with exp(logp - OLD) = ratios."""
    return (OLD + torch.log(torch.tensor(ratios, dtype=dtype))).requires_grad_()


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def grad(matrix, logp):
    return torch.autograd.grad(matrix.sum(), logp, retain_graph=True)[0]


def inputs(logp, old, adv, mask, entropy=None, **extra):
    """Everything the trainer can offer, as the registry sees it."""
    offered = {
        "logp": logp,
        "old_logp": old,
        "advantages": adv,
        "response_mask": mask,
        "entropy": entropy if entropy is not None else torch.linspace(0.1, 3.0, logp.numel(), dtype=logp.dtype).view_as(logp),
        "ref_logp": old,
        "sampling_logp": old,
        "progress": 0.5,
        "prox_logp": old,
        "generator": torch.Generator().manual_seed(0),
    }
    offered.update(extra)
    return offered


def call(name, offered, **overrides):
    params = {**yaml_params(name), **overrides}
    return POLICY_LOSSES.call(name, offered, params)


# ------------------------------------------------------------------------------------------------
# registry, YAML, requirements
# ------------------------------------------------------------------------------------------------


def test_every_loss_is_registered_and_has_a_yaml():
    assert set(ZOO) <= set(POLICY_LOSSES.names())
    for name in ZOO:
        assert (LOSS_DIR / f"{name}.yaml").is_file(), name


@pytest.mark.parametrize("path", sorted(LOSS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_yaml_is_accepted_and_matches_the_signature_defaults(path):
    name = path.stem
    params = yaml_params(name)
    POLICY_LOSSES.validate_params(name, params, TRAINER_INPUTS)
    signature = inspect.signature(POLICY_LOSSES.get(name)).parameters
    for key, value in params.items():
        assert key not in TRAINER_INPUTS, f"{name}: param {key} shadows a trainer input"
        assert signature[key].default == value, f"{name}.{key}: yaml {value} != default {signature[key].default}"


def test_loss_requirements_are_declared_at_registration():
    for name in POLICY_LOSSES.names():
        needs = POLICY_LOSSES.needs(name)
        for aggregation in (needs.aggregation, needs.paper_aggregation):
            assert aggregation is None or aggregation in AGGREGATIONS, (name, aggregation)
        if needs.aggregation or needs.ratio_level or needs.advantage_level:
            assert needs.conflicts, f"{name} must say why"
    assert POLICY_LOSSES.needs("gspo").aggregation == "seq_mean_token_mean"
    assert POLICY_LOSSES.needs("gmpo").advantage_level == "sequence"
    assert POLICY_LOSSES.needs("cispo_upper").ratio_level == "token"
    assert POLICY_LOSSES.needs("ppo_clip") == Needs()
    with pytest.raises(ValueError, match="must say why"):
        Needs(aggregation="token_mean")
    with pytest.raises(ValueError, match="must be one of"):
        Needs(advantage_level="response")


def test_missing_extra_input_is_a_config_error():
    from rlbench.errors import ConfigError

    logp = ratio_logp([[1.0]])
    base = {"logp": logp, "old_logp": torch.full_like(logp, OLD), "advantages": t([[1.0]]), "response_mask": t([[1.0]])}
    for name, needed in [("ppo_ewma", "prox_logp"), ("hapo", "entropy"), ("aepo", "entropy"), ("mdpo", "progress")]:
        with pytest.raises(ConfigError, match=needed):
            POLICY_LOSSES.call(name, base, {})


# ------------------------------------------------------------------------------------------------
# generic properties of every loss: ratio 1, extreme ratios, padding, zero-length rows
# ------------------------------------------------------------------------------------------------

# Parameters under which the gradient at ratio 1 is exactly the REINFORCE gradient -A grad logp.
# (Losses whose gradient at ratio 1 differs by a known factor are checked in their own tests:
# soft_sapo's value 2/tau, hapo, aepo, asymre, degrpo; gspo and gmpo need their aggregation.)
REINFORCE_AT_RATIO_ONE = {
    "ppo_clip": {}, "gspo_token": {}, "cispo_upper": {}, "cispo_two_sided": {}, "soft_sapo": {},
    "reinforce": {}, "clip_cov": {}, "kl_cov": {}, "ce_gppo": {}, "spo_simple": {}, "m2po": {},
    "intellect2": {}, "mdpo": {}, "ppo_ewma": {}, "dppo": {}, "rec": {}, "opmd": {}, "is_surrogate": {},
    "rec_one_side_is": {"clip_mode": "one_side", "weighting": "importance"},
    "rec_two_side": {"clip_mode": "two_side"},
    "rec_ring": {"clip_mode": "ring"},
    "hapo_no_redistribution": {"adv_beta": 0.0},
    "aepo_plain_advantage": {"entropy_adv_coef": 0.0},
    "asymre_no_shift": {"baseline_shift": 0.0},
    "dppo_variance_rule_zero_fraction": {"rule": "surrogate_variance", "drop_fraction": 0.0},
}


def _batch(seed=0, rows=3, cols=5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(rows, cols, generator=g, dtype=F64) * 3).requires_grad_()
    adv = torch.randn(rows, cols, generator=g, dtype=F64)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])[:rows, :cols]
    return logp, adv, mask


@pytest.mark.parametrize("case", sorted(REINFORCE_AT_RATIO_ONE))
def test_on_policy_gradient_is_reinforce(case):
    name = case if case in POLICY_LOSSES else case.split("_")[0]
    logp, adv, mask = _batch()
    old = logp.detach()  # one on-policy update
    matrix, metrics = call(name, inputs(logp, old, adv, mask), **REINFORCE_AT_RATIO_ONE[case])
    assert torch.allclose(grad(matrix, logp), -adv * mask, atol=1e-12)
    assert all(isinstance(v, float) for v in metrics.values())


def test_on_policy_sequence_losses_give_reinforce_under_their_aggregation():
    # With A constant within each response: d/dlogp of seq_mean_token_mean(gspo or gmpo matrix)
    # = -A_i s_i (1/|o_i|) / N_seq at s_i = 1, i.e. the REINFORCE gradient under the same aggregation.
    logp, _, mask = _batch(1)
    adv = t([[1.5], [-0.5], [0.25]]).expand(3, 5) * mask
    old = logp.detach()
    reference = grad(seq_mean_token_mean(-adv * logp * mask, mask, batch_sequences=3), logp)
    for name in ("gspo", "gmpo", "gspo_token"):
        matrix, _ = call(name, inputs(logp, old, adv, mask))
        agg = seq_mean_token_mean(matrix, mask, batch_sequences=3)
        assert torch.allclose(torch.autograd.grad(agg, logp)[0], reference, atol=1e-12), name


def _garbage_padding_case(dtype):
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]], dtype)
    clean_logp = t([[-0.5, -1.2, -2.0, 0.0], [-0.3, -0.9, 0.0, 0.0]], dtype)
    old = t([[-0.6, -1.0, -2.3, 0.0], [-0.2, -1.1, 0.0, 0.0]], dtype)
    adv = t([[1.0, 1.0, 1.0, 0.0], [-0.5, -0.5, 0.0, 0.0]], dtype)
    entropy = t([[0.5, 1.5, 2.5, 0.0], [0.7, 0.2, 0.0, 0.0]], dtype)
    garbage = (1 - mask) * 37.0
    return mask, clean_logp, old, adv, entropy, garbage


@pytest.mark.parametrize("name", ZOO)
def test_padding_is_zero_and_does_not_leak(name):
    mask, clean_logp, old, adv, entropy, garbage = _garbage_padding_case(F64)
    clean = clean_logp.clone().requires_grad_()
    dirty = (clean_logp + garbage).requires_grad_()
    m_clean, _ = call(name, inputs(clean, old, adv, mask, entropy))
    m_dirty, _ = call(name, inputs(dirty, old - garbage, adv + garbage, mask, entropy + garbage))
    assert torch.all(m_dirty[mask == 0] == 0)
    assert torch.all(grad(m_dirty, dirty)[mask == 0] == 0)
    assert torch.allclose(m_dirty, m_clean, atol=1e-12)
    assert torch.allclose(grad(m_dirty, dirty), grad(m_clean, clean), atol=1e-12)


@pytest.mark.parametrize("name", ZOO)
def test_extreme_ratios_stay_finite(name):
    # log-ratios of +-50 (clamped to +-20) in float32, with both advantage signs
    mask = torch.ones(2, 3)
    old = torch.full((2, 3), -30.0)
    logp = (old + t([[50.0, -50.0, 0.0], [-50.0, 50.0, 20.0]], torch.float32)).requires_grad_()
    adv = t([[1.0, -1.0, 1.0], [1.0, -1.0, -1.0]], torch.float32)
    matrix, metrics = call(name, inputs(logp, old, adv, mask, progress=1.0))
    assert torch.isfinite(matrix).all() and torch.isfinite(grad(matrix, logp)).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ZOO)
def test_zero_length_rows(name):
    # Row 1 has no response tokens: it contributes zeros and does not change the other rows.
    mask, logp0, old, adv, entropy, _ = _garbage_padding_case(F64)
    empty = torch.zeros(1, 4, dtype=F64)
    logp = logp0.clone().requires_grad_()
    full = torch.cat([logp[:1], empty, logp[1:]])
    with_empty, _ = call(
        name,
        inputs(full, torch.cat([old[:1], empty, old[1:]]), torch.cat([adv[:1], empty + 1, adv[1:]]),
               torch.cat([mask[:1], empty, mask[1:]]), torch.cat([entropy[:1], empty, entropy[1:]])),
    )
    without, _ = call(name, inputs(logp, old, adv, mask, entropy))
    assert torch.all(with_empty[1] == 0) and torch.isfinite(with_empty).all()
    assert torch.allclose(with_empty[[0, 2]], without, atol=1e-12)
    all_empty, metrics = call(name, inputs(torch.zeros(2, 3, dtype=F64, requires_grad=True), torch.zeros(2, 3, dtype=F64),
                                           torch.ones(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64)))
    assert torch.all(all_empty == 0) and all(math.isfinite(v) for v in metrics.values())


# ------------------------------------------------------------------------------------------------
# GSPO, GSPO-token, GMPO
# ------------------------------------------------------------------------------------------------

SEQ_MASK = t([[1, 1, 1], [1, 1, 0]])


def test_gspo_closed_form():
    # row 0: log-ratios [0.3, -0.1, 0.1] -> mean 0.1 -> s0 = e^0.1 = 1.10517, A = +1: inside [0.8, 1.2]
    #        -> every token carries -A s0 = -1.10517
    # row 1: log-ratios [-0.2, -0.4] -> mean -0.3 -> s1 = e^-0.3 = 0.74082 < 0.8, A = -2:
    #        max(2 * 0.74082, 2 * 0.8) = 1.6 (clipped: whole sequence, zero gradient)
    old = torch.full((2, 3), OLD, dtype=F64)
    logp = (old + t([[0.3, -0.1, 0.1], [-0.2, -0.4, 0.0]])).requires_grad_()
    adv = t([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    matrix, metrics = POLICY_LOSSES.get("gspo")(logp, old, adv, SEQ_MASK, clip_low=0.2, clip_high=0.2)
    s0 = math.exp(0.1)
    assert torch.allclose(matrix, t([[-s0] * 3, [1.6, 1.6, 0.0]]))
    loss = seq_mean_token_mean(matrix, SEQ_MASK, batch_sequences=2)
    assert loss.item() == pytest.approx((-s0 + 1.6) / 2)  # = -(1/G) sum_i min(s_i A_i, clip(s_i) A_i)
    # d loss / d logp_0t = (1/2) * (-A s0) * (1/3) = -s0/6 ; row 1 clipped -> 0
    g = torch.autograd.grad(loss, logp)[0]
    assert torch.allclose(g, t([[-s0 / 6] * 3, [0.0, 0.0, 0.0]]))
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)  # the 2 tokens of the clipped sequence


def test_gspo_ratio_is_the_geometric_mean():
    # all token ratios 1.1 -> s = 1.1 ; ratios [2, 0.5] -> s = sqrt(2 * 0.5) = 1
    logp = ratio_logp([[1.1, 1.1, 1.1], [2.0, 0.5, 1.0]])
    adv = t([[1.0] * 3, [1.0, 1.0, 0.0]])
    matrix, _ = POLICY_LOSSES.get("gspo")(logp, torch.full((2, 3), OLD, dtype=F64), adv, SEQ_MASK, 0.5, 0.5)
    assert torch.allclose(matrix, t([[-1.1] * 3, [-1.0, -1.0, 0.0]]))


def test_gspo_token_value_and_gradient():
    # same inputs as test_gspo_closed_form with token-level advantages in row 0:
    # value s_it = s_i; grad of l_it = -A_it s_i (unclipped rows), per token (not averaged)
    old = torch.full((2, 3), OLD, dtype=F64)
    logp = (old + t([[0.3, -0.1, 0.1], [-0.2, -0.4, 0.0]])).requires_grad_()
    adv = t([[1.0, 2.0, -1.0], [-2.0, -2.0, 0.0]])
    matrix, _ = POLICY_LOSSES.get("gspo_token")(logp, old, adv, SEQ_MASK, clip_low=0.2, clip_high=0.2)
    s0 = math.exp(0.1)
    assert torch.allclose(matrix, t([[-s0, -2 * s0, s0], [1.6, 1.6, 0.0]]))
    assert torch.allclose(grad(matrix, logp), t([[-s0, -2 * s0, s0], [0.0, 0.0, 0.0]]))


def test_gspo_gradient_equals_gspo_token_with_sequence_advantages():
    g = torch.Generator().manual_seed(3)
    mask = t([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]])
    old = -torch.rand(4, 6, generator=g, dtype=F64) * 2
    adv = t([[0.7], [-1.3], [0.4], [-0.2]]).expand(4, 6) * mask
    for scale in (0.05, 0.5):  # mostly unclipped / several sequences clipped
        grads, values = [], []
        for name in ("gspo", "gspo_token"):
            logp = (old + scale * torch.randn(4, 6, generator=torch.Generator().manual_seed(4), dtype=F64)).requires_grad_()
            matrix, _ = POLICY_LOSSES.get(name)(logp, old, adv, mask, clip_low=0.1, clip_high=0.1)
            loss = seq_mean_token_mean(matrix, mask, batch_sequences=4)
            values.append(loss)
            grads.append(torch.autograd.grad(loss, logp)[0])
        assert torch.allclose(values[0], values[1], atol=1e-12)
        assert torch.allclose(grads[0], grads[1], atol=1e-12)


def test_gmpo_sign_aware_log_space_clip():
    # row 0, A = +1: log-ratios [0.6, -0.2, 0.2] -> capped at 0.4: [0.4, -0.2, 0.2], mean 0.4/3
    #   rho0 = e^(0.4/3); loss -rho0; token 0 clipped (no gradient)
    # row 1, A = -1: log-ratios [-0.6, 0.1] -> floored at -0.4: [-0.4, 0.1], mean -0.15
    #   rho1 = e^-0.15; loss +rho1; token 0 clipped
    # under seq_mean_token_mean (N_seq = 2): d/dlogp = (1/2)(-A_i rho_i)(1/|o_i|) on unclipped tokens
    old = torch.full((2, 3), OLD, dtype=F64)
    logp = (old + t([[0.6, -0.2, 0.2], [-0.6, 0.1, 5.0]])).requires_grad_()
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    matrix, metrics = POLICY_LOSSES.get("gmpo")(logp, old, adv, SEQ_MASK, clip_low=0.4, clip_high=0.4)
    rho0, rho1 = math.exp(0.4 / 3), math.exp(-0.15)
    assert torch.allclose(matrix, t([[-rho0] * 3, [rho1, rho1, 0.0]]))
    loss = seq_mean_token_mean(matrix, SEQ_MASK, batch_sequences=2)
    g = torch.autograd.grad(loss, logp)[0]
    assert torch.allclose(g, t([[0.0, -rho0 / 6, -rho0 / 6], [0.0, rho1 / 4, 0.0]]))
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)


# ------------------------------------------------------------------------------------------------
# CISPO
# ------------------------------------------------------------------------------------------------

CISPO_RATIOS = [[0.5, 1.0, 1.1, 1.3, 6.0]]
CISPO_ADV = t([[1.0, -1.0, 2.0, 1.0, -1.0]])
ONES5 = torch.ones(1, 5, dtype=F64)


def test_cispo_upper_caps_only_from_above():
    # w = sg(min(rho, 5)) = [0.5, 1, 1.1, 1.3, 5]; l = -w A logp; grad = -w A = [-0.5, 1, -2.2, -1.3, 5]
    logp = ratio_logp(CISPO_RATIOS)
    matrix, metrics = POLICY_LOSSES.get("cispo_upper")(logp, torch.full_like(logp, OLD), CISPO_ADV, ONES5, ratio_max=5.0)
    w = t([[0.5, 1.0, 1.1, 1.3, 5.0]])
    assert torch.allclose(matrix, -w * CISPO_ADV * logp.detach())
    assert torch.allclose(grad(matrix, logp), t([[-0.5, 1.0, -2.2, -1.3, 5.0]]))
    assert metrics["cispo_clip_fraction"] == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="absolute"):
        POLICY_LOSSES.get("cispo_upper")(logp, torch.full_like(logp, OLD), CISPO_ADV, ONES5, ratio_max=0.28)


def test_cispo_two_sided_clips_both_ways():
    # w = sg(clip(rho, 0.8, 1.2)) = [0.8, 1, 1.1, 1.2, 1.2]; grad = -w A = [-0.8, 1, -2.2, -1.2, 1.2]
    logp = ratio_logp(CISPO_RATIOS)
    matrix, metrics = POLICY_LOSSES.get("cispo_two_sided")(logp, torch.full_like(logp, OLD), CISPO_ADV, ONES5)
    w = t([[0.8, 1.0, 1.1, 1.2, 1.2]])
    assert torch.allclose(matrix, -w * CISPO_ADV * logp.detach())
    assert torch.allclose(grad(matrix, logp), t([[-0.8, 1.0, -2.2, -1.2, 1.2]]))
    assert metrics["cispo_clip_fraction"] == pytest.approx(3 / 5)


@pytest.mark.parametrize(
    "ratios, ratio_max, clip_high",
    [([0.8, 0.95, 1.0, 1.15, 1.2], 5.0, 0.2),   # every ratio in [0.8, min(1.2, 5)]
     ([0.85, 1.0, 1.05, 1.1], 1.1, 0.3)],        # every ratio in [0.8, min(1.3, 1.1)]
)
def test_cispo_variants_agree_inside_both_ranges(ratios, ratio_max, clip_high):
    adv = torch.linspace(-1, 1, len(ratios), dtype=F64)[None]
    mask = torch.ones(1, len(ratios), dtype=F64)
    out = []
    for name, params in (("cispo_upper", {"ratio_max": ratio_max}), ("cispo_two_sided", {"clip_low": 0.2, "clip_high": clip_high})):
        logp = ratio_logp([ratios])
        matrix, _ = POLICY_LOSSES.get(name)(logp, torch.full_like(logp, OLD), adv, mask, **params)
        out.append((matrix, grad(matrix, logp)))
    assert torch.allclose(out[0][0], out[1][0]) and torch.allclose(out[0][1], out[1][1])


# ------------------------------------------------------------------------------------------------
# SAPO, SPO, REINFORCE
# ------------------------------------------------------------------------------------------------


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate():
    # token 0: rho 1.5, A +1, tau 1:    f = 4 sig(0.5);                l = -f;   dl/dlogp = -4 sig'(0.5) * 1.5
    # token 1: rho 0.5, A -2, tau 1.05: f = sig(-0.525) * 4/1.05;      l = 2f;   dl/dlogp = 2 * 4 sig'(-0.525) * 0.5
    # (f'(rho) = sig'(tau(rho-1)) * tau * 4/tau = 4 sig'; dl/dlogp = -A f'(rho) rho)
    logp = ratio_logp([[1.5, 0.5]])
    adv = t([[1.0, -2.0]])
    matrix, metrics = POLICY_LOSSES.get("soft_sapo")(logp, torch.full_like(logp, OLD), adv, torch.ones(1, 2, dtype=F64))
    d = lambda x: _sig(x) * (1 - _sig(x))  # noqa: E731
    assert torch.allclose(matrix, t([[-4 * _sig(0.5), 2 * _sig(-0.525) * 4 / 1.05]]))
    assert torch.allclose(grad(matrix, logp), t([[-4 * d(0.5) * 1.5, 2 * 4 * d(-0.525) * 0.5]]))
    # gate_damping: mean of 1 - f'(rho) = 1 - sech^2(x/2), x = tau (rho - 1)
    sech2 = lambda x: 1 / math.cosh(x / 2) ** 2  # noqa: E731
    assert metrics["gate_damping"] == pytest.approx(((1 - sech2(0.5)) + (1 - sech2(-0.525))) / 2)


def test_sapo_at_ratio_one_value_is_two_over_tau_and_slope_is_one():
    logp = ratio_logp([[1.0, 1.0]])
    adv = t([[0.5, -3.0]])
    matrix, metrics = POLICY_LOSSES.get("soft_sapo")(logp, logp.detach(), adv, torch.ones(1, 2, dtype=F64),
                                                     tau_pos=1.0, tau_neg=1.05)
    assert torch.allclose(matrix, t([[-0.5 * 2 / 1.0, 3.0 * 2 / 1.05]]))  # -A * 2/tau
    assert metrics["gate_damping"] == 0.0
    assert torch.allclose(grad(matrix, logp), -adv)  # gate slope sig'(0) * 4 = 1


def test_spo_simple_closed_form():
    # clip_high 0.2 (A > 0), clip_low 0.1 (A < 0)
    # t0: A 1, rho 1.5:  J = 1.5 - 0.5^2/0.4 = 0.875;  dJ/drho = 1 - 0.5/0.2 = -1.5 -> dl/dlogp = 1.5 * 1.5 = 2.25
    # t1: A -2, rho 0.5: J = -1 - 2 * 0.25/0.2 = -3.5; dJ/drho = -2 + 2 * 0.5/0.1 = 8 -> dl/dlogp = -8 * 0.5 = -4
    # t2: A 1, rho 1.2 (= 1 + eps, the optimum): J = 1.2 - 0.04/0.4 = 1.1; dJ/drho = 0
    logp = ratio_logp([[1.5, 0.5, 1.2]])
    adv = t([[1.0, -2.0, 1.0]])
    matrix, _ = POLICY_LOSSES.get("spo_simple")(logp, torch.full_like(logp, OLD), adv, torch.ones(1, 3, dtype=F64), clip_low=0.1, clip_high=0.2)
    assert torch.allclose(matrix, t([[-0.875, 3.5, -1.1]]))
    assert torch.allclose(grad(matrix, logp), t([[2.25, -4.0, 0.0]]), atol=1e-12)


def test_reinforce_closed_form():
    logp = t([[-0.5, -2.0, -7.0]]).requires_grad_()
    adv = t([[1.0, -0.5, 3.0]])
    matrix, metrics = POLICY_LOSSES.get("reinforce")(logp, adv, t([[1.0, 1.0, 0.0]]))
    assert torch.allclose(matrix, t([[0.5, -1.0, 0.0]]))
    assert torch.allclose(grad(matrix, logp), t([[-1.0, 0.5, 0.0]]))
    assert metrics == {}


# ------------------------------------------------------------------------------------------------
# Clip-Cov, KL-Cov
# ------------------------------------------------------------------------------------------------

# 10 valid tokens (2 x 5). mean A = 0, logp = -3 + x with mean x = 0, so Cov_t = A_t x_t:
COV_ADV = t([[2.0, 2.0, 1.0, -1.0, -2.0], [-2.0, 0.0, 0.0, 0.0, 0.0]])
COV_X = t([[1.0, 2.0, 3.0, -1.0, -1.0], [1.0, 0.0, 0.0, 0.0, -5.0]])
# Cov = [2, 4, 3, 1, 2 | -2, 0, 0, 0, 0]; in (1, 5): tokens 0, 1, 2, 4 (token 3 has Cov = 1, not > 1)
COV_MASK = torch.ones(2, 5, dtype=F64)


def _cov_logp():
    return (-3.0 + COV_X).requires_grad_()


def test_clip_cov_deterministic_selection_detaches_top_covariance():
    # k = floor(0.2 * 10) = 2 -> tokens 1 (Cov 4) and 2 (Cov 3): value kept (-A at ratio 1), gradient 0
    logp = _cov_logp()
    matrix, metrics = POLICY_LOSSES.get("clip_cov")(logp, logp.detach(), COV_ADV, COV_MASK, clip_cov_ratio=0.2)
    assert torch.allclose(matrix, -COV_ADV)
    expected = -COV_ADV.clone()
    expected[0, 1] = expected[0, 2] = 0.0
    assert torch.allclose(grad(matrix, logp), expected)
    assert metrics["cov_detached_fraction"] == pytest.approx(0.2)


def test_clip_cov_skips_ppo_clipped_tokens_and_breaks_ties_by_position():
    # token 1 (A = 2) gets ratio 1.5 -> PPO-clipped -> not a candidate; candidates 0 (Cov 2), 2 (3), 4 (2)
    # top-2: token 2, then token 0 (ties with token 4, earlier position wins)
    logp = _cov_logp()
    old = logp.detach().clone()
    old[0, 1] -= math.log(1.5)
    matrix, _ = POLICY_LOSSES.get("clip_cov")(logp, old, COV_ADV, COV_MASK, clip_cov_ratio=0.2)
    g = grad(matrix, logp)
    assert g[0, 0] == 0 and g[0, 2] == 0 and g[0, 1] == 0  # 0, 2 detached; 1 clipped by PPO
    assert g[0, 4] == 2.0 and g[0, 3] == 1.0


def test_clip_cov_random_selection_uses_the_generator():
    picks = []
    for seed in (0, 0, 1, 2, 3, 4):
        logp = _cov_logp()
        matrix, _ = POLICY_LOSSES.get("clip_cov")(
            logp, logp.detach(), COV_ADV, COV_MASK, generator=torch.Generator().manual_seed(seed), clip_cov_ratio=0.2
        )
        detached = (grad(matrix, logp) == 0) & (COV_ADV != 0)
        assert detached.sum() == 2 and set(detached.flatten().nonzero().flatten().tolist()) <= {0, 1, 2, 4}
        picks.append(tuple(detached.flatten().tolist()))
    assert picks[0] == picks[1]  # same seed, same selection
    assert len(set(picks)) > 1  # the selection is random across seeds


def test_kl_cov_penalises_the_top_covariance_tokens():
    # ratio e^0.1 everywhere except token 2 (e^-0.2); top-2 Cov: tokens 1 and 2
    # l = -A rho + 0.1 |log rho| [t in {1, 2}];  dl/dlogp = -A rho + 0.1 sign(log rho) [t in {1, 2}]
    logp = _cov_logp()
    lr = torch.full((2, 5), 0.1, dtype=F64)
    lr[0, 2] = -0.2
    old = logp.detach() - lr
    matrix, metrics = POLICY_LOSSES.get("kl_cov")(logp, old, COV_ADV, COV_MASK, kl_cov_ratio=0.2, ppo_kl_coef=0.1)
    rho = lr.exp()
    selected = torch.zeros(2, 5, dtype=F64)
    selected[0, 1] = selected[0, 2] = 1.0
    assert torch.allclose(matrix, -COV_ADV * rho + 0.1 * lr.abs() * selected)
    assert torch.allclose(grad(matrix, logp), -COV_ADV * rho + 0.1 * lr.sign() * selected)
    assert metrics["kl_cov_fraction"] == pytest.approx(0.2)


# ------------------------------------------------------------------------------------------------
# CE-GPPO, AEPO (gradient-preserving clipping)
# ------------------------------------------------------------------------------------------------

GP_RATIOS = [[1.5, 0.5, 1.1, 1.5, 0.5]]
GP_ADV = t([[1.0, -1.0, 1.0, -1.0, 1.0]])


def test_ce_gppo_clipped_tokens_keep_bounded_gradients():
    # clip 0.2 / 0.2, beta_low 0.75, beta_high 0.6
    # t0: A +1, rho 1.5 > 1.2: l = -0.6 * 1.2 * 1 * u  -> value -0.72, grad -0.72 (PPO: grad 0)
    # t1: A -1, rho 0.5 < 0.8: l = -0.75 * 0.8 * (-1) u -> value 0.6, grad 0.6   (PPO: grad 0)
    # t2: A +1, rho 1.1: PPO -1.1;  t3: A -1, rho 1.5: PPO max(1.5, 1.2) = 1.5;  t4: A +1, rho 0.5: max(-0.5, -0.8) = -0.5
    logp = ratio_logp(GP_RATIOS)
    matrix, metrics = POLICY_LOSSES.get("ce_gppo")(
        logp, torch.full_like(logp, OLD), GP_ADV, ONES5, clip_low=0.2, clip_high=0.2, beta_low=0.75, beta_high=0.6
    )
    assert torch.allclose(matrix, t([[-0.72, 0.6, -1.1, 1.5, -0.5]]))
    assert torch.allclose(grad(matrix, logp), t([[-0.72, 0.6, -1.1, 1.5, -0.5]]))
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)


def test_ce_gppo_reduces_to_ppo():
    # beta = 1: PPO's forward value; beta = 0: PPO's gradient
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 6, generator=g, dtype=F64) * 2
    delta = torch.randn(3, 6, generator=g, dtype=F64) * 0.5
    adv = torch.randn(3, 6, generator=g, dtype=F64)
    mask = torch.ones(3, 6, dtype=F64)
    ppo_logp = (old + delta).requires_grad_()
    ppo, _ = ppo_clip_loss(ppo_logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    for beta, check_value in ((1.0, True), (0.0, False)):
        logp = (old + delta).requires_grad_()
        matrix, _ = POLICY_LOSSES.get("ce_gppo")(logp, old, adv, mask, 0.2, 0.28, beta, beta)
        if check_value:
            assert torch.allclose(matrix, ppo)
        else:
            assert torch.allclose(grad(matrix, logp), grad(ppo, ppo_logp))


def test_aepo_forward_is_ppo_and_upper_clipped_tokens_keep_gradient():
    # entropy_adv_coef 0: value == ppo_clip; gradient: t0 (A +1, rho 1.5 > 1.2) -> -(1 + 0.2) = -1.2
    # t1 (A -1, rho 0.5 < 0.8) stays PPO-frozen (0); others as PPO
    logp = ratio_logp(GP_RATIOS)
    old = torch.full_like(logp, OLD)
    entropy = torch.ones(1, 5, dtype=F64)
    matrix, _ = POLICY_LOSSES.get("aepo")(logp, old, GP_ADV, ONES5, entropy, entropy_adv_coef=0.0)
    ppo, _ = ppo_clip_loss(logp, old, GP_ADV, ONES5)
    assert torch.allclose(matrix, ppo)
    assert torch.allclose(grad(matrix, logp), t([[-1.2, 0.0, -1.1, 1.5, -0.5]]))


def test_aepo_entropy_aware_advantage():
    # log-entropies 0..4, pivot 0.5 -> h = [-1, -0.5, 0, 0.5, 1]; A~ = A (1 + 0.5 h) = A [0.5, 0.75, 1, 1.25, 1.5]
    # on-policy: gradient -A~
    logp = ratio_logp([[1.0] * 5])
    entropy = torch.exp(torch.arange(5, dtype=F64))[None]
    adv = t([[1.0, -1.0, 2.0, 1.0, -2.0]])
    matrix, _ = POLICY_LOSSES.get("aepo")(logp, logp.detach(), adv, ONES5, entropy, entropy_adv_coef=0.5, entropy_pivot=0.5)
    assert torch.allclose(grad(matrix, logp), -adv * t([[0.5, 0.75, 1.0, 1.25, 1.5]]))


def test_aepo_released_zscore_entropy_advantage():
    # entropies [1, 2, 3, 4, 5] (one padded token, entropy 99): mean 3, std (Bessel) sqrt(2.5);
    # z = [-2, -1, 0, 1, 2] / sqrt(2.5), padding 0; A~ = A (1 + 0.2 z); on-policy gradient -A~
    logp = ratio_logp([[1.0] * 6])
    entropy = t([[1.0, 2.0, 3.0, 4.0, 5.0, 99.0]])
    mask = t([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    adv = t([[1.0, -1.0, 2.0, 1.0, -2.0, 3.0]])
    z = t([[-2.0, -1.0, 0.0, 1.0, 2.0, 0.0]]) / math.sqrt(2.5)
    assert torch.allclose(standardized_entropy(entropy, mask), z)
    matrix, _ = POLICY_LOSSES.get("aepo")(logp, logp.detach(), adv, mask, entropy, entropy_adv_coef=0.2,
                                          entropy_norm="zscore")
    assert torch.allclose(grad(matrix, logp), -adv * (1 + 0.2 * z) * mask)
    with pytest.raises(ConfigError, match="entropy_norm"):
        POLICY_LOSSES.validate_params("aepo", {"entropy_norm": "minmax"})


# dual clip c = 3 on clip 0.2 / 0.2 (ce_gppo beta_low 0.5, beta_high 1; aepo with the plain advantage):
# t0: A -1, rho 4 > 3: l = min(max(4, 1.2), 3) = 3, grad 0 (without the dual clip: 4, grad 4)
# t1: A -1, rho 0.5 < 0.8: ce_gppo -0.5 * 0.8 * (-1) u = 0.4, grad 0.4 (below c: untouched); aepo PPO's 0.8, grad 0
# t2: A -1, rho 2 < 3: l = 2, grad 2;   t3: A +1, rho 4 > 1.2: l = -1.2 u, grad -1.2 (A > 0: no dual clip)
DUAL_RATIOS = [[4.0, 0.5, 2.0, 4.0]]
DUAL_ADV = t([[-1.0, -1.0, -1.0, 1.0]])


@pytest.mark.parametrize("name, value, gradient", [
    ("ce_gppo", [3.0, 0.4, 2.0, -1.2], [0.0, 0.4, 2.0, -1.2]),
    ("aepo", [3.0, 0.8, 2.0, -1.2], [0.0, 0.0, 2.0, -1.2]),
])
def test_gradient_preserving_losses_take_the_dual_clip(name, value, gradient):
    logp = ratio_logp(DUAL_RATIOS)
    old = torch.full_like(logp, OLD)
    ones = torch.ones(1, 4, dtype=F64)
    extra = {"entropy": ones, "entropy_adv_coef": 0.0} if name == "aepo" else {"beta_low": 0.5, "beta_high": 1.0}
    matrix, _ = POLICY_LOSSES.get(name)(logp, old, DUAL_ADV, ones, clip_low=0.2, clip_high=0.2, dual_clip=3.0, **extra)
    assert torch.allclose(matrix, t([value])) and torch.allclose(grad(matrix, logp), t([gradient]))
    plain, _ = POLICY_LOSSES.get(name)(logp, old, DUAL_ADV, ones, clip_low=0.2, clip_high=0.2, **extra)
    assert plain[0, 0].item() == pytest.approx(4.0) and grad(plain, logp)[0, 0].item() == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="dual_clip"):
        POLICY_LOSSES.validate_params(name, {"dual_clip": 1.0})


# ------------------------------------------------------------------------------------------------
# HAPO
# ------------------------------------------------------------------------------------------------

HAPO_ENTROPY = torch.exp(torch.arange(5, dtype=F64))[None]  # log H = 0, 1, 2, 3, 4


def test_normalized_entropy_closed_form():
    # pivot 0.5: q = 2 -> centred [-2, -1, 0, 1, 2] -> h = [-1, -0.5, 0, 0.5, 1]
    assert torch.allclose(normalized_entropy(HAPO_ENTROPY, ONES5, 0.5), t([[-1.0, -0.5, 0.0, 0.5, 1.0]]))
    # pivot 0.8: q = 3.2 -> centred [-3.2, -2.2, -1.2, -0.2, 0.8] -> negatives / 3.2, positives / 0.8
    h = normalized_entropy(HAPO_ENTROPY, ONES5, 0.8)
    assert torch.allclose(h, t([[-1.0, -2.2 / 3.2, -1.2 / 3.2, -0.2 / 3.2, 1.0]]))
    assert h.max() == 1 and h.min() == -1
    # padding is ignored and gets 0; zero entropy is floored (finite)
    padded = normalized_entropy(t([[0.0, 1.0, 5.0, 99.0]]), t([[1.0, 1.0, 1.0, 0.0]]), 0.5)
    assert torch.isfinite(padded).all() and padded[0, 3] == 0 and padded[0, 0] == -1 and padded[0, 2] == 1


def test_hapo_adaptive_clip_and_redistribution():
    # h = [-1, -0.5, 0, 0.5, 1] (pivot 0.5), alpha = beta = 1, eps 0.2:
    #   eps_l' = [0.4, 0.3, 0.2, 0.2, 0.2], eps_h' = [0.2, 0.2, 0.2, 0.3, 0.4]
    #   neutral zone N = (1 - eps_l'/2, 1 + eps_h'/2)
    # t0: h -1, rho 0.7, A -1: outside N (0.8, 1.1), low entropy -> A; bound 0.6 -> unclipped: l = 0.7, grad 0.7
    #     (plain PPO would clip at 0.8: constant 0.8)
    # t1: h -0.5, rho 0.9, A +1: inside N (0.85, 1.1), low -> A^ent = 0.5; l = -0.45, grad -0.45
    # t2: h 0, rho 1.05, A +2: A^ent = A; l = -2.1, grad -2.1
    # t3: h 0.5, rho 1.2, A +1: outside N (0.9, 1.15), high -> A^ent = 1.5; bound 1.3: l = -1.8, grad -1.8
    # t4: h 1, rho 1.5, A +1: outside N, high -> A^ent = 2; clipped at 1.4: l = -2.8, grad 0
    logp = ratio_logp([[0.7, 0.9, 1.05, 1.2, 1.5]])
    adv = t([[-1.0, 1.0, 2.0, 1.0, 1.0]])
    matrix, metrics = POLICY_LOSSES.get("hapo")(logp, torch.full_like(logp, OLD), adv, ONES5, HAPO_ENTROPY, entropy_pivot=0.5)
    assert torch.allclose(matrix, t([[0.7, -0.45, -2.1, -1.8, -2.8]]))
    assert torch.allclose(grad(matrix, logp), t([[0.7, -0.45, -2.1, -1.8, 0.0]]))
    assert metrics["redistributed_fraction"] == pytest.approx(3 / 5)  # t1, t3, t4 (t2 has h = 0: A^ent = A)


def test_hapo_on_policy_gradient_constant():
    # at rho = 1 every token is in N: high-entropy tokens use A, low-entropy ones A (1 + beta h)
    # -> gradient -A (1 + beta min(h, 0)) = -A [0, 0.5, 1, 1, 1] with beta = 1
    logp = ratio_logp([[1.0] * 5])
    adv = t([[1.0, -2.0, 1.0, 3.0, -1.0]])
    matrix, _ = POLICY_LOSSES.get("hapo")(logp, logp.detach(), adv, ONES5, HAPO_ENTROPY, entropy_pivot=0.5)
    assert torch.allclose(grad(matrix, logp), -adv * t([[0.0, 0.5, 1.0, 1.0, 1.0]]))


def test_hapo_without_adaptation_is_ppo_with_dual_clip_10():
    logp = ratio_logp([[0.5, 1.5, 30.0, 1.1, 0.9]])
    old = torch.full_like(logp, OLD)
    adv = t([[-1.0, 1.0, -1.0, 1.0, -1.0]])
    matrix, _ = POLICY_LOSSES.get("hapo")(logp, old, adv, ONES5, HAPO_ENTROPY, clip_alpha=0.0, adv_beta=0.0)
    ppo, _ = ppo_clip_loss(logp, old, adv, ONES5, dual_clip=10.0)
    assert torch.allclose(matrix, ppo) and matrix[0, 2] == 10.0  # A = -1, rho = 30: capped at -A c


# ------------------------------------------------------------------------------------------------
# M2PO, INTELLECT-2, MDPO, PPO-EWMA, D-PPO
# ------------------------------------------------------------------------------------------------

M2_MASK = t([[1, 1, 1, 0], [1, 1, 1, 0]])
M2_LR = t([[0.5, -0.3, 0.1, 10.0], [0.0, 0.2, -0.1, -10.0]])  # padding holds |log rho| = 10


@pytest.mark.parametrize("threshold, masked", [(0.04, [(0, 0)]), (0.02, [(0, 0), (0, 1)]), (0.1, [])])
def test_m2po_masks_largest_squared_log_ratios(threshold, masked):
    # (log rho)^2 over valid tokens = [0.25, 0.09, 0.01, 0, 0.04, 0.01], sum 0.40, M2 = 0.0667
    # drop 0.25 -> 0.15/5 = 0.03 (<= 0.04 stop); then drop 0.09 -> 0.06/4 = 0.015 (<= 0.02 stop)
    old = torch.full((2, 4), OLD, dtype=F64)
    logp = (old + M2_LR).requires_grad_()
    adv = t([[1.0, -1.0, 2.0, 1.0], [1.0, 1.0, -1.0, 1.0]])
    matrix, metrics = POLICY_LOSSES.get("m2po")(logp, old, adv, M2_MASK, m2_threshold=threshold)
    keep = M2_MASK.clone()
    for index in masked:
        keep[index] = 0
    rho = M2_LR.exp()
    assert torch.allclose(matrix, -rho * adv * keep)
    assert torch.allclose(grad(matrix, logp), -rho * adv * keep)
    assert metrics["m2"] == pytest.approx(0.4 / 6)
    assert metrics["m2_masked"] == pytest.approx({0: 0.4 / 6, 1: 0.03, 2: 0.015}[len(masked)])
    assert metrics["m2_masked"] <= threshold
    assert metrics["masked_fraction"] == pytest.approx(len(masked) / 6)


def _trl_delta_loss(ratio, adv, eps_low, eps_high, delta):
    """The INTELLECT-2 / TRL form: -min(min(rho, delta) A, clip(rho, 1-e_l, 1+e_h) A)."""
    return -torch.minimum(ratio.clamp(max=delta) * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def test_intellect2_is_ppo_dual_clip_and_matches_the_capped_ratio_form():
    ratios = [0.1, 0.7, 0.95, 1.1, 1.3, 3.0, 4.5, 100.0]
    for sign in (1.0, -1.0):
        logp = ratio_logp([ratios])
        old = torch.full_like(logp, OLD)
        adv = torch.full((1, len(ratios)), sign, dtype=F64)
        mask = torch.ones(1, len(ratios), dtype=F64)
        matrix, _ = POLICY_LOSSES.get("intellect2")(logp, old, adv, mask, delta=4.0)
        ppo, _ = ppo_clip_loss(logp, old, adv, mask, dual_clip=4.0)
        capped_logp = ratio_logp([ratios])
        trl = _trl_delta_loss(torch.exp(capped_logp - OLD), adv, 0.2, 0.2, 4.0)
        assert torch.allclose(matrix, ppo) and torch.allclose(matrix, trl)
        assert torch.allclose(grad(matrix, logp), grad(trl, capped_logp))
    # A = -1, rho = 100: the loss is bounded by delta |A| = 4
    assert matrix[0, -1].item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="delta"):
        POLICY_LOSSES.get("intellect2")(logp, old, adv, mask, clip_high=0.2, delta=1.1)


def test_mdpo_annealed_kl_weight():
    # rho = e^0.2 = 1.221403, A = 1: kl = rho log rho - rho + 1 = 0.244281 - 1.221403 + 1 = 0.022878
    # progress 0.5 -> t = 0.5 -> weight 2: l = -1.221403 + 2 * 0.022878; dl/dlogp = -rho + 2 rho log rho
    rho = math.exp(0.2)
    kl = rho * 0.2 - rho + 1
    for progress, weight in ((0.0, 1.0), (0.5, 2.0), (0.75, 4.0), (1.0, 100.0)):
        logp = ratio_logp([[rho]])
        matrix, metrics = POLICY_LOSSES.get("mdpo")(logp, torch.full_like(logp, OLD), t([[1.0]]), t([[1.0]]), progress)
        assert metrics["kl_weight"] == pytest.approx(weight)
        assert matrix.item() == pytest.approx(-rho + weight * kl)
        assert grad(matrix, logp).item() == pytest.approx(-rho + weight * rho * 0.2)
        assert metrics["kl"] == pytest.approx(kl) and kl >= 0


def test_ppo_ewma_decoupled_proximal_policy():
    # t0: w = pi_prox/pi_old = 2, r = pi/pi_prox = 1.1, A 1: l = 2 * -1.1 = -2.2, grad -2.2
    # t1: w = 0.5, r = 1.5 > 1.2 (clipped), A 1: l = 0.5 * -1.2 = -0.6, grad 0
    old = torch.full((1, 2), OLD, dtype=F64)
    prox = (old + torch.log(t([[2.0, 0.5]]))).requires_grad_()
    logp = (prox.detach() + torch.log(t([[1.1, 1.5]]))).requires_grad_()
    adv = t([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=F64)
    matrix, metrics = POLICY_LOSSES.get("ppo_ewma")(logp, old, adv, mask, prox)
    assert torch.allclose(matrix, t([[-2.2, -0.6]]))
    g_logp, = torch.autograd.grad(matrix.sum(), logp, retain_graph=True)
    assert torch.allclose(g_logp, t([[-2.2, 0.0]]))
    matrix.sum().backward()
    assert prox.grad is None or torch.all(prox.grad == 0)  # the IS weight carries no gradient
    assert metrics["is_weight_mean"] == pytest.approx(1.25)
    capped, _ = POLICY_LOSSES.get("ppo_ewma")(logp, old, adv, mask, prox, is_weight_max=1.5)
    assert torch.allclose(capped, t([[-1.5 * 1.1, -0.6]]))


def test_ppo_ewma_with_prox_equal_to_old_is_ppo_clip():
    logp, adv, mask = _batch(6)
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=torch.Generator().manual_seed(7), dtype=F64)
    matrix, _ = POLICY_LOSSES.get("ppo_ewma")(logp, old, adv, mask, old)
    ppo, _ = ppo_clip_loss(logp, old, adv, mask)
    assert torch.equal(matrix, ppo)


def test_dppo_ratio_deviation_drops_far_ratios():
    # |rho - 1| <= 0.3 keeps t0 (1.0), t1 (1.15), t4 (0.75); drops t2 (1.4), t3 (0.6)
    # kept, A = 1, eps 0.2: t0 -1, t1 -1.15, t4 max(-0.75, -0.8) = -0.75
    logp = ratio_logp([[1.0, 1.15, 1.4, 0.6, 0.75]])
    matrix, metrics = POLICY_LOSSES.get("dppo")(logp, torch.full_like(logp, OLD), torch.ones(1, 5, dtype=F64), ONES5)
    assert torch.allclose(matrix, t([[-1.0, -1.15, 0.0, 0.0, -0.75]]))
    assert torch.allclose(grad(matrix, logp), t([[-1.0, -1.15, 0.0, 0.0, -0.75]]))
    assert metrics["dropped_fraction"] == pytest.approx(0.4)


def test_dppo_surrogate_variance_rule():
    # rho = 1, A = [0, 0, 0, 0, 10]: surrogate = A, mean 2, squared deviations [4, 4, 4, 4, 64]
    # drop floor(0.2 * 5) = 1 token: t4
    logp = ratio_logp([[1.0] * 5])
    adv = t([[0.0, 0.0, 0.0, 0.0, 10.0]])
    matrix, _ = POLICY_LOSSES.get("dppo")(logp, logp.detach(), adv, ONES5, rule="surrogate_variance", drop_fraction=0.2)
    assert torch.all(matrix == 0) and torch.all(grad(matrix, logp) == 0)
    with pytest.raises(ValueError, match="rule"):
        POLICY_LOSSES.get("dppo")(logp, logp.detach(), adv, ONES5, rule="bound")


# ------------------------------------------------------------------------------------------------
# DeGRPO
# ------------------------------------------------------------------------------------------------

DEGRPO_MASK = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])  # |R_0| = 2, |R_1| = 4 response tokens after the control token


def test_degrpo_weights_and_aggregation():
    # ratio 1: l_t = -A. Matrix = -A * (alpha on the control token, 1/|R_i| on the rest)
    # seq_mean_token_sum: (1/2) sum_i (alpha (-A_i) + (-A_i))
    logp = ratio_logp([[1.0] * 5] * 2)
    adv = t([[1.0] * 5, [-0.5] * 5]) * DEGRPO_MASK
    alpha = 0.3
    matrix, metrics = POLICY_LOSSES.get("degrpo")(logp, logp.detach(), adv, DEGRPO_MASK, alpha=alpha)
    expected = t([[-alpha, -0.5, -0.5, 0, 0], [0.5 * alpha, 0.125, 0.125, 0.125, 0.125]])
    assert torch.allclose(matrix, expected)
    assert torch.allclose(grad(matrix, logp), expected)  # control gradient alpha * -A: independent of length
    loss = seq_mean_token_sum(matrix, DEGRPO_MASK, batch_sequences=2)
    assert loss.item() == pytest.approx(0.5 * ((-alpha - 1.0) + (0.5 * alpha + 0.5)))
    assert metrics["control_loss"] == pytest.approx((-1.0 + 0.5) / 2)


def test_degrpo_alpha_one_equal_lengths_is_mean_control_plus_mean_response():
    g = torch.Generator().manual_seed(8)
    mask = torch.ones(3, 4, dtype=F64)
    old = -torch.rand(3, 4, generator=g, dtype=F64)
    logp = (old + 0.1 * torch.randn(3, 4, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(3, 1, generator=g, dtype=F64).expand(3, 4)
    matrix, _ = POLICY_LOSSES.get("degrpo")(logp, old, adv, mask, alpha=1.0)
    token, _ = ppo_clip_loss(logp, old, adv, mask)
    loss = seq_mean_token_sum(matrix, mask, batch_sequences=3)
    assert loss.item() == pytest.approx((token[:, 0].mean() + token[:, 1:].mean()).item())


def test_degrpo_control_mask_and_left_padding():
    # default control token = first response token even with left padding (row 0 starts at t = 2)
    mask = t([[0, 0, 1, 1, 1]])
    logp = ratio_logp([[1.0] * 5])
    adv = torch.ones(1, 5, dtype=F64) * mask
    default, _ = POLICY_LOSSES.get("degrpo")(logp, logp.detach(), adv, mask, alpha=0.1)
    assert torch.allclose(default, t([[0, 0, -0.1, -0.5, -0.5]]))
    control = t([[0, 0, 0, 1, 0]])  # explicit control token at t = 3
    explicit, _ = POLICY_LOSSES.get("degrpo")(logp, logp.detach(), adv, mask, control_mask=control, alpha=0.1)
    assert torch.allclose(explicit, t([[0, 0, -0.5, -0.1, -0.5]]))


# ------------------------------------------------------------------------------------------------
# REC, OPMD, AsymRE
# ------------------------------------------------------------------------------------------------


def test_rec_one_side_mask_is_exactly_the_ppo_frozen_tokens():
    g = torch.Generator().manual_seed(9)
    old = -torch.rand(4, 8, generator=g, dtype=F64)
    delta = torch.randn(4, 8, generator=g, dtype=F64) * 0.4
    adv = torch.randn(4, 8, generator=g, dtype=F64)
    mask = torch.ones(4, 8, dtype=F64)
    ppo_logp = (old + delta).requires_grad_()
    ppo, _ = ppo_clip_loss(ppo_logp, old, adv, mask)
    frozen = grad(ppo, ppo_logp) == 0
    logp = (old + delta).requires_grad_()
    matrix, metrics = POLICY_LOSSES.get("rec")(logp, old, adv, mask, clip_mode="one_side")
    rec_frozen = grad(matrix, logp) == 0
    assert frozen.any() and torch.equal(rec_frozen, frozen)
    assert torch.allclose(grad(matrix, logp)[~frozen], -adv[~frozen])  # NoIS: -A on kept tokens
    assert metrics["masked_fraction"] == pytest.approx(frozen.double().mean().item())


def test_rec_two_side_mask_and_importance_weight():
    # ratios [0.5, 0.9, 1.1, 1.5], A = [1, -1, 2, -1]; two_side keeps 0.9 and 1.1
    # importance weighting: grad = -sg(rho) A on kept tokens = [0, 0.9, -2.2, 0]
    logp = ratio_logp([[0.5, 0.9, 1.1, 1.5]])
    adv = t([[1.0, -1.0, 2.0, -1.0]])
    matrix, _ = POLICY_LOSSES.get("rec")(logp, torch.full_like(logp, OLD), adv, torch.ones(1, 4, dtype=F64),
                                         clip_mode="two_side", weighting="importance")
    assert torch.allclose(grad(matrix, logp), t([[0.0, 0.9, -2.2, 0.0]]))
    assert torch.allclose(matrix, t([[0.0, 0.9, -2.2, 0.0]]) * logp.detach())
    with pytest.raises(ValueError, match="clip_mode"):
        POLICY_LOSSES.get("rec")(logp, logp.detach(), adv, torch.ones(1, 4, dtype=F64), clip_mode="bogus")


# the ring on a grid of rho (columns) and A (rows), e_l = e_h = 0.2, e_l' = 0.6, e_h' = 2: the band is
# [0.8, 1.2]; A >= 0 also keeps rho <= 0.4, A <= 0 also keeps rho >= 3 (every bound inclusive)
RING_RHO = [0.3, 0.4, 0.5, 0.8, 1.0, 1.2, 2.0, 3.0, 4.0]
RING_KEEP = {
    -1.0: [0, 0, 0, 1, 1, 1, 0, 1, 1],
    0.0: [1, 1, 0, 1, 1, 1, 0, 1, 1],
    1.0: [1, 1, 0, 1, 1, 1, 0, 0, 0],
}


def test_rec_ring_mask_on_a_grid_with_its_boundaries():
    rho = t([RING_RHO] * 3)
    adv = t([[a] * len(RING_RHO) for a in RING_KEEP])
    keep = rec_keep_mask(rho, adv, "ring", 0.2, 0.2, 0.6, 2.0)
    assert torch.equal(keep, t(list(RING_KEEP.values())).bool())
    # through the loss (NoIS): grad = -A on kept tokens, 0 on dropped ones; of the 27 tokens
    # 4 + 2 + 4 = 10 are dropped (masked_fraction)
    logp = ratio_logp([RING_RHO] * 3)
    matrix, metrics = POLICY_LOSSES.get("rec")(logp, torch.full_like(logp, OLD), adv, torch.ones_like(adv),
                                               clip_mode="ring")
    assert torch.allclose(grad(matrix, logp), -adv * keep)
    assert metrics["masked_fraction"] == pytest.approx(10 / 27)


def test_rec_ring_with_everything_in_the_band_is_the_plain_rec_loss():
    # clip_low = 1 and a huge clip_high put every ratio in the band: the mask is all ones and the loss is
    # exactly clip_mode none's, which is exactly REINFORCE's -A logp
    logp, adv, mask = _batch(seed=4)
    old = logp.detach() + torch.randn(logp.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    ring, _ = POLICY_LOSSES.get("rec")(logp, old, adv, mask, clip_mode="ring", clip_low=1.0, clip_high=1e9)
    plain, _ = POLICY_LOSSES.get("rec")(logp, old, adv, mask)
    reinforce, _ = POLICY_LOSSES.get("reinforce")(logp, adv, mask)
    assert torch.equal(ring, plain) and torch.equal(plain, reinforce)
    assert torch.equal(grad(ring, logp), grad(reinforce, logp))


def test_rec_advantage_weighting():
    # A' = A exp(A / temp): A = [-1, 0, 2], temp 1 -> [-e^-1, 0, 2 e^2]; temp 2 -> [-e^-0.5, 0, 2 e]
    adv = t([[-1.0, 0.0, 2.0]])
    assert torch.allclose(advantage_weighted(adv), t([[-math.exp(-1), 0.0, 2 * math.exp(2)]]))
    assert torch.allclose(advantage_weighted(adv, 2.0), t([[-math.exp(-0.5), 0.0, 2 * math.e]]))
    # in the loss at ratio 1: l = -A' logp, grad -A'; weighting none keeps -A
    logp = t([[-0.5, -1.0, -2.0]]).requires_grad_()
    mask = torch.ones(1, 3, dtype=F64)
    weighted, _ = POLICY_LOSSES.get("rec")(logp, logp.detach(), adv, mask, weighting="advantage", temp=2.0)
    assert torch.allclose(grad(weighted, logp), t([[math.exp(-0.5), 0.0, -2 * math.e]]))
    plain, _ = POLICY_LOSSES.get("rec")(logp, logp.detach(), adv, mask, weighting="none", temp=2.0)
    assert torch.equal(grad(plain, logp), -adv)
    # the weighting acts at ratio 1, so rec with it declares no ratio-only term; the mask options do
    needs = POLICY_LOSSES.needs("rec")
    assert needs.ratio_term({"weighting": "advantage"}) is None
    assert "mask" in needs.ratio_term({"weighting": "none", "clip_mode": "ring"})


@pytest.mark.parametrize("params, match", [
    ({"clip_mode": "rings"}, "clip_mode"), ({"weighting": "adv"}, "weighting"),
    ({"clip_low_prime": 1.5}, "clip_low_prime"), ({"temp": 0.0}, "temp"),
])
def test_rec_bad_settings_are_config_errors(params, match):
    with pytest.raises(ConfigError, match=match):
        check_rec(params)


def test_opmd_regulariser():
    # l = -A logp + (tau/2) (logp - old)^2 ; grad = -A + tau (logp - old); 0 extra gradient at logp = old
    old = t([[-1.0, -2.0]])
    logp = (old + t([[0.3, 0.0]])).requires_grad_()
    adv = t([[1.0, -1.0]])
    matrix, _ = POLICY_LOSSES.get("opmd")(logp, old, adv, torch.ones(1, 2, dtype=F64), tau=2.0)
    assert torch.allclose(matrix, -adv * logp.detach() + t([[0.09, 0.0]]))
    assert torch.allclose(grad(matrix, logp), t([[-1.0 + 0.6, 1.0]]))


def test_asymre_lowered_baseline():
    # A' = A + delta = [1.1, -0.9]; l = -A' logp; grad -A'
    logp = t([[-0.5, -2.0]]).requires_grad_()
    adv = t([[1.0, -1.0]])
    matrix, _ = POLICY_LOSSES.get("asymre")(logp, logp.detach(), adv, torch.ones(1, 2, dtype=F64), baseline_shift=0.1)
    assert torch.allclose(matrix, t([[1.1 * -0.5 * -1, -0.9 * -2.0 * -1]]))
    assert torch.allclose(grad(matrix, logp), t([[-1.1, 0.9]]))


def test_sequence_mean_helper():
    values = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert torch.allclose(sequence_mean(values, mask), t([2.0, 4.0, 0.0]))


def test_token_counts_are_robust_to_float_error():
    # 0.29 * 100 = 28.999999999999996 in floating point: still 29 tokens
    logp = torch.zeros(1, 100, dtype=F64, requires_grad=True)
    adv = torch.arange(100, dtype=F64)[None] / 100
    matrix, metrics = POLICY_LOSSES.get("kl_cov")(logp, logp.detach() - 0.1, adv, torch.ones(1, 100, dtype=F64), kl_cov_ratio=0.29)
    assert metrics["kl_cov_fraction"] == pytest.approx(0.29)


def test_is_surrogate_is_the_unclipped_ratio_times_advantage():
    # rho = [2, .5, 3], A = [1, -1, 2], last token padding: l = -rho A = [-2, .5, 0]; no clip at rho = 2
    logp = ratio_logp([[2.0, 0.5, 3.0]])
    matrix, metrics = call("is_surrogate", inputs(logp, torch.full_like(logp, OLD), t([[1.0, -1.0, 2.0]]), t([[1.0, 1.0, 0.0]])))
    assert torch.allclose(matrix, t([[-2.0, 0.5, 0.0]]))
    # d l / d logp = -rho A
    assert torch.allclose(grad(matrix, logp), t([[-2.0, 0.5, 0.0]]))
    assert metrics["ratio_mean"] == pytest.approx(1.25)
