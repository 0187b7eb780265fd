"""The HF engine's lean decoding steps (rlbench/rollout/engines/lean_decode.py) against the model's own forward:
Llama (also with every projection biased), Qwen2 (query/key/value biases) and Qwen3 (per-head query/key
norms, a head size other than hidden / heads), padded prompts, rows leaving the batch, the KV kept across
calls, weights changed between calls; and the models it must leave to the model's forward."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rlbench.rollout import GenerationRequest, HFGenerateEngine, SamplingParams
from rlbench.rollout.engines.cpu_linear import LARGE_VOCAB, fast_cpu_linears
from rlbench.rollout.engines.hf import ModelSteps
from rlbench.rollout.engines.lean_decode import LeanDecoder, LeanSteps, lean_decode_unsupported

from test_rollout import tiny  # noqa: F401  (fixture: the tiny model and the SmolLM2 tokenizer)

TOLERANCE = 1e-5  # equal bit for bit where the few-rows kernel runs; float rounding elsewhere
PROMPTS = [(5, 17, 300, 4000, 9), (7, 8, 9, 10, 11, 12, 13, 14, 15), (1000, 2000, 3000)]  # padded to 9 positions


def small_model(family: str, *, vocab: int = LARGE_VOCAB, seed: int = 0, **overrides):
    """A random two-layer model of ``family`` (grouped key/value heads), weights (and Qwen2's projection
    biases) large enough that the logits are far from uniform."""
    import transformers

    sizes = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, initializer_range=0.2, attn_implementation="sdpa")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    if family == "qwen3":
        sizes["head_dim"] = 32  # 4 heads x 32 = 128 query dimensions on a 64-wide residual stream
    torch.manual_seed(seed)
    model = model_class(config_class(**{**sizes, **overrides})).eval()
    with torch.no_grad():
        for module in model.modules():  # transformers initialises biases to zero: make them count
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.2)
    return model


class Tokenizer:
    """What the engine reads of a tokenizer: EOS and pad ids, and decoding."""

    eos_token_id = 2
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def prefill(engine: HFGenerateEngine):
    """The engine's prefill of :data:`PROMPTS` (left padded): logits, cache, mask, last positions."""
    return engine._prefill(PROMPTS, 1)


