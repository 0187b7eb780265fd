"""Rollout engines: the HF generate engine on the tiny model, vLLM conversion on stand-ins."""

from __future__ import annotations

import math
import os
import types
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from omegaconf import OmegaConf

from rlbench.config.schema import RolloutConfig
from rlbench.config.typed import typed_node
from rlbench.errors import ConfigError
from rlbench.model import build_tiny_model, load_policy
from rlbench.rollout import GenerationRequest, HFGenerateEngine, SamplingParams, make_engine
from rlbench.rollout.engines.hf import sample_from_logprobs
from rlbench.utils import Progress
from rlbench.rollout.engines.vllm import (
    VLLMEngine,
    requests_to_vllm_inputs,
    vllm_outputs_to_completions,
    vllm_sampling_kwargs,
)

from conftest import has_vllm_gpu, model_preset

ROOT = Path(__file__).resolve().parents[1]
EOS_BIAS = 8.0  # makes EOS ~6% likely per step under the random tiny model


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def eos_model(tiny):
    """A tiny model whose EOS logit is raised, so that responses end at EOS often."""
    _, tokenizer = tiny
    model = build_tiny_model(tokenizer, None, seed=1)
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = EOS_BIAS
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    return model, tokenizer


def _prompt(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def _recompute(model, prompt, response, temperature=1.0, top_p=1.0) -> torch.Tensor:
    """Independent log-probs of ``response`` given ``prompt``: unpadded forward pass,
    ``log_softmax(logits / temperature)`` with optional top-p filtering written out here."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    if top_p < 1.0:
        probs = torch.softmax(logits, -1)
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        keep_sorted = before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_counts_and_shapes_with_varying_n(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, batch_size=3)
    requests = [
        GenerationRequest(_prompt(tokenizer, "one two three"), n=2),
        GenerationRequest(_prompt(tokenizer, "a"), n=0),
        GenerationRequest(_prompt(tokenizer, "a much longer prompt than the others here"), n=5),
        GenerationRequest(_prompt(tokenizer, "x y"), n=1),
    ]
    out = engine.generate(requests, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(0))
    assert [len(c) for c in out] == [2, 0, 5, 1]
    for i, comps in enumerate(out):
        for c in comps:
            assert c.request_index == i
            assert c.prompt_ids == requests[i].prompt_ids
            assert 1 <= len(c.response_ids) <= 6
            assert len(c.logprobs) == len(c.response_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert c.prefix_len == 0
            assert c.text == tokenizer.decode(c.response_ids, skip_special_tokens=True)
    assert engine.generate([], SamplingParams()) == []


def test_response_stops_at_first_eos(eos_model):
    model, tokenizer = eos_model
    eos = tokenizer.eos_token_id
    engine = HFGenerateEngine(model, tokenizer, batch_size=16)
    requests = [GenerationRequest(_prompt(tokenizer, "hello there"), n=8), GenerationRequest(_prompt(tokenizer, "q"), n=8)]
    out = engine.generate(requests, SamplingParams(max_new_tokens=16), torch.Generator().manual_seed(1))
    comps = [c for cs in out for c in cs]
    finished = [c for c in comps if c.finished]
    unfinished = [c for c in comps if not c.finished]
    assert finished and unfinished  # both kinds occur with this EOS rate
    for c in finished:
        assert c.response_ids[-1] == eos
        assert eos not in c.response_ids[:-1]
        assert "<|im_end|>" not in c.text
    for c in unfinished:
        assert len(c.response_ids) == 16
        assert eos not in c.response_ids
    assert any(len(c.response_ids) < 16 for c in finished)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_recomputation(eos_model, temperature):
    model, tokenizer = eos_model
    engine = HFGenerateEngine(model, tokenizer, batch_size=4)  # several batches, left padding
    requests = [
        GenerationRequest(_prompt(tokenizer, "The quick brown fox"), n=3),
        GenerationRequest(_prompt(tokenizer, "hi"), n=3),
    ]
    out = engine.generate(requests, SamplingParams(temperature=temperature, max_new_tokens=10), torch.Generator().manual_seed(2))
    for comps in out:
        for c in comps:
            ref = _recompute(model, c.prompt_ids, c.response_ids, temperature)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref.tolist())


def test_top_p_logprobs_are_of_the_truncated_distribution(eos_model):
    model, tokenizer = eos_model
    engine = HFGenerateEngine(model, tokenizer)
    prompt = _prompt(tokenizer, "Count: one two")
    params = SamplingParams(temperature=1.0, top_p=0.5, max_new_tokens=8)
    (comps,) = engine.generate([GenerationRequest(prompt, n=4)], params, torch.Generator().manual_seed(3))
    for c in comps:
        ref = _recompute(model, prompt, c.response_ids, 1.0, top_p=0.5)
        assert torch.isfinite(ref).all()
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
        untruncated = _recompute(model, prompt, c.response_ids, 1.0)
        assert (torch.tensor(c.logprobs) > untruncated).all()


def test_same_generator_state_same_outputs(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, batch_size=4)
    requests = [GenerationRequest(_prompt(tokenizer, "abc"), n=3), GenerationRequest(_prompt(tokenizer, "de f"), n=2)]
    params = SamplingParams(max_new_tokens=4)

    def run(seed):
        out = engine.generate(requests, params, torch.Generator().manual_seed(seed))
        return [[(c.response_ids, c.logprobs) for c in cs] for cs in out]

    assert run(5) == run(5)
    assert run(5) != run(6)
    g = torch.Generator().manual_seed(5)
    first = engine.generate(requests, params, g)
    second = engine.generate(requests, params, g)  # generator advanced: new samples
    assert [c.response_ids for c in first[0]] != [c.response_ids for c in second[0]]


def test_global_rng_untouched(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer)
    state = torch.get_rng_state()
    engine.generate([GenerationRequest(_prompt(tokenizer, "abc"), n=2)], SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert torch.equal(state, torch.get_rng_state())


def test_training_mode_restored(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer)
    model.train()
    try:
        engine.generate([GenerationRequest(_prompt(tokenizer, "abc"), n=1)], SamplingParams(max_new_tokens=2), torch.Generator())
        assert model.training
    finally:
        model.eval()


def test_prefix_continuation(eos_model):
    model, tokenizer = eos_model
    engine = HFGenerateEngine(model, tokenizer, batch_size=2)
    prompt = _prompt(tokenizer, "Question: what is 2+2?")
    prefix = _prompt(tokenizer, " The answer is")
    requests = [GenerationRequest(prompt, n=3, prefix_ids=prefix), GenerationRequest(prompt, n=1)]
    out = engine.generate(requests, SamplingParams(temperature=0.8, max_new_tokens=6), torch.Generator().manual_seed(4))
    for c in out[0]:
        assert c.prefix_len == len(prefix)
        assert tuple(c.response_ids[: len(prefix)]) == prefix
        assert len(prefix) < len(c.response_ids) <= len(prefix) + 6
        assert len(c.logprobs) == len(c.response_ids)
        ref = _recompute(model, prompt, c.response_ids, 0.8)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
        assert c.text == tokenizer.decode(c.response_ids, skip_special_tokens=True)
        assert c.text.startswith(" The answer is")
    assert out[1][0].prefix_len == 0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_shared_prefill_equals_unshared(eos_model, temperature, top_p):
    """Prefilling each distinct input once and copying its KV cache to the request's rows gives the
    samples and log-probs of prefilling every row itself, at the same seed (prefixes included)."""
    model, tokenizer = eos_model
    requests = [
        GenerationRequest(_prompt(tokenizer, "The quick brown fox"), n=5),
        GenerationRequest(_prompt(tokenizer, "hi"), n=3, prefix_ids=_prompt(tokenizer, " there friend")),
        GenerationRequest(_prompt(tokenizer, "hi"), n=2),
    ]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12)

    def run(share):
        engine = HFGenerateEngine(model, tokenizer, batch_size=6, share_prefill=share)  # a request split across batches
        out = engine.generate(requests, params, torch.Generator().manual_seed(11))
        return [[(c.response_ids, c.logprobs, c.finished) for c in cs] for cs in out]

    shared, unshared = run(True), run(False)
    # the same tokens and ends; log-probs to float rounding (a one-row and a batched prefill can round
    # differently, by 1 ulp measured on an AMD EPYC)
    assert [[(ids, done) for ids, _, done in cs] for cs in shared] == [[(ids, done) for ids, _, done in cs] for cs in unshared]
    for cs, us in zip(shared, unshared):
        for (_, lp, _), (_, ulp, _) in zip(cs, us):
            assert lp == pytest.approx(ulp, abs=1e-5)
    assert any(done for cs in shared for _, _, done in cs)  # rows left the batch early


def _kernel_or_skip():
    from rlbench.rollout.engines.cpu_linear import few_rows_kernel, few_rows_kernel_unavailable

    reason = few_rows_kernel_unavailable()
    if reason is not None:
        pytest.skip(f"few-rows CPU kernel unavailable here: {reason}")
    kernel = few_rows_kernel()
    assert kernel is not None, "an AVX2 machine with a compiler and ninja must build the few-rows kernel (see the log)"
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64])
@pytest.mark.parametrize("outputs,features,with_bias", [(1, 8, False), (6, 16, True), (13, 64, True), (192, 576, False)])
def test_few_rows_kernel_is_linear_and_row_and_thread_invariant(rows, outputs, features, with_bias):
    """The few-rows kernel (rlbench/rollout/engines/cpu_linear_kernel.cpp) computes x @ W.T + b (to float
    rounding, against float64); each output row is bit for bit the same computed alone, in any batch,
    and with 1 or 2 threads (one dot product in a fixed order per output)."""
    kernel = _kernel_or_skip()
    g = torch.Generator().manual_seed(rows * 1000 + outputs)
    x = torch.randn(rows, features, generator=g)
    w = torch.randn(outputs, features, generator=g)
    b = torch.randn(outputs, generator=g) if with_bias else None
    y = kernel.few_rows_linear(x, w, b)
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert y.shape == (rows, outputs) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=1e-5 * features**0.5)
    for m in {0, rows // 2, rows - 1}:
        assert torch.equal(kernel.few_rows_linear(x[m : m + 1].contiguous(), w, b), y[m : m + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernel.few_rows_linear(x, w, b)
        torch.set_num_threads(2)
        double = kernel.few_rows_linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, y) and torch.equal(double, y)


def test_cpu_linear_routes_by_shape_and_falls_back(monkeypatch):
    """cpu_linear: the few-rows kernel for 1-64 rows whose width is a multiple of 8, oneDNN or
    PyTorch's kernel otherwise, and never the kernels when autograd records (they have no backward)."""
    import rlbench.rollout.engines.cpu_linear as cpu

    kernel = _kernel_or_skip()
    calls = []
    monkeypatch.setattr(cpu, "few_rows_kernel", lambda: types.SimpleNamespace(few_rows_linear=lambda *a: calls.append(a[0].shape) or kernel.few_rows_linear(*a)))
    w, b = torch.randn(24, 16), torch.randn(24)
    for shape, used in [((3, 16), True), ((2, 5, 16), True), ((cpu.FEW_ROWS_MAX, 16), True), ((cpu.FEW_ROWS_MAX + 1, 16), False)]:
        calls.clear()
        x = torch.randn(*shape)
        y = cpu.cpu_linear(x, w, b, output_layer=False)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))
        assert bool(calls) == used, shape
    calls.clear()
    x, w12 = torch.randn(3, 12), torch.randn(5, 12)
    assert torch.equal(cpu.cpu_linear(x, w12, None, output_layer=False), torch.nn.functional.linear(x, w12))
    assert not calls  # width 12 is not a multiple of 8
    weight = torch.randn(24, 16, requires_grad=True)
    y = cpu.cpu_linear(torch.randn(3, 16), weight, None, output_layer=False)
    y.sum().backward()
    assert not calls and weight.grad is not None


