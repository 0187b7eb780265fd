"""The forward pass: one function, :func:`token_outputs`, gives the per-token log-probs (and on
request entropies, critic values, the full distribution) of a batch's responses; every log-prob the
step needs (sampling pass, reference, proximal policy, SPO's stored responses) comes from it.

The batch layout (left-padded prompts, right-padded responses) is described in
rlbench.training.batch.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from contextvars import ContextVar
from typing import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlbench.rollout.hf_engine import plain_kv_layers
from rlbench.training.batch import TrainBatch, micro_batches
from rlbench.training.distributed import several_ranks, unwrap


# trainer.precision of the forwards inside :func:`forward_precision` (the runner sets it around training).
PRECISION: ContextVar[str] = ContextVar("precision", default="auto")

# A change of the logits every forward inside :func:`training_logits_transform` applies before its
# log-softmax: ``transform(logits [B, T, V], batch) -> logits`` (after the temperature). The rollout
# strategy that samples from a changed distribution (rollout=masked) sets it around the step, so that
# the ratio compares the distribution that was sampled from.
LOGITS_TRANSFORM: ContextVar[Callable[[torch.Tensor, TrainBatch], torch.Tensor] | None] = ContextVar(
    "logits_transform", default=None
)


@contextlib.contextmanager
def training_logits_transform(
    transform: Callable[[torch.Tensor, TrainBatch], torch.Tensor] | None,
) -> Iterator[None]:
    """Apply ``transform`` to the logits of every :func:`token_outputs` inside (None: no change)."""
    token = LOGITS_TRANSFORM.set(transform)
    try:
        yield
    finally:
        LOGITS_TRANSFORM.reset(token)


@contextlib.contextmanager
def forward_precision(precision: str) -> Iterator[None]:
    """Run the forwards inside at ``precision``: auto (bf16 autocast on CUDA, fp32 on CPU), fp32, or
    bf16 (autocast on any device, CPU included). Master weights and the loss stay fp32."""
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be auto, fp32 or bf16, got {precision!r}")
    token = PRECISION.set(precision)
    try:
        yield
    finally:
        PRECISION.reset(token)


def autocast_context(device: torch.device | str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA and under precision bf16; nothing otherwise (float32)."""
    device_type, precision = torch.device(device).type, PRECISION.get()
    if precision == "bf16" or (precision == "auto" and device_type == "cuda"):
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def innermost(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper and a peft (LoRA) wrapper: its forward's signature."""
    model = unwrap(model)
    base = getattr(model, "get_base_model", None)  # peft
    return base() if base is not None else model


def activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether the model recomputes activations in backward (trainer.gradient_checkpointing)."""
    inner = innermost(model)
    flag = getattr(inner, "is_activation_checkpointing", None)  # transformers >= 5; older: is_gradient_checkpointing
    return bool(flag if flag is not None else getattr(inner, "is_gradient_checkpointing", False))


def _last_hidden(out: object, with_hidden: bool) -> torch.Tensor | None:
    """The final (post-norm) hidden states of a forward run with output_hidden_states."""
    return out.hidden_states[-1] if with_hidden else None


def _logits_per_row(
    model: torch.nn.Module, batch: TrainBatch, with_hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits that predict each response token, [B, T, V], one forward over every full row; with
    ``with_hidden`` also the final hidden states at the same positions ([B, T, H])."""
    T = batch.response_mask.shape[1]
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        logits_to_keep=T + 1,
        use_cache=False,
        output_hidden_states=with_hidden,
    )
    hidden = _last_hidden(out, with_hidden)
    return out.logits[:, -(T + 1) : -1, :], None if hidden is None else hidden[:, -(T + 1) : -1, :]


# One response pass costs about as much as this many extra padded positions (the layers' fixed
# cost per pass); rows are split into length buckets only where that saves more (docs/performance.md).
BUCKET_PASS_TOKENS = 64


