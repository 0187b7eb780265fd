"""LoRA (rlbench/model/lora.py): the adapters' update is the dense update seen through the chain rule,
the reference is the base model with adapters off (a view, no copy), the engines sample base +
adapters, only adapters are trained and saved, and bad target modules are refused."""


import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from rlbench.errors import ConfigError
from rlbench.model.lora import AdaptersOff, apply_lora, engine_weights, is_lora, reference_model, save_lora
from rlbench.training.forward import token_outputs
from rlbench.training.update import standard_update

from test_trainer import RecordingOptimizer, algo, prepared_batch, tiny_lm

R, ALPHA = 2, 6.0
SCALE = ALPHA / R
TARGETS = ["q_proj", "v_proj"]


def lora_cfg(**overrides):
    return OmegaConf.create({"r": R, "alpha": ALPHA, "dropout": 0.0, "target_modules": TARGETS,
                             "merge_on_save": False, **overrides})


def lora_model(seed=0):
    """A LoRA policy whose B is not zero (peft starts B at 0, where dL/dA vanishes)."""
    model = apply_lora(tiny_lm(seed), lora_cfg())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def adapted_layers(model):
    """name -> (A, B, base W) of every adapted linear layer."""
    out = {}
    for name, module in model.get_base_model().named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[name] = (module.lora_A["default"].weight, module.lora_B["default"].weight, module.get_base_layer().weight)
    return out


def dense_merged(model):
    """A plain model whose weights are W + (alpha / r) B A."""
    dense = tiny_lm(0)
    dense.load_state_dict(engine_weights(model))
    return dense


def test_only_adapters_train():
    model = lora_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert len(adapted_layers(model)) == 2 * len(TARGETS)  # 2 decoder layers


def test_lora_update_is_the_dense_update_through_the_chain_rule():
    """W' = W + s B A, so for the same loss L: dL/dB = s G A^T and dL/dA = s B^T G with G = dL/dW'
    the dense gradient of the merged model (s = alpha / r)."""
    algorithm = algo("token_mean")
    batch = prepared_batch(algorithm)
    model = lora_model()
    dense = dense_merged(model)
    update = dict(micro_batch_size=5, max_grad_norm=None, temperature=1.0, norm_length=6)
    lora_params = [p for p in model.parameters() if p.requires_grad]
    lora_recorded, dense_recorded = RecordingOptimizer(lora_params), RecordingOptimizer(dense)
    standard_update(model, lora_recorded, batch, algorithm, **update)
    standard_update(dense, dense_recorded, batch, algorithm, **update)
    lora_grad = {id(p): g for p, g in zip(lora_params, lora_recorded.steps[0])}
    dense_grad = dict(zip([n for n, _ in dense.named_parameters()], dense_recorded.steps[0]))
    for name, (a, b, _) in adapted_layers(model).items():
        g = dense_grad[f"{name}.weight"]
        assert g.abs().max() > 1e-4
        assert torch.allclose(lora_grad[id(b)], SCALE * g @ a.detach().T, atol=1e-6, rtol=1e-4), name
        assert torch.allclose(lora_grad[id(a)], SCALE * b.detach().T @ g, atol=1e-6, rtol=1e-4), name


def test_the_reference_is_the_base_model_with_adapters_off_and_no_copy():
    base = tiny_lm(0)
    model = lora_model()
    reference = reference_model(model)
    assert isinstance(reference, AdaptersOff) and list(reference.parameters()) == []
    batch = prepared_batch(algo("token_mean"))
    with torch.no_grad():
        ref_logp = token_outputs(reference, batch).logp
        base_logp = token_outputs(base, batch).logp
        policy_logp = token_outputs(model, batch).logp
    assert torch.allclose(ref_logp, base_logp, atol=1e-6)
    assert (policy_logp - base_logp).abs().max() > 1e-3  # the adapters change the policy
    assert model.training == reference.policy.training  # the view leaves the policy's mode alone
    plain = reference_model(base)
    assert not plain.training and all(not p.requires_grad for p in plain.parameters())


def test_the_engine_weights_sample_base_plus_adapters():
    model = lora_model()
    dense = dense_merged(model)
    assert not any("lora" in k or "base_layer" in k for k in engine_weights(model))
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        assert torch.allclose(dense(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    assert not is_lora(dense) and is_lora(model)


def test_saving_writes_adapters_or_the_merged_model(tmp_path):
    model = lora_model()
    save_lora(model, tmp_path / "adapters", merge=False)
    files = {p.name for p in (tmp_path / "adapters").iterdir()}
    assert "adapter_config.json" in files and not any(f.startswith("model") for f in files)
    save_lora(model, tmp_path / "merged", merge=True)
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    assert is_lora(model)  # merging worked on a copy


def test_target_modules_not_in_the_model_are_refused():
    with pytest.raises(ConfigError, match=r"no module of this model is named \['qkv'\]; its linear layers are .*q_proj"):
        apply_lora(tiny_lm(0), lora_cfg(target_modules=["q_proj", "qkv"]))
    with pytest.raises(ConfigError, match="empty"):
        apply_lora(tiny_lm(0), lora_cfg(target_modules=[]))
