"""Closed-form checks of the advantage-estimator zoo (rlbench/algorithm/advantages/).

Every expected number below was worked out by hand; the arithmetic is in the comments. Tensors
are tiny and built by hand: no model, no randomness except seeded fixtures.
"""

import inspect
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlbench.algorithm import ADVANTAGES
from rlbench.algorithm.advantages import (
    PVPOBaselineCache,
    SPOTracker,
    batch_std_advantage,
    dr_grpo_advantage,
    edge_grpo_advantage,
    gae_advantage,
    gae_returns,
    gpg_advantage,
    grpo_advantage,
    grpo_s_advantage,
    gtpo_advantage,
    ngrpo_advantage,
    opo_advantage,
    passk_advantage,
    polychromic_advantage,
    pvpo_advantage,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    reinforce_pp_returns,
    remax_advantage,
    rloo_advantage,
    spo_advantage,
    spo_tracker_init,
    spo_tracker_update,
    value_loss,
)
from rlbench.errors import ConfigError

NEW_NAMES = [
    "batch_std", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "gpg", "passk",
    "ngrpo", "spo", "pvpo", "edge_grpo", "polychromic", "gtpo", "grpo_s", "gae",
]  # fmt: skip
ADVANTAGE_YAML_DIR = Path(__file__).resolve().parents[1] / "conf" / "algorithm" / "advantage"
TRAINER_INPUTS = {
    "rewards", "group_index", "response_mask", "entropy", "old_logp", "values", "baseline_rewards",
    "token_rewards", "tracker_baseline", "answer_keys", "diversity",
}  # fmt: skip


def col(adv):
    """The per-response value of a broadcast advantage (its first token)."""
    return adv[:, 0].double()


def close(actual, expected, tol=1e-4):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(actual.double(), expected, atol=tol, rtol=0), f"{actual} != {expected}"


# --------------------------------------------------------------------------------------------
# A mixed batch with every edge case at once:
#   g0 = [1, 0, 0]        mixed, size 3
#   g1 = [1, 1]           all-equal (all correct)
#   g2 = [1]              singleton
#   g3 = [0, 0, 0]        all wrong
#   g4 = [0, 1]           row 9 (reward 0) has a zero-length response (mask row all zero)
# Lengths vary, padding sits at the end of every row.
# --------------------------------------------------------------------------------------------
EDGE_REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
EDGE_GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 4, 4])
EDGE_LENGTHS = [4, 2, 3, 1, 4, 2, 3, 4, 1, 0, 2]
EDGE_MASK = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in EDGE_LENGTHS])
SINGLETON_ROW, EMPTY_ROW = 5, 9


def edge_inputs():
    generator = torch.Generator().manual_seed(0)
    batch, length = EDGE_MASK.shape
    noise = torch.rand(batch, batch, generator=generator)
    return {
        "rewards": EDGE_REWARDS,
        "group_index": EDGE_GROUPS,
        "response_mask": EDGE_MASK,
        "entropy": 0.1 + torch.rand(batch, length, generator=generator),
        "old_logp": -torch.rand(batch, length, generator=generator),
        "values": torch.rand(batch, length, generator=generator),
        "baseline_rewards": torch.full((batch,), 0.25),
        "tracker_baseline": torch.rand(batch, generator=generator),
        "answer_keys": torch.tensor([3, 4, 4, 5, 6, 7, 8, 8, 9, 1, 2]),
        "diversity": (noise + noise.T) / 2,
    }


def yaml_params(name):
    node = OmegaConf.to_container(OmegaConf.load(ADVANTAGE_YAML_DIR / f"{name}.yaml"))
    assert node.pop("name") == name
    return node


# ----------------------------------------------------------------------------- registry + YAML


def test_every_new_estimator_is_registered():
    assert set(NEW_NAMES) <= set(ADVANTAGES.names())


@pytest.mark.parametrize("name", NEW_NAMES)
def test_yaml_params_are_accepted_and_match_the_defaults(name):
    params = yaml_params(name)
    ADVANTAGES.validate_params(name, params, TRAINER_INPUTS)
    signature = inspect.signature(ADVANTAGES.get(name)).parameters
    for key, value in params.items():
        assert signature[key].default == value, f"{name}.yaml {key}={value} differs from the code default"


@pytest.mark.parametrize("name", NEW_NAMES)
def test_every_estimator_runs_on_the_edge_batch(name):
    """Shape [B,T], finite, exactly 0 on padding and on the zero-length response."""
    torch.manual_seed(0)
    adv = ADVANTAGES.call(name, edge_inputs(), yaml_params(name))
    assert adv.shape == EDGE_MASK.shape
    assert torch.isfinite(adv).all()
    assert torch.all(adv[EDGE_MASK == 0] == 0), "padding must carry no advantage"
    assert torch.all(adv[EMPTY_ROW] == 0)