@pytest.mark.parametrize(
    "family, overrides",
    [("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {}), ("qwen3", {})],
    ids=["llama", "llama-biases", "qwen2", "qwen3"],
)
def test_lean_steps_equal_the_model_forward(family, overrides):
    """Teacher-forced decoding of five rows over three padded prompts: every step's logits, and at the
    end each row's kept keys and values, equal those of the model's forward with transformers' cache,
    also after rows left the batch."""
    model = small_model(family, **overrides)
    assert lean_decode_unsupported(model) is None
    if family == "qwen2" or overrides:
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # the fused product carries biases
    engine = HFGenerateEngine(model, Tokenizer(), progress=False)
    rows = torch.tensor([0, 0, 1, 2, 2])
    tokens = torch.randint(3, LARGE_VOCAB, (len(rows), 6), generator=torch.Generator().manual_seed(1))
    decoder = LeanDecoder(model)  # outside fast_cpu_linears, as the engine builds it
    with torch.inference_mode(), fast_cpu_linears(model):
        _, cache, mask, last = prefill(engine)
        assert mask is not None  # the prompts are padded
        reference = ModelSteps(model, cache, mask, rows, len(PROMPTS))
        _, cache, mask, _ = prefill(engine)
        lean = decoder.steps(cache, mask, rows, new_tokens=6)
        positions = last.index_select(0, rows)
        running = torch.arange(len(rows))
        for step in range(6):
            if step == 3:  # rows 1 and 3 leave (sampled EOS)
                keep = torch.tensor([0, 2, 4])
                reference.select_rows(keep)
                lean.select_rows(keep)
                positions, running = positions[keep], running[keep]
            positions = positions + 1
            expected = reference.step(tokens[running, step], positions)
            got = lean.step(tokens[running, step], positions)
            assert got.shape == expected.shape == (len(running), LARGE_VOCAB)
            assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE), (step, (got - expected).abs().max())
            assert expected.std() > 0.1  # logits far from uniform: a wrong rotation or mask would show
        for row in range(len(running)):
            for (k, v), (ek, ev) in zip(lean.row_kv(row), reference.row_kv(row)):
                assert k.shape == ek.shape and torch.allclose(k, ek, atol=TOLERANCE) and torch.allclose(v, ev, atol=TOLERANCE)


def test_lean_steps_see_only_their_row():
    """A row's logits do not depend on the other rows of its batch (nor on their padding): decoding a
    row alone gives its logits in the batch."""
    model = small_model("llama")
    engine = HFGenerateEngine(model, Tokenizer(), progress=False)
    decoder = LeanDecoder(model)
    tokens = torch.tensor([[11, 12], [21, 22], [31, 32]])
    with torch.inference_mode(), fast_cpu_linears(model):
        _, cache, mask, last = prefill(engine)
        batch = decoder.steps(cache, mask, torch.arange(3), new_tokens=2)
        together = [batch.step(tokens[:, s], last + 1 + s) for s in range(2)]
        for row, prompt in enumerate(PROMPTS):
            _, cache, mask, alone_last = engine._prefill([prompt], 1)
            alone = decoder.steps(cache, mask, torch.tensor([0]), new_tokens=2)
            for s in range(2):
                logits = alone.step(tokens[row : row + 1, s], alone_last + 1 + s)
                assert torch.allclose(logits[0], together[s][row], atol=TOLERANCE)


def test_engine_samples_equal_with_and_without_lean_decoding(tiny):
    """The engine on the tiny model (Llama, 49,152 ids: lean decoding applies) gives the same tokens, and
    log-probs to 1e-5, with lean decoding on and off, with the KV kept across calls and a second call
    that extends kept sequences; lean decoding is what ran."""
    model, tokenizer = tiny
    assert lean_decode_unsupported(model) is None
    steps = []
    original = LeanSteps.step

    def counted(self, tokens, positions):
        steps.append(len(tokens))
        return original(self, tokens, positions)

    params = SamplingParams(temperature=0.9, max_new_tokens=6)
    prompts = [tuple(tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]), (tokenizer.bos_token_id or 1, 42)]

    def run(lean: bool):
        engine = HFGenerateEngine(model, tokenizer, progress=False, prefix_cache_mb=64, lean_decode=lean)
        first = engine.generate([GenerationRequest(p, n=3) for p in prompts], params, torch.Generator().manual_seed(5))
        longer = [GenerationRequest(c.prompt_ids, n=2, prefix_ids=tuple(c.response_ids), score_prefix=False) for cs in first for c in cs if not c.finished]
        second = engine.generate(longer, params, torch.Generator().manual_seed(6))
        assert engine.prefix_cache.stats.reused_tokens > 0  # the second call started from kept keys and values
        return [(c.response_ids, c.logprobs) for cs in first + second for c in cs]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LeanSteps, "step", counted)
        lean = run(True)
        assert steps, "lean decoding did not run"
        steps.clear()
        plain = run(False)
        assert not steps
    assert [ids for ids, _ in lean] == [ids for ids, _ in plain]
    for (_, lp), (_, plp) in zip(lean, plain):
        assert lp == pytest.approx(plp, abs=TOLERANCE, nan_ok=True)