def test_cpu_kernels_give_the_default_kernels_samples(eos_model, monkeypatch):
    """The engine's linear layers through the CPU kernels (rlbench/rollout/engines/cpu_linear.py; they apply
    to the tiny model's 49,152-id float32 model on CPU) give the default kernels' tokens, and
    log-probs to float rounding; every layer's own forward is back after each call."""
    import rlbench.rollout.engines.cpu_linear as cpu

    model, tokenizer = eos_model
    kernel = _kernel_or_skip()
    layers = cpu.layers_for_cpu_kernels(model)
    assert layers[0] is model.get_output_embeddings() and len(layers) == 1 + sum(
        type(m) is torch.nn.Linear for m in model.modules() if m is not layers[0]
    )
    calls = []
    monkeypatch.setattr(cpu, "few_rows_kernel", lambda: types.SimpleNamespace(few_rows_linear=lambda *a: calls.append(1) or kernel.few_rows_linear(*a)))
    requests = [GenerationRequest(_prompt(tokenizer, "The quick brown fox"), n=4), GenerationRequest(_prompt(tokenizer, "hi"), n=3)]
    params = SamplingParams(temperature=0.9, max_new_tokens=10)

    def run(fast):
        calls.clear()
        out = HFGenerateEngine(model, tokenizer, cpu_kernels=fast).generate(requests, params, torch.Generator().manual_seed(3))
        assert not any("forward" in vars(layer) for layer in layers)
        return [(c.response_ids, c.logprobs) for cs in out for c in cs], len(calls)

    (fast, fast_calls), (default, default_calls) = run(True), run(False)
    assert fast_calls > 0 and default_calls == 0
    assert [ids for ids, _ in fast] == [ids for ids, _ in default]
    for (_, lp), (_, dlp) in zip(fast, default):
        assert lp == pytest.approx(dlp, abs=1e-5)