def length_buckets(lengths: Sequence[int], pass_tokens: float | None = None) -> list[list[int]]:
    """Rows grouped by response length for the response passes: the split of the rows, taken in order of
    decreasing length, that minimises ``sum over buckets (rows x longest length + pass_tokens)``, the
    positions computed plus each pass's fixed cost (exact dynamic programme, O(rows^2)). Rows of one
    length always form one bucket. Returns row indices, longest bucket first, each in decreasing
    length (ties in row order). ``pass_tokens`` defaults to :data:`BUCKET_PASS_TOKENS`."""
    pass_tokens = BUCKET_PASS_TOKENS if pass_tokens is None else pass_tokens
    n = len(lengths)
    order = sorted(range(n), key=lambda r: (-lengths[r], r))
    best = [0.0] + [math.inf] * n  # best[j]: least cost of the first j rows of ``order``
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last bucket is order[i:j]; its longest row is order[i]
            cost = best[i] + (j - i) * lengths[order[i]] + pass_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets: list[list[int]] = []
    j = n
    while j > 0:
        buckets.append(order[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


def _logits_shared_prompts(
    model: torch.nn.Module, batch: TrainBatch, with_hidden: bool = False, bucket: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Same logits (and hidden states) as :func:`_logits_per_row`, running each distinct prompt only
    once and skipping most of the responses' right padding: ``(rows, logits [b, T_b, V], hidden)``
    chunks, where ``T_b`` is the longest response among ``rows`` (positions beyond a row's response are
    padding, beyond ``T_b`` they are not computed).

    Responses of one group share their prompt (same tokens, same left padding). The prompt pass runs
    on one row per group and keeps its key/value cache, which is gathered to the response rows
    (differentiably, so gradients flow back into the shared prompt pass); the response passes then
    run on the response tokens alone, one per bucket of rows of similar length
    (:func:`length_buckets`; ``bucket=False``: one pass over all rows). The logit that predicts
    response token 0 is the prompt pass's last position.
    """
    P, T = batch.prompt_width, batch.response_mask.shape[1]
    groups, row_to_group = torch.unique(batch.group_index, return_inverse=True)
    rows = torch.arange(batch.size, device=batch.input_ids.device)
    first_row = torch.full((len(groups),), batch.size, device=rows.device).scatter_reduce(
        0, row_to_group, rows, reduce="amin"
    )
    prompt_mask = batch.attention_mask[first_row, :P]
    prompt_out = model(
        input_ids=batch.input_ids[first_row, :P],
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=1,
        use_cache=True,
        output_hidden_states=with_hidden,
    )
    first_logits = prompt_out.logits[row_to_group]  # [B, 1, V]
    prompt_hidden = _last_hidden(prompt_out, with_hidden)
    first_hidden = None if prompt_hidden is None else prompt_hidden[row_to_group, -1:, :]  # [B, 1, H]
    if T == 1:
        return [(rows, first_logits, first_hidden)]
    # transformers >= 5.x names the cache `cache` (older releases: `past_key_values`)
    cache_name = "cache" if "cache" in inspect.signature(innermost(model).forward).parameters else "past_key_values"
    cache = getattr(prompt_out, cache_name)
    lengths = batch.attention_mask[:, P : P + T].sum(-1).clamp(min=1, max=T).tolist()
    layers = plain_kv_layers(cache)  # None: a cache that cannot be split by rows (sliding window)
    buckets = length_buckets(lengths) if bucket and layers is not None else [rows.tolist()]

    def response_pass(index: torch.Tensor, width: int, rows_cache):
        logits, hidden = first_logits[index], None if first_hidden is None else first_hidden[index]
        if width == 1:
            return index, logits, hidden
        mask = batch.attention_mask[index, : P + width - 1]
        out = model(
            input_ids=batch.input_ids[index, P : P + width - 1],
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, P:],
            use_cache=True,
            output_hidden_states=with_hidden,
            **{cache_name: rows_cache},
        )
        response_hidden = _last_hidden(out, with_hidden)
        return (
            index,
            torch.cat([logits, out.logits], dim=1),
            None if response_hidden is None else torch.cat([hidden, response_hidden], dim=1),
        )

    if len(buckets) == 1:  # one pass over every row: the prompt cache itself, one row per response row
        cache.reorder_cache(row_to_group)
        return [response_pass(rows, T, cache)]
    from transformers.cache_utils import DynamicCache

    chunks = []
    for bucket_rows in buckets:
        index = torch.tensor(bucket_rows, device=rows.device)
        source = row_to_group[index]
        rows_cache = DynamicCache(ddp_cache_data=[(x.keys.index_select(0, source), x.values.index_select(0, source)) for x in layers])
        chunks.append(response_pass(index, max(lengths[r] for r in bucket_rows), rows_cache))
    return chunks


@dataclass
class TokenOutputs:
    """What one forward pass gives for every response token of a (sub-)batch."""

    logp: torch.Tensor  # [B, T] log pi(o_t | q, o_<t)
    entropy: torch.Tensor | None = None  # [B, T] entropy of pi(. | q, o_<t)
    values: torch.Tensor | None = None  # [B, T] critic values V(q, o_<t) (value head on the same state)
    log_probs: torch.Tensor | None = None  # [B, T, V] the whole distribution (trust-region KL)


def groups_share_prompts(batch: TrainBatch) -> bool:
    """True when every response of a group has its group's prompt (the same tokens and padding), the
    condition of :func:`_logits_shared_prompts`; a strategy that pools several prompts in one group
    (rollout=equivalent_states) breaks it, and each row then runs its own prompt."""
    prompts = batch.input_ids[:, : batch.prompt_width]
    rows = torch.arange(batch.size, device=prompts.device)
    first = torch.full((int(batch.group_index.max()) + 1,), batch.size, device=prompts.device).scatter_reduce(
        0, batch.group_index, rows, reduce="amin"
    )
    return bool((prompts == prompts[first[batch.group_index]]).all())


def token_outputs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    share_prompts: bool = True,
    entropy_requires_grad: bool = True,
    value_head: torch.nn.Module | None = None,
    with_log_probs: bool = False,
) -> TokenOutputs:
    """log pi(o_t | q, o_<t) for every response token, and on request the entropy of
    pi(. | q, o_<t), the critic value ``value_head(h_t)`` of the hidden state that predicts o_t, and
    the full-vocabulary log-probs. Logits are divided by ``temperature`` (the sampling
    temperature), so that the ratio compares the distribution that was actually sampled from. With
    ``share_prompts`` each distinct prompt runs once (see :func:`_logits_shared_prompts`); the
    result is the same."""
    T = batch.response_mask.shape[1]
    # Under DDP / FSDP every rank must run the same forwards (their collectives pair up), and the
    # shared-prompt path runs one or two depending on the micro-batch: one forward per row there.
    # Gradient checkpointing turns the key/value cache off in training, which that path needs.
    shared = (
        share_prompts and not several_ranks() and not activation_checkpointing(model)
        and int(torch.unique(batch.group_index).numel()) < batch.size and groups_share_prompts(batch)
    )
    transform = LOGITS_TRANSFORM.get()
    with autocast_context(batch.input_ids.device):
        if shared:
            # a logits transform and the full distribution take the whole [B, T, V] block: one response pass
            chunks = _logits_shared_prompts(model, batch, value_head is not None, bucket=transform is None and not with_log_probs)
        else:
            rows = torch.arange(batch.size, device=batch.input_ids.device)
            chunks = [(rows, *_logits_per_row(model, batch, with_hidden=value_head is not None))]
    targets = batch.input_ids[:, batch.prompt_width : batch.prompt_width + T]
    parts: dict[str, list[torch.Tensor]] = {"logp": [], "entropy": [], "values": []}
    log_probs = None
    for rows, logits, hidden in chunks:
        logits = logits.float()
        if temperature and temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        if transform is not None:
            logits = transform(logits, batch)
        log_probs = F.log_softmax(logits, dim=-1)
        width = logits.shape[1]
        parts["logp"].append(log_probs.gather(-1, targets[rows, :width].unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            # Only an entropy bonus needs its gradient; for logging and entropy-aware pieces (which
            # detach it) skip the autograd graph over the [B, T, vocab] probabilities.
            with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
                # a transform's -inf logits (excluded tokens) contribute 0 * 0, not 0 * -inf
                finite_logp = log_probs if transform is None else torch.where(log_probs.isfinite(), log_probs, 0.0)
                parts["entropy"].append(-(log_probs.exp() * finite_logp).sum(-1))
        if value_head is not None:
            parts["values"].append(value_head(hidden))
    # chunks of several row buckets: back to [B, T] in row order, zero beyond each bucket's width
    order = torch.cat([rows for rows, _, _ in chunks])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)

    def assemble(name: str) -> torch.Tensor | None:
        pieces = parts[name]
        if not pieces:
            return None
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([F.pad(x, (0, T - x.shape[1])) for x in pieces])[inverse]

    logp, entropy, values = assemble("logp"), assemble("entropy"), assemble("values")
    return TokenOutputs(logp, entropy, values, log_probs if with_log_probs else None)


@torch.no_grad()
def batch_outputs(
    model: torch.nn.Module,
    batch: TrainBatch,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool = False,
    value_head: torch.nn.Module | None = None,
) -> TokenOutputs:
    """Log-probs, and optionally entropies and critic values, of the whole batch without gradient
    ([B, T] each, zero on padding)."""
    def zeros() -> torch.Tensor:
        return torch.zeros_like(batch.response_mask)

    result = TokenOutputs(zeros(), zeros() if with_entropy else None, zeros() if value_head is not None else None)
    for rows in micro_batches(torch.arange(batch.size, device=batch.input_ids.device), micro_batch_size):
        sub = batch.select(rows)
        out = token_outputs(model, sub, temperature, with_entropy=with_entropy, value_head=value_head)
        for name in ("logp", "entropy", "values"):
            target, part = getattr(result, name), getattr(out, name)
            if target is not None:
                target[rows, : part.shape[1]] = part * sub.response_mask
    return result
