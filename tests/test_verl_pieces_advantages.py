"""Closed-form tests of verl's advantage-side pieces (rlbench/algorithm/advantages/verl_pieces.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.algorithm.advantages import grpo_advantage
from rlbench.algorithm.advantages.verl_pieces import (
    gdpo_advantage,
    optimal_token_baseline_advantage,
    pf_ppo_resample,
    pf_ppo_weights,
)
from rlbench.errors import ConfigError


def _logp(pi):
    return torch.tensor(pi, dtype=torch.float64).log()


def test_otb_closed_form_on_a_hand_computed_group():
    # one group of two responses, outcome reward on the last token; lengths 2 and 2
    mask = torch.ones(2, 2)
    token_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    old_logp = _logp([[0.5, 0.5], [0.25, 0.5]])
    sum_pi_sq = torch.full((2, 2), 0.5, dtype=torch.float64)
    # ||s||^2 = 1 - 2 pi + 0.5: row0 [0.5, 0.5] -> W [0.5, 1.0]; row1 [1.0, 0.5] -> W [1.0, 1.5]
    # G: row0 [1, 1], row1 [0, 0]; B_0 = 0.5 / 1.5 = 1/3, B_1 = 1.0 / 2.5 = 0.4
    adv = optimal_token_baseline_advantage(token_rewards, torch.tensor([0, 0]), mask, old_logp, sum_pi_sq, epsilon=0.0)
    expected = torch.tensor([[1 - 1 / 3, 1 - 0.4], [-1 / 3, -0.4]])
    torch.testing.assert_close(adv, expected.float())


def test_otb_baseline_minimises_the_exact_gradient_variance_among_constant_baselines():
    # one-step softmax bandit: action a ~ pi, reward r(a), score s = e_a - pi, ||s||^2 = 1 - 2 pi_a + sum pi^2.
    # Var[(r - b) s] (trace) = E[(r - b)^2 ||s||^2] - ||E[r s]||^2 is minimised at b* = E[r ||s||^2] / E[||s||^2].
    pi = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    r = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)
    sum_sq = float((pi**2).sum())

    def variance(b: float) -> float:
        total = 0.0
        mean_grad = torch.zeros(3, dtype=torch.float64)
        for a in range(3):
            s = torch.nn.functional.one_hot(torch.tensor(a), 3).double() - pi
            total += float(pi[a]) * (float(r[a]) - b) ** 2 * float(s @ s)
            mean_grad += pi[a] * r[a] * s
        return total - float(mean_grad @ mean_grad)

    # a group whose empirical action frequencies equal pi: a0, a0, a1, a2 (one-token responses)
    actions = [0, 0, 1, 2]
    token_rewards = r[actions][:, None]
    old_logp = pi[actions].log()[:, None]
    adv = optimal_token_baseline_advantage(token_rewards, torch.zeros(4, dtype=torch.long), torch.ones(4, 1),
                                           old_logp, torch.full((4, 1), sum_sq, dtype=torch.float64), epsilon=0.0)
    b_star = float(token_rewards[0, 0] - adv[0, 0].double())
    w = 1 - 2 * pi + sum_sq
    assert b_star == pytest.approx(float((pi * r * w).sum() / (pi * w).sum()), rel=1e-6)
    best = variance(b_star)
    mean_baseline = float((pi * r).sum())
    assert best < variance(mean_baseline)  # beats GRPO's mean baseline here
    for other in [b_star + d for d in (-1.0, -0.1, -0.01, 0.01, 0.1, 1.0)]:
        assert best < variance(other)


def test_otb_singleton_group_and_zero_tail_choices():
    # group 0: lengths 3 and 1 (response 0 alone past position 1); group 1: one response
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    token_rewards = torch.tensor([[0.0, 0.0, 2.0], [1.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    old_logp = torch.full((3, 3), math.log(0.5), dtype=torch.float64)
    sum_pi_sq = torch.full((3, 3), 0.5, dtype=torch.float64)  # ||s||^2 = 0.5 on every token
    group = torch.tensor([0, 0, 1])
    adv = optimal_token_baseline_advantage(token_rewards, group, mask, old_logp, sum_pi_sq, epsilon=0.0)
    # position 0: both present, W equal -> B = (2 + 1) / 2 = 1.5; positions 1, 2: only response 0 -> B = 0 (zero tail)
    torch.testing.assert_close(adv[0], torch.tensor([0.5, 2.0, 2.0]))
    torch.testing.assert_close(adv[1], torch.tensor([-0.5, 0.0, 0.0]))
    torch.testing.assert_close(adv[2], torch.zeros(3))  # singleton group: A = 0 (rlbench convention; verl: A = G)
    kept = optimal_token_baseline_advantage(token_rewards, group, mask, old_logp, sum_pi_sq, handle_zero_tail=False,
                                            epsilon=0.0)
    torch.testing.assert_close(kept[0], torch.tensor([0.5, 0.0, 0.0]))  # its own return as baseline


def test_tool_otb_keeps_observation_tokens_out_of_the_baseline():
    # response 0 has two observation tokens (mask 0) in the middle, response 1 none; after removing them
    # both have 3 trained tokens, so the TIR baseline equals OTB on the compacted responses.
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    token_rewards = torch.tensor([[0.0, 9.0, 9.0, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0, 0.0]])
    old_logp = torch.log(torch.tensor([[0.9, 0.01, 0.02, 0.3, 0.6], [0.2, 0.7, 0.4, 0.5, 0.5]], dtype=torch.float64))
    sum_pi_sq = torch.tensor([[0.8, 0.9, 0.9, 0.3, 0.5], [0.2, 0.6, 0.3, 0.5, 0.5]], dtype=torch.float64)
    group = torch.tensor([0, 0])
    tir = optimal_token_baseline_advantage(token_rewards, group, mask, old_logp, sum_pi_sq, positions="trained")
    keep = mask.bool()
    compact = [torch.stack([t[0][keep[0]], t[1][keep[1]]]) for t in (token_rewards, old_logp, sum_pi_sq)]
    reference = optimal_token_baseline_advantage(compact[0], group, torch.ones(2, 3), compact[1], compact[2])
    torch.testing.assert_close(tir[keep].view(2, 3), reference)
    assert bool((tir[~keep] == 0).all())
    # changing the observation tokens' probabilities (and rewards under mask 0) changes nothing
    old_logp2, sum_pi_sq2 = old_logp.clone(), sum_pi_sq.clone()
    old_logp2[0, 1:3], sum_pi_sq2[0, 1:3] = math.log(0.999), 0.001
    again = optimal_token_baseline_advantage(token_rewards, group, mask, old_logp2, sum_pi_sq2, positions="trained")
    torch.testing.assert_close(again, tir)
    # the column variant would mix response 0's trained tokens with response 1's at other positions
    column = optimal_token_baseline_advantage(token_rewards, group, mask, old_logp, sum_pi_sq)
    assert not torch.allclose(column, tir)
    with pytest.raises(ConfigError):
        optimal_token_baseline_advantage(token_rewards, group, mask, old_logp, sum_pi_sq, positions="turn")


def test_gdpo_with_one_component_is_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 1.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 3)
    gdpo = gdpo_advantage(rewards[:, None], group, mask, batch_whiten=False)
    torch.testing.assert_close(gdpo, grpo_advantage(rewards, group, mask))
    # verl's default batch whitening is whitening of the GRPO advantage
    grpo = grpo_advantage(rewards, group, mask)[:, 0].double()
    whitened = (grpo - grpo.mean()) / (grpo.std() + 1e-6)
    torch.testing.assert_close(gdpo_advantage(rewards[:, None], group, mask)[:, 0], whitened.float())


def test_gdpo_normalises_components_of_different_scales_separately():
    # one group of 4: correctness in {0, 1}, a length term on a 100x larger scale
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])
    length = torch.tensor([0.0, 100.0, 100.0, 0.0])
    group = torch.zeros(4, dtype=torch.long)
    mask = torch.ones(4, 1)
    adv = gdpo_advantage(torch.stack([correct, length], 1), group, mask, epsilon=0.0, batch_whiten=False)
    z = 1.0 / math.sqrt(1.0 / 3.0)  # each column: values +-0.5 around the mean, unbiased std sqrt(1/3)
    expected = torch.tensor([0.5 - 0.5, 0.5 + 0.5, -0.5 + 0.5, -0.5 - 0.5]) * z
    torch.testing.assert_close(adv[:, 0], expected.float())
    # GRPO on the summed reward ranks by the large-scale term only: responses 1 and 2 tie for the top
    summed = grpo_advantage(correct + length, group, mask)[:, 0]
    assert summed[1] > summed[0] and abs(float(summed[1] - summed[2])) < 0.05
    weighted = gdpo_advantage(torch.stack([correct, length], 1), group, mask, [2.0, 0.5], epsilon=0.0, batch_whiten=False)
    torch.testing.assert_close(weighted[:, 0], ((2.0 * (correct - 0.5) + 0.5 * (length - 50) / 100) * z).float())
    with pytest.raises(ConfigError):
        gdpo_advantage(torch.stack([correct, length], 1), group, mask, [1.0])


def test_pf_ppo_weights_closed_forms():
    rewards = torch.tensor([-2.0, 0.5, 3.0, 3.0, 1.0])
    torch.testing.assert_close(pf_ppo_weights(rewards, "pow", 2.0), torch.tensor([4.0, 0.25, 9.0, 9.0, 1.0]).double())
    torch.testing.assert_close(pf_ppo_weights(rewards, "max_min"), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]).double())
    torch.testing.assert_close(pf_ppo_weights(rewards, "max_random"), torch.tensor([0.1, 0.1, 0.4, 0.4, 0.1]).double())
    with pytest.raises(ConfigError):
        pf_ppo_weights(rewards, "top_k")


def test_pf_ppo_resample_follows_its_seed_and_weights():
    rewards = torch.tensor([-1.0, 0.0, 0.0, 1.0, 0.0])
    draw = lambda seed, method: pf_ppo_resample(rewards, torch.Generator().manual_seed(seed), method)
    assert torch.equal(draw(7, "max_random"), draw(7, "max_random"))
    assert any(not torch.equal(draw(7, "max_random"), draw(s, "max_random")) for s in range(8, 20))
    # max_min and pow(2) never draw a zero-weight response (the 0-reward middle ones)
    for method in ("max_min", "pow"):
        assert set(draw(3, method).tolist()) <= {0, 3}
    # all-zero weights: the batch is kept
    assert torch.equal(pf_ppo_resample(torch.zeros(3), torch.Generator().manual_seed(0)), torch.arange(3))


def test_registered_gdpo_splits_outcome_and_shaping():
    from rlbench.algorithm.registry import ADVANTAGES

    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0])
    shaping = torch.tensor([0.0, -0.5, -0.1, 0.0])
    group = torch.zeros(4, dtype=torch.long)
    mask = torch.ones(4, 2)
    inputs = {"rewards": outcome + shaping, "outcome": outcome, "group_index": group, "response_mask": mask}
    params = {"shaping_weight": 0.5, "batch_whiten": False}
    got = ADVANTAGES.call("gdpo", inputs, params)
    expected = gdpo_advantage(torch.stack([outcome, shaping], 1), group, mask, [1.0, 0.5], batch_whiten=False)
    torch.testing.assert_close(got, expected)
    # no reward shaping: the shaping column is constant, so GDPO is GRPO on the outcome
    no_shaping = {**inputs, "rewards": outcome}
    torch.testing.assert_close(ADVANTAGES.call("gdpo", no_shaping, {"batch_whiten": False}),
                               grpo_advantage(outcome, group, mask))


def test_gdpo_runs_end_to_end_from_the_config(make_cfg, tmp_path):
    import json

    from rlbench import runner

    cfg = make_cfg("experiment=smoke", "algorithm/advantage=gdpo", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false")
    runner.run(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for step in steps:  # batch whitening: mean 0, std 1 over the batch's tokens (equal lengths in the smoke run)
        assert abs(step["advantage_mean"]) < 1e-4
        assert step["advantage_std"] == pytest.approx(1.0, abs=1e-3)


def test_pf_ppo_is_a_checked_algorithm_block_that_resamples_from_its_stream():
    from conftest import algorithm_from
    from rlbench.errors import ConfigError

    algorithm = algorithm_from({"name": "grpo", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
                                "aggregation": {"name": "token_mean"}, "pf_ppo": {"method": "max_min"}})
    rewards = torch.tensor([0.0, 0.5, 1.0, 0.25])
    rows = algorithm.pf_ppo.rows(rewards, torch.Generator().manual_seed(0))
    assert set(rows.tolist()) <= {0, 2} and len(rows) == 4  # only the batch's worst and best responses
    assert torch.equal(rows, algorithm.pf_ppo.rows(rewards, torch.Generator().manual_seed(0)))
    with pytest.raises(ConfigError, match="pf_ppo"):
        algorithm_from({"name": "grpo", "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"},
                        "aggregation": {"name": "token_mean"}, "pf_ppo": {"method": "best"}})


@pytest.mark.slow
def test_pf_ppo_runs_from_the_command_line(tmp_path):
    import json

    from conftest import compose_config
    from rlbench.runner import run

    run(compose_config(["experiment=smoke", "+algorithm.pf_ppo={method: max_min}", "logger=files"], tmp_path))
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(step["optimizer_steps"] >= 1 for step in steps)