def test_cpu_kernels_only_for_large_float32_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlbench.rollout.engines.cpu_linear import LARGE_VOCAB, layers_for_cpu_kernels

    def llama(vocab):
        config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
        return LlamaForCausalLM(config)

    assert len(layers_for_cpu_kernels(llama(LARGE_VOCAB))) == 8  # output layer, q k v o, gate up down
    assert layers_for_cpu_kernels(llama(512)) == []  # the learning tier's toy keeps the default kernels
    assert layers_for_cpu_kernels(llama(LARGE_VOCAB).to(torch.bfloat16)) == []


def test_prefill_once_per_input_and_finished_rows_leave(eos_model):
    """The prefill runs one row per distinct input; a row that sampled EOS is in no later forward
    pass (each decoding step's batch is the rows still running)."""
    model, tokenizer = eos_model
    rows_per_forward: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        engine = HFGenerateEngine(model, tokenizer, batch_size=64)
        hello = _prompt(tokenizer, "hello there")
        requests = [GenerationRequest(hello, n=6), GenerationRequest(_prompt(tokenizer, "q"), n=8), GenerationRequest(hello, n=2)]
        out = engine.generate(requests, SamplingParams(max_new_tokens=16), torch.Generator().manual_seed(1))
    finally:
        hook.remove()
    lengths = [len(c.response_ids) for cs in out for c in cs]
    assert rows_per_forward[0] == 2  # one prefill row per distinct prompt (two requests share one), not 16
    # decoding step t (1-based) runs the rows whose response is longer than t tokens
    expected = [sum(length > t for length in lengths) for t in range(1, max(lengths))]
    assert rows_per_forward[1:] == expected
    assert expected[-1] < 16  # rows did leave


