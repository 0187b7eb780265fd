"""SofT-GRPO (arXiv:2511.06411): the soft-thinking rollout (rlbench/rollout/strategies/soft_thinking.py), the
Gumbel-reparameterised likelihood (rlbench/algorithm/soft_thinking.py) and the training forward of soft steps
(rlbench/training/soft_tokens.py).

Closed forms against torch.distributions.Gumbel; on the tiny model, the rollout's recorded log-likelihoods
against the training forward's recomputation (the ratio at theta = theta_old), the convex hull of the soft
inputs, the gradient's path to the soft steps' logits, and the discrete-only path against GRPO."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlbench.algorithm.soft_thinking import (
    SOFT_IDS, SOFT_NOISY_LOGP, SOFT_WEIGHTS, gumbel_log_density, gumbel_softmax_weights, sample_gumbel,
    soft_token_log_prob, top_k_log_probs,
)
from rlbench.config.typed import rollout_config
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.rollout import validate_strategy
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.strategies.iid import IIDSampling
from rlbench.rollout.strategies.soft_thinking import SoftDecoding, SoftThinking, SoftThinkingOptions, soft_think_and_answer
from rlbench.training.batch import collate
from rlbench.training.forward import token_outputs
from rlbench.training.soft_tokens import soft_input_embeddings, soft_step_mask, with_soft_log_probs

from conftest import model_preset, smoke_cli_steps
from test_rollout_sampling_transforms import hf_setup, problems

K = 4


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def soft_rollout(tiny, think_tokens=3, seed=0, temperature=1.0):
    model, tokenizer = tiny
    options = SoftThinkingOptions(think_tokens=think_tokens, top_k=K, gumbel_temperature=0.5)
    strategy = SoftThinking(hf_setup(model, tokenizer, n=3, max_new_tokens=7, seed=seed, temperature=temperature), options)
    graded, metrics = strategy.rollout(problems("a", "b"))
    return strategy, graded, metrics


def test_gumbel_log_density_matches_torch_gumbel():
    g = torch.linspace(-2.0, 8.0, 101, dtype=torch.float64)
    expected = torch.distributions.Gumbel(0.0, 1.0).log_prob(g)
    torch.testing.assert_close(gumbel_log_density(g), expected, rtol=0, atol=1e-12)


def test_soft_token_log_prob_is_the_gumbel_density_of_the_noise():
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 3.0]], dtype=torch.float64)
    ids = torch.tensor([[4, 0, 3]])
    log_pk = top_k_log_probs(logits, ids)
    chosen = torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(log_pk[0], chosen - torch.logsumexp(chosen, 0))  # renormalised over the top-k
    assert math.isclose(float(log_pk.exp().sum()), 1.0, rel_tol=1e-12)
    noise = torch.tensor([[0.3, -0.7, 1.9]], dtype=torch.float64)
    y = log_pk + noise
    expected = torch.distributions.Gumbel(0.0, 1.0).log_prob(noise).sum(-1)
    torch.testing.assert_close(soft_token_log_prob(log_pk, y), expected, rtol=0, atol=1e-12)


def test_sampled_noise_is_standard_gumbel():
    g = sample_gumbel((200_000,), torch.Generator().manual_seed(0), "cpu").double()
    euler_gamma, variance = 0.5772156649, math.pi**2 / 6
    assert abs(float(g.mean()) - euler_gamma) < 0.02  # standard error 0.003
    assert abs(float(g.var()) - variance) < 0.05  # standard error about 0.009


def test_gumbel_softmax_weights_lie_in_the_simplex_and_sharpen_with_tau():
    y = torch.tensor([[0.4, -1.0, 2.0, 0.1]])
    for tau in (0.1, 0.25, 1.0):
        w = gumbel_softmax_weights(y, tau)
        assert bool((w >= 0).all()) and math.isclose(float(w.sum()), 1.0, rel_tol=1e-6)
    assert float(gumbel_softmax_weights(y, 0.1).max()) > float(gumbel_softmax_weights(y, 1.0).max())


def test_soft_steps_are_recorded_and_their_inputs_lie_in_the_convex_hull(tiny):
    model, _ = tiny
    _, graded, metrics = soft_rollout(tiny)
    assert metrics["soft_thinking_steps"] == 3.0
    batch = collate(graded.groups, pad_token_id=0)
    soft = soft_step_mask(batch)
    assert soft is not None and bool(soft[:, :3].all()) and not bool(soft[:, 3:].any())
    weights, ids = batch.extras[SOFT_WEIGHTS.name], batch.extras[SOFT_IDS.name]
    assert weights.shape == (batch.size, batch.response_mask.shape[1], K) and ids.dtype == torch.long
    w = weights[soft]
    assert bool((w >= 0).all())
    torch.testing.assert_close(w.sum(-1), torch.ones(len(w)), rtol=0, atol=1e-5)
    # each soft step's top token is the argmax of its noisy log-probs, a token of its top-k
    top = ids[soft].gather(-1, batch.extras[SOFT_NOISY_LOGP.name][soft].argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(top, batch.response_ids[soft])
    # the training input of a soft step: the weights' convex combination of the top-k embeddings
    embedding = model.get_input_embeddings()
    with torch.no_grad():
        embeds = soft_input_embeddings(embedding, batch, soft)
        P = batch.prompt_width
        response = embeds[:, P : P + soft.shape[1]]
        table = embedding(ids[soft])  # [S, K, H]
        torch.testing.assert_close(response[soft], (w.unsqueeze(-1) * table).sum(-2), rtol=0, atol=1e-6)
        # inside the hull: a convex combination (weights >= 0, sum 1) lies within the top-k embeddings' box
        low, high = table.min(-2).values, table.max(-2).values
        assert bool((response[soft] >= low - 1e-5).all() and (response[soft] <= high + 1e-5).all())
        torch.testing.assert_close(response[~soft], embedding(batch.response_ids)[~soft])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ratio_is_one_at_the_sampling_policy(tiny, temperature):
    """The training forward's log-likelihood of every token, soft and discrete, equals the one the rollout
    recorded under the same weights: the PPO ratio at theta = theta_old is 1."""
    model, _ = tiny
    _, graded, _ = soft_rollout(tiny, seed=1, temperature=temperature)
    batch = collate(graded.groups, pad_token_id=0)
    with torch.no_grad():
        logp = token_outputs(model, batch, temperature).logp
    mask = batch.response_mask.bool()
    ratio = torch.exp(logp - batch.sampling_logp)[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-4)
    soft = soft_step_mask(batch)
    assert bool((logp[soft] != 0).all())  # the soft steps are scored, by their Gumbel density


def test_gradient_reaches_the_soft_steps_logits(tiny):
    model, _ = tiny
    _, graded, _ = soft_rollout(tiny, seed=2)
    batch = collate(graded.groups, pad_token_id=0)
    soft = soft_step_mask(batch)
    B, T = soft.shape
    vocab = model.get_output_embeddings().weight.shape[0]
    logits = torch.randn(B, T, vocab, requires_grad=True)
    logp = with_soft_log_probs(torch.zeros(B, T), logits, batch, soft, 1.0)
    (logp * soft).sum().backward()
    grad = logits.grad
    on_top_k = torch.zeros_like(grad, dtype=torch.bool).scatter(-1, batch.extras[SOFT_IDS.name], True) & soft.unsqueeze(-1)
    assert bool((grad[on_top_k] != 0).all())  # every top-k logit of every soft step
    assert bool((grad[~on_top_k] == 0).all())  # nothing else: the answer's positions and the other tokens
    # through the model: the soft steps' likelihood alone moves the output layer
    model.zero_grad()
    out = token_outputs(model, batch, 1.0)
    (out.logp * soft).sum().backward()
    assert float(model.get_output_embeddings().weight.grad.abs().sum()) > 0
    model.zero_grad()


def test_end_of_thinking_marker_stops_the_soft_steps(tiny):
    model, _ = tiny
    prompts = [tuple(range(5, 12))]
    params = SamplingParams(1.0, 1.0, 7)
    options = SoftThinkingOptions(think_tokens=4, top_k=K, gumbel_temperature=0.5)
    first = soft_think_and_answer(model, prompts, params, SoftDecoding(options, (2,), 0, None), torch.Generator().manual_seed(3))
    assert first[0]["soft_steps"] == 4
    marker = first[0]["ids"][0]  # the first soft step's top token, made the end-of-thinking marker
    again = soft_think_and_answer(model, prompts, params, SoftDecoding(options, (2,), 0, marker), torch.Generator().manual_seed(3))
    assert again[0]["soft_steps"] == 1 and again[0]["ids"][0] == marker
    assert again[0][SOFT_WEIGHTS.name][0] == first[0][SOFT_WEIGHTS.name][0]


def test_thinking_budget_zero_samples_what_iid_samples(tiny):
    model, tokenizer = tiny
    soft = SoftThinking(hf_setup(model, tokenizer, seed=4), SoftThinkingOptions(think_tokens=0))
    iid = IIDSampling(hf_setup(model, tokenizer, seed=4))
    a, b = soft.rollout(problems("a", "b"))[0], iid.rollout(problems("a", "b"))[0]
    assert [[(c.response_ids, c.logprobs) for c in g] for g in a.groups] == [[(c.response_ids, c.logprobs) for c in g] for g in b.groups]


def test_discrete_tokens_carrying_soft_inputs_score_as_plain_tokens(tiny):
    """A batch whose soft inputs mark no soft step (all weights 0) gives exactly the plain forward's outputs."""
    model, _ = tiny
    _, graded, _ = soft_rollout(tiny, seed=5)
    plain = collate(graded.groups, pad_token_id=0)
    plain_extras, plain.extras = plain.extras, {}
    marked = dataclasses.replace(plain, extras={**plain_extras, SOFT_WEIGHTS.name: torch.zeros_like(plain_extras[SOFT_WEIGHTS.name])})
    with torch.no_grad():
        a = token_outputs(model, plain, 1.0, with_entropy=True)
        b = token_outputs(model, marked, 1.0, with_entropy=True)
    assert torch.equal(a.logp, b.logp) and torch.equal(a.entropy, b.entropy)


