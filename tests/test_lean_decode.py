"""The HF engine's lean decoding steps (rlbench/rollout/lean_decode.py) against the model's own forward:
Llama, Qwen2 (projection biases) and Qwen3 (per-head query/key norms), padded prompts, rows leaving
the batch, the KV kept across calls; and the models it must leave to the model's forward."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rlbench.rollout import GenerationRequest, HFGenerateEngine, SamplingParams
from rlbench.rollout.cpu_linear import LARGE_VOCAB, fast_cpu_linears
from rlbench.rollout.hf_engine import ModelSteps
from rlbench.rollout.lean_decode import LeanDecoder, LeanSteps, lean_decode_unsupported

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
        sizes["head_dim"] = 16
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


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_lean_steps_equal_the_model_forward(family):
    """Teacher-forced decoding of five rows over three padded prompts: every step's logits, and at the
    end each row's kept keys and values, equal those of the model's forward with transformers' cache,
    also after rows left the batch."""
    model = small_model(family)
    assert lean_decode_unsupported(model) is None
    if family == "qwen2":
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
        lean = decoder.steps(decoder.fuse(), cache, mask, rows, new_tokens=6)
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
        batch = decoder.steps(decoder.fuse(), cache, mask, torch.arange(3), new_tokens=2)
        together = [batch.step(tokens[:, s], last + 1 + s) for s in range(2)]
        for row, prompt in enumerate(PROMPTS):
            _, cache, mask, alone_last = engine._prefill([prompt], 1)
            alone = decoder.steps(decoder.fuse(), cache, mask, torch.tensor([0]), new_tokens=2)
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
    ],
    ids=["eager", "gelu", "small-vocab", "bfloat16", "sliding-window", "hook", "lora"],
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
    with caplog.at_level(logging.INFO, logger="rlbench.rollout.hf_engine"):
        for seed in range(2):
            out = engine.generate([GenerationRequest((5, 17, 300, 9), n=2)], SamplingParams(max_new_tokens=3), torch.Generator().manual_seed(seed))
            assert all(len(c.response_ids) >= 1 for c in out[0])
    assert sum("lean decoding" in r.getMessage() for r in caplog.records) == 1


def hooked(model):
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    return model


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).get_base_model()
