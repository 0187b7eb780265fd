"""Iterative rounds (algorithm.update.round_steps, rlbench/training/rounds.py; docs/preference.md, "Iterative
rounds"): REBEL's rounds on a bandit compound to pi_0 exp(T eta R), the round policy's refresh and checkpoint
state, the step's pi_old under rounds, and the refused compositions. INPO's rounds: tests/test_inpo_nash.py."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from conftest import algorithm_from
from test_inpo_nash import newton_minimise
from test_trainer import tiny_lm
from test_verl_pieces_losses import PadTokenizer, WeightSyncEngine, _graded_with_engine_logprobs
from rlbench.algorithm.losses.relative_rewards import rebel_loss
from rlbench.config.typed import typed_config
from rlbench.errors import ConfigError
from rlbench.reward.graders import training_grader
from rlbench.training import step
from rlbench.training.rounds import RoundPolicy
from rlbench.validation import check_sharded_run_features


def test_rebel_rounds_compound_to_pi_0_tilted_by_rounds_times_eta_times_the_reward():
    """REBEL (arXiv:2404.16767, Algorithm 1): each round's regression reaches pi_t exp(eta R), so T rounds reach
    pi_0 exp(T eta R) (normalised), with pi_t the previous round's fitted policy."""
    eta, rounds = 0.7, 4
    rewards = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)
    start = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    mask, group = torch.ones(3, 1, dtype=torch.float64), torch.zeros(3, dtype=torch.long)
    policy = start
    for _ in range(rounds):
        pi_t = policy.log()[:, None]

        def loss_of(logits, pi_t=pi_t):
            matrix, _ = rebel_loss(torch.log_softmax(logits, 0)[:, None], pi_t, mask, rewards, group, eta=eta)
            return matrix.sum()

        policy = torch.softmax(newton_minimise(loss_of, pi_t.squeeze(1)), 0)
    assert torch.allclose(policy, torch.softmax(start.log() + rounds * eta * rewards, 0), atol=1e-9)


