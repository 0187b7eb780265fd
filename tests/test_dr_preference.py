"""DRPO, doubly robust preference optimisation (rlbench/algorithm/losses/doubly_robust.py, arXiv:2506.01183):
the estimate stays unbiased when either the preference model or the behaviour policy of the weights is right
(a simulated bandit, Monte-Carlo mean against the exact total preference), where the direct method is biased;
the loss on a group against its closed form; the preset composes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import algorithm_from, compose_config

from rlbench.algorithm.aggregation import group_mean
from rlbench.algorithm.losses.doubly_robust import (
    bradley_terry_preferences,
    dr_preference_loss,
    group_estimate,
    oracle_preferences,
)
from rlbench.errors import ConfigError
from rlbench.validation import validate_config

# A 4-armed bandit: the groups are drawn from the behaviour policy MU, the target is PI; the true preference P
# is intransitive (arms 0 > 1 > 2 > 0), so no Bradley-Terry model is right.
MU = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
PI = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
SKEW = torch.tensor([[0.0, 1.0, -1.0, 0.5], [-1.0, 0.0, 1.0, -0.5], [1.0, -1.0, 0.0, 0.25], [-0.5, 0.5, -0.25, 0.0]],
                    dtype=torch.float64)
P = 0.5 + 0.4 * SKEW                                                     # P[a, b] = P(arm a beats arm b)
WRONG_MODEL = bradley_terry_preferences(torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64), 1.0)
WRONG_BEHAVIOUR = torch.full((4,), 0.25, dtype=torch.float64)
TRUTH = float(PI @ P @ MU)                                               # psi = E_{y~pi, y'~mu} P(y > y')


def simulate(groups=20000, n=4, seed=0):
    """Arms [G, n] drawn from MU and labels [G, n, n] drawn from P (z_ba = 1 - z_ab)."""
    gen = torch.Generator().manual_seed(seed)
    arms = torch.multinomial(MU, groups * n, replacement=True, generator=gen).view(groups, n)
    draws = (torch.rand(groups, n, n, generator=gen, dtype=torch.float64) < P[arms[:, :, None], arms[:, None, :]]).double()
    upper = torch.triu(torch.ones(n, n, dtype=torch.float64), 1)
    labels = draws * upper + (1 - draws.transpose(1, 2)) * upper.T
    return arms, labels


def estimates(arms, labels, model, behaviour, residual=True):
    """Per group psi_hat with the model matrix ``model`` [4,4] and the weights' behaviour policy ``behaviour`` [4];
    ``residual=False``: the direct method alone (labels replaced by the model, so the correction is 0)."""
    g = model[arms[:, :, None], arms[:, None, :]]
    return group_estimate(PI.log()[arms], MU.log()[arms], behaviour.log()[arms], labels if residual else g, g, clip=None)


def standard_error(values):
    return float(values.std() / math.sqrt(values.numel()))


def test_dr_estimate_is_unbiased_when_either_the_model_or_the_behaviour_is_right_and_the_direct_method_is_not():
    arms, labels = simulate()
    cases = {
        "model wrong, behaviour right": estimates(arms, labels, WRONG_MODEL, MU),
        "model right, behaviour wrong": estimates(arms, labels, P, WRONG_BEHAVIOUR),
    }
    for name, values in cases.items():
        assert abs(float(values.mean()) - TRUTH) < 4 * standard_error(values), (name, float(values.mean()), TRUTH)
    direct = estimates(arms, labels, WRONG_MODEL, MU, residual=False)
    bias = float(direct.mean()) - TRUTH
    assert abs(bias) > 0.05 and abs(bias) > 10 * standard_error(direct), bias
    # and the correction does need one of the two: both wrong is biased too
    both_wrong = estimates(arms, labels, WRONG_MODEL, WRONG_BEHAVIOUR)
    assert abs(float(both_wrong.mean()) - TRUTH) > 10 * standard_error(both_wrong)


def test_the_direct_method_is_unbiased_with_the_right_model():
    arms, labels = simulate(seed=1)
    direct = estimates(arms, labels, P, MU, residual=False)
    assert abs(float(direct.mean()) - TRUTH) < 4 * standard_error(direct)


def test_two_responses_give_the_papers_doubled_pair_estimate():
    gen = torch.Generator().manual_seed(3)
    policy, sampler, behaviour = (torch.randn(2, generator=gen, dtype=torch.float64) for _ in range(3))
    z, g = 1.0, 0.7
    labels = torch.tensor([[0.5, z], [1 - z, 0.5]], dtype=torch.float64)
    model = torch.tensor([[0.5, g], [1 - g, 0.5]], dtype=torch.float64)
    rho, w = (policy - sampler).exp(), (policy - behaviour).exp()
    # 1/2 [E_pi g(y, y_2) + w_1 (z - g_12)] + 1/2 [E_pi g(y, y_1) + w_2 ((1 - z) - g_21)], E_pi by the other response
    expected = 0.5 * (rho[0] * g + w[0] * (z - g)) + 0.5 * (rho[1] * (1 - g) + w[1] * ((1 - z) - (1 - g)))
    assert float(group_estimate(policy, sampler, behaviour, labels, model, clip=None)) == pytest.approx(float(expected))


def group_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(5, 3, generator=gen) * 2).requires_grad_()
    mask = torch.ones(5, 3)
    mask[2, 1:] = 0
    return logp, mask, torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9]), torch.tensor([0, 0, 0, 1, 1])


def test_loss_at_the_sampler_is_minus_the_mean_oracle_preference_with_its_gradient():
    """At pi_theta = pi_old = pi_ref with the sampler as the behaviour, the model cancels: psi_hat = mean_{a != b} z_ab
    (1/2 by symmetry), and d psi_hat / d L(y_a) = sum_{b != a} z_ab / (n (n - 1)); the KL term is 0 with gradient 0."""
    logp, mask, rewards, groups = group_inputs()
    matrix, metrics = dr_preference_loss(logp, logp.detach(), logp.detach(), mask, rewards, groups,
                                         behaviour="sampler", preference_temperature=0.3)
    loss = group_mean(matrix, mask, batch_groups=2)
    assert loss.item() == pytest.approx(-0.5, rel=1e-6) and metrics["dr_preference_estimate"] == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.zeros(5)
    for rows in ([0, 1, 2], [3, 4]):
        n = len(rows)
        z = oracle_preferences(rewards[rows]).fill_diagonal_(0).sum(1) / (n * (n - 1))
        expected[rows] = -z / 2  # two groups
    assert torch.allclose(grad, expected[:, None] * mask, atol=1e-6)


def test_loss_with_the_reference_as_behaviour_matches_the_estimate_and_the_kl():
    logp, mask, rewards, groups = group_inputs(seed=1)
    old = logp.detach() + 0.1 * torch.randn(5, 3, generator=torch.Generator().manual_seed(4))
    ref = logp.detach() - 0.2
    beta, temperature = 0.04, 0.5
    matrix, _ = dr_preference_loss(logp, old, ref, mask, rewards, groups, beta=beta, preference_temperature=temperature,
                                   behaviour="reference", is_clip=None)
    total = 0.0
    for rows in ([0, 1, 2], [3, 4]):
        policy, sampler, reference = ((x[rows] * mask[rows]).sum(-1) for x in (logp, old, ref))
        r = rewards[rows]
        psi = group_estimate(policy, sampler, reference, oracle_preferences(r), bradley_terry_preferences(r, temperature), None)
        diff = ref[rows] - logp[rows]
        kl = ((policy - sampler).exp() * ((diff.exp() - diff - 1) * mask[rows]).sum(-1)).mean()  # weighted by rho
        total = total + (-psi + beta * kl)
    assert group_mean(matrix, mask, batch_groups=2).item() == pytest.approx(float(total.detach()) / 2, rel=1e-5)


def test_responses_the_sampler_did_not_draw_are_taken_as_drawn_by_the_reference():
    """rollout=offline: behaviour log-prob 0 and every token off-policy; the Monte-Carlo and the sampler weights
    then use pi_ref, as if old_logp were the reference's."""
    logp, mask, rewards, groups = group_inputs(seed=2)
    ref = logp.detach() - 0.3
    for behaviour in ("reference", "sampler"):
        offline, _ = dr_preference_loss(logp, torch.zeros_like(ref), ref, mask, rewards, groups, behaviour=behaviour,
                                        off_policy=torch.ones_like(ref))
        as_reference, _ = dr_preference_loss(logp, ref, ref, mask, rewards, groups, behaviour=behaviour)
        assert torch.allclose(offline, as_reference)


