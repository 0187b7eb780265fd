"""The HF engine's one-token decoding steps for Llama, Qwen2 and Qwen3 models on CPU, written out
without transformers' per-module machinery.

A decoding step on CPU moves few rows through every layer, so besides reading the weights (the few-rows
kernel, rlbench/rollout/engines/cpu_linear.py) its cost is Python and dispatch: transformers' model, layer,
attention and MLP wrappers, the attention mask built again for every step, the KV cache grown by
``torch.cat`` in every layer, seven separate products per layer. :class:`LeanDecoder` runs the same
step as the model's own forward, layer by layer (Touvron et al. 2023, arXiv:2302.13971, section 2:
pre-normalisation with RMSNorm, rotary positions, SwiGLU), with fewer operations:

* per layer, with ``x`` the residual stream of the new token and ``n(.)`` RMSNorm,
  ``[q | k | v] = n(x) W_qkv (+ b_qkv)`` as **one** product (the three weights concatenated when the
  decoder is built, once per weights version), Qwen3's per-head ``q, k = n(q), n(k)``, the rotary
  rotation ``q cos + rotate_half(q) sin`` (Su et al. 2021, arXiv:2104.09864, section 3.4.2), attention
  of the token over its row's cached keys and values, ``x += o W_o``; then ``[g | u] = n(x) W_gate_up``
  as one product and ``x += (silu(g) * u) W_down``; after the last layer ``logits = n(x) W_head``;
* the keys and values live in buffers allocated once for the prompt plus ``max_new_tokens``
  positions (:class:`LeanSteps`); a step writes its position in place;
* attention reads each key/value head once for its group of query heads (sdpa's ``enable_gqa``, no
  repeated keys), with the padding mask of the prompts as a boolean view of one buffer.

The embedding, the rotary tables (every rope type the model's own ``rotary_emb`` computes) and the
norms' weights are the model's own modules and parameters. The concatenated weights are a copy (for
SmolLM2-135M 70 M floats, 280 MB): :meth:`LeanDecoder.current` says whether they still match the
model. The operations are those of transformers' Llama, Qwen2 and Qwen3 layers in the same order; with
the few-rows kernel (each output one dot product in a fixed order, so a fused product equals the separate
ones) the logits equal the model's forward bit for bit on this project's machine (SmolLM2-135M, 48
steps of 16 rows); the tests compare to 1e-5.

**Where it applies** (:func:`lean_decode_unsupported` says why not): where the CPU kernels apply (a
float32 model on CPU with a large output layer: the learning tier's 512-id toy keeps the model's
forward, so its calibrated trajectories do not change), to transformers' own ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` (exact classes: a subclass or a remote-code model may
change the forward) with full attention in every layer, sdpa attention, SiLU gating, plain
``nn.Linear`` projections (a LoRA or quantized layer is not one) and no forward hooks, on a
transformers whose cache holds per-layer keys and values (``transformers.cache_utils.DynamicLayer``). Everything
else, and decoding under FSDP (whose forwards are collective), goes through the model's forward.
Measured in ``docs/performance.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlbench.rollout.engines.cpu_linear import cpu_linear, layers_for_cpu_kernels, plain_float32_cpu_linear
from rlbench.rollout.engines.prefix_cache import KV, weights_version
from rlbench.rollout.engines.refill import join_rows
from rlbench.utils import SDPA_GROUPED_HEADS

# transformers.models.<family>.modeling_<family>: <Prefix>ForCausalLM, <Prefix>Model, <Prefix>DecoderLayer, <Prefix>RMSNorm
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}


@functools.lru_cache(maxsize=None)
def _family_classes() -> dict[type, tuple[type, type, type]]:
    """``{causal LM class: (base model class, decoder layer class, RMSNorm class)}`` of the supported
    families, from the installed transformers (looked up once)."""
    import importlib

    classes = {}
    for family, prefix in FAMILIES.items():
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        classes[getattr(module, f"{prefix}ForCausalLM")] = (
            getattr(module, f"{prefix}Model"), getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RMSNorm"),
        )
    return classes


def lean_decode_unsupported(model) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (module docstring), or None when it can.
    Called outside :func:`~rlbench.rollout.engines.cpu_linear.fast_cpu_linears` (which replaces the linear
    layers' forwards)."""
    if not layers_for_cpu_kernels(model):
        return "not a float32 CPU model with a large plain output layer (where the CPU kernels apply)"
    if not SDPA_GROUPED_HEADS:
        return f"torch {torch.__version__} has no grouped key/value heads in sdpa (needs 2.5)"
    try:
        from transformers.cache_utils import DynamicLayer  # noqa: F401  (per-layer keys and values)
        families = _family_classes()
    except (ImportError, AttributeError) as exc:
        return f"this transformers has no per-layer KV cache or lacks a supported family ({exc})"
    if type(model) not in families:
        return f"{type(model).__name__} is not transformers' own " + ", ".join(c.__name__ for c in families)
    base_class, layer_class, norm_class = families[type(model)]
    config, base = model.config, model.model
    if type(base) is not base_class or type(base.norm) is not norm_class or type(base.embed_tokens) is not torch.nn.Embedding:
        return f"{type(model).__name__} holds a {type(base).__name__} with {type(base.norm).__name__}, not {base_class.__name__}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r} (needs sdpa)"
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"activation {getattr(config, 'hidden_act', None)!r} (needs silu)"
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"} or getattr(config, "use_sliding_window", False):
        return "a layer attends over a sliding window"
    if len(base.layers) != config.num_hidden_layers:
        return f"{len(base.layers)} layers for num_hidden_layers={config.num_hidden_layers}"
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not layer_class:
            return f"layer {i} is a {type(layer).__name__}, not {layer_class.__name__}"
        if getattr(attn, "sliding_window", None) is not None or not hasattr(attn, "scaling"):
            return f"layer {i} attends over a sliding window or has no attention scaling"
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(plain_float32_cpu_linear(m) for m in linears):
            return f"layer {i} has a projection that is not a plain float32 CPU nn.Linear (LoRA, quantized, another device)"
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if any(type(n) is not norm_class for n in norms):
            return f"layer {i} has a norm that is not {norm_class.__name__}"
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in model.modules()):
        return "a module has forward hooks or a replaced forward (they would be bypassed)"
    return None


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467, eq. 4): ``w * x / sqrt(mean(x^2) + eps)``
    over the last dimension, with ``norm``'s weight and epsilon."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension's halves (the rotary embedding's pairing)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A hidden layer's product through the CPU kernels (:func:`~rlbench.rollout.engines.cpu_linear.cpu_linear`)."""
    return cpu_linear(x, weight, bias, output_layer=False)


@dataclass
class FusedLayer:
    """One layer's concatenated weights: ``[W_q; W_k; W_v]`` and ``[W_gate; W_up]`` (and biases)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, linears)])


class LeanDecoder:
    """Decoding steps of a supported model (module docstring), its products through the CPU kernels;
    holds the layers' concatenated weights as they were when it was built."""

    def __init__(self, model):
        reason = lean_decode_unsupported(model)
        if reason is not None:
            raise ValueError(f"lean decoding cannot run this model: {reason}")
        self.model = model
        self.version = weights_version(model)
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.query_heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        with torch.no_grad():
            self.fused = [
                FusedLayer(
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), _cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]), _cat_bias(m.gate_proj, m.up_proj),
                )
                for a, m in ((layer.self_attn, layer.mlp) for layer in model.model.layers)
            ]

    def current(self, model) -> bool:
        """Whether this decoder's weights are ``model``'s as they are now."""
        return weights_version(model) == self.version

    def steps(self, cache, mask: torch.Tensor | None, rows: torch.Tensor, new_tokens: int) -> "LeanSteps":
        """Decoding state for the rows ``rows`` (indices into the prefill's batch) of a prefill's
        transformers cache (``cache.layers[i].keys``: ``[inputs, kv_heads, length, head_dim]``) and
        its attention mask (None: no padding), with room for ``new_tokens`` more positions."""
        first = cache.layers[0].keys
        length = first.shape[2]
        capacity = length + new_tokens
        keys, values = [], []
        for layer in cache.layers:
            k = first.new_empty((len(rows), self.kv_heads, capacity, self.head_dim))
            v = torch.empty_like(k)
            k[:, :, :length] = layer.keys.index_select(0, rows)
            v[:, :, :length] = layer.values.index_select(0, rows)
            keys.append(k)
            values.append(v)
        valid = None
        if mask is not None:
            valid = torch.ones((len(rows), capacity), dtype=torch.bool, device=first.device)
            valid[:, :length] = mask.index_select(0, rows).bool()
        return LeanSteps(self, keys, values, valid, length)