@pytest.mark.parametrize("name", ["batch_std", "rloo", "opo", "gpg", "passk", "edge_grpo", "polychromic"])
def test_singleton_groups_get_zero(name):
    adv = ADVANTAGES.call(name, edge_inputs(), yaml_params(name))
    assert torch.all(adv[SINGLETON_ROW] == 0)


@pytest.mark.parametrize("name", ["batch_std", "rloo", "opo", "gpg", "passk", "edge_grpo"])
def test_all_equal_groups_get_zero(name):
    adv = ADVANTAGES.call(name, edge_inputs(), yaml_params(name))
    assert torch.all(adv[EDGE_GROUPS == 1] == 0)  # g1 = [1, 1]
    assert torch.all(adv[EDGE_GROUPS == 3] == 0)  # g3 = [0, 0, 0]


def test_unknown_yaml_param_is_a_config_error():
    with pytest.raises(ConfigError):
        ADVANTAGES.validate_params("rloo", {"epsilon": 1e-6}, TRAINER_INPUTS)


# ----------------------------------------------------------------------------- batch_std


def test_batch_std_hand_values():
    # rewards [1,0,0,0 | 1,1,0,0]: group means 0.25 and 0.5.
    # batch: mean 3/8; sum of squared deviations = 3*(5/8)^2 + 5*(3/8)^2 = 1.875; /7 -> std 0.517549
    # g0: 0.75/0.517549 = 1.44914, -0.25/0.517549 = -0.48305;  g1: +-0.5/0.517549 = +-0.96609
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = batch_std_advantage(rewards, groups, torch.ones(8, 2), epsilon=0.0)
    close(col(adv), [1.44914, -0.48305, -0.48305, -0.48305, 0.96609, 0.96609, -0.96609, -0.96609])


def test_batch_std_equals_grpo_for_a_single_group():
    # Both use the unbiased std of the same B rewards, so one group makes them identical.
    rewards = torch.tensor([0.3, 1.0, 0.0, 0.7, 0.2])
    groups = torch.zeros(5, dtype=torch.long)
    mask = torch.ones(5, 3)
    assert torch.allclose(batch_std_advantage(rewards, groups, mask), grpo_advantage(rewards, groups, mask))


def test_batch_std_all_equal_batch_is_zero():
    adv = batch_std_advantage(torch.ones(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2), epsilon=0.0)
    assert torch.all(adv == 0)


# ----------------------------------------------------------------------------- rloo


def test_rloo_hand_values_with_variable_group_sizes():
    # g0 [1,0,0,0]: 1 - 0 = 1;  0 - (1+0+0)/3 = -1/3.   g1 [2,4]: 2-4 = -2, 4-2 = 2.   g2 [5]: 0.
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 4, 5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = rloo_advantage(rewards, groups, torch.ones(7, 2))
    close(col(adv), [1, -1 / 3, -1 / 3, -1 / 3, -2, 2, 0])


def test_rloo_is_n_over_n_minus_one_dr_grpo_for_equal_groups():
    rewards = torch.tensor([0.1, 0.9, 0.4, 0.0, 1.0, 1.0, 0.0, 0.5, 0.2, 0.2, 0.7, 0.3])
    groups = torch.arange(3).repeat_interleave(4)
    mask = torch.ones(12, 2)
    expected = (4 / 3) * dr_grpo_advantage(rewards, groups, mask)
    assert torch.allclose(rloo_advantage(rewards, groups, mask), expected, atol=1e-6)


# ----------------------------------------------------------------------------- reinforce++


def test_reinforce_pp_returns_gamma_one_outcome_only_is_r_on_every_token():
    rewards = torch.tensor([1.0, -0.5, 0.3])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    returns = reinforce_pp_returns(rewards, mask, gamma=1.0)
    close(returns, [[1, 1, 1, 0], [-0.5, -0.5, 0, 0], [0, 0, 0, 0]])


def test_reinforce_pp_returns_discount_and_mask_holes():
    # row 0: r = [0,1,2], gamma 0.5: G2 = 2, G1 = 1 + 0.5*2 = 2, G0 = 0 + 0.5*2 = 1.
    # row 1: mask [1,0,1] (a tool-output hole), r = [1,9,2]: the 9 is ignored and the hole is
    #        skipped: G2 = 2, G1 = 0 (masked), G0 = 1 + 0.5*2 = 2.
    token_rewards = torch.tensor([[0.0, 1, 2], [1, 9, 2]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 1]])
    returns = reinforce_pp_returns(torch.zeros(2), mask, token_rewards=token_rewards, gamma=0.5)
    close(returns, [[1, 2, 2], [2, 0, 2]])


