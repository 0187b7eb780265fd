"""The packed training forward: a micro-batch as one sequence without padding.

The rows of a group share their prompt. :func:`pack_groups` lays out one sequence: each group's prompt
once (without its left padding and without its last token), then every row's response segment (the
prompt's last token followed by the response but its last token), rows of a group side by side.
Response position j of row r then predicts response token j, from position ``p_r - 1 + j`` (p_r: the
prompt's length), as in the row's own forward. :func:`packed_attention` runs the model on that
sequence with an attention that follows the layout: a prompt attends causally to itself; a block of
response segments (a group's rows, at most :data:`BLOCK_TOKENS` tokens) attends to its group's prompt
and, causally, to its own segment. So every token sees exactly the keys of its row's forward, the
linear layers see no padding and no token twice, and the backward forms each weight's gradient once.

Against one forward per row this saves the prompts' repetition and the padding; against one pass per
prompt plus length-bucketed response passes (the layout it replaces), the padding left in the buckets
and the per-pass cost of writing and adding every weight gradient again (docs/performance.md).

The attention is a Hugging Face attention function (``AttentionInterface``) registered as
:data:`PACKED_ATTENTION` and selected for the duration of the forward; it calls PyTorch's
``scaled_dot_product_attention`` once per prompt and once per response block. It applies where the
model uses ``sdpa`` and no sliding window shorter than a row (:func:`packing_supported`); a forward run
elsewhere while it is selected (no layout set) gets the standard sdpa attention.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from rlbench.utils import SDPA_GROUPED_HEADS

PACKED_ATTENTION = "rlbench_packed"
BLOCK_TOKENS = 1024  # response tokens per attention call: a larger group's rows are split into several blocks


@dataclass(frozen=True)
class ResponseBlock:
    """Response segments of adjacent rows of one group: positions ``[start, end)`` attend to the
    group's prompt ``prompt`` (a ``(start, end)`` span) and causally within their own segment
    (``mask``: [end - start, prompt length + end - start], True = attend)."""

    start: int
    end: int
    prompt: tuple[int, int]
    mask: torch.Tensor


@dataclass(frozen=True)
class PackedLayout:
    """One sequence for a micro-batch (module docstring)."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    prompt_tokens: int  # the first prompt_tokens positions are the prompts (no logits needed)
    prompts: list[tuple[int, int]]  # each group's prompt span
    blocks: list[ResponseBlock]
    index: torch.Tensor  # [B, T]: response position (after the prompts) predicting token t of row b; -1 past its end

    @property
    def response_tokens(self) -> int:
        return self.input_ids.shape[1] - self.prompt_tokens


def pack_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    response_width: int,
    row_to_group: torch.Tensor,
    first_row: torch.Tensor,
    block_tokens: int | None = None,
) -> PackedLayout:
    """The layout of rows ``[B, prompt_width + response_width]`` (left-padded prompts, right-padded
    responses; ``row_to_group[b]``: the group of row b, ``first_row[g]``: a row holding group g's
    prompt). A row's response length is its attended response tokens, at least 1 (module docstring)."""
    block_tokens = BLOCK_TOKENS if block_tokens is None else block_tokens
    P, T = prompt_width, response_width
    device = input_ids.device
    prompt_lengths = attention_mask[first_row, :P].sum(-1).tolist()
    lengths = attention_mask[:, P : P + T].sum(-1).clamp(min=1, max=T).tolist()
    groups = row_to_group.tolist()
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    prompts: list[tuple[int, int]] = []
    offset = 0
    if min(prompt_lengths, default=1) < 1:
        raise ValueError("every row needs a prompt token to pack (its last token opens the response segment)")
    for g, row in enumerate(first_row.tolist()):
        p = prompt_lengths[g] - 1  # the last prompt token opens each response segment
        pieces.append(input_ids[row, P - 1 - p : P - 1])
        positions.append(torch.arange(p, device=device))
        prompts.append((offset, offset + p))
        offset += p
    prompt_tokens = offset
    index = torch.full((len(groups), T), -1, dtype=torch.long, device=device)
    blocks: list[ResponseBlock] = []
    masks: dict[tuple[int, ...], torch.Tensor] = {}
    rows_by_group: list[list[int]] = [[] for _ in prompts]
    for r, g in enumerate(groups):
        rows_by_group[g].append(r)
    for g, rows in enumerate(rows_by_group):
        p = prompt_lengths[g] - 1
        block: list[int] = []
        for i, r in enumerate(rows):
            pieces.append(input_ids[r, P - 1 : P - 1 + lengths[r]])
            positions.append(torch.arange(p, p + lengths[r], device=device))
            index[r, : lengths[r]] = torch.arange(offset - prompt_tokens, offset - prompt_tokens + lengths[r], device=device)
            offset += lengths[r]
            block.append(lengths[r])
            last = i == len(rows) - 1
            if last or sum(block) + lengths[rows[i + 1]] > block_tokens:
                key = (p, *block)
                if key not in masks:
                    masks[key] = _block_mask(p, block, device)
                blocks.append(ResponseBlock(offset - sum(block), offset, prompts[g], masks[key]))
                block = []
    return PackedLayout(
        input_ids=torch.cat(pieces)[None],
        position_ids=torch.cat(positions)[None],
        prompt_tokens=prompt_tokens,
        prompts=prompts,
        blocks=blocks,
        index=index,
    )


