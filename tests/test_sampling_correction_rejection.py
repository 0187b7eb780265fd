"""verl's rollout_rs rejection modes (rlbench/algorithm/sampling_correction.py): which tokens and
responses each keeps, worked by hand on log-prob tensors."""

import math

import pytest
import torch

from rlbench.algorithm.sampling_correction import (
    DIVERGENCE_REJECTION_MODES,
    SamplingCorrection,
    rejection_keep_mask,
    token_divergence,
)
from rlbench.errors import ConfigError

# Response 0: log-ratios [0, 0.5, -0.5]; response 1: [0.1, 0.1, pad]; response 2: [2.0, 0, 0].
LOG_RATIO = torch.tensor([[0.0, 0.5, -0.5], [0.1, 0.1, 0.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
SAMPLING = torch.full_like(LOG_RATIO, -1.0)
OLD = SAMPLING + LOG_RATIO


def keep(mode, threshold=None, low=0.5, high=2.0):
    return rejection_keep_mask(mode, OLD, SAMPLING, MASK, low, high, threshold)


def test_divergences_closed_form():
    x = torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)
    assert torch.allclose(token_divergence(x, "k2"), torch.tensor([0.0, 0.125, 0.125], dtype=torch.float64))
    k3 = [0.0, math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5]
    assert torch.allclose(token_divergence(x, "k3"), torch.tensor(k3, dtype=torch.float64))


def test_token_k2_rejects_tokens_above_threshold():
    # k2: 0.125 at +-0.5, 0.005 at 0.1, 2.0 at 2.0; threshold 0.1 rejects those three tokens only.
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.float64)
    assert torch.equal(keep("token_k2", threshold=0.1), expected)


def test_token_k3_is_asymmetric():
    # k3(0.5) = 0.1487 > 0.12 > k3(-0.5) = 0.1065: the +0.5 token goes, the -0.5 one stays.
    expected = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.float64)
    assert torch.equal(keep("token_k3", threshold=0.12), expected)


def test_seq_sum_and_mean_k1_reject_whole_responses():
    # sums: 0, 0.2, 2.0 -> ratios 1, 1.22, 7.39: [0.5, 2] keeps responses 0 and 1.
    assert torch.equal(keep("seq_sum_k1"), MASK * torch.tensor([[1.0], [1.0], [0.0]], dtype=torch.float64))
    # means: 0, 0.1, 2/3 -> ratios 1, 1.105, 1.948: all kept under cap 2, response 2 rejected under cap 1.5.
    assert torch.equal(keep("seq_mean_k1"), MASK)
    assert torch.equal(keep("seq_mean_k1", high=1.5), MASK * torch.tensor([[1.0], [1.0], [0.0]], dtype=torch.float64))


def test_seq_k2_statistics():
    # k2 per response: [0, .125, .125] sum .25 mean .0833 max .125; [.005, .005] sum .01 mean .005
    # max .005; [2, 0, 0] sum 2 mean .667 max 2.
    rows = lambda *kept: MASK * torch.tensor([[k] for k in kept], dtype=torch.float64)
    assert torch.equal(keep("seq_sum_k2", threshold=0.2), rows(0.0, 1.0, 0.0))
    assert torch.equal(keep("seq_mean_k2", threshold=0.1), rows(1.0, 1.0, 0.0))
    assert torch.equal(keep("seq_max_k2", threshold=0.1), rows(0.0, 1.0, 0.0))
    assert torch.equal(keep("seq_max_k3", threshold=0.2), rows(1.0, 1.0, 0.0))


def test_padding_does_not_count():
    # A huge log-ratio on a padded token changes no decision.
    old = OLD.clone()
    old[1, 2] = 15.0
    for mode in DIVERGENCE_REJECTION_MODES:
        threshold = None if mode.endswith("_k1") else 0.1
        assert torch.equal(rejection_keep_mask(mode, old, SAMPLING, MASK, 0.5, 2.0, threshold), keep(mode, threshold))