def test_unscored_prefix_skips_scoring_only(eos_model):
    """score_prefix=False: the same continuations and log-probs, the prefix's log-probs NaN."""
    model, tokenizer = eos_model
    engine = HFGenerateEngine(model, tokenizer)
    prompt, prefix = _prompt(tokenizer, "Question: what is 2+2?"), _prompt(tokenizer, " The answer is")
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    scored, unscored = (
        engine.generate([GenerationRequest(prompt, n=3, prefix_ids=prefix, score_prefix=flag)], params, torch.Generator().manual_seed(4))[0]
        for flag in (True, False)
    )
    for a, b in zip(scored, unscored):
        assert a.response_ids == b.response_ids and a.logprobs[len(prefix):] == b.logprobs[len(prefix):]
        assert all(math.isnan(x) for x in b.logprobs[: len(prefix)]) and not any(math.isnan(x) for x in a.logprobs)


def test_greedy_rows_identical_and_batch_independent(tiny):
    model, tokenizer = tiny
    requests = [GenerationRequest(_prompt(tokenizer, "Once upon a time"), n=4), GenerationRequest(_prompt(tokenizer, "x"), n=2)]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    big = HFGenerateEngine(model, tokenizer, batch_size=64).generate(requests, params, torch.Generator().manual_seed(0))
    one = HFGenerateEngine(model, tokenizer, batch_size=1).generate(requests, params, torch.Generator().manual_seed(9))
    for comps in big:
        assert all(c.response_ids == comps[0].response_ids for c in comps)
    assert [[c.response_ids for c in cs] for cs in big] == [[c.response_ids for c in cs] for cs in one]
    for comps in big:  # greedy log-probs are those of the temperature-1 distribution
        ref = _recompute(model, comps[0].prompt_ids, comps[0].response_ids, 1.0)
        assert torch.allclose(torch.tensor(comps[0].logprobs), ref, atol=1e-4)