def test_reinforce_pp_whitens_over_valid_tokens():
    # returns: row 0 [1,1,pad], row 1 [0,pad,pad] -> valid [1,1,0]: mean 2/3,
    # unbiased var = (1/9 + 1/9 + 4/9)/2 = 1/3 -> std 0.57735; A = 0.57735, 0.57735, -1.15470.
    adv = reinforce_pp_advantage(torch.tensor([1.0, 0]), torch.tensor([[1.0, 1, 0], [1, 0, 0]]), epsilon=0.0)
    close(adv, [[0.57735, 0.57735, 0], [-1.15470, 0, 0]])


def test_reinforce_pp_baseline_hand_values():
    # a = r - group mean = [0.5, -0.5, 0, 0]; tokens (lengths 2,1,2,2): [.5,.5,-.5,0,0,0,0]
    # mean 0.5/7 = 0.0714286; deviations .428571 (x2), -.571429, -.0714286 (x4)
    # SS = 2*.183673 + .326531 + 4*.005102 = .714286 -> var .119048, std .345033
    # A = 1.24212, -1.65616, -0.20702
    rewards = torch.tensor([1.0, 0, 1, 1])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1], [1, 0], [1, 1], [1, 1]])
    adv = reinforce_pp_baseline_advantage(rewards, groups, mask, epsilon=0.0)
    close(adv, [[1.24212, 1.24212], [-1.65616, 0], [-0.20702, -0.20702], [-0.20702, -0.20702]])


# ----------------------------------------------------------------------------- remax / pvpo


def test_remax_outcome_and_token_rewards():
    # outcome: [1, 0] - greedy 0.5 = [0.5, -0.5]
    adv = remax_advantage(torch.tensor([1.0, 0]), torch.tensor([0.5, 0.5]), torch.tensor([[1.0, 1], [1, 0]]))
    close(adv, [[0.5, 0.5], [-0.5, 0]])
    # token rewards [0, -0.1, 1]: G = [0.9, 0.9, 1.0]; minus 0.5 -> [0.4, 0.4, 0.5]
    adv = remax_advantage(torch.tensor([1.0]), torch.tensor([0.5]), torch.ones(1, 3), torch.tensor([[0.0, -0.1, 1]]))
    close(adv, [[0.4, 0.4, 0.5]])


def test_pvpo_with_group_mean_anchor_is_dr_grpo():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 2)
    anchor = torch.tensor([1 / 3, 1 / 3, 1 / 3, 2.5 / 3, 2.5 / 3, 2.5 / 3])
    assert torch.allclose(pvpo_advantage(rewards, anchor, groups, mask), dr_grpo_advantage(rewards, groups, mask))


def test_pvpo_keeps_signal_in_all_correct_and_all_wrong_groups():
    # all correct with V_ref 0.25 -> +0.75; all wrong with V_ref 0.25 -> -0.25
    rewards = torch.tensor([1.0, 1, 0, 0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = pvpo_advantage(rewards, torch.full((4,), 0.25), groups, torch.ones(4, 1))
    close(col(adv), [0.75, 0.75, -0.25, -0.25])
    # scale_by_std: those groups have std 0 and stay unscaled; a [1,0] group (std 0.70711) is scaled:
    # (1 - 0.25)/0.70711 = 1.06066, (0 - 0.25)/0.70711 = -0.35355
    adv = pvpo_advantage(
        torch.tensor([1.0, 1, 1, 0]), torch.full((4,), 0.25), groups, torch.ones(4, 1), scale_by_std=True, epsilon=0.0
    )
    close(col(adv), [0.75, 0.75, 1.06066, -0.35355])


def test_pvpo_baseline_cache():
    cache = PVPOBaselineCache(refresh_every=10)
    cache.put("a", [1, 0, 0, 1], step=0)  # mean 0.5
    cache.put("b", [1, 1], step=5)  # mean 1.0
    close(cache.baseline(["a", "b", "a"]), [0.5, 1.0, 0.5])
    assert cache.in_band("a") and not cache.in_band("b")
    assert cache.stale("a", step=10) and not cache.stale("b", step=10) and cache.stale("new", step=0)
    with pytest.raises(KeyError):
        cache.baseline(["missing"])
    restored = PVPOBaselineCache()
    restored.load_state_dict(cache.state_dict())
    assert restored.refresh_every == 10 and restored.mean("b") == 1.0


# ----------------------------------------------------------------------------- opo


def test_opo_length_weighted_baseline():
    # lengths [1,2,3], rewards [1,0,1]: b = (1*1 + 2*0 + 3*1)/6 = 2/3 -> A = [1/3, -2/3, 1/3]
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 0], [1, 1, 1]])
    adv = opo_advantage(torch.tensor([1.0, 0, 1]), torch.zeros(3, dtype=torch.long), mask)
    close(adv, [[1 / 3, 0, 0], [-2 / 3, -2 / 3, 0], [1 / 3, 1 / 3, 1 / 3]])