def test_engine_rows_leave_the_lean_steps_and_new_weights_are_used():
    """Through the engine, with EOS made likely (by the sampling hook, which keeps lean decoding on):
    rows that ended leave the lean steps, and the samples equal the model's forward's; after the
    weights change in place, the engine decodes with the new weights (a new decoder), again equal to
    the model's forward. Off under FSDP and without the CPU kernels."""
    model = small_model("llama")

    def more_eos(logits, contexts):
        return logits + torch.nn.functional.one_hot(torch.tensor(Tokenizer.eos_token_id), logits.shape[-1]) * 4.0

    params = SamplingParams(temperature=1.0, max_new_tokens=12, logits_transform=more_eos)
    requests = [GenerationRequest(p, n=3) for p in PROMPTS]
    rows_per_step = []
    original = LeanSteps.step

    def counted(self, tokens, positions):
        rows_per_step.append(len(tokens))
        return original(self, tokens, positions)

    lean_engine = HFGenerateEngine(model, Tokenizer(), progress=False)
    plain_engine = HFGenerateEngine(model, Tokenizer(), progress=False, lean_decode=False)

    def both(seed):
        rows_per_step.clear()
        lean = lean_engine.generate(requests, params, torch.Generator().manual_seed(seed))
        steps = list(rows_per_step)
        plain = plain_engine.generate(requests, params, torch.Generator().manual_seed(seed))
        assert not rows_per_step[len(steps):]  # the plain engine never ran the lean steps
        lean, plain = [c for cs in lean for c in cs], [c for cs in plain for c in cs]
        assert [c.response_ids for c in lean] == [c.response_ids for c in plain]
        for a, b in zip(lean, plain):
            assert a.logprobs == pytest.approx(b.logprobs, abs=TOLERANCE)
        return steps, lean

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LeanSteps, "step", counted)
        steps, before = both(seed=3)
        assert steps == sorted(steps, reverse=True) and steps[-1] < 9, steps  # of 9 rows, fewer once some ended
        assert any(c.finished for c in before) and not all(c.finished for c in before)
        first_decoder = lean_engine._lean
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.mul_(3.0)
            model.model.layers[0].self_attn.k_proj.weight.add_(0.1)
        steps, after = both(seed=3)
        assert lean_engine._lean is not first_decoder and lean_engine._lean.current(model)
        assert [c.response_ids for c in after] != [c.response_ids for c in before]
    assert HFGenerateEngine(model, Tokenizer(), cpu_kernels=False)._lean_decoder() is None
    fsdp = HFGenerateEngine(model, Tokenizer())
    fsdp.synced_gpus = True
    assert fsdp._lean_decoder() is None and HFGenerateEngine(model, Tokenizer())._lean_decoder() is not None


def mistral():
    import transformers

    config = transformers.MistralConfig(vocab_size=LARGE_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=None, attn_implementation="sdpa")
    return transformers.MistralForCausalLM(config).eval()


def scaled_llama():
    import transformers

    class ScaledLlama(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    base = small_model("llama")
    model = ScaledLlama(base.config).eval()
    model.load_state_dict(base.state_dict())
    return model


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda: small_model("llama", attn_implementation="eager"), "attention implementation 'eager'"),
        (lambda: small_model("llama", hidden_act="gelu"), "activation 'gelu'"),
        (lambda: small_model("llama", vocab=512), "large plain output layer"),
        (lambda: small_model("llama").to(torch.bfloat16), "large plain output layer"),
        (lambda: small_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0), "sliding window"),
        (lambda: hooked(small_model("llama")), "forward hooks"),
        (lambda: with_lora(small_model("llama")), "not a plain float32 CPU nn.Linear"),
        (mistral, "MistralForCausalLM is not transformers' own"),
        (scaled_llama, "ScaledLlama is not transformers' own"),
    ],
    ids=["eager", "gelu", "small-vocab", "bfloat16", "sliding-window", "hook", "lora", "mistral", "subclass"],
)
def test_models_lean_decoding_cannot_run_use_the_forward(change, reason, caplog):
    """Each model lean decoding does not cover is named with its reason, refused by the decoder, and the
    engine decodes it through the model's forward (saying so once)."""
    model = change()
    why = lean_decode_unsupported(model)
    assert why is not None and reason in why
    with pytest.raises(ValueError, match="lean decoding cannot run"):
        LeanDecoder(model)
    engine = HFGenerateEngine(model, Tokenizer(), progress=False)
    with caplog.at_level(logging.INFO, logger="rlbench.rollout.engines.hf"):
        for seed in range(2):
            out = engine.generate([GenerationRequest((5, 17, 300, 9), n=2)], SamplingParams(max_new_tokens=3), torch.Generator().manual_seed(seed))
            assert all(len(c.response_ids) >= 1 for c in out[0])
    # said once per model where the CPU kernels would apply; the others are already said by cpu_linear
    assert sum("lean decoding" in r.getMessage() for r in caplog.records) == (0 if "large plain output layer" in reason else 1)


def hooked(model):
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    return model


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).get_base_model()