class LeanSteps:
    """The keys and values of the rows being decoded (buffers ``[rows, kv_heads, capacity,
    head_dim]`` per layer, ``length`` positions filled, ``valid`` the positions a row attends to, None
    without padding) and :meth:`step`, which feeds one token per row."""

    def __init__(self, decoder: LeanDecoder, keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor | None, length: int):
        self.decoder = decoder
        self.keys = keys
        self.values = values
        self.valid = valid
        self.length = length

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (in that order)."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        if self.valid is not None:
            self.valid = self.valid.index_select(0, index)

    def add_rows(self, cache, mask: torch.Tensor | None, rows: torch.Tensor, new_tokens: int) -> None:
        """Append the rows ``rows`` of a prefill's transformers cache (and its mask, None: no padding) after
        the running rows, right-aligned (rlbench/rollout/engines/refill.py), with room for ``new_tokens``
        more positions."""
        at = self.length
        old = [(k[:, :, :at], v[:, :, :at]) for k, v in zip(self.keys, self.values)]
        new = [(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in cache.layers]
        valid = self.valid[:, :at] if self.valid is not None else None
        layers, self.valid, self.length = join_rows(old, valid, new, mask.index_select(0, rows).bool() if mask is not None else None, new_tokens)
        self.keys, self.values = [k for k, _ in layers], [v for _, v in layers]

    def row_kv(self, row: int) -> KV:
        """The row's keys and values at the positions it attends to, per layer ``[kv_heads, n, head_dim]``."""
        at = self.valid[row, : self.length] if self.valid is not None else slice(None)
        return tuple(
            (k[row, :, : self.length][:, at].clone(), v[row, :, : self.length][:, at].clone()) for k, v in zip(self.keys, self.values)
        )

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[rows]`` at ``positions`` ``[rows]``; returns the next-token logits ``[rows, vocab]``."""
        d = self.decoder
        model = d.model.model
        rows, at, dim = tokens.shape[0], self.length, d.head_dim
        x = model.embed_tokens(tokens[:, None])  # [rows, 1, hidden]
        cos, sin = model.rotary_emb(x, positions[:, None])
        cos, sin = cos[:, None], sin[:, None]  # [rows, 1, 1, head_dim], broadcast over heads
        mask = self.valid[:, None, None, : at + 1] if self.valid is not None else None
        splits = [d.query_heads * dim, d.kv_heads * dim, d.kv_heads * dim]
        for layer, fused, keys, values in zip(model.layers, d.fused, self.keys, self.values):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = linear(rms_norm(x, layer.input_layernorm), fused.qkv, fused.qkv_bias).split(splits, dim=-1)
            q, k = q.view(rows, 1, d.query_heads, dim), k.view(rows, 1, d.kv_heads, dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of each head's query and key
                q, k = rms_norm(q, attn.q_norm), rms_norm(k, attn.k_norm)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(rows, 1, d.kv_heads, dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            keys[:, :, at : at + 1] = k * cos + rotate_half(k) * sin
            values[:, :, at : at + 1] = v
            o = F.scaled_dot_product_attention(
                q, keys[:, :, : at + 1], values[:, :, : at + 1], attn_mask=mask, scale=attn.scaling, enable_gqa=True,
            )
            x = x + linear(o.transpose(1, 2).reshape(rows, 1, d.query_heads * dim), attn.o_proj.weight, attn.o_proj.bias)
            gate, up = linear(rms_norm(x, layer.post_attention_layernorm), fused.gate_up, fused.gate_up_bias).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        self.length = at + 1
        head = d.model.get_output_embeddings()
        return cpu_linear(rms_norm(x[:, 0], model.norm), head.weight, head.bias, output_layer=True)
