"""CLPO's dynamic KL (arXiv:2509.25004 v1; the authors' release, github.com/csuking/CLPO @ cb77b56,
verl/workers/actor/dp_actor.py kl_in_loss_scale): the loss's KL term of each response times its curriculum label's
factor (algorithm.kl.difficulty_scale, rlbench.algorithm.kl.difficulty_kl_scale). Closed form on hand values (a hard
response's KL gradient is half the others'), every factor 1 = the plain KL term bit for bit, bad settings refused,
and a step whose batch carries the labels of the clpo sampler's groups."""

import math

import pytest
import torch
from conftest import algorithm_from, compose_config
from omegaconf import OmegaConf

from rlbench.algorithm.kl import difficulty_kl_scale
from rlbench.errors import ConfigError
from rlbench.validation import validate_config

NORMS = {"batch_tokens": 4, "batch_sequences": 2, "norm_length": 2}


def kl_algorithm(coef=0.1, **scale):
    return algorithm_from(OmegaConf.create({
        "advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}, "aggregation": {"name": "token_mean"},
        "kl": {"coef": coef, "estimator": "k3", **({"difficulty_scale": scale} if scale else {})},
    }))


def test_the_factor_of_each_label():
    scales = {"hard": 0.5, "medium": 1.0, "easy": 2.0}
    assert difficulty_kl_scale(["hard", "medium", "easy", None], scales).tolist() == [0.5, 1.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="trivial"):
        difficulty_kl_scale(["trivial"], scales)


def loss_and_gradient(algorithm, kl_scale=None):
    """Two responses of two tokens, the same log-ratio ref - logp = ln 2 on every token, zero advantages."""
    logp = torch.zeros(2, 2, requires_grad=True)
    ref = torch.full((2, 2), math.log(2.0))
    loss, metrics = algorithm.compute_loss(logp=logp, old_logp=logp.detach(), advantages=torch.zeros(2, 2),
                                           response_mask=torch.ones(2, 2), norms=NORMS, ref_logp=ref, kl_scale=kl_scale)
    loss.backward()
    return loss, logp.grad


def test_a_hard_response_pulls_half_as_hard_towards_the_reference():
    """k3 = e^d - d - 1 with d = ref - logp = ln 2: k3 = 1 - ln 2, dk3/dlogp = 1 - e^d = -1. Token mean over 4 tokens,
    beta = 0.1, s = (0.5, 1): loss = 0.1 (2 * 0.5 + 2 * 1)(1 - ln 2) / 4; gradient 0.1 s_i (-1) / 4 on each token:
    -0.0125 on the hard response's tokens, -0.025 on the other's."""
    algorithm = kl_algorithm(hard=0.5)
    scale = difficulty_kl_scale(["hard", "easy"], algorithm.kl_difficulty_scale)
    loss, grad = loss_and_gradient(algorithm, scale)
    assert loss.item() == pytest.approx(0.1 * 3 * (1 - math.log(2)) / 4, rel=1e-6)
    assert grad.tolist() == [[pytest.approx(-0.0125)] * 2, [pytest.approx(-0.025)] * 2]
    assert torch.equal(grad[0] * 2, grad[1])  # exactly half


def test_every_factor_one_is_the_plain_kl_term_bit_for_bit():
    plain = kl_algorithm()
    assert plain.kl_difficulty_scale is None  # the schema default (null): no per-response input at all
    assert kl_algorithm(hard=1.0, medium=1.0, easy=1.0).kl_difficulty_scale is None
    loss, grad = loss_and_gradient(plain)
    # the same loss as before the factor existed: beta * token_mean(k3)
    logp = torch.zeros(2, 2, requires_grad=True)
    k3 = torch.exp(torch.full((2, 2), math.log(2.0)) - logp) - (math.log(2.0) - logp) - 1
    (0.1 * k3.sum() / 4).backward()
    assert torch.equal(loss.detach(), (0.1 * k3.sum() / 4).detach()) and torch.equal(grad, logp.grad)
    # a factor on a label no response carries changes nothing either
    scaled = kl_algorithm(hard=0.5)
    loss_scaled, grad_scaled = loss_and_gradient(scaled, difficulty_kl_scale(["medium", "easy"], scaled.kl_difficulty_scale))
    assert torch.equal(loss_scaled, loss) and torch.equal(grad_scaled, grad)
    with pytest.raises(ValueError, match="kl_scale"):
        loss_and_gradient(scaled)  # the factors are required once set


@pytest.mark.parametrize("algorithm, message", [
    (lambda: kl_algorithm(coef=0.0, hard=0.5), "needs algorithm.kl.coef > 0"),
    (lambda: kl_algorithm(hard=-0.5), "factor >= 0"),
    (lambda: kl_algorithm(trivial=0.5), "factor >= 0"),
])
def test_bad_factors_are_refused(algorithm, message):
    with pytest.raises(ConfigError, match=message):
        algorithm()


def test_the_factors_need_the_clpo_labels(tmp_path):
    with pytest.raises(ConfigError, match="prompt_sampler=clpo"):
        validate_config(compose_config(["experiment=smoke", "algorithm.kl.coef=0.001",
                                        "+algorithm.kl.difficulty_scale.hard=0.5"], tmp_path))
    validate_config(compose_config(["experiment=smoke", "prompt_sampler=clpo", "algorithm.kl.coef=0.001",
                                    "+algorithm.kl.difficulty_scale.hard=0.5"], tmp_path))


def test_a_step_trains_on_the_groups_its_curriculum_returns_with_their_factors(tmp_path, monkeypatch):
    """The step's observe hook returns its first group only, labelled hard, and the second labelled easy would
    have been dropped: the update sees that group's rows with s = 0.5 each."""
    import dataclasses

    from rlbench.config.typed import typed_config
    from rlbench.dataset.base import Problem
    from rlbench.model import load_policy
    from rlbench.reward.graders import training_grader
    from rlbench.rollout import make_engine
    from rlbench.training import step
    from rlbench.training.rewrites import BUCKET_KEY

    cfg = compose_config(["experiment=smoke", "prompt_sampler=clpo", "algorithm.kl.coef=0.001",
                          "+algorithm.kl.difficulty_scale.hard=0.5"], tmp_path)
    config = typed_config(cfg)
    cpu = torch.device("cpu")
    model, tokenizer = load_policy(config.model, device=cpu, dtype=torch.float32, seed=cfg.seed, cache_dir=cfg.cache_dir)
    ctx = step.make_step_context(config, algorithm_from(cfg.algorithm), model, tokenizer,
                                 make_engine(config.rollout, model, tokenizer, cpu), cpu, training_grader(config))
    seen = []
    monkeypatch.setattr(step, "update", lambda ctx, batch, *args: seen.append(batch) or {})

    def first_group_hard(graded):
        first = graded.select([0])
        return dataclasses.replace(first, problems=[dataclasses.replace(first.problems[0], meta={BUCKET_KEY: "hard"})])

    problems = [Problem(f"p{i}", f"What is {i} + 2?", str(i + 2)) for i in range(2)]
    step.train_step(ctx, problems, observe=first_group_hard)
    n = config.rollout.n
    assert seen[0].size == n and seen[0].kl_scale.tolist() == [0.5] * n
