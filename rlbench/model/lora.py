"""LoRA through peft (``model.lora``; Hu et al. 2021, arXiv:2106.09685): W x + (alpha / r) B A x.

* only the adapters (A, B) are trained; the base weights are frozen;
* the KL reference is the base model: the same modules with the adapters disabled
  (:func:`reference_model` returns a view, :class:`AdaptersOff`; no second copy of the weights);
* the engines sample from base + adapters: the HF engine runs the peft model itself, the vLLM engine
  loads :func:`engine_weights` (the merged weights under the base model's names);
* saving writes the adapters alone, or base + adapters merged (``model.lora.merge_on_save``);
* per-role adapters (``model.lora.per_role``; AT-GRPO's per-role policies, arXiv:2510.11062, section 3): one
  adapter per role of the environment, named after the role, on the same frozen base. :func:`role_adapters`
  names them (turn t is role t mod their number); :func:`active_adapter` runs a forward with one of them
  (the engine samples a role's turn with it, rlbench.training.forward trains each role's tokens with it).
"""

from __future__ import annotations

import copy
import contextlib
from typing import Any, Iterator, Sequence

import torch

from rlbench.errors import ConfigError


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def check_target_modules(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target must name a module of ``model`` (the last part of its dotted name), else the
    adapters would silently be missing where the user asked for them."""
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets if t not in leaves]
    if not targets or missing:
        raise ConfigError(
            f"model.lora.target_modules {targets}: " + (f"no module of this model is named {missing}" if missing else "empty")
            + f"; its linear layers are {linear}"
        )


def apply_lora(model: torch.nn.Module, lora: Any, roles: Sequence[str] = ()) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``lora.target_modules`` (a peft model; base weights frozen).
    B starts at zero (peft's default), so the wrapped model computes exactly what ``model`` did.

    ``roles`` (two or more names): one adapter per role, named after it, all trainable; they start
    identical (the first role's A copied into the others, B = 0), so the run starts from one policy
    (the shared one's). The first role's adapter is the active one outside :func:`active_adapter`."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules)
    check_target_modules(model, targets)
    config = LoraConfig(
        r=int(lora.r), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout), target_modules=targets,
        bias="none", task_type="CAUSAL_LM",
    )
    if not roles:
        return get_peft_model(model, config)
    if len(roles) < 2 or len(set(roles)) != len(roles):
        raise ConfigError(f"per-role LoRA adapters need two or more distinct role names, got {list(roles)}")
    model = get_peft_model(model, config, adapter_name=roles[0])
    for role in roles[1:]:
        model.add_adapter(role, config)
    first = {name: p for name, p in model.named_parameters() if f".{roles[0]}." in name}
    with torch.no_grad():
        for name, p in model.named_parameters():
            for role in roles[1:]:
                if f".{role}." in name and "lora_" in name:
                    p.copy_(first[name.replace(f".{role}.", f".{roles[0]}.")])
    model.set_adapter(roles[0])
    model.role_adapters = tuple(roles)
    _train_every_adapter(model)
    return model


def role_adapters(model: torch.nn.Module) -> tuple[str, ...]:
    """The adapters of a per-role LoRA policy in role order (turn t is role t mod their number); () for
    any other model (one policy for every role)."""
    return tuple(getattr(model, "role_adapters", ()) or ())


def turn_adapter(adapters: Sequence[str], turn: int) -> str:
    """The adapter of the role that acts in turn ``turn`` (0-based): roles take turns in a fixed order,
    role(t) = t mod (number of roles), as algorithm=at_grpo's key reads it."""
    return adapters[turn % len(adapters)]


def _train_every_adapter(model: torch.nn.Module) -> None:
    """peft freezes the adapters that are not active; every role's adapter trains."""
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)


@contextlib.contextmanager
def active_adapter(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Forwards inside run ``model`` (a per-role LoRA policy) with adapter ``name`` alone; every adapter
    stays trainable (peft's switch would freeze the others), the first role's is active again after."""
    adapters = role_adapters(model)
    if name not in adapters:
        raise ValueError(f"adapter {name!r} is not one of the policy's role adapters {list(adapters)}")
    model.set_adapter(name)
    _train_every_adapter(model)
    try:
        yield
    finally:
        model.set_adapter(adapters[0])
        _train_every_adapter(model)


class AdaptersOff(torch.nn.Module):
    """The base model of a LoRA policy: the policy's own modules run with the adapters disabled.

    The policy is held without registering it as a submodule, so the view has no parameters of its
    own (nothing to train, copy or save) and ``eval()`` on it leaves the policy's mode alone."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    def get_base_model(self) -> torch.nn.Module:
        return self.policy.get_base_model()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """The KL reference pi_ref: for a LoRA policy the base weights with adapters off (a view);
    otherwise a frozen copy of the initial policy."""
    if is_lora(model):
        return AdaptersOff(model)
    return copy.deepcopy(model).eval().requires_grad_(False)


def engine_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under the plain Hugging Face names an inference engine loads (vLLM's
    ``load_weights``): for a LoRA policy each adapted weight is W + (alpha / r) B A, so the engine
    samples from base + adapters without knowing about LoRA; the model is not changed."""
    if not is_lora(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight.detach()
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter).detach().to(weight.dtype)
            merged[f"{name}.weight"] = weight
    out = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        out[key] = merged.get(key, value.detach())
    return out


def save_lora(model: torch.nn.Module, target: Any, merge: bool) -> None:
    """The adapters alone (peft format: adapter_config.json + adapter weights), or with ``merge`` a
    plain Hugging Face model whose weights are base + adapters."""
    if merge:
        base = copy.deepcopy(model).merge_and_unload()
        base.save_pretrained(target)
    else:
        model.save_pretrained(target)