def test_the_round_policy_is_refreshed_at_each_rounds_first_step_and_saved_inside_a_round():
    model = torch.nn.Linear(2, 2)
    rounds = RoundPolicy(model, round_steps=3)
    seen = []
    for updates_done in range(7):
        metrics = rounds.begin_step(model, updates_done)
        seen.append((metrics["round"], rounds.snapshot.weight.clone()))
        with torch.no_grad():
            model.weight += 1.0  # the step's update
    assert [r for r, _ in seen] == [1, 1, 1, 2, 2, 2, 3]
    for updates_done, (_, weight) in enumerate(seen):  # pi_t is the policy before the round's first update
        assert torch.allclose(weight, seen[0][1] + (updates_done // 3) * 3.0)
    assert rounds.state_dict(3) is None and rounds.state_dict(6) is None  # a boundary: the next step copies anew
    inside = rounds.state_dict(5)
    restored = RoundPolicy(torch.nn.Linear(2, 2), round_steps=3)
    restored.load_state_dict(inside, 5)
    assert torch.equal(restored.snapshot.weight, rounds.snapshot.weight)
    with pytest.raises(ValueError, match="inside round 2"):
        restored.load_state_dict(None, 4)
    restored.load_state_dict(None, 6)  # at a boundary nothing is needed


def _inpo_context(make_cfg, round_steps):
    """INPO's step context on the tiny Llama (seed 0) and the groups every step trains on."""
    cfg = make_cfg("experiment=smoke", "algorithm=inpo", f"algorithm.update.round_steps={round_steps}")
    config = typed_config(cfg)
    model = tiny_lm(seed=0)
    ctx = step.make_step_context(config, algorithm_from(cfg.algorithm), model, PadTokenizer(), WeightSyncEngine(),
                                 torch.device("cpu"), training_grader(config))
    return ctx, _graded_with_engine_logprobs(model, ctx.temperature, ctx.micro_batch_size)


def _learn(ctx, graded):
    return step.learn_step(ctx, graded, {}, 0.0, 0.0, started=time.perf_counter(), generation_cost={})


def _learn_steps(make_cfg, round_steps, steps=3):
    """``steps`` learn_steps of INPO from the same weights and groups; returns each step's metrics, the weights
    before and after each step, and the step context."""
    ctx, graded = _inpo_context(make_cfg, round_steps)
    metrics, weights = [], [[p.detach().clone() for p in ctx.model.parameters()]]
    for _ in range(steps):
        metrics.append(_learn(ctx, graded))
        weights.append([p.detach().clone() for p in ctx.model.parameters()])
    return metrics, weights, ctx


def test_a_round_of_one_step_is_the_default_and_a_longer_round_keeps_pi_t(make_cfg):
    default, default_weights, _ = _learn_steps(make_cfg, "null")
    one, one_weights, _ = _learn_steps(make_cfg, 1)
    for a, b in zip(default, one):  # pi_t is the policy before each update either way
        assert b["policy_loss"] == pytest.approx(a["policy_loss"], rel=1e-5, abs=1e-9)
    for a, b in zip(default_weights[-1], one_weights[-1]):
        assert torch.allclose(a, b, atol=1e-6)
    two, two_weights, ctx = _learn_steps(make_cfg, 2)
    assert [m["round"] for m in two] == [1.0, 1.0, 2.0] and "round" not in default[0]
    # step 1 is the same; step 2 keeps pi_t = the initial policy, so its loss and update differ from the default
    assert two[0]["policy_loss"] == pytest.approx(default[0]["policy_loss"], rel=1e-5, abs=1e-9)
    assert two[1]["policy_loss"] != pytest.approx(default[1]["policy_loss"], rel=1e-3)
    # after step 3 (round 2's first) pi_t is the policy after step 2
    for held, trained in zip(ctx.rounds.snapshot.parameters(), two_weights[2]):
        assert torch.equal(held, trained)


def test_rounds_are_refused_where_pi_old_is_not_a_rounds_pi_t(make_cfg):
    with pytest.raises(ConfigError, match="round_steps=2 freezes pi_t"):
        algorithm_from(make_cfg("experiment=smoke", "algorithm=grpo", "algorithm.update.round_steps=2").algorithm)
    with pytest.raises(ConfigError, match="fsdp"):
        check_sharded_run_features(typed_config(make_cfg("experiment=smoke", "algorithm=inpo",
                                                         "algorithm.update.round_steps=2", "trainer.parallelism=fsdp")))


def test_a_context_restored_inside_a_later_round_trains_as_the_uninterrupted_one(make_cfg):
    """The step context's state (what a checkpoint saves besides weights and optimizer) holds pi_t inside a round:
    restored into a fresh context after update 3 (round 2 of 2-step rounds, pi_t = the policy after update 2,
    not the initial one), the next step gives the uninterrupted run's metrics and weights."""
    timing = step.TIMING_METRICS
    ctx, graded = _inpo_context(make_cfg, 2)
    for _ in range(3):
        _learn(ctx, graded)
    state = ctx.state_dict()
    assert state["rounds"] is not None
    weights, optimizer = copy.deepcopy(ctx.model.state_dict()), copy.deepcopy(ctx.optimizer.state_dict())
    resumed, _ = _inpo_context(make_cfg, 2)
    resumed.model.load_state_dict(weights)
    resumed.optimizer.load_state_dict(optimizer)
    resumed.load_state_dict(state)
    expected, got = _learn(ctx, graded), _learn(resumed, graded)
    assert {k: v for k, v in got.items() if k not in timing} == {k: v for k, v in expected.items() if k not in timing}
    for a, b in zip(ctx.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def _sampled_ids(tmp_path, *overrides, steps=2):
    """The response ids INPO's rollout sampled at each of ``steps`` train_steps (tiny model, seed 0, 2-step
    rounds) with ``overrides``, and the step context."""
    from conftest import compose_config
    from rlbench.dataset.base import Problem
    from rlbench.model import load_policy
    from rlbench.rollout import make_engine

    cfg = compose_config(["experiment=smoke", "algorithm=inpo", "algorithm.update.round_steps=2", "trainer.lr=0.05",
                          *overrides], tmp_path)
    config = typed_config(cfg)
    cpu = torch.device("cpu")
    model, tokenizer = load_policy(config.model, device=cpu, dtype=torch.float32, seed=cfg.seed, cache_dir=cfg.cache_dir)
    ctx = step.make_step_context(config, algorithm_from(cfg.algorithm), model, tokenizer,
                                 make_engine(config.rollout, model, tokenizer, cpu), cpu, training_grader(config))
    problems = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(2)]
    sampled = []
    for _ in range(steps):
        seen = []
        step.train_step(ctx, problems, observe=seen.append)
        sampled.append([[tuple(c.response_ids) for c in group] for group in seen[0].groups])
    return sampled, ctx


def test_round_sampling_pi_t_samples_the_round_with_its_frozen_copy(tmp_path):
    """algorithm.update.round_sampling=pi_t (INPO's and REBEL's Algorithm 1: sample with pi_t, then fit): step 2,
    inside the round, samples from pi_t = the policy before step 1's update, i.e. what a run whose step 1 changed
    nothing (trainer.lr=0) samples at step 2 from the same random stream; with round_sampling=policy step 2
    samples from the updated policy. The policy's own engine is back in the sampler after each rollout."""
    pi_t, ctx = _sampled_ids(tmp_path / "pi_t")
    unchanged, _ = _sampled_ids(tmp_path / "lr0", "trainer.lr=0.0")
    policy, _ = _sampled_ids(tmp_path / "policy", "algorithm.update.round_sampling=policy")
    assert pi_t[0] == unchanged[0] == policy[0]  # a round's first rollout: pi_t is the policy
    assert pi_t[1] == unchanged[1]
    assert policy[1] != pi_t[1]  # the updated policy samples otherwise (lr 0.05 on the tiny model)
    assert ctx.sampler.engine is ctx.engine and ctx.rounds.engine is not ctx.engine
    assert ctx.rounds.engine.model is ctx.rounds.snapshot


def test_round_sampling_pi_t_is_refused_with_the_asynchronous_generator(make_cfg):
    from rlbench.validation import validate_config

    with pytest.raises(ConfigError, match="round_sampling=pi_t"):
        validate_config(make_cfg("experiment=smoke", "algorithm=inpo", "trainer.max_staleness=1"))
    validate_config(make_cfg("experiment=smoke", "algorithm=inpo", "trainer.max_staleness=1",
                             "algorithm.update.round_sampling=policy"))