def test_opo_equal_lengths_is_dr_grpo_and_empty_group_falls_back_to_mean():
    rewards = torch.tensor([1.0, 0, 0, 0.4, 0.6])
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.ones(5, 3)
    assert torch.allclose(opo_advantage(rewards, groups, mask), dr_grpo_advantage(rewards, groups, mask))
    # all-empty group: the baseline falls back to the mean, and no token carries the advantage.
    adv = opo_advantage(torch.tensor([1.0, 0]), torch.tensor([0, 0]), torch.zeros(2, 3))
    assert torch.all(adv == 0) and torch.isfinite(adv).all()


# ----------------------------------------------------------------------------- gpg


def test_gpg_adaptive_alpha_hand_values():
    # B = 8, nonzero rewards = 4 -> alpha = 2.  g0 mean .25 -> 2*(.75, -.25);  g1 mean .75 -> 2*(.25, -.75)
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = gpg_advantage(rewards, groups, torch.ones(8, 1))
    close(col(adv), [1.5, -0.5, -0.5, -0.5, 0.5, 0.5, -1.5, 0.5])


def test_gpg_alpha_override_and_denominators():
    # rewards [1,0 | 1,1]: nonzero 3 -> alpha 4/3; informative responses (group std > 0) 2 -> alpha 2
    rewards = torch.tensor([1.0, 0, 1, 1])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 1)
    close(col(gpg_advantage(rewards, groups, mask)), [4 / 3 * 0.5, -4 / 3 * 0.5, 0, 0])
    close(col(gpg_advantage(rewards, groups, mask, alpha_denominator="informative")), [1.0, -1.0, 0, 0])
    close(col(gpg_advantage(rewards, groups, mask, alpha=0.1)), [0.05, -0.05, 0, 0])  # override works
    with pytest.raises(ConfigError):
        gpg_advantage(rewards, groups, mask, alpha_denominator="bogus")


def test_gpg_with_all_nonzero_rewards_is_dr_grpo():
    rewards = torch.tensor([1.0, 0.5, 0.2, 2.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 2)
    assert torch.allclose(gpg_advantage(rewards, groups, mask), dr_grpo_advantage(rewards, groups, mask))


def test_gpg_all_zero_batch_is_zero():
    adv = gpg_advantage(torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))
    assert torch.all(adv == 0)


# ----------------------------------------------------------------------------- passk


def test_passk_max_minus_second():
    # g0 [1, .5, .2]: top gets 1 - .5 = .5; std: mean .56667, SS = .18778+.00444+.13444 = .32667,
    # var .16333, std .40415 -> .5/.40415 = 1.23718.  g1 [1, 1] (tie) -> 0.  g2 [0.3] singleton -> 0.
    rewards = torch.tensor([1.0, 0.5, 0.2, 1.0, 1.0, 0.3])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = torch.ones(6, 1)
    close(col(passk_advantage(rewards, groups, mask, epsilon=0.0)), [1.23718, 0, 0, 0, 0, 0])
    close(col(passk_advantage(rewards, groups, mask, scale_by_std=False)), [0.5, 0, 0, 0, 0, 0])


