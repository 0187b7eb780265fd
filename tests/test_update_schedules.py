"""Update schedules: TRPO's conjugate gradient, Fisher products and trust-region step, SFPO's
fast/reposition/slow rule and entropy switch, and PPO-EWMA's proximal policy."""

import copy

import pytest
import torch

from conftest import algorithm_from
from rlbench.algorithm.schedules import (
    SFPOSettings,
    SFPOSwitch,
    TRPOSettings,
    conjugate_gradient,
    entropy_zscore,
    ewma_update_,
    interpolate_,
    trust_region_scale,
)
from rlbench.errors import ConfigError
from rlbench.training.forward import batch_outputs, token_outputs
from rlbench.training.update import standard_update
from rlbench.training.update_schedules import (
    EWMAPolicy,
    UpdateState,
    _TrustRegionProblem,
    make_update_state,
    sfpo_update,
    trpo_update,
)

from test_trainer import prepared_batch, tiny_lm


def algorithm_with(loss="ppo_clip", aggregation="token_mean", **update):
    return algorithm_from({
        "name": "t", "advantage": {"name": "grpo"}, "loss": {"name": loss}, "aggregation": {"name": aggregation},
        "update": update,
    })


def parameters_of(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def stored_batch(algorithm, model, seed=0):
    batch = prepared_batch(algorithm, seed)
    batch.old_logp = batch_outputs(model, batch, micro_batch_size=5, temperature=1.0).logp
    return batch


UPDATE = dict(micro_batch_size=5, max_grad_norm=None, temperature=1.0, norm_length=6)
TRPO_UPDATE = {**UPDATE, "micro_batch_size": 12}  # one micro-batch: each Fisher product is a double backward


# ------------------------------------------------------------------------------------------------ TRPO


def test_conjugate_gradient_solves_a_small_spd_system():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(10, 10, generator=g, dtype=torch.float64)
    a = m @ m.T + 0.5 * torch.eye(10, dtype=torch.float64)
    b = torch.randn(10, generator=g, dtype=torch.float64)
    x = conjugate_gradient(lambda v: a @ v, b, iterations=10)
    assert torch.allclose(x, torch.linalg.solve(a, b), atol=1e-6)
    assert torch.count_nonzero(conjugate_gradient(lambda v: a @ v, torch.zeros(10, dtype=torch.float64), 10)) == 0


def test_trust_region_scale_meets_the_quadratic_kl_model():
    # s^T F s = 8, delta = .01 -> beta = sqrt(.02 / 8) = .05; then .5 beta^2 s^T F s = delta
    beta = trust_region_scale(8.0, 0.01)
    assert beta == pytest.approx(0.05)
    assert 0.5 * beta**2 * 8.0 == pytest.approx(0.01)
    assert trust_region_scale(0.0, 0.01) == 0.0


def _problem(algorithm, model, batch):
    return _TrustRegionProblem(model, batch, algorithm, micro_batch_size=6, temperature=1.0, norm_length=6, progress=0.0)


def test_fisher_vector_product_is_the_kl_hessian():
    """F v against central differences of grad KL(pi_old || pi_theta) along v, plus symmetry and
    positive semi-definiteness (the model is float64, so the differences are accurate)."""
    model = tiny_lm().double()
    algorithm = algorithm_with(loss="is_surrogate", schedule="trpo")
    batch = stored_batch(algorithm, model)
    problem = _problem(algorithm, model, batch)
    problem.loss_gradient()  # stores pi_old over the vocabulary
    g = torch.Generator().manual_seed(1)
    n = sum(p.numel() for p in problem.params)
    u, v = (torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2))
    fv, fu = problem.fisher_vector_product(v, 0.0), problem.fisher_vector_product(u, 0.0)
    assert torch.dot(u, fv).item() == pytest.approx(torch.dot(v, fu).item(), rel=1e-6)
    assert torch.dot(v, fv).item() > 0

    theta = parameters_of(model)

    def kl_gradient(at):
        torch.nn.utils.vector_to_parameters(at, problem.params)
        total = torch.zeros(n, dtype=torch.float64)
        for sub, old in zip(problem.parts, problem.old_log_probs):
            log_probs = token_outputs(model, sub, with_log_probs=True).log_probs.double()
            kl = (old.exp() * (old - log_probs)).sum(-1).mul(sub.response_mask).sum() / problem.tokens
            total += torch.nn.utils.parameters_to_vector(torch.autograd.grad(kl, problem.params))
        return total

    eps = 1e-4
    finite = (kl_gradient(theta + eps * v) - kl_gradient(theta - eps * v)) / (2 * eps)
    torch.nn.utils.vector_to_parameters(theta, problem.params)
    # token_outputs computes log-softmax in float32, so agree to float32 precision
    assert torch.allclose(fv, finite, rtol=1e-2, atol=1e-3 * finite.abs().max().item())


