"""The forward pass: one function, :func:`token_outputs`, gives the per-token log-probs (and on
request entropies, critic values, the full distribution) of a batch's responses; every log-prob the
step needs (sampling pass, reference, proximal policy, SPO's stored responses) comes from it.

The batch layout (left-padded prompts, right-padded responses) is described in
rlbench.training.batch.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlbench.model.lora import active_adapter, role_adapters
from rlbench.training.batch import TrainBatch, micro_batches
from rlbench.training.distributed import several_ranks, unwrap
from rlbench.training.packing import check_attention_calls, pack_groups, packed_attention, packing_supported
from rlbench.training.soft_tokens import soft_input_embeddings, soft_step_mask, with_soft_log_probs
from rlbench.training.token_log_probs import token_distribution_stats


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
    model: torch.nn.Module, batch: TrainBatch, with_hidden: bool = False, soft: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits that predict each response token, [B, T, V], one forward over every full row; with
    ``with_hidden`` also the final hidden states at the same positions ([B, T, H]); ``soft`` [B, T]: the
    soft thinking steps, whose inputs are mixtures of embeddings (rlbench/training/soft_tokens.py)."""
    T = batch.response_mask.shape[1]
    out = model(**_row_inputs(model, batch, soft), logits_to_keep=T + 1, use_cache=False, output_hidden_states=with_hidden)
    hidden = _last_hidden(out, with_hidden)
    return out.logits[:, -(T + 1) : -1, :], None if hidden is None else hidden[:, -(T + 1) : -1, :]