def test_model_generation_config_defaults_do_not_leak(tiny):
    """A checkpoint's generation_config (top_k, repetition penalty) must not alter sampling."""
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, "abc def")
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    engine = HFGenerateEngine(model, tokenizer)
    base = engine.generate([GenerationRequest(prompt, n=3)], params, torch.Generator().manual_seed(0))
    saved = model.generation_config
    try:
        model.generation_config = type(saved).from_dict(
            {**saved.to_dict(), "top_k": 5, "repetition_penalty": 1.5, "min_p": 0.2, "do_sample": True, "temperature": 0.3}
        )
        leaked = engine.generate([GenerationRequest(prompt, n=3)], params, torch.Generator().manual_seed(0))
        assert model.generation_config.top_k == 5  # restored
    finally:
        model.generation_config = saved
    assert [c.response_ids for c in base[0]] == [c.response_ids for c in leaked[0]]
    for c in leaked[0]:
        assert torch.allclose(torch.tensor(c.logprobs), _recompute(model, prompt, c.response_ids), atol=1e-4)


def test_invalid_params(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer)
    req = [GenerationRequest((1, 2), n=1)]
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(req, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(req, SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([GenerationRequest((), n=1)], SamplingParams())


def test_max_new_tokens_zero_returns_prefix_only(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer)
    (comps,) = engine.generate([GenerationRequest((5, 6, 7), n=2, prefix_ids=(8, 9))], SamplingParams(max_new_tokens=0))
    assert [c.response_ids for c in comps] == [[8, 9], [8, 9]]
    assert all(len(c.logprobs) == 2 and not c.finished for c in comps)


def test_sync_weights_switches_model(tiny):
    model, tokenizer = tiny
    other = build_tiny_model(tokenizer, None, seed=7)
    engine = HFGenerateEngine(model, tokenizer)
    engine.sync_weights(other)
    assert engine.model is other


def test_make_engine_from_config(tiny):
    model, tokenizer = tiny
    rollout = typed_node(OmegaConf.load(ROOT / "conf" / "rollout" / "iid.yaml"), RolloutConfig)
    assert rollout.engine == "hf" and rollout.n == 4 and rollout.max_new_tokens == 16
    engine = make_engine(rollout, model, tokenizer)
    assert isinstance(engine, HFGenerateEngine) and engine.batch_size == rollout.batch_size
    with pytest.raises(ConfigError, match="rollout.engine"):
        make_engine(RolloutConfig(engine="nope"), model, tokenizer)


def test_inverse_cdf_sampler_matches_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    logp = probs.log().expand(20000, -1).contiguous()
    tokens = sample_from_logprobs(logp, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert freq[1] == 0
    assert torch.allclose(freq, probs, atol=0.012), freq
    again = sample_from_logprobs(logp, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)
    # a dominant token does not swallow the tail that follows it in vocabulary order
    big = torch.full((2000, 20000), -40.0)
    big[:, 0] = 0.0
    big[:, -1] = -3.0
    tail = (sample_from_logprobs(torch.log_softmax(big, -1), torch.Generator().manual_seed(1)) == 19999).float().mean()
    assert 0.03 < tail < 0.07


def test_progress_line():
    import io

    stream = io.StringIO()
    p = Progress("rollout", 10, stream=stream)
    p.update(5)
    assert "[rollout] 5/10 (50%)" in stream.getvalue() and "ETA 00:" in stream.getvalue()
    quiet = Progress("rollout", 10, stream=stream, enabled=False)
    quiet.update(5)
    assert "5/10" in quiet.line() and stream.getvalue().count("\n") == 1


# ------------------------------------------------------------------ vLLM (conversion on CPU)


@dataclass
class FakeLogprob:
    logprob: float
    rank: int = 1


@dataclass
class FakeCompletionOutput:
    token_ids: list[int]
    logprobs: list[dict]
    finish_reason: str
    text: str = ""
    index: int = 0


@dataclass
class FakeRequestOutput:
    outputs: list[FakeCompletionOutput] = field(default_factory=list)


def _fake(tokens, lps, reason, text=""):
    return FakeRequestOutput([FakeCompletionOutput(tokens, [{t: FakeLogprob(lp), 999: FakeLogprob(-9.0)} for t, lp in zip(tokens, lps)], reason, text)])


def test_requests_to_vllm_inputs():
    reqs = [GenerationRequest((1, 2), n=2), GenerationRequest((3,), n=0), GenerationRequest((4, 5), n=1, prefix_ids=(6, 7))]
    prompts, rows = requests_to_vllm_inputs(reqs)
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [4, 5, 6, 7]}]
    assert rows == [0, 0, 2]
    kw = vllm_sampling_kwargs(SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=17), seed=123)
    assert kw["n"] == 1 and kw["temperature"] == 0.6 and kw["top_p"] == 0.9
    assert kw["max_tokens"] == 17 and kw["logprobs"] == 0 and kw["seed"] == 123
    assert kw["top_k"] == -1 and kw["repetition_penalty"] == 1.0


