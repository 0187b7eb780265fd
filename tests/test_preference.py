"""The pairwise preference losses (rlbench/algorithm/losses/preference.py): the pairs a group gives, each loss
against its closed form, the mean over groups, and the update that keeps a group in one micro-batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import algorithm_from, compose_config
from rlbench.algorithm.aggregation import group_mean
from rlbench.algorithm.losses.preference import dpo_loss, ipo_loss, preference_pairs, simpo_loss
from rlbench.errors import ConfigError
from rlbench.training.batch import group_minibatches, whole_group_chunks

# two groups: group 0 rewards 1, 0, 0.5 (rows 0-2); group 1 all tied (rows 3-4): no pair
REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1])


def pairs(pairing, rewards=REWARDS, groups=GROUPS):
    winners, losers, weights = preference_pairs(rewards, groups, pairing)
    return sorted(zip(winners.tolist(), losers.tolist())), weights.tolist()


def test_pairs_of_each_pairing_and_no_pair_from_ties():
    assert pairs("best_worst") == ([(0, 1)], [1.0])
    found, weights = pairs("all")
    assert found == [(0, 1), (0, 2), (2, 1)] and weights == pytest.approx([1 / 3] * 3)
    assert pairs("adjacent")[0] == [(0, 2), (2, 1)]
    # levels 1 > 0.5 > 0 with a tie at the top: every response of a level against every one of the next
    found, _ = pairs("adjacent", torch.tensor([1.0, 1.0, 0.5, 0.0]), torch.zeros(4, dtype=torch.long))
    assert found == [(0, 2), (1, 2), (2, 3)]
    # the first of tied best and tied worst responses is taken
    assert pairs("best_worst", torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long))[0] == [(1, 0)]
    with pytest.raises(ValueError, match="pairing must be one of"):
        preference_pairs(REWARDS, GROUPS, "random")


def batch_terms(seed=0, rows=5, tokens=4):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(rows, tokens, generator=gen) * 2).requires_grad_()
    ref = -torch.rand(rows, tokens, generator=gen) * 2
    mask = torch.ones(rows, tokens)
    mask[1, 2:] = 0  # a shorter loser
    return logp, ref, mask


def test_dpo_matches_its_closed_form_value_and_gradient():
    logp, ref, mask = batch_terms()
    beta = 0.1
    matrix, metrics = dpo_loss(logp, ref, mask, REWARDS, GROUPS, beta=beta, pairing="all")
    loss = group_mean(matrix, mask, batch_groups=2)
    delta = ((logp - ref) * mask).sum(-1)
    expected = sum(-F.logsigmoid(beta * (delta[w] - delta[lo])) for w, lo in [(0, 1), (0, 2), (2, 1)]) / 3 / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["preference_accuracy"] == pytest.approx(float(sum(delta[w] > delta[lo] for w, lo in [(0, 1), (0, 2), (2, 1)])) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/d logp_0t = -(1/2)(1/3) beta [sigma(-beta z_01) + sigma(-beta z_02)] on every token of response 0
    z = lambda w, lo: beta * (delta[w] - delta[lo]).detach()  # noqa: E731
    g0 = -(beta / 6) * (torch.sigmoid(-z(0, 1)) + torch.sigmoid(-z(0, 2)))
    assert torch.allclose(grad[0], g0.expand(4), atol=1e-7)
    g1 = (beta / 6) * (torch.sigmoid(-z(0, 1)) + torch.sigmoid(-z(2, 1)))  # the loser: pushed down, masked tokens 0
    assert torch.allclose(grad[1], torch.stack([g1, g1, torch.tensor(0.0), torch.tensor(0.0)]), atol=1e-7)
    assert torch.count_nonzero(grad[3:]) == 0  # the tied group gives no gradient


def test_ipo_is_minimised_where_the_log_ratio_gap_is_one_over_two_tau():
    tau = 0.25
    logp, ref, mask = batch_terms(rows=2)
    groups, rewards = torch.zeros(2, dtype=torch.long), torch.tensor([1.0, 0.0])
    # set the winner's log-ratio sum exactly 1/(2 tau) = 2 above the loser's
    with torch.no_grad():
        gap = ((logp - ref) * mask).sum(-1)
        logp[0, 0] += 2.0 - (gap[0] - gap[1])
    matrix, metrics = ipo_loss(logp, ref, mask, rewards, groups, tau=tau)
    loss = group_mean(matrix, mask, batch_groups=1)
    assert loss.item() == pytest.approx(0.0, abs=1e-10)
    assert metrics["preference_margin"] == pytest.approx(2.0, abs=1e-5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.abs().max().item() < 1e-5
    matrix, _ = ipo_loss(logp.detach() + torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]), ref, mask, rewards, groups, tau=tau)
    assert group_mean(matrix, mask, batch_groups=1).item() == pytest.approx(1.0, rel=1e-5)  # (3 - 2)^2


def test_simpo_is_reference_free_and_length_normalised():
    logp, _, mask = batch_terms(rows=2)
    groups, rewards = torch.zeros(2, dtype=torch.long), torch.tensor([0.0, 1.0])  # row 1 is preferred
    beta, gamma = 2.0, 0.5
    matrix, _ = simpo_loss(logp, mask, rewards, groups, beta=beta, gamma=gamma)
    s = (logp * mask).sum(-1) / mask.sum(-1)
    expected = -F.logsigmoid(beta * (s[1] - s[0]) - gamma)
    assert group_mean(matrix, mask, batch_groups=1).item() == pytest.approx(expected.item(), rel=1e-6)
    # repeating every response's tokens (same mean log-likelihood) leaves the loss unchanged
    doubled, _ = simpo_loss(logp.repeat(1, 2), mask.repeat(1, 2), rewards, groups, beta=beta, gamma=gamma)
    assert group_mean(doubled, mask.repeat(1, 2), batch_groups=1).item() == pytest.approx(expected.item(), rel=1e-6)


def test_micro_batches_of_whole_groups_add_up_to_the_full_batch_loss():
    gen = torch.Generator().manual_seed(3)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    rewards = torch.rand(9, generator=gen)
    logp, ref = -torch.rand(9, 5, generator=gen), -torch.rand(9, 5, generator=gen)
    mask = torch.ones(9, 5)
    full = group_mean(dpo_loss(logp, ref, mask, rewards, groups, pairing="all")[0], mask, batch_groups=3)
    chunks = whole_group_chunks(torch.arange(9), groups, 4)
    assert [c.tolist() for c in chunks] == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]  # 3 + 2 > 4: no group is cut
    parts = sum(
        group_mean(dpo_loss(logp[c], ref[c], mask[c], rewards[c], groups[c], pairing="all")[0], mask[c], batch_groups=3)
        for c in chunks
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_mini_batches_are_whole_groups_seeded_and_cover_the_batch():
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    splits = group_minibatches(groups, 2, torch.Generator().manual_seed(0))
    again = group_minibatches(groups, 2, torch.Generator().manual_seed(0))
    assert [s.tolist() for s in splits] == [s.tolist() for s in again]
    assert sorted(torch.cat(splits).tolist()) == list(range(8))
    for split in splits:
        for g in torch.unique(groups[split]).tolist():
            assert set((groups == g).nonzero().squeeze(-1).tolist()) <= set(split.tolist())
    assert len(splits) == 2 and all(len(torch.unique(groups[s])) == 2 for s in splits)


@pytest.mark.parametrize("preset,reference", [("dpo", True), ("ipo", True), ("simpo", False)])
def test_presets_compose_and_load_a_reference_only_when_the_loss_reads_it(tmp_path, preset, reference):
    cfg = compose_config([f"algorithm={preset}"], tmp_path)
    algorithm = algorithm_from(cfg.algorithm)
    assert algorithm.loss_reads_whole_groups and algorithm.needs_reference is reference


@pytest.mark.parametrize("override,named", [
    ({"kl": {"coef": 0.05}}, "algorithm.kl.coef > 0"),
    ({"entropy_coef": 0.01}, "algorithm.entropy_coef > 0"),
    ({"update": {"schedule": "sfpo"}}, "algorithm.update.schedule=sfpo"),
])
def test_terms_that_change_the_pairwise_objective_are_refused(tmp_path, override, named):
    from omegaconf import OmegaConf

    cfg = compose_config(["algorithm=dpo"], tmp_path)
    values = OmegaConf.merge(cfg.algorithm, override)
    with pytest.raises(ConfigError, match="pairwise preference loss") as raised:
        algorithm_from(values)
    assert named in str(raised.value)


def test_the_aggregation_must_be_the_mean_over_groups(tmp_path):
    cfg = compose_config(["algorithm=dpo", "algorithm/aggregation=token_mean"], tmp_path)
    with pytest.raises(ConfigError, match="group_mean"):
        algorithm_from(cfg.algorithm)


def test_dpo_loss_at_the_reference_is_log_two():
    logp, _, mask = batch_terms(rows=2)
    matrix, metrics = dpo_loss(logp, logp.detach(), mask, torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long))
    assert group_mean(matrix, mask, batch_groups=1).item() == pytest.approx(math.log(2), rel=1e-6)
    assert metrics["preference_accuracy"] == 0.0  # margin exactly 0: not yet ranked right


# ------------------------------------------------------------------ TRPA, INPO, PRO, REBEL, CoPG, P3O

from rlbench.algorithm.losses.preference import inpo_loss, pro_loss, trpa_loss  # noqa: E402
from rlbench.algorithm.losses.relative_rewards import copg_loss, p3o_loss, rebel_loss  # noqa: E402

TWO = torch.zeros(2, dtype=torch.long)


def total(matrix, mask, groups=1):
    return group_mean(matrix, mask, batch_groups=groups)


def test_trpa_equals_online_dpo_with_equal_betas_and_the_reference_as_pi_old():
    logp, ref, mask = batch_terms()
    for pairing in ("best_worst", "all", "adjacent"):
        trpa, _ = trpa_loss(logp, ref, ref, mask, REWARDS, GROUPS, beta_win=0.3, beta_lose=0.3, pairing=pairing)
        dpo, _ = dpo_loss(logp, ref, mask, REWARDS, GROUPS, beta=0.3, pairing=pairing)
        assert total(trpa, mask, 2).item() == pytest.approx(total(dpo, mask, 2).item(), rel=1e-6)
    # anisotropic weights: the loss moves the winner up and the loser down (gradient signs)
    matrix, _ = trpa_loss(logp, logp.detach(), ref, mask, REWARDS, GROUPS, beta_win=0.5, beta_lose=0.1, pairing="best_worst")
    (grad,) = torch.autograd.grad(total(matrix, mask, 2), logp)
    assert (grad[0] < 0).all() and (grad[1, :2] > 0).all()  # descent raises log pi(y_w), lowers log pi(y_l)
    # the KL term adds lambda (KL(y_w) + KL(y_l)) / 2 per pair
    with_kl, _ = trpa_loss(logp, logp.detach(), ref, mask, REWARDS, GROUPS, kl_coef=2.0, pairing="best_worst")
    without, _ = trpa_loss(logp, logp.detach(), ref, mask, REWARDS, GROUPS, pairing="best_worst")
    k3 = lambda row: ((torch.exp(ref[row] - logp[row]) - (ref[row] - logp[row]) - 1) * mask[row]).sum()  # noqa: E731
    added = total(with_kl, mask, 2) - total(without, mask, 2)
    assert added.item() == pytest.approx((2.0 * (k3(0) + k3(1)) / 2 / 2).item(), rel=1e-5)


def test_inpo_vanishes_at_the_mirror_descent_step_and_reduces_its_residual():
    eta, tau = 1.0, 0.2
    logp, ref, mask = batch_terms(rows=2)
    old = -torch.rand(2, 4, generator=torch.Generator().manual_seed(5))
    rewards = torch.tensor([1.0, 0.0])
    # the OMD closed form: log pi(y_w)/pi(y_l) = eta tau log ref ratio + (1 - eta tau) log pi_t ratio + eta / 2
    seq = lambda x: (x * mask).sum(-1)  # noqa: E731
    target = eta * tau * (seq(ref)[0] - seq(ref)[1]) + (1 - eta * tau) * (seq(old)[0] - seq(old)[1]) + eta / 2
    with torch.no_grad():
        logp[0, 0] += target - (seq(logp)[0] - seq(logp)[1])
    matrix, _ = inpo_loss(logp, old, ref, mask, rewards, TWO, eta=eta, tau=tau)
    assert total(matrix, mask).item() == pytest.approx(0.0, abs=1e-9)
    (grad,) = torch.autograd.grad(total(matrix, mask), logp)
    assert grad.abs().max().item() < 1e-4


def test_pro_with_two_responses_is_bradley_terry_on_mean_log_likelihood_plus_sft():
    logp, _, mask = batch_terms(rows=2)
    rewards = torch.tensor([0.0, 1.0])  # row 1 ranks first
    matrix, metrics = pro_loss(logp, mask, rewards, TWO, sft_coef=0.05)
    s = (logp * mask).sum(-1) / mask.sum(-1)
    expected = -F.logsigmoid(1.0 * (s[1] - s[0])) - 0.05 * s[1]  # T = 1 / (1 - 0)
    assert total(matrix, mask).item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["preference_margin"] == pytest.approx((s[1] - s[0]).item(), rel=1e-6)


def test_pro_dynamic_temperatures_follow_the_reward_gaps():
    s = torch.tensor([0.3, -0.2, -1.0])
    r = torch.tensor([1.0, 0.5, 0.0])  # sorted best first
    from rlbench.algorithm.losses.preference import plackett_luce_terms

    first = -torch.log_softmax(torch.tensor([0.3 * 1.0, -0.2 * 0.5, -1.0 * 1.0]), 0)[0]  # T_1^1 = min(1/0.5, 1/1) = 1
    second = -torch.log_softmax(torch.tensor([-0.2 * 0.5, -1.0 * 0.5]), 0)[0]  # T_2^2 = T_2^3 = 1/0.5
    assert plackett_luce_terms(s, r).item() == pytest.approx((first + second).item(), rel=1e-6)
    assert plackett_luce_terms(torch.tensor([1.0, 0.0, -1.0]), r) < plackett_luce_terms(torch.tensor([-1.0, 0.0, 1.0]), r)


def test_rebel_is_zero_at_eta_times_the_reward_gap_and_shift_invariant():
    eta = 0.5
    logp, _, mask = batch_terms(rows=2)
    old = -torch.rand(2, 4, generator=torch.Generator().manual_seed(7))
    rewards = torch.tensor([1.0, 0.25])
    change = ((logp - old) * mask).sum(-1)
    with torch.no_grad():
        logp[0, 0] += eta * 0.75 - (change[0] - change[1])
    assert total(rebel_loss(logp, old, mask, rewards, TWO, eta=eta)[0], mask).item() == pytest.approx(0.0, abs=1e-9)
    moved = logp.detach() + 0.3
    a = total(rebel_loss(moved, old, mask, rewards, TWO, eta=eta)[0], mask)
    b = total(rebel_loss(moved, old, mask, rewards + 10.0, TWO, eta=eta)[0], mask)
    assert a.item() == pytest.approx(b.item(), rel=1e-6) and a.item() > 0
    # a tie is a pair too (pairing any): its target is an equal change of both log-likelihoods
    tied, _ = rebel_loss(moved, old, mask, torch.tensor([0.5, 0.5]), TWO, eta=eta)
    gap = (((moved - old) * mask).sum(-1) @ torch.tensor([1.0, -1.0])) / eta
    assert total(tied, mask).item() == pytest.approx(gap.item() ** 2, rel=1e-5)


def test_copg_squared_loss_gradient_is_the_contrastive_policy_gradient():
    beta = 0.2
    logp, ref, mask = batch_terms(rows=2)
    rewards = torch.tensor([1.0, 0.0])
    (grad,) = torch.autograd.grad(total(copg_loss(logp, ref, mask, rewards, TWO, beta=beta)[0], mask), logp)
    drift = ((logp - ref) * mask).sum(-1).detach()
    regularised = rewards - beta * drift
    # CoPG ascent direction (R_theta(y) - R_theta(y')) grad (L(y) - L(y')): +c on y's tokens, -c on y''s
    c = regularised[0] - regularised[1]
    assert torch.allclose(-grad, torch.stack([c * mask[0], -c * mask[1]]), atol=1e-6)
    # finite difference of the loss along a direction agrees with autograd
    direction = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)) * mask
    f = lambda x: total(copg_loss(x, ref, mask, rewards, TWO, beta=beta)[0], mask).double()  # noqa: E731
    h = 1e-3
    numeric = (f(logp.detach() + h * direction) - f(logp.detach() - h * direction)) / (2 * h)
    assert numeric.item() == pytest.approx((grad * direction).sum().item(), rel=1e-2)


@pytest.mark.parametrize("clip", ["separate", "joint"])
def test_p3o_is_shift_invariant_and_its_gradient_at_ratio_one_is_half_the_gap(clip):
    logp, _, mask = batch_terms(rows=2)
    rewards = torch.tensor([1.0, 0.25])
    matrix, metrics = p3o_loss(logp, logp.detach(), mask, rewards, TWO, clip=clip)
    (grad,) = torch.autograd.grad(total(matrix, mask), logp)
    half_gap = 0.5 * 0.75
    assert torch.allclose(grad, torch.stack([-half_gap * mask[0], half_gap * mask[1]]), atol=1e-6)
    old = logp.detach() - 0.05
    a = total(p3o_loss(logp.detach(), old, mask, rewards, TWO, clip=clip)[0], mask)
    b = total(p3o_loss(logp.detach(), old, mask, rewards - 3.0, TWO, clip=clip)[0], mask)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert metrics["preference_margin"] == pytest.approx(0.75)


# ------------------------------------------------------------------ tabular convergence (one-token responses)


def fit_bandit(loss_of, steps=3000, lr=0.05, arms=3, seed=0):
    """Minimise ``loss_of(logp [arms, 1])`` over the logits of a softmax policy on ``arms`` one-token
    responses (every arm is one response of a single group); returns the fitted probabilities."""
    theta = torch.zeros(arms, requires_grad=True)
    with torch.no_grad():
        theta += torch.randn(arms, generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.Adam([theta], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(torch.log_softmax(theta, 0)[:, None]).backward()
        optimizer.step()
    return torch.softmax(theta.detach(), 0)


def test_copg_reaches_the_reference_tilted_by_the_reward_from_uniform_off_policy_pairs():
    beta = 0.5
    rewards = torch.tensor([1.0, 0.4, 0.0])
    ref = torch.log(torch.tensor([[0.2], [0.5], [0.3]]))
    mask, group = torch.ones(3, 1), torch.zeros(3, dtype=torch.long)  # every pair of arms once: uniform data
    fitted = fit_bandit(lambda logp: total(copg_loss(logp, ref, mask, rewards, group, beta=beta)[0], mask))
    target = torch.softmax(ref.squeeze(1) + rewards / beta, 0)
    assert torch.allclose(fitted, target, atol=1e-3)


def test_rebel_round_reaches_pi_t_tilted_by_eta_times_the_reward():
    eta = 0.7
    rewards = torch.tensor([0.0, 1.0, 0.5])
    pi_t = torch.log(torch.tensor([[0.6], [0.1], [0.3]]))
    mask, group = torch.ones(3, 1), torch.zeros(3, dtype=torch.long)
    fitted = fit_bandit(lambda logp: total(rebel_loss(logp, pi_t, mask, rewards, group, eta=eta)[0], mask))
    assert torch.allclose(fitted, torch.softmax(pi_t.squeeze(1) + eta * rewards, 0), atol=1e-3)


def test_dpo_ranks_the_pairs_of_a_bandit_right():
    rewards = torch.tensor([0.0, 1.0, 0.5])
    ref = torch.log(torch.tensor([[0.5], [0.2], [0.3]]))
    mask, group = torch.ones(3, 1), torch.zeros(3, dtype=torch.long)
    fitted = fit_bandit(lambda logp: total(dpo_loss(logp, ref, mask, rewards, group, beta=1.0, pairing="all")[0], mask),
                        steps=500)
    ratio = fitted / ref.squeeze(1).exp()
    assert ratio[1] > ratio[2] > ratio[0]  # the implicit reward log(pi / pi_ref) follows the ranking