def test_bad_knobs_are_refused():
    logp, mask, rewards, groups = group_inputs()
    with pytest.raises(ConfigError, match="behaviour must be one of"):
        dr_preference_loss(logp, logp.detach(), logp.detach(), mask, rewards, groups, behaviour="pi_ref")
    with pytest.raises(ConfigError, match="preference_temperature must be > 0"):
        dr_preference_loss(logp, logp.detach(), logp.detach(), mask, rewards, groups, preference_temperature=0)


def test_preset_composes_reads_whole_groups_and_loads_a_reference(tmp_path):
    algorithm = algorithm_from(compose_config(["algorithm=dr_preference"], tmp_path).algorithm)
    assert algorithm.loss_reads_whole_groups and algorithm.needs_reference


@pytest.mark.parametrize("override,named", [
    ("algorithm.loss.behaviour=pi_ref", "behaviour must be one of"),
    ("algorithm.loss.preference_temperature=0", "preference_temperature must be > 0"),
    ("algorithm.loss.is_clip=0", "is_clip must be > 0"),
    ("algorithm.loss.beta=-0.1", "beta must be >= 0"),
])
def test_bad_knobs_are_refused_before_anything_loads(make_cfg, override, named):
    validate_config(make_cfg("experiment=smoke", "algorithm=dr_preference"))
    with pytest.raises(ConfigError, match=named):
        validate_config(make_cfg("experiment=smoke", "algorithm=dr_preference", override))