def test_vllm_outputs_to_completions():
    reqs = [GenerationRequest((1, 2), n=2), GenerationRequest((3,), n=0), GenerationRequest((4, 5), n=1, prefix_ids=(6, 7))]
    _, rows = requests_to_vllm_inputs(reqs)
    outputs = [
        _fake([10, 11, 0], [-0.1, -0.2, -0.3], "stop", "ab"),
        _fake([12, 13, 14], [-1.0, -2.0, -3.0], "length", "cde"),
        _fake([15], [-0.5], "length", "f"),
    ]
    out = vllm_outputs_to_completions(
        reqs, outputs, rows, prefix_logprobs={2: [-0.7, -0.8]}, eos_ids=[0],
        decode=lambda ids: " ".join(map(str, ids)),
    )
    assert [len(c) for c in out] == [2, 0, 1]
    a, b = out[0]
    assert a.response_ids == [10, 11, 0] and a.finished and a.logprobs == [-0.1, -0.2, -0.3]
    assert b.response_ids == [12, 13, 14] and not b.finished and b.logprobs == [-1.0, -2.0, -3.0]
    (c,) = out[2]
    assert c.response_ids == [6, 7, 15] and c.prefix_len == 2 and c.request_index == 2
    assert c.logprobs == [-0.7, -0.8, -0.5] and c.text == "6 7 15" and c.prompt_ids == (4, 5)
    # without decode the vLLM text is used; a missing prefix score is an error
    out = vllm_outputs_to_completions(reqs[:1], outputs[:2], rows[:2])
    assert out[0][0].text == "ab"
    with pytest.raises(ValueError, match="prefix logprobs"):
        vllm_outputs_to_completions(reqs, outputs, rows)