def _block_mask(prompt: int, segments: list[int], device) -> torch.Tensor:
    """[sum(segments), prompt + sum(segments)]: every query sees the whole prompt, and the keys of its
    own segment up to itself."""
    n = sum(segments)
    segment = torch.repeat_interleave(torch.arange(len(segments), device=device), torch.tensor(segments, device=device))
    order = torch.arange(n, device=device)
    own = (segment[:, None] == segment[None, :]) & (order[None, :] <= order[:, None])
    return torch.cat([torch.ones(n, prompt, dtype=torch.bool, device=device), own], dim=1)


# The layout of the forward running in this thread, and a count of its attention calls (one per layer).
_LAYOUT: ContextVar[tuple[PackedLayout | None, list[int]]] = ContextVar("packed_layout", default=(None, []))


def _sdpa(query, key, value, *, mask=None, causal=False, dropout=0.0, scaling=None):
    groups = query.shape[1] // key.shape[1]
    options = {}
    if groups > 1:
        # CPU: sdpa shares the key/value heads itself. CUDA's masked kernels (and torch < 2.5) need them
        # repeated, else a masked call falls back to the math kernel (as transformers' own sdpa path does).
        if query.device.type == "cpu" and SDPA_GROUPED_HEADS:
            options["enable_gqa"] = True
        else:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, **options
    )


def _packed_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The attention of a packed forward (module docstring); query [1, heads, N, d], key and value
    [1, kv heads, N, d]. Returns [1, N, heads, d], as Hugging Face's attention functions do."""
    layout, calls = _LAYOUT.get()
    if layout is None:  # a forward outside packed_attention: the attention the model was loaded with
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # (a sliding window is passed on by some models; packing_supported admitted only rows shorter than it)
    unsupported = [name for name in ("softcap", "s_aux", "position_bias") if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"the packed training forward does not support attention with {unsupported}")
    calls.append(1)
    outputs = []
    for start, end in layout.prompts:
        if end > start:
            span = slice(start, end)
            outputs.append(_sdpa(query[:, :, span], key[:, :, span], value[:, :, span], causal=True, dropout=dropout, scaling=scaling))
    for block in layout.blocks:
        own, prompt = slice(block.start, block.end), slice(*block.prompt)
        keys = torch.cat([key[:, :, prompt], key[:, :, own]], dim=2)
        values = torch.cat([value[:, :, prompt], value[:, :, own]], dim=2)
        outputs.append(_sdpa(query[:, :, own], keys, values, mask=block.mask, dropout=dropout, scaling=scaling))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _register() -> bool:
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError:  # transformers without pluggable attention: no packed forward
        return False
    AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # masks of forwards outside (no layout)
    return True


_REGISTERED = _register()


ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def packing_supported(model: torch.nn.Module, longest_row: int) -> bool:
    """Whether :func:`packed_attention` can run ``model`` (a Hugging Face model, unwrapped): attention
    through sdpa in every layer (no linear-attention, state-space or convolution layers, which would
    mix the packed rows), no logit soft-capping, and no sliding window shorter than ``longest_row`` tokens.
    A model whose attention bypasses the registered function is caught after its first packed forward
    (:func:`check_attention_calls`)."""
    config = getattr(model, "config", None)
    if not _REGISTERED or config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return False
    if not set(getattr(config, "layer_types", None) or ()) <= ATTENTION_LAYER_TYPES:
        return False
    window = getattr(config, "sliding_window", None)
    return not (window and getattr(config, "use_sliding_window", True) and window < longest_row)


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, layout: PackedLayout) -> Iterator[list[int]]:
    """Inside, ``model``'s attention follows ``layout`` (``model``: the unwrapped Hugging Face model;
    :func:`packing_supported` must hold); yields the list its attention calls are counted in. The
    attention implementation of the config and its sub-configs is restored on exit."""
    config = model.config
    saved = [(c, c._attn_implementation) for c in _configs(config)]
    calls: list[int] = []
    token = None
    try:
        token = _LAYOUT.set((layout, calls))
        config._attn_implementation = PACKED_ATTENTION
        yield calls
    finally:
        for c, implementation in saved:  # outer configs first: each setter also sets its sub-configs
            c._attn_implementation = implementation
        if token is not None:
            _LAYOUT.reset(token)


def _configs(config) -> list:
    """A config and its sub-configs, recursively (composite models carry one per part)."""
    found = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found.extend(_configs(sub))
    return found


def check_attention_calls(model: torch.nn.Module, calls: list[int]) -> None:
    """After a packed forward: every attention layer went through the packed attention. A model that picks
    its attention elsewhere (remote code, a class fixed at load) would have run full attention across the
    packed rows; refuse it rather than train on wrong log-probs."""
    layers = getattr(model.config, "num_hidden_layers", None)
    if layers is not None and len(calls) != layers:
        raise RuntimeError(
            f"the packed training forward saw {len(calls)} attention calls for {layers} layers: this model's "
            "attention does not go through transformers' attention functions, so it cannot run packed; "
            "rlbench.training.packing.packing_supported must exclude it (please report the model)"
        )