def _kl_and_surrogate(model, batch, old_log_probs):
    """Token-mean KL(pi_old || pi) over the vocabulary and the mean surrogate rho A, measured directly."""
    with torch.no_grad():
        out = token_outputs(model, batch, with_log_probs=True)
    mask = batch.response_mask
    kl = ((old_log_probs.exp() * (old_log_probs - out.log_probs)).sum(-1) * mask).sum() / mask.sum()
    surrogate = (torch.exp(out.logp - batch.old_logp) * batch.advantages * mask).sum() / mask.sum()
    return kl.item(), surrogate.item()


def test_trpo_step_keeps_the_kl_bound_and_improves_the_surrogate():
    model = tiny_lm()
    max_kl = 0.01
    algorithm = algorithm_with(loss="is_surrogate", schedule="trpo", trpo={"max_kl": max_kl})
    batch = stored_batch(algorithm, model)
    with torch.no_grad():
        old_log_probs = token_outputs(model, batch, with_log_probs=True).log_probs
    _, surrogate_before = _kl_and_surrogate(model, batch, old_log_probs)
    before = parameters_of(model)
    stats = trpo_update(model, batch, algorithm, algorithm.schedule_settings, **TRPO_UPDATE)
    kl, surrogate_after = _kl_and_surrogate(model, batch, old_log_probs)
    assert stats["trpo_step"] > 0 and not torch.equal(parameters_of(model), before)
    assert 0 < kl <= max_kl * (1 + 1e-4) and kl == pytest.approx(stats["trpo_kl"], rel=1e-3)
    assert surrogate_after > surrogate_before
    assert stats["trpo_improvement"] == pytest.approx(surrogate_after - surrogate_before, rel=1e-3)


def test_trpo_step_length_is_sqrt_two_delta_over_the_curvature():
    """The natural direction s does not depend on delta, and the applied step is
    b^j sqrt(2 delta / s^T F s) s: its length over (b^j sqrt(delta)) is the same for every delta, so
    the step vanishes like sqrt(delta)."""
    normalised, lengths = [], []
    for max_kl in (1e-3, 1e-5):
        model = tiny_lm()
        algorithm = algorithm_with(loss="is_surrogate", schedule="trpo", trpo={"max_kl": max_kl})
        batch = stored_batch(algorithm, model)
        before = parameters_of(model)
        stats = trpo_update(model, batch, algorithm, algorithm.schedule_settings, **TRPO_UPDATE)
        assert stats["trpo_step"] > 0 and stats["trpo_kl"] <= max_kl
        lengths.append((parameters_of(model) - before).norm().item())
        normalised.append(lengths[-1] / (stats["trpo_step"] * max_kl**0.5))
    assert normalised[0] == pytest.approx(normalised[1], rel=1e-3)
    assert lengths[1] < 0.2 * lengths[0]


def test_trpo_without_any_advantage_does_not_move():
    model = tiny_lm()
    algorithm = algorithm_with(loss="is_surrogate", schedule="trpo")
    batch = stored_batch(algorithm, model)
    batch.advantages = torch.zeros_like(batch.advantages)
    before = parameters_of(model)
    stats = trpo_update(model, batch, algorithm, algorithm.schedule_settings, **TRPO_UPDATE)
    assert torch.equal(parameters_of(model), before) and stats["trpo_step"] == 0.0


# ------------------------------------------------------------------------------------------------ SFPO


def test_interpolate_is_exact_for_every_parameter():
    start = [torch.tensor([0.0, 1.0]), torch.tensor([[2.0]])]
    params = [torch.tensor([10.0, -1.0]), torch.tensor([[4.0]])]
    interpolate_(params, start, 0.25)
    assert torch.equal(params[0], torch.tensor([2.5, 0.5])) and torch.equal(params[1], torch.tensor([[2.5]]))


def sfpo_algorithm(fast_steps, alpha, entropy_z=None):
    return algorithm_with(schedule="sfpo", sfpo={"fast_steps": fast_steps, "alpha": alpha, "entropy_z": entropy_z})


def run_sfpo(algorithm, model, batch, lr=0.5):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    state = make_update_state(algorithm, model)
    return sfpo_update(model, optimizer, batch, algorithm, state, **UPDATE)


def run_plain(model, batch, updates, lr=0.5):
    plain = algorithm_with()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(updates):
        standard_update(model, optimizer, batch, plain, **UPDATE)