def test_vllm_engine_with_stand_in_llm(tiny):
    """The engine's plumbing (seeds, prefix scoring, conversion) with a fake ``vllm.LLM``."""
    model, tokenizer = tiny

    class FakeLLM:
        def __init__(self):
            self.calls = []
            self.applied = 0
            self.resets = 0

        def generate(self, prompts, sampling_params, use_tqdm=False):
            self.calls.append((prompts, sampling_params))
            return [_fake([sp["seed"] % 1000, tokenizer.eos_token_id], [-1.0, -0.5], "stop") for sp in sampling_params]

        def apply_model(self, fn):
            class M:
                def load_weights(_, weights):
                    self.applied += len(list(weights))
            fn(M())

        def reset_prefix_cache(self):
            self.resets += 1

    llm = FakeLLM()
    engine = VLLMEngine(model, tokenizer, llm=llm, sampling_params_factory=dict)
    prompt = _prompt(tokenizer, "hello")
    reqs = [GenerationRequest(prompt, n=2), GenerationRequest(prompt, n=1, prefix_ids=(42, 43))]
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    out = engine.generate(reqs, params, torch.Generator().manual_seed(0))
    again = engine.generate(reqs, params, torch.Generator().manual_seed(0))
    assert [[c.response_ids for c in cs] for cs in out] == [[c.response_ids for c in cs] for cs in again]
    seeds = [sp["seed"] for sp in llm.calls[0][1]]
    assert len(set(seeds)) == 3
    (c,) = out[1]
    assert c.response_ids[:2] == [42, 43] and c.finished
    ref = _recompute(model, prompt, [42, 43], 1.0)
    assert torch.allclose(torch.tensor(c.logprobs[:2]), ref, atol=1e-4)
    engine.sync_weights(model)
    assert llm.applied == len(model.state_dict()) and llm.resets == 1


# ------------------------------------------------------------------ vLLM on GPU


@pytest.mark.gpu
@pytest.mark.skipif(not has_vllm_gpu(), reason="needs CUDA and vLLM")
def test_vllm_engine_gpu(tmp_path):
    """vLLM samples from the converted SmolLM2 with log-probs that match the HF model, and
    sync_weights changes what it samples."""
    model, tokenizer = load_policy(model_preset("smollm2_135m"), device="cuda")
    engine = VLLMEngine(model, tokenizer, gpu_memory_utilization=0.2, enforce_eager=True)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_dict=False)
    reqs = [GenerationRequest(tuple(ids), n=4), GenerationRequest(tuple(ids), n=2, prefix_ids=tuple(ids[-3:]))]
    params = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=16)
    out = engine.generate(reqs, params, torch.Generator().manual_seed(0))
    assert [len(c) for c in out] == [4, 2]
    for comps in out:
        for c in comps:
            full = torch.tensor([list(ids) + c.response_ids], device="cuda")
            with torch.no_grad():
                logits = model(input_ids=full).logits[0, len(ids) - 1 : -1].float() / 0.8
            ref = torch.log_softmax(logits, -1).gather(-1, full[0, len(ids) :, None]).squeeze(-1).cpu()
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=5e-2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.sync_weights(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    after = engine.generate(reqs[:1], greedy)
    ref = HFGenerateEngine(model, tokenizer).generate(reqs[:1], greedy)
    assert after[0][0].response_ids[:4] == ref[0][0].response_ids[:4]