def test_passk_binary_rewards_only_single_success_groups_carry_signal():
    # g0 one success of 4: gap 1, std 0.5 -> 2.  g1 two successes: gap 0.  g2 none: 0.
    rewards = torch.tensor([0.0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    groups = torch.arange(3).repeat_interleave(4)
    close(col(passk_advantage(rewards, groups, torch.ones(12, 1), epsilon=0.0)), [0, 2] + [0] * 10)


# ----------------------------------------------------------------------------- ngrpo


def test_ngrpo_worked_numbers():
    # G=8, one correct, +1 virtual 1.0: 9 values with two 1s: mean 2/9,
    # var = (2*(7/9)^2 + 7*(2/9)^2)/8 = 0.194444, std 0.440959:
    # A+ = (7/9)/0.440959 = 1.76383, A- = -(2/9)/0.440959 = -0.50395
    rewards = torch.tensor([1.0] + [0.0] * 7)
    groups = torch.zeros(8, dtype=torch.long)
    close(col(ngrpo_advantage(rewards, groups, torch.ones(8, 1), epsilon=0.0)), [1.76383] + [-0.50395] * 7)
    # all wrong: mean 1/9, var = ((8/9)^2 + 8*(1/9)^2)/8 = 1/9, std 1/3 -> A = -(1/9)/(1/3) = -1/3
    close(col(ngrpo_advantage(torch.zeros(8), groups, torch.ones(8, 1), epsilon=0.0)), [-1 / 3] * 8)


def test_ngrpo_edge_cases():
    # all correct -> 0; singleton wrong: {0, 1} mean .5 std .70711 -> -.70711
    rewards = torch.tensor([1.0, 1, 1, 0])
    groups = torch.tensor([0, 0, 0, 1])
    close(col(ngrpo_advantage(rewards, groups, torch.ones(4, 1), epsilon=0.0)), [0, 0, 0, -0.70711])


def test_ngrpo_without_virtual_samples_is_grpo():
    rewards, groups, mask = EDGE_REWARDS, EDGE_GROUPS, EDGE_MASK
    assert torch.allclose(ngrpo_advantage(rewards, groups, mask, num_virtual=0), grpo_advantage(rewards, groups, mask))


# ----------------------------------------------------------------------------- edge_grpo


def test_edge_grpo_scales_by_inverse_relative_entropy():
    # GRPO (eps 0) on [1,0,0,0]: [1.5, -.5, -.5, -.5]. Mean entropies [2,1,1,1] -> batch mean 1.25.
    # A = 1.5*1.25/2 = 0.9375;  -0.5*1.25/1 = -0.625.  (Doubling an entropy halves |A|.)
    # Row 4 is empty: it gets 0 and does not enter the batch mean.
    rewards = torch.tensor([1.0, 0, 0, 0, 1])
    groups = torch.tensor([0, 0, 0, 0, 1])
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 0], [1, 1], [0, 0]])
    entropy = torch.tensor([[1.0, 3], [1, 1], [1, 99], [0.5, 1.5], [7, 7]])
    adv = edge_grpo_advantage(rewards, groups, mask, entropy, epsilon=0.0)
    close(adv, [[0.9375, 0.9375], [-0.625, -0.625], [-0.625, 0], [-0.625, -0.625], [0, 0]])


def test_edge_grpo_equal_entropies_is_grpo():
    entropy = torch.full(EDGE_MASK.shape, 0.7)
    adv = edge_grpo_advantage(EDGE_REWARDS, EDGE_GROUPS, EDGE_MASK, entropy, epsilon=1e-4)
    assert torch.allclose(adv, grpo_advantage(EDGE_REWARDS, EDGE_GROUPS, EDGE_MASK, epsilon=1e-4), atol=1e-6)


# ----------------------------------------------------------------------------- gtpo / grpo_s


def test_gtpo_hand_values():
    # One group: i0 correct H=[1,3], i1 correct H=[3,1], i2 wrong H=[2,pad]; a1 = a2 = 0.5.
    # t=0: O+ alive {0,1}, sum H 4, d 2 -> shares 1/4*2 = .5, 3/4*2 = 1.5 -> r~ .75, 1.25
    # t=1: shares 1.5, .5 -> r~ 1.25, .75.   i2 t=0: O- alone -> share 1 -> r~ = -.5 - .5 = -1
    # tokens [.75,1.25,1.25,.75,-1]: mean .6, SS = 2*.0225 + 2*.4225 + 2.56 = 3.45, var .8625, std .928709
    # A = .15/.928709 = .16151, .65/.928709 = .69990, -1.6/.928709 = -1.72282
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 0]])
    entropy = torch.tensor([[1.0, 3], [3, 1], [2, 5]])
    adv = gtpo_advantage(torch.tensor([1.0, 1, 0]), torch.zeros(3, dtype=torch.long), mask, entropy, epsilon=0.0)
    close(adv, [[0.16151, 0.69990], [0.69990, 0.16151], [-1.72282, 0]])


