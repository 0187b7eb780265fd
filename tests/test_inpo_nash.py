"""INPO's rounds on a tabular preference game approach its Nash mixture (Zhang et al. 2024, arXiv:2407.00617,
sections 3-4; docs/preference.md, "Iterative rounds").

The game: three one-token responses and a general preference matrix P[a, b] = P(a > b) (P + P^T = 1) with no
Condorcet winner (every response loses to another), so no Bradley-Terry reward explains it. A round fits
the policy's logits to INPO's loss (rlbench.algorithm.losses.preference.inpo_loss) on every ordered pair
(a, b) labelled a > b, weighed by the round's sampling probability pi_t(a) pi_t(b) P(a > b); pi_t is then
the fitted policy. The minimiser of that expected loss is the online-mirror-descent step

    pi_{t+1}(y) ~ pi_t(y)^(1 - eta tau) pi_ref(y)^(eta tau) exp(eta P(y > pi_t)),

whose fixed point is the tau-regularised Nash policy pi*_tau ~ pi_ref exp(P pi*_tau / tau) (the Nash
mixture of the game as tau -> 0). The loss is quadratic in the logits (a pair's h is a difference of
logits), so one Newton step from any start reaches a round's minimiser.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rlbench.algorithm.losses.preference import inpo_loss

DOUBLE = torch.float64
UNIFORM = torch.full((3,), 1 / 3, dtype=DOUBLE)
START = torch.tensor([0.7, 0.2, 0.1], dtype=DOUBLE)  # the initial policy: far from every equilibrium
# rock-paper-scissors: each response beats the next surely; its Nash mixture is uniform
ROCK_PAPER_SCISSORS = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.5, 1.0], [1.0, 0.0, 0.5]], dtype=DOUBLE)
# a lopsided cycle: 0 beats 1 surely, 1 beats 2 w.p. 0.9, 2 beats 0 w.p. 0.7 (no Condorcet winner either)
LOPSIDED = torch.tensor([[0.5, 1.0, 0.3], [0.0, 0.5, 0.9], [0.7, 0.1, 0.5]], dtype=DOUBLE)


def nash_mixture(preference: torch.Tensor) -> torch.Tensor:
    """The Nash mixture of a 3-response symmetric game with a full-support equilibrium: the null vector of the
    skew-symmetric payoff A = P - 1/2 (A pi = 0: no response beats pi more than half the time),
    (a_12, a_20, a_01) for responses (0, 1, 2), normalised."""
    a = preference - 0.5
    null = torch.stack([a[1, 2], a[2, 0], a[0, 1]])
    assert (null > 0).all(), "the equilibrium has full support only when every response beats another"
    return null / null.sum()


def exploitability(preference: torch.Tensor, policy: torch.Tensor) -> float:
    """max_y P(y > policy) - 1/2: 0 exactly at the Nash mixture."""
    return float((preference @ policy).max() - 0.5)


def newton_minimise(loss_of, logits: torch.Tensor) -> torch.Tensor:
    """The minimiser of a loss quadratic in ``logits`` (up to the shift every softmax ignores): one Newton step
    with the Hessian's pseudo-inverse, then a second one, which must leave it in place."""
    for _ in range(2):
        theta = logits.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_of(theta), theta)
        hessian = torch.autograd.functional.hessian(loss_of, theta.detach())
        logits = theta.detach() - torch.linalg.pinv(hessian) @ grad
    return logits


