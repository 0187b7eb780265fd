"""The policy loss's random stream (the ``generator`` step input): a torch.Generator per micro-batch
derived from (run seed, step, rank, micro-batch index), so reruns and resumed runs draw the same;
Clip-Cov's uniform random pick among its band's candidates (arXiv:2505.22617, sec. 4)."""

import math
from collections import Counter
from itertools import combinations
from types import SimpleNamespace

import pytest
import torch

import rlbench.training.step as step_module
import rlbench.training.update as update_module
from conftest import algorithm_from
from rlbench.algorithm.registry import POLICY_LOSSES
from rlbench.algorithm.step_inputs import STEP_INPUTS
from rlbench.config.typed import typed_config
from rlbench.reward.graders import training_grader
from rlbench.training.step import make_step_context, update
from rlbench.training.update import LossStreams, standard_update
from rlbench.utils import loss_generator

from test_trainer import prepared_batch, tiny_lm

F64 = torch.float64
# 10 valid tokens (2 x 5). mean A = 0, logp = -3 + x with mean x = 0, so Cov_t = A_t x_t:
ADV = torch.tensor([[2.0, 2.0, 1.0, -1.0, -2.0], [-2.0, 0.0, 0.0, 0.0, 0.0]], dtype=F64)
X = torch.tensor([[1.0, 2.0, 3.0, -1.0, -1.0], [1.0, 0.0, 0.0, 0.0, -5.0]], dtype=F64)
# Cov = [2, 4, 3, 1, 2 | -2, 0, 0, 0, 0]: in the band (1, 5) are tokens 0, 1, 2, 4 (token 3: Cov = 1, not > 1)
CANDIDATES = (0, 1, 2, 4)
MASK = torch.ones(2, 5, dtype=F64)


def detached_tokens(generator):
    """The flat indices clip_cov detached (k = floor(0.2 * 10) = 2): zero gradient where -A is not 0."""
    logp = (-3.0 + X).requires_grad_()
    matrix, metrics = POLICY_LOSSES.get("clip_cov")(logp, logp.detach(), ADV, MASK, generator=generator, clip_cov_ratio=0.2)
    assert torch.allclose(matrix, -ADV)  # ratio 1: the value is -A on every token, detached or not
    assert metrics["cov_detached_fraction"] == pytest.approx(0.2)
    (grad,) = torch.autograd.grad(matrix.sum(), logp)
    return tuple(sorted(((grad == 0) & (ADV != 0)).flatten().nonzero().flatten().tolist()))


def test_clip_cov_picks_a_uniform_random_pair_of_the_band_candidates():
    # k = 2 of the 4 candidates: C(4, 2) = 6 pairs, each with probability 1/6
    picks = Counter(detached_tokens(torch.Generator().manual_seed(seed)) for seed in range(600))
    assert set(picks) == set(combinations(CANDIDATES, 2))  # only band candidates, always 2, every pair reachable
    # 600 draws, 100 expected per pair: a Pearson chi-square with 5 degrees of freedom under 20.5 (p = 0.001)
    chi_square = sum((count - 100) ** 2 / 100 for count in picks.values())
    assert chi_square < 20.5
    assert detached_tokens(torch.Generator().manual_seed(7)) == detached_tokens(torch.Generator().manual_seed(7))
    assert len({detached_tokens(torch.Generator().manual_seed(s)) for s in range(5)}) > 1


def test_clip_cov_takes_every_candidate_when_k_exceeds_them():
    # ratio 0.5: k = 5 > 4 candidates -> all four detached, whatever the stream
    logp = (-3.0 + X).requires_grad_()
    matrix, _ = POLICY_LOSSES.get("clip_cov")(logp, logp.detach(), ADV, MASK, generator=torch.Generator().manual_seed(3),
                                              clip_cov_ratio=0.5)
    (grad,) = torch.autograd.grad(matrix.sum(), logp)
    assert ((grad == 0) & (ADV != 0)).flatten().nonzero().flatten().tolist() == list(CANDIDATES)


def test_loss_generator_is_a_function_of_seed_step_and_micro_batch():
    def draws(*key, rank=0):
        return torch.rand(4, generator=loss_generator(*key, rank=rank)).tolist()

    assert draws(0, 3, 1) == draws(0, 3, 1)  # the same (seed, step, micro-batch): the same stream
    others = [draws(0, 4, 1), draws(0, 3, 2), draws(1, 3, 1), draws(0, 3, 1, rank=1)]
    assert all(other != draws(0, 3, 1) for other in others)  # another step, micro-batch, seed or rank
    assert len({tuple(o) for o in others}) == len(others)
    streams = LossStreams(seed=0, step=3)
    assert [streams.next().initial_seed() for _ in range(3)] == [loss_generator(0, 3, k).initial_seed() for k in range(3)]
    assert streams.at(1).initial_seed() == loss_generator(0, 3, 1).initial_seed()


def test_the_generator_is_a_step_input_the_trainer_provides():
    entry = STEP_INPUTS["generator"]
    assert entry.producer == "step" and entry.provided_for(object())
    assert "generator" in POLICY_LOSSES.inputs


WIDE_BAND = {"clip_cov_ratio": 0.5, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9}  # half the tokens, any of them


def clip_cov_algorithm():
    return algorithm_from({"name": "t", "advantage": {"name": "grpo"}, "loss": {"name": "clip_cov", **WIDE_BAND},
                           "aggregation": {"name": "token_mean"}, "update": {}})


def update_with(streams):
    algorithm = clip_cov_algorithm()
    model = tiny_lm()
    batch = prepared_batch(algorithm)
    standard_update(model, torch.optim.SGD(model.parameters(), lr=0.5), batch, algorithm, micro_batch_size=5,
                    max_grad_norm=None, temperature=1.0, norm_length=6, loss_streams=streams)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def test_each_micro_batch_loss_draws_from_its_steps_generator(monkeypatch):
    seeds, micro_batch_loss = [], update_module.micro_batch_loss

    def spy(*args, generator=None, **options):
        seeds.append(generator.initial_seed())
        return micro_batch_loss(*args, generator=generator, **options)

    with monkeypatch.context() as patch:
        patch.setattr(update_module, "micro_batch_loss", spy)
        first = update_with(LossStreams(seed=0, step=2))
    micro_batches = math.ceil(prepared_batch(clip_cov_algorithm()).size / 5)
    assert seeds == [loss_generator(0, 2, k).initial_seed() for k in range(micro_batches)]
    assert torch.equal(update_with(LossStreams(seed=0, step=2)), first)  # bit for bit
    assert not torch.equal(update_with(LossStreams(seed=0, step=3)), first)  # another step, another pick


def test_the_trainer_passes_the_streams_of_its_seed_and_step(make_cfg, monkeypatch):
    cfg = make_cfg("experiment=smoke", "seed=5", "algorithm=clip_cov")
    algorithm = algorithm_from(cfg.algorithm)
    ctx = make_step_context(typed_config(cfg), algorithm, torch.nn.Linear(2, 2), None, None, torch.device("cpu"),
                            training_grader(typed_config(cfg)))
    ctx.engine = SimpleNamespace(sync_weights=lambda model: None)
    ctx.policy_version = 3
    seen = {}
    monkeypatch.setattr(step_module, "apply_update_schedule",
                        lambda *args, **options: seen.update(options) or {"optimizer_steps": 0.0})
    batch = prepared_batch(algorithm)
    update(ctx, batch, torch.ones(batch.size, dtype=torch.bool), 0.0, None)
    assert seen["loss_streams"] == LossStreams(seed=5, step=3, rank=0)