def test_gtpo_wrong_responses_punish_confident_tokens_most():
    # Wrong i1 H=[1,4], i2 H=[4,1]: t=0 1/H = 1, .25 (sum 1.25, d 2) -> shares 1.6, .4
    # -> r~ = -.5 - .8 = -1.3 for the confident (H=1) token, -.5 - .2 = -.7 for the other.
    mask = torch.ones(3, 2)
    entropy = torch.tensor([[1.0, 1], [1, 4], [4, 1]])
    adv = gtpo_advantage(torch.tensor([1.0, 0, 0]), torch.zeros(3, dtype=torch.long), mask, entropy)
    assert adv[1, 0] < adv[1, 1] and adv[2, 1] < adv[2, 0]
    assert adv[1, 0] == adv.min() and adv[2, 1] == adv.min()
    assert torch.all(adv[0] > 0) and torch.all(adv[1:] < 0)


def test_gtpo_uniform_entropy_has_grpo_sign_pattern():
    entropy = torch.ones(EDGE_MASK.shape)
    adv = gtpo_advantage(EDGE_REWARDS, EDGE_GROUPS, EDGE_MASK, entropy)
    grpo = grpo_advantage(EDGE_REWARDS, EDGE_GROUPS, EDGE_MASK)
    # g4 differs by design: its wrong response is empty, so it has no tokens in GTPO's token
    # statistics and the lone correct response is compared with nothing (GRPO gives it +0.707).
    kept = EDGE_GROUPS != 4
    assert torch.equal(torch.sign(adv[kept]), torch.sign(grpo[kept]))
    assert torch.all(adv[EDGE_GROUPS == 4] == 0)


def test_grpo_s_hand_values():
    # mean entropies: i0 1 (correct), i1 3 (correct), i2 2 (wrong); b1 = b2 = .5
    # O+: shares 1/4*2 = .5, 3/4*2 = 1.5 -> r^ .75, 1.25;  O- alone -> r^ -1
    # GRPO on [.75, 1.25, -1]: mean 1/3, SS = .173611 + .840278 + 1.777778 = 2.791667, var 1.395833,
    # std 1.181454 -> A = .35267, .77588, -1.12855
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 0]])
    entropy = torch.tensor([[0.5, 1.5], [3, 3], [2, 9]])
    adv = grpo_s_advantage(torch.tensor([1.0, 1, 0]), torch.zeros(3, dtype=torch.long), mask, entropy, epsilon=0.0)
    close(adv, [[0.35267, 0.35267], [0.77588, 0.77588], [-1.12855, 0]])


def test_grpo_s_uniform_entropy_binary_rewards_is_grpo():
    # r^ = 2r - 1 (an affine map of 0/1 rewards), and GRPO is affine invariant when epsilon = 0.
    entropy = torch.full(EDGE_MASK.shape, 0.3)
    adv = grpo_s_advantage(EDGE_REWARDS, EDGE_GROUPS, EDGE_MASK, entropy, epsilon=0.0)
    assert torch.allclose(adv, grpo_advantage(EDGE_REWARDS, EDGE_GROUPS, EDGE_MASK, epsilon=0.0), atol=1e-6)


# ----------------------------------------------------------------------------- polychromic


def test_polychromic_answer_keys_hand_values():
    # rewards [1,1,1,0], keys [7,7,8,9], sets of 2 (all 6):
    # (0,1) same answer: d=1/2, f=.5 | (0,2) d=1, f=1 | (0,3) d=1/2, mean r .5, f=.25
    # (1,2) f=1 | (1,3) f=.25 | (2,3) f=.25      -> b = 3.25/6 = .541667
    # A0 = mean(.5,1,.25) - b = .041667 = A1; A2 = mean(1,1,.25) - b = .208333; A3 = .25 - b = -.291667
    adv = polychromic_advantage(
        torch.tensor([1.0, 1, 1, 0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1),
        answer_keys=torch.tensor([7, 7, 8, 9]), set_size=2,
    )  # fmt: skip
    close(col(adv), [0.041667, 0.041667, 0.208333, -0.291667])
    assert abs(col(adv).sum().item()) < 1e-6  # sum_S (f - b) = 0 and every response is in 3 sets


def test_polychromic_pairwise_diversity_hand_values():
    # rewards all 1; D01 = 0, D02 = D12 = 1; sets of 2: f(0,1)=0, f(0,2)=1, f(1,2)=1, b = 2/3
    # A0 = A1 = .5 - 2/3 = -1/6;  A2 = 1 - 2/3 = 1/3
    diversity = torch.tensor([[0.0, 0, 1], [0, 0, 1], [1, 1, 0]])
    adv = polychromic_advantage(
        torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3, 1),
        diversity=diversity, diversity_from="diversity", set_size=2,
    )  # fmt: skip
    close(col(adv), [-1 / 6, -1 / 6, 1 / 3])