@pytest.mark.parametrize("fast_steps,alpha,plain_updates", [
    (0, 0.8, 1),  # K = 0: the reposition is a no-op, one plain update
    (1, 1.0, 2),  # K = 1, alpha = 1: two plain updates in a row
    (2, 0.0, 1),  # alpha = 0: back to theta_0, then one plain update (SGD keeps no state)
])
def test_sfpo_special_cases_equal_plain_updates(fast_steps, alpha, plain_updates):
    base = tiny_lm()
    batch = stored_batch(algorithm_with(), base)
    sfpo_model, plain_model = copy.deepcopy(base), copy.deepcopy(base)
    stats = run_sfpo(sfpo_algorithm(fast_steps, alpha), sfpo_model, batch)
    run_plain(plain_model, batch, plain_updates)
    assert stats["optimizer_steps"] == fast_steps + 1 and stats["sfpo_active"] == 1.0
    assert torch.allclose(parameters_of(sfpo_model), parameters_of(plain_model), atol=1e-6)
    assert not torch.allclose(parameters_of(sfpo_model), parameters_of(base), atol=1e-6)


def test_sfpo_slow_step_starts_from_the_interpolated_point():
    """K = 2, alpha = .5 with SGD: theta~ = theta_0 + .5 (theta_2 - theta_0), then one step from theta~."""
    base = tiny_lm()
    batch = stored_batch(algorithm_with(), base)
    sfpo_model = copy.deepcopy(base)
    run_sfpo(sfpo_algorithm(2, 0.5), sfpo_model, batch)
    manual = copy.deepcopy(base)
    run_plain(manual, batch, 2)
    theta_tilde = parameters_of(base) + 0.5 * (parameters_of(manual) - parameters_of(base))
    torch.nn.utils.vector_to_parameters(theta_tilde, manual.parameters())
    run_plain(manual, batch, 1)
    assert torch.allclose(parameters_of(sfpo_model), parameters_of(manual), atol=1e-6)


def test_entropy_zscore_closed_form():
    # window [1, 2, 3]: mean 2, population std sqrt(2/3) -> z = 1 / .816497 = 1.224745
    assert entropy_zscore([5.0, 1.0, 2.0, 3.0], window=3) == pytest.approx(1.224745, rel=1e-5)
    assert entropy_zscore([1.0, 2.0], window=3) is None


