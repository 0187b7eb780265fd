"""Closed-form tests of the advantage- and loss-side cores of HAPO, CAMPO, D-PPO and M2PO
(issue 33): each value below is computed by hand in the comment beside it."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.algorithm.registry import ADVANTAGES


def _mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])


# --------------------------------------------------------------------------- HAPO: token-level group average
def test_hapo_tlga_mean_weighs_rewards_by_length():
    """{r = 1 with 10 tokens, r = 0 with 30}: mu_tok = 10/40 = 0.25 (GRPO's mean: 0.5);
    sigma_tok = sqrt((10 * 0.75^2 + 30 * 0.25^2) / 40) = sqrt(0.1875); A = (r - 0.25) / sigma_tok."""
    rewards = torch.tensor([1.0, 0.0])
    mask = _mask([10, 30])
    adv = ADVANTAGES.get("hapo_tlga")(rewards, torch.tensor([0, 0]), mask, epsilon=0.0)
    sigma = math.sqrt(0.1875)
    assert adv[0, 0].item() == pytest.approx(0.75 / sigma, rel=1e-6)
    assert adv[1, 0].item() == pytest.approx(-0.25 / sigma, rel=1e-6)
    assert torch.all(adv[0, 10:] == 0)  # padding
    # the length-weighted mean is what sets the sign balance: sum over tokens of A is 0
    assert (adv * mask).sum().item() == pytest.approx(0.0, abs=1e-5)


def test_hapo_tlga_equal_lengths_is_grpo_with_population_std():
    """Equal lengths: token statistics are the responses' (population std), i.e. GRPO's advantage
    times std_unbiased / std_population = sqrt(n / (n - 1))."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = _mask([4] * 6)
    tlga = ADVANTAGES.get("hapo_tlga")(rewards, group, mask, epsilon=0.0)
    grpo = ADVANTAGES.get("grpo")(rewards, group, mask, epsilon=0.0)
    assert torch.allclose(tlga, grpo * math.sqrt(3 / 2), atol=1e-6)


def test_hapo_tlga_falls_back_to_grpo_when_some_advantage_reaches_the_threshold():
    """One correct response of 1 token among three wrong ones of 100: mu_tok = 1/301,
    sigma_tok = sqrt(300)/301, A_correct = (300/301) / (sqrt(300)/301) = sqrt(300) = 17.3 >= 5, so the
    group takes GRPO's advantage; the other group (equal lengths, |A| < 5) keeps the TLGA value."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = _mask([1, 100, 100, 100, 3, 3])
    tlga = ADVANTAGES.get("hapo_tlga")(rewards, group, mask, epsilon=0.0)
    grpo = ADVANTAGES.get("grpo")(rewards, group, mask, epsilon=0.0)
    assert torch.allclose(tlga[:4], grpo[:4])
    assert tlga[4, 0].item() == pytest.approx(1.0)  # (1 - 0.5) / 0.5, population std of {1, 0}
    unsmoothed = ADVANTAGES.get("hapo_tlga")(rewards, group, mask, epsilon=0.0, fallback_threshold=100.0)
    assert unsmoothed[0, 0].item() == pytest.approx(math.sqrt(300), rel=1e-5)


def _released_tlga(rewards, group, lengths, epsilon=1e-6):
    """The released algorithm as its README describes it, written per group with Python lists: the
    token scores are each reward repeated |o_i| times; mean and population std over them; the
    group's GRPO advantage (unbiased std) if any normalised value reaches 5."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, group)):
        members = [j for j in range(len(rewards)) if group[j] == g]
        tokens = [rewards[j] for j in members for _ in range(lengths[j])]
        mean = sum(tokens) / len(tokens)
        std = (sum((t - mean) ** 2 for t in tokens) / len(tokens)) ** 0.5
        normed = [(rewards[j] - mean) / (std + epsilon) for j in members]
        if any(abs(v) >= 5 for v in normed):
            values = [rewards[j] for j in members]
            m = sum(values) / len(values)
            s = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5
            out.append((r - m) / (s + epsilon))
        else:
            out.append((r - mean) / (std + epsilon))
    return out


def test_hapo_tlga_matches_the_released_algorithm_on_random_binary_batches():
    """Binary rewards (the verifier's), random lengths 1..40, 8 groups of 4: equal to the per-group
    reference above (where the released code also tests padding positions, a zero reward's value, the
    verdict is the same for binary rewards)."""
    generator = torch.Generator().manual_seed(3)
    rewards = (torch.rand(32, generator=generator) < 0.3).double()
    lengths = torch.randint(1, 41, (32,), generator=generator)
    group = torch.arange(8).repeat_interleave(4)
    adv = ADVANTAGES.get("hapo_tlga")(rewards, group, _mask(lengths.tolist()).double())
    expected = _released_tlga(rewards.tolist(), group.tolist(), lengths.tolist())
    for i in range(32):
        if rewards[group == group[i]].std() > 0:  # mixed groups (all-equal ones: 0 on both sides)
            assert adv[i, 0].item() == pytest.approx(expected[i], rel=1e-6)
        else:
            assert adv[i, 0].item() == 0.0
    assert any(rewards[group == g].std() > 0 for g in range(8))


def test_hapo_tlga_degenerate_groups_get_zero():
    """A singleton group, an all-equal group and a group whose responses are all empty get A = 0."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    group = torch.tensor([0, 1, 1, 2, 2])
    mask = _mask([3, 2, 4, 0, 0], width=4)
    adv = ADVANTAGES.get("hapo_tlga")(rewards, group, mask)
    assert torch.all(adv == 0)
    assert not torch.isnan(adv).any()


# --------------------------------------------------------------------------- CAMPO: repetition penalty
@pytest.mark.parametrize("text, share", [
    ("abcabcabc", 1.0),                  # three copies of "abc" cover everything
    ("xyzabcabc", 6 / 9),                # two copies of "abc" after a 3-character prefix
    ("The answer is 4. The answer is 4. ", 1.0),  # a sentence twice (period 17)
    ("Let x = 2. Then y = 3", 0.0),      # no final repeat
    ("xaaaaa", 4 / 6),                   # the longest period repeating twice ("aa") wins, as in the released code
    ("", 0.0),
    ("a", 0.0),
])
def test_tail_loop_fraction_on_known_repeats(text, share):
    from rlbench.algorithm.shaping import tail_loop_fraction

    assert tail_loop_fraction(text) == pytest.approx(share)


def test_tail_loop_fraction_min_repeats():
    """"pqpqpq" + "r" ends in no loop; "rpqpqpq" ends in 3 copies of "pq" (6/7) and also 1 copy of the
    rest; with min_repeats = 4 nothing repeats 4 times (0)."""
    from rlbench.algorithm.shaping import tail_loop_fraction

    assert tail_loop_fraction("pqpqpqr") == 0.0
    assert tail_loop_fraction("rpqpqpq") == pytest.approx(6 / 7)
    assert tail_loop_fraction("rpqpqpq", min_repeats=4) == 0.0
    assert tail_loop_fraction("rpqpqpqpq", min_repeats=4) == pytest.approx(8 / 9)
    assert tail_loop_fraction(list(range(5)) + [7, 8] * 10) == pytest.approx(20 / 25)  # any sequence (token ids)


def _released_loop_share(units: list, min_repeats: int = 2) -> float:
    """The released detector as described: for every period L, count the back-to-back copies of the last
    L units walking backwards; the longest period with at least min_repeats copies sets the loop's start."""
    n, start = len(units), len(units)
    for period in range(1, n // min_repeats + 1):
        copies, right = 1, n - period
        while right - period >= 0 and units[right - period:right] == units[right:right + period]:
            copies, right = copies + 1, right - period
        if copies >= min_repeats:
            start = right
    return (n - start) / n if n else 0.0


def test_tail_loop_fraction_equals_the_quadratic_detector_on_random_sequences():
    """The O(n) Z-function form gives the released two-pointer detector's share on 300 random sequences
    over a 2-3 letter alphabet (many loops) with lengths 0..40."""
    import random

    from rlbench.algorithm.shaping import tail_loop_fraction

    rng = random.Random(0)
    for _ in range(300):
        units = [rng.randrange(rng.choice([2, 3])) for _ in range(rng.randrange(41))]
        for min_repeats in (2, 3):
            assert tail_loop_fraction(units, min_repeats) == pytest.approx(_released_loop_share(units, min_repeats))


def test_campo_repetition_penalty_modes_and_the_truncated_scan():
    """Eq. 6: r - f(o); the released code: r - 0.1 when f > 0; only truncated responses are scanned
    unless truncated_only is false."""
    from rlbench.algorithm.shaping import REWARD_SHAPING, apply_shaping

    ids = [[1, 2, 3] * 3, [7, 8, 9, 1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [5, 6, 5, 6]]
    finished = torch.tensor([False, False, False, True])
    inputs = {"response_token_ids": ids, "finished": finished}
    fraction = REWARD_SHAPING.call("campo_repetition", inputs, {})
    assert fraction.tolist() == pytest.approx([-1.0, -2 / 3, 0.0, 0.0])  # "okok" ended with EOS: not scanned
    every = REWARD_SHAPING.call("campo_repetition", inputs, {"truncated_only": False})
    assert every.tolist() == pytest.approx([-1.0, -2 / 3, 0.0, -1.0])
    flag = REWARD_SHAPING.call("campo_repetition", inputs, {"mode": "flag", "weight": 0.1})
    assert flag.tolist() == pytest.approx([-0.1, -0.1, 0.0, 0.0])
    shaped = apply_shaping(torch.tensor([1.0, 0.0, 1.0, 1.0]), [("campo_repetition", {})], inputs)
    assert shaped.tolist() == pytest.approx([0.0, -2 / 3, 1.0, 1.0])
    with pytest.raises(ValueError, match="mode"):
        REWARD_SHAPING.call("campo_repetition", inputs, {"mode": "loop"})


def test_campo_repetition_reads_token_ids_not_the_text():
    """The loop is found on the responses' token ids (the released find_infinite_loop_start compares ids):
    text that repeats under two tokenisations ("ab" x 3 against "a" + "babab") is no loop, and the
    shaping inputs carry each completion's ids as sampled."""
    from rlbench.algorithm.shaping import REWARD_SHAPING
    from rlbench.dataset.base import Problem
    from rlbench.rollout.engines.base import Completion
    from rlbench.rollout.groups import shaping_inputs
    from rlbench.reward.math import Grade

    class Vocabulary:
        pieces = {1: "ab", 2: "a", 3: "babab"}

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    tokenizer = Vocabulary()
    looped, retokenised = (Completion(0, (0,), ids, [0.0] * 3, False, text=tokenizer.decode(ids)) for ids in ([1, 1, 1], [2, 3]))
    assert looped.text == "ababab" and retokenised.text == "ababab"
    grades = [Grade(correct=False, extracted=None, reward=0.0, format_ok=True)] * 2
    inputs = shaping_inputs([Problem("u", "q", "a")], [[looped, retokenised]], grades, 3, tokenizer)
    assert inputs["response_token_ids"] == [[1, 1, 1], [2, 3]]
    penalty = REWARD_SHAPING.call("campo_repetition", inputs, {})
    assert penalty.tolist() == pytest.approx([-1.0, 0.0])


# --------------------------------------------------------------------------- M2PO: the mask and the adaptive clip
def _m2po(lr: list[float], adv: list[float], **params):
    from rlbench.algorithm.registry import POLICY_LOSSES

    old = torch.zeros(1, len(lr), dtype=torch.float64)
    logp = torch.tensor([lr], dtype=torch.float64, requires_grad=True)
    matrix, metrics = POLICY_LOSSES.get("m2po")(
        logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, len(lr), dtype=torch.float64), **params)
    matrix.sum().backward()
    return matrix[0].detach(), logp.grad[0], metrics


def test_m2po_mask_drops_only_the_largest_log_ratios():
    """(log rho)^2 = [0.25, 0.01, 0.01, 0]: mean 0.0675 > 0.04; without the first the rest has mean
    0.02 / 3 <= 0.04, so only the first token is masked; the others keep -rho A."""
    lr, adv = [0.5, 0.1, -0.1, 0.0], [1.0, 1.0, -1.0, 1.0]
    loss, grad, metrics = _m2po(lr, adv, m2_threshold=0.04)
    assert loss[0].item() == 0.0 and grad[0].item() == 0.0
    expected = [-math.exp(0.1), math.exp(-0.1), -1.0]
    assert loss[1:].tolist() == pytest.approx(expected)
    assert grad[1:].tolist() == pytest.approx(expected)  # d(-rho A)/d logp = -rho A
    assert metrics["masked_fraction"] == pytest.approx(0.25)
    assert metrics["m2"] == pytest.approx(0.0675) and metrics["m2_masked"] == pytest.approx(0.02 / 3)


def test_m2po_clip_bounds_from_the_harmful_tokens():
    """Harmful tokens (A > 0, rho > 1 or A < 0, rho < 1): indices 0, 1, 2, 5 with (log rho)^2 sorted
    [0.0025, 0.01, 0.04, 0.25]: M2 = 0.075625 > 0.04. Capping at the k-th value gives sums 0.01,
    0.0325, 0.0925 (< 4 x 0.04 = 0.16) and 0.3025: tau^2 = 0.04, tau = 0.2, M2 after = (0.0525 + 0.04) / 4.
    Bounds [e^-0.2, e^0.2] without floors: only token 1 (A > 0, rho = e^0.5 > e^0.2) is clipped."""
    lr, adv = [0.1, 0.5, -0.2, 0.3, -0.4, -0.05], [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    loss, grad, metrics = _m2po(lr, adv, mode="clip", min_clip_low=0.0, min_clip_high=0.0)
    assert metrics["m2"] == pytest.approx(0.075625)
    assert metrics["m2_masked"] == pytest.approx(0.023125)
    assert metrics["clip_low"] == pytest.approx(1 - math.exp(-0.2))
    assert metrics["clip_high"] == pytest.approx(math.exp(0.2) - 1)
    assert loss[1].item() == pytest.approx(-math.exp(0.2)) and grad[1].item() == 0.0
    for i in (0, 3, 4, 5):  # inside the bounds, or on the side the clip does not bind
        assert loss[i].item() == pytest.approx(-adv[i] * math.exp(lr[i]))
        assert grad[i].item() == pytest.approx(-adv[i] * math.exp(lr[i]))
    assert metrics["masked_fraction"] == pytest.approx(1 / 6)
    # the released floors: e_l >= 0.3, e_h >= 0.5, so the range is [0.7, 1.5] and token 1 (1.65) still clips
    _, _, floored = _m2po(lr, adv, mode="clip")
    assert (floored["clip_low"], floored["clip_high"]) == (pytest.approx(0.3), pytest.approx(0.5))


def test_m2po_clip_within_budget_is_the_plain_surrogate():
    """Every (log rho)^2 <= 0.01 < 0.04: no constraint, l = -rho A everywhere (and all rho = 1 gives -A)."""
    lr, adv = [0.1, -0.1, 0.05, 0.0], [1.0, -1.0, -2.0, 3.0]
    loss, _, metrics = _m2po(lr, adv, mode="clip")
    assert loss.tolist() == pytest.approx([-a * math.exp(r) for r, a in zip(lr, adv)])
    assert metrics["masked_fraction"] == 0.0 and metrics["clip_high"] == math.inf
    loss, _, _ = _m2po([0.0] * 4, adv, mode="clip")
    assert loss.tolist() == pytest.approx([-a for a in adv])


def test_m2po_clip_caps_the_second_moment_of_a_heavy_tailed_batch():
    """On random heavy-tailed log-ratios the harmful tokens' capped second moment is within the budget,
    and tau is one of the observed |log rho| (the largest that fits)."""
    from rlbench.algorithm.losses.soft_trust_region import m2po_clip_bounds

    generator = torch.Generator().manual_seed(0)
    lr = 0.1 * torch.randn(4, 64, generator=generator) / torch.randn(4, 64, generator=generator).abs().clamp(min=0.05)
    adv = torch.randn(4, 64, generator=generator)
    tau, m2, after = m2po_clip_bounds(lr, adv, torch.ones(4, 64, dtype=torch.bool), 0.04)
    assert m2 > 0.04 >= after
    harmful = ((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0))
    assert torch.isclose(lr[harmful].abs().double(), torch.tensor(tau, dtype=torch.float64)).any()


def _released_tau(harmful_squares: list[float], budget: float) -> tuple[float, float]:
    """The released solver as described: walk the ascending squares; at the first k where capping the
    rest at the k-th value reaches n x budget, tau^2 is the (k-1)-th value (0 at k = 0)."""
    values = sorted(harmful_squares)
    n, target = len(values), budget * len(values)
    if sum(values) / n <= budget:
        return math.inf, sum(values) / n
    prefix = 0.0
    for k, value in enumerate(values):
        prefix += value
        if value * (n - k - 1) + prefix >= target:
            if k == 0:  # every square is above the budget (the released code then reports the uncapped mean)
                return 0.0, 0.0
            cap = values[k - 1]
            return math.sqrt(cap), (sum(values[:k]) + cap * (n - k)) / n
    raise AssertionError("unreachable: k = n - 1 always reaches the total")


def test_m2po_clip_bounds_equal_the_released_solver_on_random_batches():
    from rlbench.algorithm.losses.soft_trust_region import m2po_clip_bounds

    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        lr = 0.3 * torch.randn(3, 16, generator=generator, dtype=torch.float64)
        adv = torch.randn(3, 16, generator=generator, dtype=torch.float64)
        valid = torch.rand(3, 16, generator=generator) < 0.8
        harmful = valid & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
        tau, m2, after = m2po_clip_bounds(lr, adv, valid, 0.04)
        expected_tau, expected_after = _released_tau((lr[harmful] ** 2).tolist(), 0.04)
        assert m2 == pytest.approx((lr[harmful] ** 2).mean().item())
        assert tau == pytest.approx(expected_tau) and after == pytest.approx(expected_after)


def test_m2po_paper_preset_trains_on_stale_data_with_the_released_clip(tmp_path):
    from conftest import compose_config

    cfg = compose_config(["paper=m2po"], tmp_path)
    assert cfg.trainer.max_staleness == 64  # stale_iteration = 64 rollout batches (256 model updates)
    assert cfg.algorithm.loss.mode == "clip" and cfg.algorithm.loss.m2_threshold == 0.04


# --------------------------------------------------------------------------- A2C: the preset is PPO's 1 x 1 special case
def test_a2c_preset_gradient_equals_the_ppo_preset_with_one_full_batch_update(tmp_path):
    """algorithm=a2c and algorithm=ppo with A2C's settings (1 epoch x 1 full mini-batch, lambda = 1, no
    whitening) give the same gradient on one batch (Huang et al. 2022, arXiv:2205.09123): rho = 1 and
    V = V_old, so PPO's ratio and value clips are inactive. The a2c preset's loss is REINFORCE."""
    from conftest import algorithm_from, compose_config
    from test_critic import critic_batch, first_update_gradient, random_head
    from test_trainer import tiny_lm

    a2c_cfg = compose_config(["algorithm=a2c"], tmp_path / "a2c")
    ppo_cfg = compose_config(["algorithm=ppo", "algorithm.update.epochs=1", "algorithm.update.minibatches=1",
                              "algorithm.advantage.lam=1.0", "algorithm.advantage.whiten=false"], tmp_path / "ppo")
    a2c, ppo = algorithm_from(a2c_cfg.algorithm), algorithm_from(ppo_cfg.algorithm)
    assert a2c.loss.name == "reinforce" and ppo.loss.name == "ppo_clip"
    base_model = tiny_lm()
    base_head = random_head(base_model)
    batch = critic_batch(base_model, base_head, a2c)
    assert torch.count_nonzero(batch.advantages) > 0
    grads = [first_update_gradient(base_model, base_head, batch, algorithm) for algorithm in (a2c, ppo)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in grads[0])


# --------------------------------------------------------------------------- D-PPO: the variance-bound dropout
def _dppo(ratios: list[float], adv: list[float], **params):
    from rlbench.algorithm.registry import POLICY_LOSSES

    mask = torch.tensor([[1.0] * len(ratios) + [0.0]], dtype=torch.float64)
    logp = torch.tensor([[math.log(r) for r in ratios] + [0.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([adv + [5.0]], dtype=torch.float64)
    matrix, metrics = POLICY_LOSSES.get("dppo")(logp, torch.zeros_like(logp), advantages, mask, **params)
    matrix.sum().backward()
    return matrix[0].detach(), logp.grad[0], metrics


def test_dppo_variance_bound_drops_what_lowers_the_correlation_term():
    """rho = [1.5, 1.1, 0.8, 1.0, 1.3], A = [1, 1, 1, 2, -1]: x = (rho - 1) A = [0.5, 0.1, -0.2, 0, -0.3],
    S = 0.1, c = x (S - x) = [-0.2, 0, -0.06, 0, -0.12]. drop_fraction 0.4 of 5 tokens: the two smallest
    c (tokens 0 and 4) are dropped; the kept ones keep PPO-clip's value and gradient (-rho A inside
    [0.8, 1.2]). The identity: Var(x) = S^2 (N-1)/N^2 - C/N = 0.0016 + 0.38/5 = 0.0776, and the kept
    x = [0.1, -0.2, 0] have variance 0.05/3 - (1/30)^2 = 0.01556."""
    ratios, adv = [1.5, 1.1, 0.8, 1.0, 1.3], [1.0, 1.0, 1.0, 2.0, -1.0]
    loss, grad, metrics = _dppo(ratios, adv, rule="variance_bound", drop_fraction=0.4)
    assert loss[[0, 4]].tolist() == [0.0, 0.0] and grad[[0, 4]].tolist() == [0.0, 0.0]
    assert loss[1:4].tolist() == pytest.approx([-1.1, -0.8, -2.0])
    assert grad[1:4].tolist() == pytest.approx([-1.1, -0.8, -2.0])
    assert metrics["dropped_fraction"] == pytest.approx(0.4)
    x = torch.tensor([0.5, 0.1, -0.2, 0.0, -0.3], dtype=torch.float64)
    assert x.var(unbiased=False).item() == pytest.approx(0.0776)
    assert x[1:4].var(unbiased=False).item() == pytest.approx(0.05 / 3 - (1 / 30) ** 2)
    # one token: the smallest c (token 0); a large fraction drops only the three tokens with c < 0
    assert _dppo(ratios, adv, rule="variance_bound", drop_fraction=0.2)[2]["dropped_fraction"] == pytest.approx(0.2)
    loss, _, metrics = _dppo(ratios, adv, rule="variance_bound", drop_fraction=0.8)
    assert metrics["dropped_fraction"] == pytest.approx(0.6) and loss[[0, 2, 4]].tolist() == [0.0, 0.0, 0.0]


def test_dppo_variance_bound_drops_nothing_at_ratio_one():
    _, grad, metrics = _dppo([1.0] * 4, [1.0, -1.0, 2.0, -2.0], rule="variance_bound", drop_fraction=0.5)
    assert metrics["dropped_fraction"] == 0.0 and grad[:4].tolist() == pytest.approx([-1.0, 1.0, -2.0, 2.0])


def test_dppo_preset_uses_the_variance_bound_rule(tmp_path):
    from conftest import compose_config

    cfg = compose_config(["algorithm=dppo"], tmp_path)
    assert cfg.algorithm.loss.rule == "variance_bound"