@pytest.mark.slow
def test_soft_grpo_without_thinking_trains_exactly_as_grpo(tmp_path):
    """The discrete-only path (think_tokens 0) of algorithm=soft_grpo is GRPO: the same steps, metric for metric."""
    timing = {"generate_s", "update_s", "step_s", "tokens_per_s", "engine_s", "peak_memory_mb"}
    soft = smoke_cli_steps(tmp_path / "soft", "algorithm=soft_grpo", "rollout.soft_thinking.think_tokens=0", "seed=3")
    grpo = smoke_cli_steps(tmp_path / "grpo", "algorithm=grpo", "seed=3")
    assert [{k: v for k, v in s.items() if k not in timing} for s in soft] == [{k: v for k, v in s.items() if k not in timing} for s in grpo]


def test_settings_are_checked_before_the_model_loads(make_cfg):
    validate_strategy(rollout_config(make_cfg("algorithm=soft_grpo").rollout), "grpo")

    def rollout(engine="hf", top_p=1.0, max_new_tokens=8, **block):
        return rollout_config({
            "strategy": "soft_thinking", "engine": engine, "n": 2, "temperature": 1.0, "top_p": top_p,
            "max_new_tokens": max_new_tokens, "soft_thinking": block,
        })

    with pytest.raises(ConfigError, match=r"rollout=soft_thinking feeds soft tokens .* inputs_embeds .*rollout.engine=hf"):
        validate_strategy(rollout(engine="vllm"), "grpo")
    with pytest.raises(ConfigError, match=r"top_k must be an integer >= 2"):
        validate_strategy(rollout(top_k=1), "grpo")
    with pytest.raises(ConfigError, match=r"think_tokens \(8\) must be below rollout.max_new_tokens \(8\)"):
        validate_strategy(rollout(think_tokens=8), "grpo")
    with pytest.raises(ConfigError, match=r"rollout.top_p must be 1"):
        validate_strategy(rollout(top_p=0.9), "grpo")
    with pytest.raises(ConfigError, match=r"gumbel_temperature \(tau_g\) must be > 0"):
        validate_strategy(rollout(gumbel_temperature=0.0), "grpo")
    with pytest.raises(ConfigError, match=r"think_tokens must be an integer >= 0"):
        validate_strategy(rollout(think_tokens=-1), "grpo")
    validate_strategy(rollout(think_tokens=0, top_p=0.9), "grpo")  # discrete only: rollout=iid's settings


def test_a_multi_token_end_of_thinking_marker_is_refused(tiny):
    model, tokenizer = tiny
    strategy = SoftThinking(hf_setup(model, tokenizer), SoftThinkingOptions(think_tokens=2, end_of_thinking="</think> done"))
    with pytest.raises(ConfigError, match=r"end_of_thinking=.* tokens for this tokenizer; it must be one"):
        strategy.rollout(problems("a"))