def test_polychromic_identical_responses_and_diverse_newcomer():
    groups = torch.zeros(5, dtype=torch.long)
    same = polychromic_advantage(torch.ones(5), groups, torch.ones(5, 1), answer_keys=torch.full((5,), 4))
    assert torch.all(same == 0)
    # equal rewards, one response with a new answer -> it gets A > 0, the others A < 0
    diverse = polychromic_advantage(torch.ones(5), groups, torch.ones(5, 1), answer_keys=torch.tensor([4, 4, 4, 4, 5]))
    assert diverse[4, 0] > 0 and torch.all(diverse[:4, 0] < 0)


def test_polychromic_sampled_sets_approximate_enumeration():
    rewards = torch.tensor([1.0, 0, 1, 1, 0, 1, 0, 1])
    keys = torch.tensor([1, 2, 3, 1, 5, 3, 6, 7])
    groups, mask = torch.zeros(8, dtype=torch.long), torch.ones(8, 1)
    exact = polychromic_advantage(rewards, groups, mask, answer_keys=keys, set_size=4, max_sets=70)  # C(8,4)=70
    first = polychromic_advantage(rewards, groups, mask, answer_keys=keys, set_size=4, max_sets=60, seed=3)
    again = polychromic_advantage(rewards, groups, mask, answer_keys=keys, set_size=4, max_sets=60, seed=3)
    assert torch.equal(first, again)  # seeded
    mean = torch.stack(
        [polychromic_advantage(rewards, groups, mask, answer_keys=keys, max_sets=60, seed=s) for s in range(10)]
    ).mean(0)
    assert torch.allclose(mean, exact, atol=0.02)  # |exact| is 0.04-0.09; 10 seeds land within 0.01


def test_polychromic_needs_its_input_and_blends_grpo():
    with pytest.raises(ConfigError):
        polychromic_advantage(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2, 1))
    rewards, groups, mask = torch.tensor([1.0, 0, 0, 1]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1)
    keys = torch.tensor([1, 2, 3, 4])
    poly = polychromic_advantage(rewards, groups, mask, answer_keys=keys)
    both = polychromic_advantage(rewards, groups, mask, answer_keys=keys, grpo_coef=1.0, poly_coef=2.0)
    assert torch.allclose(both, grpo_advantage(rewards, groups, mask) + 2 * poly, atol=1e-6)


# ----------------------------------------------------------------------------- spo


def test_spo_tracker_update_closed_form():
    # (value .5, weight 1) = Beta(.5,.5); r = 1, kl = .06 = d_half -> 2^-1 = .5 (rho_min lowered to .1)
    # alpha = .5*.5 + 1 = 1.25, beta = .5*.5 = .25 -> value 1.25/1.5 = 5/6, weight 1.5
    value, weight = spo_tracker_update(0.5, 1.0, 1.0, 0.06, rho_min=0.1)
    assert value.item() == pytest.approx(5 / 6) and weight.item() == pytest.approx(1.5)
    # default rho_min .875 clips .5 up: alpha = .875*.5 + 1 = 1.4375, weight = 1.875 -> value .766667
    value, weight = spo_tracker_update(0.5, 1.0, 1.0, 0.06)
    assert value.item() == pytest.approx(1.4375 / 1.875) and weight.item() == pytest.approx(1.875)
    # kl = 0 -> 2^0 = 1, clipped to rho_max .96; r = 0: alpha = .96*.5 = .48, weight 1.96
    value, _ = spo_tracker_update(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    close(value, [0.48 / 1.96])
    # constant-rho variant
    value, weight = spo_tracker_update(0.5, 1.0, 1.0, 123.0, rho=0.5)
    assert value.item() == pytest.approx(5 / 6)


def test_spo_tracker_init():
    # 3 successes of 4, rho_min .875: value (3.5)/5 = .7, weight 1/(1-.875) = 8
    assert spo_tracker_init(3, 4) == (pytest.approx(0.7), pytest.approx(8.0))
    assert spo_tracker_init(0, 0) == (0.5, 1.0)


def test_spo_advantage_hand_values():
    # a = r - p = [.5, -.5, .75, -.75]: mean 0, var (.25+.25+.5625+.5625)/3 = .541667, std .735980
    # A = .67937, -.67937, 1.01905, -1.01905
    adv = spo_advantage(torch.tensor([1.0, 0, 1, 0]), torch.tensor([0.5, 0.5, 0.25, 0.75]), torch.ones(4, 2))
    close(col(adv), [0.67937, -0.67937, 1.01905, -1.01905])
    raw = spo_advantage(torch.tensor([1.0, 0]), torch.tensor([0.25, 0.25]), torch.ones(2, 1), normalize=False)
    close(col(raw), [0.75, -0.25])


def test_spo_gives_signal_where_grpo_groups_are_degenerate():
    # Two prompts, all responses correct (GRPO: 0), but the tracker believed .5 and .8.
    adv = spo_advantage(torch.ones(2), torch.tensor([0.5, 0.8]), torch.ones(2, 1), normalize=False)
    close(col(adv), [0.5, 0.2])


def test_spo_tracker_class():
    tracker = SPOTracker(rho_min=0.1)
    close(tracker.baseline(["x"]), [0.5])  # unseen prompt: Beta(.5,.5)
    tracker.update(["x"], [1.0], [0.06])  # -> (5/6, 1.5), as in the closed-form test
    close(tracker.baseline(["x", "y"]), [5 / 6, 0.5])
    weights = tracker.sampling_weights(["x", "y"])  # sqrt(p(1-p)) + .05: max at p = .5
    close(weights, [math.sqrt(5 / 36) + 0.05, 0.55])
    restored = SPOTracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored.state_of("x") == pytest.approx((5 / 6, 1.5))
    tracker.initialise("z", successes=3, num_samples=4)
    assert tracker.state_of("z") == pytest.approx((0.7, 1 / 0.9))


# ----------------------------------------------------------------------------- gae + value loss


def test_gae_lambda_gamma_one_is_return_minus_value():
    # R = 1 on the last token, gamma = lam = 1 -> A_t = 1 - V_t
    values = torch.tensor([[0.2, 0.5, 0.9]])
    adv = gae_advantage(torch.tensor([1.0]), values, torch.ones(1, 3), gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.8, 0.5, 0.1]])