def test_correction_weights_and_drop_use_the_mode():
    correction = SamplingCorrection(mode="seq_max_k2", threshold=0.1, rejected_tokens="drop")
    correction.check()
    assert torch.equal(correction.weights(OLD, SAMPLING, MASK), keep("seq_max_k2", threshold=0.1))
    kept, metrics = correction.drop_rejected(MASK, OLD, SAMPLING)
    assert torch.equal(kept, keep("seq_max_k2", threshold=0.1))
    assert metrics["sampling_dropped_fraction"] == pytest.approx(6 / 8)


@pytest.mark.parametrize("settings, message", [
    ({"mode": "token_k2"}, "needs threshold"),
    ({"mode": "reject", "threshold": 0.1}, "threshold is read only"),
    ({"mode": "token_k9"}, "seq_max_k3"),
])
def test_bad_settings_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        SamplingCorrection(**settings).check()


def test_rollout_rs_mode_passes_the_config_check_and_unknown_is_refused(make_cfg):
    """From the command line: a k2 mode with its threshold validates; one without it, or an unknown
    mode, is refused before anything loads, the unknown one with the list of modes."""
    from rlbench.validation import validate_config

    validate_config(make_cfg("experiment=smoke", "+algorithm.sampling_correction={mode: seq_max_k2, threshold: 0.1}"))
    with pytest.raises(ConfigError, match="needs threshold"):
        validate_config(make_cfg("experiment=smoke", "+algorithm.sampling_correction={mode: token_k3}"))
    with pytest.raises(ConfigError, match="seq_mean_k1"):
        validate_config(make_cfg("experiment=smoke", "+algorithm.sampling_correction={mode: seq_k2}"))


# verl's rollout_rs options (verl/trainer/ppo/rollout_corr_helper.py, SUPPORTED_ROLLOUT_RS_OPTIONS, read
# 2026-12-05 at commit e1904109): token_k1 is rlbench's `reject`, the other ten are modes of the same name.
VERL_ROLLOUT_RS_OPTIONS = {"token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                           "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"}


def test_the_mode_names_are_verls_options():
    assert set(DIVERGENCE_REJECTION_MODES) == VERL_ROLLOUT_RS_OPTIONS - {"token_k1"}


def verl_k1_keep(statistic: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """verl's k1 rule, from its definition: the k1 statistic is -log r (r = pi_train / pi_rollout) and a
    `lower_upper` threshold keeps log lower <= statistic <= log upper."""
    return ((statistic >= math.log(lower)) & (statistic <= math.log(upper))).to(torch.float64)


@pytest.mark.parametrize("low, high", [(0.5, 2.0), (0.9, 1.5)])
def test_k1_bounds_are_on_the_importance_weight_and_equal_verls_with_bounds_mirrored(low, high):
    """The choice: rlbench's [low, high] bounds the importance weight pi_old / pi_sampler, as `mask`,
    `reject` and `truncate` do. verl's k1 statistic is -log r, so its `lower_upper` bounds pi_rollout /
    pi_old: its [a, b] keeps what rlbench's [1 / b, 1 / a] keeps. With low = 1 / high (the default of
    both) the two are the same rule; with asymmetric bounds they are mirrored (docs/algorithms.md)."""
    sums = (LOG_RATIO * MASK).sum(-1, keepdim=True)
    means = sums / MASK.sum(-1, keepdim=True)
    for mode, statistic in (("seq_sum_k1", -sums), ("seq_mean_k1", -means)):
        ours = keep(mode, low=low, high=high)
        assert torch.equal(ours, MASK * verl_k1_keep(statistic, 1 / high, 1 / low))
        if math.isclose(low * high, 1.0):
            assert torch.equal(ours, MASK * verl_k1_keep(statistic, low, high))
    # with bounds [0.9, 1.5], response 1 (summed log-ratio 0.2: weight 1.22, inverse 0.82) is kept here
    # and rejected by verl's rule on the same numbers
    ours = keep("seq_sum_k1", low=0.9, high=1.5)
    assert torch.equal(ours[:, :1], torch.tensor([[1.0], [1.0], [0.0]], dtype=torch.float64))
    assert verl_k1_keep(-sums, 0.9, 1.5).flatten().tolist() == [1.0, 0.0, 0.0]