def _row_inputs(model: torch.nn.Module, batch: TrainBatch, soft: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The keyword inputs of a forward over every full row: the token ids (or, with ``soft`` steps, the mixed
    embeddings of ``model``'s own embedding table), the attention mask and the positions past the left padding."""
    inputs = (
        {"input_ids": batch.input_ids} if soft is None
        else {"inputs_embeds": soft_input_embeddings(unwrap(model).get_input_embeddings(), batch, soft)}
    )
    return {**inputs, "attention_mask": batch.attention_mask, "position_ids": (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)}


def value_model_outputs(critic: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """[B, T] values V_phi(q, o_<t) of a separate critic (``algorithm.critic.model=separate``; a
    rlbench.algorithm.value_model.ValueModel: its own ``backbone`` and ``head``): one forward of the critic's
    backbone over every full row, its final hidden state at the column that predicts response token t (the
    shared value head's position, rlbench/algorithm/critic.py) through its head. Only the last column's logits
    are computed (the critic reads hidden states); past a row's response: not meaningful (readers mask it)."""
    T = batch.response_mask.shape[1]
    with autocast_context(batch.input_ids.device):
        out = critic.backbone(**_row_inputs(critic.backbone, batch, soft_step_mask(batch)), logits_to_keep=1,
                              use_cache=False, output_hidden_states=True)
    return critic.head(out.hidden_states[-1][:, -(T + 1) : -1, :])


def _logits_packed(
    model: torch.nn.Module, batch: TrainBatch, with_hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The logits of :func:`_logits_per_row` from one forward over the packed micro-batch
    (rlbench.training.packing: each distinct prompt once, no padding): ``(logits [1, W, V], hidden
    [1, W, H] or None, index [B, T])``, where ``index[b, t]`` is the position among the W response
    positions whose logits predict response token t of row b (-1 past the row's response)."""
    P, T = batch.prompt_width, batch.response_mask.shape[1]
    groups, row_to_group = torch.unique(batch.group_index, return_inverse=True)
    rows = torch.arange(batch.size, device=batch.input_ids.device)
    first_row = torch.full((len(groups),), batch.size, device=rows.device).scatter_reduce(
        0, row_to_group, rows, reduce="amin"
    )
    layout = pack_groups(batch.input_ids, batch.attention_mask, P, T, row_to_group, first_row)
    with packed_attention(innermost(model), layout) as attention_calls:
        out = model(
            input_ids=layout.input_ids,
            attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=rows.device),  # 4-D: no mask is built
            position_ids=layout.position_ids,
            logits_to_keep=layout.response_tokens,
            use_cache=False,
            output_hidden_states=with_hidden,
        )
    check_attention_calls(innermost(model), attention_calls)
    hidden = _last_hidden(out, with_hidden)
    response = layout.response_tokens
    return out.logits[:, -response:], None if hidden is None else hidden[:, -response:], layout.index


@dataclass
class TokenOutputs:
    """What one forward pass gives for every response token of a (sub-)batch."""

    logp: torch.Tensor  # [B, T] log pi(o_t | q, o_<t)
    entropy: torch.Tensor | None = None  # [B, T] entropy of pi(. | q, o_<t)
    values: torch.Tensor | None = None  # [B, T] critic values V(q, o_<t) (value head on the same state)
    log_probs: torch.Tensor | None = None  # [B, T, V] the whole distribution (trust-region KL); past a row's end: not meaningful
    sum_pi_squared: torch.Tensor | None = None  # [B, T] sum_v pi(v | q, o_<t)^2, no gradient (the optimal token baseline)


def groups_share_prompts(batch: TrainBatch) -> bool:
    """True when every response of a group has its group's prompt (the same tokens and padding), the
    condition of :func:`_logits_packed`; a strategy that pools several prompts in one group
    (rollout=equivalent_states) breaks it, and each row then runs its own prompt."""
    prompts = batch.input_ids[:, : batch.prompt_width]
    rows = torch.arange(batch.size, device=prompts.device)
    first = torch.full((int(batch.group_index.max()) + 1,), batch.size, device=prompts.device).scatter_reduce(
        0, batch.group_index, rows, reduce="amin"
    )
    return bool((prompts == prompts[first[batch.group_index]]).all())


def _full_log_softmax(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    transform: Callable[[torch.Tensor, TrainBatch], torch.Tensor] | None,
    batch: TrainBatch,
    with_entropy: bool,
    entropy_requires_grad: bool,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(log pi(targets), entropy or None, log pi [B, T, V], sum_v pi(v)^2 or None)`` through the whole
    log-softmax: for a logits transform (which may exclude tokens with -inf) and for callers of the full
    distribution."""
    if temperature and temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if transform is not None:
        logits = transform(logits, batch)
    log_probs = F.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:  # no autograd graph over the [B, T, V] probabilities unless the entropy's gradient is used
        with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
            # a transform's -inf logits (excluded tokens) contribute 0 * 0, not 0 * -inf
            finite_logp = log_probs if transform is None else torch.where(log_probs.isfinite(), log_probs, 0.0)
            entropy = -(log_probs.exp() * finite_logp).sum(-1)
    sum_pi_squared = None
    if with_sum_pi_squared:
        with torch.no_grad():
            sum_pi_squared = log_probs.exp().square().sum(-1)
    return logp, entropy, log_probs, sum_pi_squared


def token_outputs(model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0, **options) -> TokenOutputs:
    """:func:`policy_outputs` of the policy; for a per-role LoRA policy (rlbench.model.lora.role_adapters;
    AT-GRPO's per-role policies, Zhao et al. 2025, arXiv:2510.11062, section 3) each role's tokens come from
    a forward with its own adapter (:func:`role_outputs`)."""
    adapters = role_adapters(unwrap(model))
    if adapters:
        return role_outputs(model, adapters, batch, temperature, **options)
    return policy_outputs(model, batch, temperature, **options)


def role_outputs(
    model: torch.nn.Module, adapters: tuple[str, ...], batch: TrainBatch, temperature: float = 1.0, **options
) -> TokenOutputs:
    """Per-role policies pi_k on one frozen base, one LoRA adapter each: the token o_t of turn t was sampled by
    role k(t) = t mod K (K = len(adapters); the turn from the step input ``step_index``) with the whole
    sequence before it run through pi_k's adapter, so

        log pi_{k(t)}(o_t | q, o_<t)

    is read off a forward of the micro-batch with adapter k(t) active: one forward per role that has a
    trained token (``response_mask``) in the micro-batch, the roles' outputs taken token by token (``where``:
    a role's adapter gets gradient from its own tokens only; a role without tokens runs no forward and its
    adapter gets no gradient). Tokens trained by no role (observations, padding) keep the first forward's
    values (masked out by every reader)."""
    step = batch.extras.get("step_index")
    if step is None:
        raise ValueError("a per-role LoRA policy reads each token's turn (the step input step_index, rollout=multi_turn)")
    role = torch.where(step >= 0, step % len(adapters), -1)
    trained = batch.response_mask.bool()
    masks = [(role == k) & trained for k in range(len(adapters))]
    acting = [k for k, mine in enumerate(masks) if bool(mine.any())] or [0]
    merged: TokenOutputs | None = None
    for k in acting:
        with active_adapter(unwrap(model), adapters[k]):
            out = policy_outputs(model, batch, temperature, **options)
        if merged is None:
            merged = out
            continue
        mine = masks[k]
        for field_name in ("logp", "entropy", "values", "log_probs", "sum_pi_squared"):
            ours, theirs = getattr(out, field_name), getattr(merged, field_name)
            if ours is not None:
                where = mine if ours.dim() == 2 else mine[..., None]
                setattr(merged, field_name, torch.where(where, ours, theirs))
    assert merged is not None
    return merged


def policy_outputs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    share_prompts: bool = True,
    entropy_requires_grad: bool = True,
    value_head: torch.nn.Module | None = None,
    with_log_probs: bool = False,
    with_sum_pi_squared: bool = False,
) -> TokenOutputs:
    """log pi(o_t | q, o_<t) for every response token, and on request the entropy of
    pi(. | q, o_<t), its sum of squared probabilities sum_v pi(v | q, o_<t)^2 (no gradient), the critic value ``value_head(h_t)`` of the hidden state that predicts o_t, and
    the full-vocabulary log-probs. Logits are divided by ``temperature`` (the sampling
    temperature), so that the ratio compares the distribution that was actually sampled from. With
    ``share_prompts`` the micro-batch runs as one packed sequence, each distinct prompt once and no
    padding (see :func:`_logits_packed`); the result is the same up to float rounding."""
    P, T = batch.prompt_width, batch.response_mask.shape[1]
    soft = soft_step_mask(batch)  # SofT-GRPO's soft thinking steps (rollout=soft_thinking), None: none
    # Under DDP / FSDP every rank must run the same forwards (their collectives pair up): one forward
    # per row there. Activation checkpointing recomputes the attention in backward, outside the
    # packed layout's scope.
    packed = (
        share_prompts and soft is None and not several_ranks() and not activation_checkpointing(model)
        and int(torch.unique(batch.group_index).numel()) < batch.size and groups_share_prompts(batch)
        and packing_supported(innermost(model), int(batch.attention_mask.sum(-1).max()))
    )
    with autocast_context(batch.input_ids.device):
        if packed:
            logits, hidden, index = _logits_packed(model, batch, value_head is not None)
        else:
            (logits, hidden), index = _logits_per_row(model, batch, with_hidden=value_head is not None, soft=soft), None
    targets = batch.input_ids[:, P : P + T]
    valid = None if index is None else index >= 0

    def gather_rows(x: torch.Tensor | None) -> torch.Tensor | None:
        """Values at the packed positions [1, W, ...] -> per response token [B, T, ...]."""
        return x if x is None or index is None else x.flatten(0, 1)[index.clamp(min=0)]

    def zero_past_end(x: torch.Tensor | None) -> torch.Tensor | None:
        return x if x is None or valid is None else x.masked_fill(~valid, 0.0)

    transform = LOGITS_TRANSFORM.get()
    log_probs = None
    if transform is None and not with_log_probs:  # the common case: no [B, T, V] log-softmax written
        position_targets = targets
        if index is not None:
            position_targets = targets.new_zeros(logits.shape[:2])
            position_targets.view(-1)[index[valid]] = targets[valid]
        logp, entropy, sum_pi_squared = token_distribution_stats(
            logits.float(), position_targets, temperature, with_entropy, with_sum_pi_squared
        )
        logp, entropy, sum_pi_squared = gather_rows(logp), gather_rows(entropy), gather_rows(sum_pi_squared)
    else:  # a logits transform and the full distribution take the whole [B, T, V] block
        logp, entropy, log_probs, sum_pi_squared = _full_log_softmax(
            gather_rows(logits).float(), targets, temperature, transform, batch, with_entropy, entropy_requires_grad,
            with_sum_pi_squared,
        )
    if soft is not None:  # a soft step's likelihood is the Gumbel density of its noise (arXiv:2511.06411, section 3)
        logp = with_soft_log_probs(logp, logits, batch, soft, temperature)
    if entropy is not None and not entropy_requires_grad:
        entropy = entropy.detach()  # only an entropy bonus needs its gradient; logging and entropy-aware pieces detach it
    values = None if value_head is None else gather_rows(value_head(hidden))
    logp, entropy, values = zero_past_end(logp), zero_past_end(entropy), zero_past_end(values)
    sum_pi_squared = zero_past_end(sum_pi_squared)
    return TokenOutputs(logp, entropy, values, log_probs if with_log_probs else None, sum_pi_squared)


@torch.no_grad()
def batch_outputs(
    model: torch.nn.Module,
    batch: TrainBatch,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool = False,
    value_head: torch.nn.Module | None = None,
    with_sum_pi_squared: bool = False,
    value_model: torch.nn.Module | None = None,
) -> TokenOutputs:
    """Log-probs, and optionally entropies, critic values and sums of squared probabilities, of the
    whole batch without gradient ([B, T] each, zero on padding). The values come from ``value_head`` on
    the policy's hidden states, or from a separate critic ``value_model`` (:func:`value_model_outputs`)."""
    def zeros() -> torch.Tensor:
        return torch.zeros_like(batch.response_mask)

    valued = value_head is not None or value_model is not None
    result = TokenOutputs(zeros(), zeros() if with_entropy else None, zeros() if valued else None,
                          sum_pi_squared=zeros() if with_sum_pi_squared else None)
    for rows in micro_batches(torch.arange(batch.size, device=batch.input_ids.device), micro_batch_size):
        sub = batch.select(rows)
        out = token_outputs(model, sub, temperature, with_entropy=with_entropy, value_head=value_head,
                            with_sum_pi_squared=with_sum_pi_squared)
        if value_model is not None:
            out.values = value_model_outputs(value_model, sub)
        for name in ("logp", "entropy", "values", "sum_pi_squared"):
            target, part = getattr(result, name), getattr(out, name)
            if target is not None:
                target[rows, : part.shape[1]] = part * sub.response_mask
    return result
