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


def test_campo_repetition_penalty_modes_and_the_truncated_scan():
    """Eq. 6: r - f(o); the released code: r - 0.1 when f > 0; only truncated responses are scanned
    unless truncated_only is false."""
    from rlbench.algorithm.shaping import REWARD_SHAPING, apply_shaping

    texts = ["abcabcabc", "xyzabcabc", "no loop here", "okok"]
    finished = torch.tensor([False, False, False, True])
    inputs = {"response_texts": texts, "finished": finished}
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