def test_sfpo_switch_fires_on_an_entropy_spike_and_stays_off():
    switch = SFPOSwitch(window=5, threshold=1.0)
    for h in (1.0, 1.1, 0.9, 1.0):
        switch.observe(h)
        assert switch.active()  # fewer than 5 entries: no z-score yet
    switch.observe(1.05)
    assert switch.active()  # z of 1.05 in [1, 1.1, .9, 1, 1.05] is .78 < 1
    switch.observe(3.0)
    assert not switch.active()  # spike
    for h in (1.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        switch.observe(h)
    assert not switch.active()  # off for good


def test_sfpo_after_the_switch_runs_a_plain_update():
    base = tiny_lm()
    algorithm = sfpo_algorithm(3, 0.8, entropy_z=1.0)
    batch = stored_batch(algorithm_with(), base)
    state = make_update_state(algorithm, base)
    state.sfpo_switch.stopped = True
    sfpo_model, plain_model = copy.deepcopy(base), copy.deepcopy(base)
    stats = sfpo_update(sfpo_model, torch.optim.SGD(sfpo_model.parameters(), lr=0.5), batch, algorithm, state, **UPDATE)
    run_plain(plain_model, batch, 1)
    assert stats["sfpo_active"] == 0.0 and stats["optimizer_steps"] == 1
    assert torch.allclose(parameters_of(sfpo_model), parameters_of(plain_model), atol=1e-6)
    assert len(state.sfpo_switch.history) == 1 and state.sfpo_switch.history[0] == pytest.approx(stats["entropy"])


# ------------------------------------------------------------------------------------------- PPO-EWMA


def test_ewma_update_matches_the_debiased_closed_form():
    thetas = [torch.tensor([1.0, 0.0]), torch.tensor([3.0, 2.0]), torch.tensor([0.0, 4.0]), torch.tensor([5.0, 5.0])]
    for beta in (0.0, 0.5, 0.9):
        average, weight = [thetas[0].clone()], 1.0
        for theta in thetas[1:]:
            weight = ewma_update_(average, [theta], weight, beta)
        coefficients = torch.tensor([beta ** (3 - k) for k in range(4)])
        expected = (coefficients[:, None] * torch.stack(thetas)).sum(0) / coefficients.sum()
        assert torch.allclose(average[0], expected)
        assert weight == pytest.approx(coefficients.sum().item())


class SteppingRecorder:
    """SGD that also records the parameters after each step."""

    def __init__(self, model, lr):
        self.model = model
        self.sgd = torch.optim.SGD(model.parameters(), lr=lr)
        self.after_steps = []

    def step(self):
        self.sgd.step()
        self.after_steps.append(parameters_of(self.model))

    def zero_grad(self, set_to_none=True):
        self.sgd.zero_grad(set_to_none=set_to_none)


def test_the_proximal_policy_follows_every_optimizer_step():
    algorithm = algorithm_with(loss="ppo_ewma", epochs=2, minibatches=3, proximal_decay=0.5)
    model = tiny_lm()
    batch = stored_batch(algorithm, model)
    theta_0 = parameters_of(model)
    state = make_update_state(algorithm, model)
    recorder = SteppingRecorder(model, lr=0.5)
    standard_update(model, recorder, batch, algorithm, generator=torch.Generator().manual_seed(0),
                    proximal=state.proximal, **UPDATE)
    thetas = [theta_0, *recorder.after_steps]
    assert len(thetas) == 7
    coefficients = [0.5 ** (6 - k) for k in range(7)]
    expected = sum(c * t for c, t in zip(coefficients, thetas)) / sum(coefficients)
    assert torch.allclose(parameters_of(state.proximal.model), expected, atol=1e-6)


def test_ppo_ewma_with_the_behaviour_policy_as_proximal_equals_ppo_clip():
    """A fresh EWMA copy is the behaviour policy, so on the first on-policy update pi_prox = pi_old
    and the decoupled loss is ppo_clip: same gradient."""
    base = tiny_lm()
    batch = prepared_batch(algorithm_with())
    grads = []
    for algorithm in (algorithm_with(loss="ppo_ewma", proximal_decay=0.9), algorithm_with(loss="ppo_clip")):
        model = copy.deepcopy(base)
        state = make_update_state(algorithm, model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        standard_update(model, optimizer, batch, algorithm, proximal=state.proximal, **UPDATE)
        grads.append(parameters_of(model))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert not torch.allclose(grads[0], parameters_of(base))


def test_the_ewma_copy_exists_only_for_a_loss_that_reads_prox_logp():
    model = tiny_lm()
    assert make_update_state(algorithm_with(), model).proximal is None
    state = make_update_state(algorithm_with(loss="ppo_ewma", proximal_decay=0.6), model)
    assert isinstance(state.proximal, EWMAPolicy) and state.proximal.decay == 0.6
    assert all(not p.requires_grad for p in state.proximal.model.parameters())
    assert make_update_state(algorithm_with(loss="ppo_ewma"), model).proximal.decay == 0.0
    assert UpdateState().parameters(model) == list(model.parameters())


# ------------------------------------------------------------------------------------------ validation


def test_schedule_settings_are_read_with_defaults():
    sfpo = algorithm_with(schedule="sfpo", sfpo={"alpha": 0.5})
    assert sfpo.schedule_settings == SFPOSettings(fast_steps=3, alpha=0.5, entropy_window=30, entropy_z=1.0)
    assert algorithm_with(schedule="trpo").schedule_settings == TRPOSettings()
    assert sfpo.needs_old_logp and algorithm_with(schedule="trpo").needs_old_logp
    assert not algorithm_with().needs_old_logp


@pytest.mark.parametrize("update,message", [
    ({"schedule": "natural"}, r"algorithm.update.schedule=natural is unknown"),
    ({"schedule": "standard", "sfpo": {"alpha": 0.5}}, r"algorithm.update.sfpo is set but algorithm.update.schedule=standard"),
    ({"schedule": "sfpo", "sfpo": {"inner_steps": 3}}, r"algorithm.update.sfpo has no key\(s\) \['inner_steps'\]"),
    ({"schedule": "sfpo", "sfpo": {"alpha": 1.5}}, r"alpha must be in \[0, 1\]"),
    ({"schedule": "trpo", "trpo": {"max_kl": 0.0}}, r"max_kl must be > 0"),
    ({"schedule": "trpo", "trpo": {"backtrack": 1.0}}, r"backtrack must be in \(0, 1\)"),
    ({"proximal_decay": 0.5}, r"proximal_decay .* only a loss reading prox_logp \(ppo_ewma\) uses; loss 'ppo_clip'"),
])
def test_bad_update_blocks_are_refused(update, message):
    with pytest.raises(ConfigError, match=message):
        algorithm_with(**update)


def test_trpo_refuses_a_proximal_policy_loss():
    with pytest.raises(ConfigError, match=r"loss 'ppo_ewma' .*schedule=trpo"):
        algorithm_with(loss="ppo_ewma", schedule="trpo")
    with pytest.raises(ConfigError, match=r"proximal_decay must be in \[0, 1\)"):
        algorithm_with(loss="ppo_ewma", proximal_decay=1.0)