def ordered_pairs(arms: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group per ordered pair (a, b), a != b: rows (a, b) with rewards (1, 0), i.e. labelled a > b.
    Returns (arm of each row, group of each row, reward of each row)."""
    pairs = list(itertools.permutations(range(arms), 2))
    rows = torch.tensor([arm for pair in pairs for arm in pair])
    groups = torch.arange(len(pairs)).repeat_interleave(2)
    return rows, groups, torch.tensor([1.0, 0.0] * len(pairs), dtype=DOUBLE)


def inpo_round(preference: torch.Tensor, pi_t: torch.Tensor, pi_ref: torch.Tensor, eta: float, tau: float) -> torch.Tensor:
    """One INPO round: the policy minimising inpo_loss's expectation over the pairs pi_t samples and the
    preference oracle labels."""
    rows, groups, rewards = ordered_pairs(len(pi_t))
    winners, losers = rows[0::2], rows[1::2]
    weights = pi_t[winners] * pi_t[losers] * preference[winners, losers]  # P(sample a, b; label a > b)
    mask = torch.ones(len(rows), 1, dtype=DOUBLE)
    old, ref = pi_t.log()[rows, None], pi_ref.log()[rows, None]

    def expected_loss(logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, 0)[rows, None]
        matrix, _ = inpo_loss(logp, old, ref, mask, rewards, groups, eta=eta, tau=tau)
        per_group = matrix.sum(-1).reshape(-1, 2).sum(-1)  # a group's loss sits on its rows
        return (weights * per_group).sum()

    return torch.softmax(newton_minimise(expected_loss, pi_t.log()), 0)


def mirror_descent_step(preference, pi_t, pi_ref, eta, tau):
    """The closed form of the OMD step (arXiv:2407.00617, section 4)."""
    return torch.softmax((1 - eta * tau) * pi_t.log() + eta * tau * pi_ref.log() + eta * (preference @ pi_t), 0)


def regularised_nash(preference: torch.Tensor, pi_ref: torch.Tensor, tau: float) -> torch.Tensor:
    """pi*_tau = softmax(log pi_ref + P pi*_tau / tau), found by damped fixed-point iteration (independent of
    INPO's loss)."""
    pi = pi_ref.clone()
    for _ in range(20000):
        pi = 0.99 * pi + 0.01 * torch.softmax(pi_ref.log() + preference @ pi / tau, 0)
    return pi


def run_rounds(preference, rounds, eta, tau, pi_ref=UNIFORM):
    policy = START.clone()
    for _ in range(rounds):
        policy = inpo_round(preference, policy, pi_ref, eta, tau)
    return policy


def test_the_nash_mixtures_are_unbeaten():
    assert torch.allclose(nash_mixture(ROCK_PAPER_SCISSORS), UNIFORM)
    assert torch.allclose(nash_mixture(LOPSIDED), torch.tensor([4 / 11, 2 / 11, 5 / 11], dtype=DOUBLE))
    for game in (ROCK_PAPER_SCISSORS, LOPSIDED):
        assert exploitability(game, nash_mixture(game)) == pytest.approx(0.0, abs=1e-12)
        assert exploitability(game, START) > 0.05


@pytest.mark.parametrize("game", [ROCK_PAPER_SCISSORS, LOPSIDED], ids=["rps", "lopsided"])
def test_a_round_of_the_loss_is_the_mirror_descent_step(game):
    """Minimising INPO's loss over the round's pairs gives the OMD closed form, for a general preference."""
    pi_t, pi_ref = torch.tensor([0.5, 0.3, 0.2], dtype=DOUBLE), torch.tensor([0.2, 0.5, 0.3], dtype=DOUBLE)
    fitted = inpo_round(game, pi_t, pi_ref, eta=0.8, tau=0.3)
    assert torch.allclose(fitted, mirror_descent_step(game, pi_t, pi_ref, 0.8, 0.3), atol=1e-9)


def test_rounds_reach_the_uniform_nash_mixture_of_rock_paper_scissors():
    policy = run_rounds(ROCK_PAPER_SCISSORS, rounds=150, eta=1.0, tau=0.1)
    assert torch.allclose(policy, UNIFORM, atol=2e-3)
    assert exploitability(ROCK_PAPER_SCISSORS, policy) < 2e-3


def test_without_the_pull_to_the_reference_the_rounds_circle():
    """tau = 0 is plain mirror descent on the game: its iterates orbit the equilibrium and do not settle
    (the KL term is what gives INPO its last-iterate convergence, arXiv:2407.00617, section 4)."""
    policy = run_rounds(ROCK_PAPER_SCISSORS, rounds=150, eta=1.0, tau=0.0)
    assert (policy - UNIFORM).abs().max() > 0.1


def test_rounds_approach_the_nash_mixture_of_a_lopsided_cycle():
    """The rounds converge to the tau-regularised equilibrium, within O(tau) of the game's Nash mixture: less
    exploitable than the start by an order of magnitude, and closer to the Nash mixture as tau shrinks."""
    tau = 0.05
    policy = run_rounds(LOPSIDED, rounds=150, eta=1.0, tau=tau)
    target = regularised_nash(LOPSIDED, UNIFORM, tau)
    assert torch.allclose(policy, target, atol=1e-2)
    nash = nash_mixture(LOPSIDED)
    assert (policy - nash).abs().max() < 0.05
    assert exploitability(LOPSIDED, policy) < exploitability(LOPSIDED, START) / 10
    distances = [float((regularised_nash(LOPSIDED, UNIFORM, t) - nash).abs().max()) for t in (0.2, 0.1, 0.05, 0.02)]
    assert distances == sorted(distances, reverse=True) and distances[-1] < 0.02