def test_gae_hand_values_and_returns():
    # gamma = lam = .5, V = [.2,.5,.9], R = 1 on the last token:
    # delta2 = 1 - .9 = .1; delta1 = .5*.9 - .5 = -.05; delta0 = .5*.5 - .2 = .05
    # A2 = .1; A1 = -.05 + .25*.1 = -.025; A0 = .05 + .25*(-.025) = .04375
    # returns = A + V = [.24375, .475, 1.0]
    values = torch.tensor([[0.2, 0.5, 0.9]])
    args = (torch.tensor([1.0]), values, torch.ones(1, 3))
    close(gae_advantage(*args, gamma=0.5, lam=0.5, whiten=False), [[0.04375, -0.025, 0.1]])
    close(gae_returns(*args, gamma=0.5, lam=0.5), [[0.24375, 0.475, 1.0]])


def test_gae_padding_holes_and_whitening():
    # row 0: mask [1,0,1] (hole), V = [.2, nan, .9]: the hole is skipped:
    #   A2 = 1 - .9 = .1, A0 = 0 + V2 - V0 + A2 = .9 - .2 + .1 = .8 (gamma = lam = 1) = 1 - V0
    # row 1: empty response -> 0 everywhere despite nan values.
    values = torch.tensor([[0.2, float("nan"), 0.9], [float("nan")] * 3])
    mask = torch.tensor([[1.0, 0, 1], [0, 0, 0]])
    adv = gae_advantage(torch.tensor([1.0, 1.0]), values, mask, gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.8, 0, 0.1], [0, 0, 0]])
    # whitened over the two valid tokens: [.8, .1] -> mean .45, std .494975 -> +-.707107
    white = gae_advantage(torch.tensor([1.0, 1.0]), values, mask, gamma=1.0, lam=1.0, epsilon=0.0)
    close(white, [[0.707107, 0, -0.707107], [0, 0, 0]])


def test_value_loss_branches():
    # t0: v 1.0, old .5, R 0: unclipped .5*1 = .5; clipped v .7 -> .5*.49 = .245 -> max .5
    # t1: v .9, old .5, R 1: unclipped .5*.01 = .005; clipped v .7 -> .5*.09 = .045 -> max .045
    # t2: padding -> 0
    values = torch.tensor([[1.0, 0.9, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 0]])
    loss = value_loss(values, old, returns, mask, clip=0.2)
    close(loss.detach(), [[0.5, 0.045, 0]])
    close(value_loss(values, old, returns, mask, clip=None).detach(), [[0.5, 0.005, 0]])
    loss.sum().backward()
    # t0 picks the unclipped branch (grad v - R = 1); t1 the clipped one (v outside the band: grad 0)
    close(values.grad, [[1.0, 0.0, 0.0]])
