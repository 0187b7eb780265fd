"""Rollout engine on a Hugging Face causal LM (CPU and GPU): its own decoding loop over the model's
forward pass with a KV cache.

How it works:

* every request is expanded into ``n`` rows whose input is ``prompt_ids + prefix_ids``; rows are
  sorted by input length (a request's rows stay together) and decoded in batches of at most
  ``batch_size`` rows;
* **shared prefill**: a batch runs the forward pass over each distinct input once (left padded) and
  copies its KV cache to the input's rows, so a group of ``n`` samples (or the branches of a tree
  node, sent as one request with ``n`` > 1, or several requests with the same input) pays for its
  prompt once. The same pass scores the
  prefix tokens (their log-probs are read off the prefill's logits);
* **finished rows leave the batch**: a row that sampled EOS is dropped from the cache and from every
  later forward pass, so a step costs the rows still running, not the batch;
* **lean decoding steps** (rlbench/rollout/engines/lean_decode.py): on CPU, a Llama, Qwen2 or Qwen3 model in
  the CPU kernels' domain decodes through :class:`~rlbench.rollout.engines.lean_decode.LeanDecoder` (the same
  operations without transformers' module wrappers, fused products, preallocated keys and values;
  the same logits bit for bit here); other models through their forward (:class:`ModelSteps`);
* the sampling distribution is defined by ``temperature`` and ``top_p`` alone (transformers'
  ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``); nothing from the model's
  ``generation_config`` (a checkpoint's ``top_k``, repetition penalty, ...) applies;
* the next token is drawn from ``log_softmax`` of the warped scores by inverse-CDF sampling
  (:func:`sample_from_logprobs`, about 10x faster on CPU than ``torch.multinomial`` for a 49k
  vocabulary); its log-prob is recorded, so the log-probs are exactly those of the distribution
  sampled from, with ``O(rows x vocab)`` memory per step;
* **KV reuse across calls** (``prefix_cache_mb`` > 0; rlbench/rollout/engines/prefix_cache.py): the
  keys and values of rows still running at ``max_new_tokens`` are kept in a byte-bounded LRU, and
  a later input that extends a kept sequence prefills only its new tokens (the kept KV left padded
  in front of them, the gap masked, positions continuing the kept ones). Emptied by
  :meth:`HFGenerateEngine.sync_weights` and when the parameters changed in place; a per-role LoRA policy
  keeps one cache per role adapter (a sequence's keys and values depend on the adapter). The random stream
  is untouched; the log-probs equal the uncached ones up to float rounding (the kept KV came from
  one-token decoding steps, the uncached prefill computes it in one pass: about 1e-6 on the tiny
  model, 2e-5 on SmolLM2-135M), so a draw differs only where its uniform falls within that rounding
  of a CDF boundary (docs/engines.md);
* ``params.logits_transform`` (a :class:`~rlbench.rollout.engines.base.LogitsTransform`, the one sampling
  hook) changes each step's raw logits before the warpers, given each running row's tokens so far;
  without it the loop is the plain one. Prefix tokens are not passed through it (a request with a
  scored prefix is refused);
* greedy decoding (``temperature == 0``) reports ``log_softmax(logits)`` at temperature 1;
* sampling is a function of the passed ``torch.Generator``: a seed is drawn from it and seeds the
  engine's own generator, so the global RNG state is left untouched and the same generator state
  gives the same completions (given the same batch composition and device). Each decoding step
  draws one uniform number per row of the batch, finished rows included, so a row's draws do not
  depend on when the other rows of its batch finish. Requests that carry their own ``seed`` (the
  evaluation's) draw each sample's tokens from a generator of its own, seeded with
  ``sample_seed(seed, k)``, so that a sample does not depend on the other requests of the call (up
  to the float effects of padding in a differently composed batch).
* **refill** (:meth:`HFGenerateEngine.generate_refilling`, rlbench/rollout/engines/refill.py; Infinite
  Sampling's continuous sampling): a queue of samples decoded in at most ``slots`` rows, a row that ends
  handing its slot to the next queued sample at the next step (its prompt prefilled alone, its keys and
  values joined right-aligned to the running rows', its own position ids); the plain loop is not touched.
* **branching while decoding** (:meth:`HFGenerateEngine.generate_branching`, rlbench/rollout/engines/branching.py;
  LATR's rollout): rows that spawn rows at uncertain tokens (``select_rows`` with a repeated index copies a
  row's keys and values) and are dropped when pruned; the plain loop above is not touched by it.
* a per-role LoRA policy (rlbench.model.lora.role_adapters): each request names its role's adapter
  (``GenerationRequest.adapter``); the rows of each adapter are decoded in batches of their own with that
  adapter active, adapter after adapter in the order they first appear; scoring is refused (no role).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Callable, Protocol, Sequence, TypeVar

import torch

from rlbench.model.lora import active_adapter, role_adapters
from rlbench.utils import Progress
from rlbench.rollout.engines.base import (
    Completion, GenerationRequest, PositionStats, SamplingParams, check_transform_requests, request_seeds, sample_seed,
)
from rlbench.rollout.engines.scoring import distribution_stats
from rlbench.rollout.engines.branching import BranchRow, BranchRule, BranchTree, checkpoint_due, nearly_full, spawn_tokens
from rlbench.rollout.engines.cpu_linear import fast_cpu_linears, layers_for_cpu_kernels
from rlbench.rollout.engines.lean_decode import LeanDecoder, lean_decode_unsupported
from rlbench.rollout.engines.prefix_cache import KV, PrefixKVCache, weights_version
from rlbench.rollout.engines.refill import join_rows


log = logging.getLogger(__name__)
T = TypeVar("T")


def inverse_cdf_sample(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logprobs`` (``[B, V]``, normalised, ``-inf`` = excluded) at the
    uniform numbers ``uniforms`` (``[B, 1]`` float64 in [0, 1)): the first token whose cumulative
    probability exceeds ``u``. The CDF is accumulated in float64 so that tail tokens keep their
    probability next to a dominant token."""
    # convert, then accumulate: the same float64 sums as ``cumsum(dtype=torch.float64)``, several times
    # faster on CPU (the converting cumsum takes a slow path)
    cdf = logprobs.exp().double().cumsum(-1)
    tokens = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(-1)
    tokens = tokens.clamp_(max=cdf.shape[-1] - 1)
    # guard against float rounding landing on an excluded token
    bad = ~torch.isfinite(logprobs.gather(-1, tokens[:, None]).squeeze(-1))
    if bad.any():
        tokens = torch.where(bad, logprobs.argmax(-1), tokens)
    return tokens


def draw_uniforms(rows: int, generator: torch.Generator | Sequence[torch.Generator] | None, device) -> torch.Tensor:
    """``[rows, 1]`` float64 uniforms from one generator, or one from each of ``rows`` generators."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.rand((1, 1), generator=g, device=device, dtype=torch.float64) for g in generator])
    return torch.rand((rows, 1), generator=generator, device=device, dtype=torch.float64)


def sample_from_logprobs(
    logprobs: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None = None
) -> torch.Tensor:
    """One token per row of ``logprobs`` drawn by inverse-CDF sampling with ``generator`` (or one
    generator per row): equivalent to ``torch.multinomial(logprobs.exp(), 1)`` in distribution but
    about ten times faster on CPU for large vocabularies."""
    return inverse_cdf_sample(logprobs, draw_uniforms(logprobs.shape[0], generator, logprobs.device))


def _warpers(params: SamplingParams) -> list:
    """transformers' warpers for ``params`` (temperature, then top-p)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    out: list = []
    if params.temperature > 0:
        if params.temperature != 1.0:
            out.append(TemperatureLogitsWarper(float(params.temperature)))
        if params.top_p < 1.0:
            out.append(TopPLogitsWarper(float(params.top_p)))
    return out


def warped_logprobs(logits: torch.Tensor, warpers: Sequence) -> torch.Tensor:
    """``log_softmax`` of ``logits`` (``[N, V]``, any dtype) after the warpers, in float32."""
    scores = logits.float()
    for w in warpers:
        scores = w(None, scores)
    return torch.log_softmax(scores, dim=-1)


def _check_params(params: SamplingParams) -> None:
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")


def draw_seed(generator: torch.Generator | None) -> int:
    """A 62-bit seed drawn from ``generator`` (from the global torch RNG when ``None``)."""
    if generator is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask)`` tensors."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _cache_argument(model) -> str:
    """The forward pass's keyword for the KV cache: ``cache`` (transformers >= 5) or
    ``past_key_values`` (4.x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(output):
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


def plain_kv_layers(cache) -> list | None:
    """The layers of a KV cache that holds every position of every row (``DynamicLayer``), else None."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return list(layers) if layers and all(type(layer) is DynamicLayer for layer in layers) else None


def _chunks(items: list[T], size: int) -> list[list[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class DecodingSteps(Protocol):
    """The rows being decoded after a prefill, and their next-token logits."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (in that order)."""

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[rows]`` at ``positions`` ``[rows]``; returns the next-token logits ``[rows, vocab]``."""

    def row_kv(self, row: int) -> KV | None:
        """The row's keys and values at the positions it attends to (None: not kept whole)."""

    def add_rows(self, cache, mask: torch.Tensor | None, rows: torch.Tensor, new_tokens: int) -> None:
        """Append the rows ``rows`` of a prefill (its cache and mask) after the running rows, with room for
        ``new_tokens`` more positions (rlbench/rollout/engines/refill.py)."""


class ModelSteps:
    """:class:`DecodingSteps` through the model's own forward with transformers' KV cache: the prefill's
    ``cache`` and attention ``mask`` (None: no padding) over its ``inputs`` distinct inputs, expanded to
    the decoded rows ``rows`` (indices into the prefill's batch)."""

    def __init__(self, model, cache, mask: torch.Tensor | None, rows: torch.Tensor, inputs: int):
        self.model = model
        self.cache = cache
        if inputs != len(rows) or not torch.equal(rows, torch.arange(len(rows), device=rows.device)):
            cache.reorder_cache(rows)
        self.mask = mask.index_select(0, rows) if mask is not None else None
        self.cache_argument = _cache_argument(model)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (in that order)."""
        self.cache.reorder_cache(index)
        if self.mask is not None:
            self.mask = self.mask[index]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[rows]`` at ``positions`` ``[rows]``; returns the next-token logits ``[rows, vocab]``."""
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=-1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=positions[:, None],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_argument: self.cache},
        )
        self.cache = _returned_cache(out)
        return out.logits[:, -1]

    def add_rows(self, cache, mask: torch.Tensor | None, rows: torch.Tensor, new_tokens: int = 0) -> None:
        """Append the rows ``rows`` of a prefill's ``cache`` (and its mask, None: no padding) after the running
        rows, right-aligned (rlbench/rollout/engines/refill.py); ``new_tokens`` is unused (the cache grows)."""
        old, new = plain_kv_layers(self.cache), plain_kv_layers(cache)
        if old is None or new is None:
            raise ValueError("refilling needs a KV cache that holds every position of every row (no sliding window)")
        layers, valid, _ = join_rows(
            [(layer.keys, layer.values) for layer in old], self.mask.bool() if self.mask is not None else None,
            [(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in new],
            mask.index_select(0, rows).bool() if mask is not None else None,
        )
        for layer, (keys, values) in zip(old, layers):
            layer.keys, layer.values = keys, values
        self.mask = None if bool(valid.all()) else valid.long()

    def row_kv(self, row: int) -> KV | None:
        """The row's keys and values at its unmasked positions, or None for a cache that does not hold
        every position (sliding window)."""
        layers = plain_kv_layers(self.cache)
        if layers is None:
            return None
        valid = self.mask[row].bool() if self.mask is not None else slice(None)
        return tuple((layer.keys[row][:, valid].clone(), layer.values[row][:, valid].clone()) for layer in layers)


class HFGenerateEngine:
    """:class:`~rlbench.rollout.engines.base.RolloutEngine` on a Hugging Face causal LM (module docstring).

    ``batch_size`` is the number of sequences (rows) decoded together. The engine samples from the
    model object it holds; :meth:`sync_weights` swaps that object. ``share_prefill=False`` runs
    the prefill once per row instead of once per distinct input (the reference the shared path is
    tested against; same samples and log-probs). ``prefix_cache_mb`` is the byte budget (MiB) of
    the KV kept across calls (module docstring; 0: off). ``cpu_kernels`` runs a large float32 model's linear
    layers on CPU through faster kernels (rlbench/rollout/engines/cpu_linear.py; False: PyTorch's default
    kernels, for comparison). ``lean_decode`` runs the decoding steps of a Llama, Qwen2 or Qwen3 model
    on CPU without transformers' module wrappers (rlbench/rollout/engines/lean_decode.py; False: through the
    model's forward, for comparison).
    """

    def __init__(
        self, model, tokenizer, *, batch_size: int = 64, device=None, progress: bool = True, share_prefill: bool = True,
        prefix_cache_mb: float = 0.0, cpu_kernels: bool = True, lean_decode: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self._device = torch.device(device) if device is not None else None
        self.progress = progress
        self.share_prefill = share_prefill
        self.cpu_kernels = cpu_kernels
        self.lean_decode = lean_decode
        # FSDP with several ranks: every forward is collective, so decoding runs the same number of
        # steps on every rank (no early stop, no dropped rows); set by rlbench.training.step.make_step_context.
        self.synced_gpus = False
        self.eos_ids = self._eos_ids(model, tokenizer)
        if not self.eos_ids:
            raise ValueError("neither the tokenizer nor the model's generation_config defines an EOS token")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.prefix_cache = PrefixKVCache(int(prefix_cache_mb * 2**20))
        self._adapter_caches: dict[str, PrefixKVCache] = {}  # a per-role policy's caches, one per adapter
        self._cached_weights: tuple[int, int] | None = None  # weights_version when the entries were stored
        self._lean: LeanDecoder | None = None  # the decoder of the current weights (rlbench/rollout/engines/lean_decode.py)
        self._lean_refused: int | None = None  # id of the model whose refusal of lean decoding was logged

    @contextlib.contextmanager
    def _adapter(self, name: str | None):
        """Decode with role adapter ``name`` active and its own KV cache (None: the model as it is)."""
        if name is None:
            yield
            return
        shared = self.prefix_cache
        self.prefix_cache = self._adapter_caches.setdefault(name, PrefixKVCache(shared.budget_bytes))
        try:
            with active_adapter(self.model, name):
                yield
        finally:
            self.prefix_cache = shared

    def _clear_caches(self) -> None:
        for cache in (self.prefix_cache, *self._adapter_caches.values()):
            cache.clear()

    def _check_adapters(self, adapters: Sequence[str | None]) -> None:
        """A per-role policy samples every request with a role adapter, any other model with none."""
        roles = role_adapters(self.model)
        if roles and any(a not in roles for a in adapters):
            raise ValueError(f"a per-role LoRA policy samples each request with one of its role adapters {list(roles)}; "
                             f"got {sorted(set(map(str, adapters)))}")
        if not roles and any(a is not None for a in adapters):
            raise ValueError("a request names a role adapter, but the policy has no per-role adapters (model.lora.per_role)")

    @property
    def reuses_kv(self) -> bool:
        """The KV cache across calls is in use (on, and not under FSDP, whose collective forwards must
        run the same passes on every rank)."""
        return self.prefix_cache.enabled and not self.synced_gpus

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _eos_ids(model, tokenizer) -> list[int]:
        ids: list[int] = []
        for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
            if value is None:
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if int(v) not in ids:
                    ids.append(int(v))
        return ids

    @property
    def device(self) -> torch.device:
        """Where inputs go: the ``device`` argument, else the model's parameters' device."""
        if self._device is not None:
            return self._device
        return next(self.model.parameters()).device

    def _prefill(self, seqs: Sequence[tuple[int, ...]], keep: int):
        """One forward pass over the left-padded ``seqs``: ``(logits of the last keep positions
        [U, keep, V], cache, attention mask or None when nothing is padded, last position ids [U])``."""
        input_ids, mask = left_pad(seqs, self.pad_id, self.device)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        padded = not bool(mask.all())
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask if padded else None,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits[:, -keep:], _returned_cache(out), (mask if padded else None), position_ids[:, -1]

    def _prefill_reusing(self, inputs: Sequence[tuple[int, ...]], prefix_lens: Sequence[int], keep: int):
        """:meth:`_prefill` of ``inputs``, starting each from the KV of its longest kept prefix
        (always running its last ``prefix_lens[u] + 1`` tokens, whose logits are read). The batch's
        past is the kept KV left padded to the longest; the new tokens follow, left padded, with
        their positions continuing the kept ones; the attention mask hides both paddings."""
        hits = [self.prefix_cache.longest_prefix(x, len(x) - n - 1) for x, n in zip(inputs, prefix_lens)] if self.reuses_kv else []
        if not any(length for length, _ in hits):
            return self._prefill(inputs, keep)
        kept = [length for length, _ in hits]
        width = max(kept)
        ids, new_mask = left_pad([x[r:] for x, r in zip(inputs, kept)], self.pad_id, self.device)
        past_mask = torch.zeros((len(inputs), width), dtype=torch.long, device=ids.device)
        for u, r in enumerate(kept):
            past_mask[u, width - r :] = 1
        layers = []
        for layer, (keys, values) in enumerate(next(kv for _, kv in hits if kv is not None)):
            past = [keys.new_zeros((len(inputs), keys.shape[0], width, keys.shape[2])), values.new_zeros((len(inputs), values.shape[0], width, values.shape[2]))]
            for u, (r, kv) in enumerate(hits):
                if r:
                    past[0][u, :, width - r :] = kv[layer][0][:, :r]
                    past[1][u, :, width - r :] = kv[layer][1][:, :r]
            layers.append(tuple(past))
        from transformers.cache_utils import DynamicCache

        mask = torch.cat([past_mask, new_mask], dim=-1)
        offsets = torch.tensor(kept, dtype=torch.long, device=ids.device)[:, None]
        position_ids = (new_mask.cumsum(-1) - 1 + offsets).masked_fill(new_mask == 0, 0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=keep,
            **{_cache_argument(self.model): DynamicCache(ddp_cache_data=layers)},
        )
        return out.logits[:, -keep:], _returned_cache(out), (None if bool(mask.all()) else mask), position_ids[:, -1]

    def _keep_rows(self, decoding: DecodingSteps, rows: Sequence[tuple[int, tuple[int, ...]]]) -> None:
        """Store ``(decoding row, tokens)`` pairs: the row's keys and values at its unmasked positions,
        which hold exactly ``tokens``."""
        for row, tokens in rows:
            kv = decoding.row_kv(row)
            if kv is None:  # sliding-window or other partial caches: nothing to reuse
                return
            if kv[0][0].shape[1] != len(tokens):
                raise RuntimeError(f"KV of {kv[0][0].shape[1]} positions for a sequence of {len(tokens)} tokens")
            self.prefix_cache.put(tokens, kv)

    @staticmethod
    def _response_logprobs(logits: torch.Tensor, length: int, warpers: Sequence) -> torch.Tensor:
        """``[length, V]`` warped log-probs of the distributions that sampled the last ``length`` tokens
        of a row's input, from the row's kept logits (``[keep, V]``): position j's logits predict token
        j + 1."""
        width = logits.shape[0]
        return warped_logprobs(logits[width - length - 1 : width - 1], warpers)

    @classmethod
    def _prefix_logprobs(cls, logits: torch.Tensor, prefix: Sequence[int], warpers: Sequence) -> list[float]:
        """Log-probs of ``prefix`` from the kept logits of one row (``[keep, V]``, the input ending
        with ``prefix``)."""
        if not prefix:
            return []
        targets = torch.tensor(list(prefix), dtype=torch.long, device=logits.device)
        lp = cls._response_logprobs(logits, len(prefix), warpers)
        return lp.gather(-1, targets[:, None]).squeeze(-1).cpu().tolist()

    def _score(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], read: Callable[[torch.Tensor, Sequence[int]], T]
    ) -> list[T]:
        """``read(kept logits [keep, V], response)`` for each ``(prompt, response)`` pair, one
        forward pass per batch of ``batch_size`` rows, the model in eval mode without autograd."""
        if any(len(p) == 0 for p, _ in items):
            raise ValueError("prefix scoring needs a non-empty prompt")
        if role_adapters(self.model):
            raise ValueError("scoring under a per-role LoRA policy is not built (a score does not name its role)")
        results: list[T] = []
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode(), fast_cpu_linears(model, self.cpu_kernels):
                for start in range(0, len(items), self.batch_size):
                    chunk = items[start : start + self.batch_size]
                    keep = max(len(x) for _, x in chunk) + 1
                    logits = self._prefill([tuple(p) + tuple(x) for p, x in chunk], keep)[0]
                    results.extend(read(logits[row], response) for row, (_, response) in enumerate(chunk))
        finally:
            model.train(was_training)
        return results

    def score_prefixes(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
    ) -> list[list[float]]:
        """Log-probs of each ``prefix`` given its ``prompt`` (``items`` = ``(prompt, prefix)``
        pairs) under the sampling distribution of ``params`` (temperature and top-p warping;
        temperature 0 scores at temperature 1). One forward pass per batch (generation scores the
        prefixes of its requests in its prefill instead)."""
        warpers = _warpers(params)
        return self._score(items, lambda logits, prefix: self._prefix_logprobs(logits, prefix, warpers))

    def position_stats(
        self, items: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], params: SamplingParams
    ) -> list[PositionStats]:
        """:class:`~rlbench.rollout.engines.base.PositionStats` of each ``(prompt, response)`` pair under the
        sampling distribution of ``params`` (as :meth:`score_prefixes`)."""
        warpers = _warpers(params)
        return self._score(items, lambda logits, response: distribution_stats(self._response_logprobs(logits, len(response), warpers)))

    def _decode_batch(
        self,
        inputs: Sequence[tuple[int, ...]],
        prefix_lens: Sequence[int],
        row_input: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | Sequence[torch.Generator] | None,
        lean: LeanDecoder | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
        """Decode one batch: ``inputs`` are the distinct inputs (``prompt + prefix``, the last
        ``prefix_lens[u]`` tokens a prefix to score), ``row_input[r]`` the input of row r. Returns
        per row its new tokens and their log-probs (up to and including EOS) and per input its
        prefix log-probs. ``lean``: the decoder of the decoding steps (None: the model's forward)."""
        warpers = _warpers(params)
        keep = max(prefix_lens) + 1
        logits, cache, mask, last_pos = self._prefill_reusing(inputs, prefix_lens, keep)
        prefix_lp = [self._prefix_logprobs(logits[u], inputs[u][len(inputs[u]) - n :] if n else (), warpers) for u, n in enumerate(prefix_lens)]
        rows = len(row_input)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        if params.max_new_tokens == 0:
            return tokens, logprobs, prefix_lp
        index = torch.tensor(list(row_input), dtype=torch.long, device=logits.device)
        scores = logits[:, -1].index_select(0, index)
        decoding: DecodingSteps
        if lean is not None:
            decoding = lean.steps(cache, mask, index, params.max_new_tokens)
        else:
            decoding = ModelSteps(self.model, cache, mask, index, len(inputs))
        del cache  # the decoding state holds what it needs (the lean steps a copy)
        position = last_pos.index_select(0, index)
        per_row_generators = isinstance(generator, (list, tuple))
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=scores.device)
        active = list(range(rows))  # batch rows still running, in cache order
        ended: set[int] = set()  # rows that sampled EOS but keep decoding (synced_gpus only)
        transform = params.logits_transform
        for step in range(params.max_new_tokens):
            if transform is not None:
                scores = transform(scores.float(), [inputs[row_input[r]] + tuple(tokens[r]) for r in active])
            logp = warped_logprobs(scores, warpers)
            if params.temperature == 0:
                chosen = logp.argmax(-1)
            elif per_row_generators:
                chosen = inverse_cdf_sample(logp, draw_uniforms(len(active), [generator[r] for r in active], logp.device))
            else:
                # one draw per row of the batch, finished rows included (module docstring)
                uniforms = draw_uniforms(rows, generator, logp.device)
                if len(active) != rows:
                    uniforms = uniforms[torch.tensor(active, device=uniforms.device)]
                chosen = inverse_cdf_sample(logp, uniforms)
            chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1)
            for r, t, lp in zip(active, chosen.tolist(), chosen_lp.tolist()):
                if r not in ended:
                    tokens[r].append(t)
                    logprobs[r].append(lp)
            running = ~torch.isin(chosen, eos)
            if params.on_budget is not None:  # the tokens sampled, and the unused budget of the rows that ended
                ended_now = 0 if self.synced_gpus else len(active) - int(running.sum())
                params.on_budget(len(active) + ended_now * (params.max_new_tokens - step - 1))
            if self.synced_gpus:  # every rank decodes max_new_tokens steps over all its rows
                ended.update(r for r, go in zip(active, running.tolist()) if not go)
                if step == params.max_new_tokens - 1:
                    break
            elif step == params.max_new_tokens - 1:
                if self.reuses_kv:  # rows cut by the length limit are the ones a caller may extend
                    kept = [(a, inputs[row_input[r]] + tuple(tokens[r][:-1])) for a, (r, go) in enumerate(zip(active, running.tolist())) if go]
                    self._keep_rows(decoding, kept)
                break
            elif not bool(running.any()):
                break
            elif not bool(running.all()):
                still = running.nonzero(as_tuple=True)[0]
                active = [active[i] for i in still.tolist()]
                chosen, position = chosen[still], position[still]
                decoding.select_rows(still)
            position = position + 1
            scores = decoding.step(chosen, position)
        return tokens, logprobs, prefix_lp

    # ---------------------------------------------------------------- RolloutEngine

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """Return, for each request, its ``n`` completions in order (see the module docstring)."""
        _check_params(params)
        for i, req in enumerate(requests):
            if req.n < 0:
                raise ValueError(f"request {i}: n must be >= 0, got {req.n}")
            if len(req.prompt_ids) == 0:
                raise ValueError(f"request {i}: prompt_ids is empty")
        check_transform_requests(requests, params)
        self._check_adapters([req.adapter for req in requests])
        rows = [(i, k) for i, req in enumerate(requests) for k in range(req.n)]
        results: list[list[Completion | None]] = [[None] * req.n for req in requests]
        if not rows:
            return [[] for _ in requests]
        own_seeds = request_seeds(requests)
        seed = sample_seed(requests[0].seed, 0) if own_seeds else draw_seed(generator)
        if self.reuses_kv and self._cached_weights != weights_version(self.model):
            self._clear_caches()  # weights changed in place since the entries were stored
            self._cached_weights = weights_version(self.model)

        model = self.model
        lean = self._lean_decoder()
        was_training = model.training
        model.eval()
        try:
            # FSDP's all-gathered weights are reused by the training forwards: no inference tensors then
            with torch.no_grad() if self.synced_gpus else torch.inference_mode(), fast_cpu_linears(model, self.cpu_kernels and not self.synced_gpus):
                sample_gen = torch.Generator(device=self.device)
                sample_gen.manual_seed(seed)
                adapters = list(dict.fromkeys(req.adapter for req in requests))  # one pass each, first seen first
                order = sorted(
                    rows, key=lambda r: (adapters.index(requests[r[0]].adapter),
                                         -(len(requests[r[0]].prompt_ids) + len(requests[r[0]].prefix_ids)))
                )
                batches = [chunk for adapter in adapters for chunk in
                           _chunks([r for r in order if requests[r[0]].adapter == adapter], self.batch_size)]
                progress = Progress("rollout", len(order), min_interval=2.0, enabled=self.progress and len(order) > self.batch_size)
                for batch in batches:
                    # the distinct inputs of the batch (equal prompt + prefix, from any request; one per
                    # row unshared) and how many of their last tokens to score
                    inputs, prefix_lens, row_input, seen = [], [], [], {}
                    for i, k in batch:
                        req = requests[i]
                        text = tuple(req.prompt_ids) + tuple(req.prefix_ids)
                        scored = len(req.prefix_ids) if req.score_prefix else 0
                        key = (text, scored) if self.share_prefill else (i, k)
                        if key not in seen:
                            seen[key] = len(inputs)
                            inputs.append(text)
                            prefix_lens.append(scored)
                        row_input.append(seen[key])
                    gens = (
                        [torch.Generator(device=self.device).manual_seed(sample_seed(requests[i].seed, k)) for i, k in batch]
                        if own_seeds
                        else sample_gen
                    )
                    with self._adapter(requests[batch[0][0]].adapter):
                        new, lps, prefix_lp = self._decode_batch(inputs, prefix_lens, row_input, params, gens, lean)
                    for row, (i, k) in enumerate(batch):
                        results[i][k] = self._make_completion(i, requests[i], new[row], lps[row], prefix_lp[row_input[row]])
                    progress.update(len(batch))
        finally:
            model.train(was_training)
        return results  # type: ignore[return-value]

    def generate_refilling(
        self, requests: Sequence[GenerationRequest], params: SamplingParams, slots: int,
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """For each request, its ``n`` completions in order, decoded in at most ``slots`` rows at once with
        in-engine refill (Infinite Sampling, arXiv:2506.22950, section 3; rlbench/rollout/engines/refill.py):
        the samples form one queue in request order (a request's ``n`` samples together; the caller orders
        it, e.g. shortest predicted first), and a row that ends hands its slot to the next queued sample at
        the next step. Requests with their own ``seed`` sample each of their samples from its own stream
        (:func:`sample_seed`), so a sample's tokens do not depend on its slot or step; without seeds one
        stream seeded from ``generator`` draws one number per running row and step (deterministic for the
        same call, not across queue orders). Not for requests with a prefix or a role adapter, a logits
        transform, or under FSDP (refused); the KV cache across calls is neither read nor written."""
        _check_params(params)
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if any(r.prefix_ids or r.adapter is not None or r.n < 0 or not r.prompt_ids for r in requests):
            raise ValueError("generate_refilling takes non-empty prompts with n >= 0 and no prefix or role adapter")
        if params.logits_transform is not None or self.synced_gpus or role_adapters(self.model):
            raise ValueError("generate_refilling does not run with a logits transform, under FSDP or with a per-role policy")
        samples = [(i, k) for i, req in enumerate(requests) for k in range(req.n)]
        results: list[list[Completion | None]] = [[None] * req.n for req in requests]
        if not samples:
            return [[] for _ in requests]
        if request_seeds(requests):
            gens: torch.Generator | list[torch.Generator] = [
                torch.Generator(device=self.device).manual_seed(sample_seed(requests[i].seed, k)) for i, k in samples]
        else:
            gens = torch.Generator(device=self.device).manual_seed(draw_seed(generator))
        model, lean = self.model, self._lean_decoder()
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode(), fast_cpu_linears(model, self.cpu_kernels):
                inputs = [tuple(requests[i].prompt_ids) for i, _ in samples]
                tokens, logprobs = self._decode_refilling(inputs, params, slots, gens, lean)
        finally:
            model.train(was_training)
        for s, (i, k) in enumerate(samples):
            results[i][k] = self._make_completion(i, requests[i], tokens[s], logprobs[s], [])
        return results  # type: ignore[return-value]

    def _decode_refilling(
        self, inputs: Sequence[tuple[int, ...]], params: SamplingParams, slots: int,
        generator: torch.Generator | Sequence[torch.Generator], lean: LeanDecoder | None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Decode the queue ``inputs`` (one prompt per sample, in queue order) in at most ``slots`` rows:
        each step first admits queued samples into the free slots (their prompts prefilled in one pass,
        equal prompts once, and joined to the running rows' cache), then samples a token for every running
        row and feeds the rows that go on. Returns per sample its tokens and log-probs (up to and including
        EOS); ``generator``: one per sample, or one for the whole call."""
        warpers, budget = _warpers(params), params.max_new_tokens
        tokens: list[list[int]] = [[] for _ in inputs]
        logprobs: list[list[float]] = [[] for _ in inputs]
        if budget == 0:
            return tokens, logprobs
        per_sample = isinstance(generator, (list, tuple))
        eos = set(self.eos_ids)
        queue = list(range(len(inputs)))[::-1]  # popped from the end: the queue's head last
        running: list[int] = []  # samples in the decoding's row order
        decoding: DecodingSteps | None = None
        scores = position = None
        while queue or running:
            if queue and len(running) < slots:
                joining = [queue.pop() for _ in range(min(slots - len(running), len(queue)))]
                distinct, row_input, seen = [], [], {}
                for s in joining:
                    key = inputs[s] if self.share_prefill else s
                    if key not in seen:
                        seen[key] = len(distinct)
                        distinct.append(inputs[s])
                    row_input.append(seen[key])
                logits, cache, mask, last_pos = self._prefill(distinct, 1)
                index = torch.tensor(row_input, dtype=torch.long, device=logits.device)
                new_scores, new_position = logits[:, -1].index_select(0, index), last_pos.index_select(0, index)
                if decoding is None:
                    decoding = lean.steps(cache, mask, index, budget) if lean is not None else ModelSteps(self.model, cache, mask, index, len(distinct))
                    scores, position = new_scores, new_position
                else:
                    decoding.add_rows(cache, mask, index, budget)
                    scores, position = torch.cat([scores, new_scores]), torch.cat([position, new_position])
                del cache
                running += joining
            logp = warped_logprobs(scores, warpers)
            if params.temperature == 0:
                chosen = logp.argmax(-1)
            else:
                chosen = inverse_cdf_sample(
                    logp, draw_uniforms(len(running), [generator[s] for s in running] if per_sample else generator, logp.device))
            chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1).tolist()
            going = []
            for a, (s, t, lp) in enumerate(zip(running, chosen.tolist(), chosen_lp)):
                tokens[s].append(t)
                logprobs[s].append(lp)
                if t not in eos and len(tokens[s]) < budget:
                    going.append(a)
            if params.on_budget is not None:  # the tokens sampled, and the unused budget of the rows that ended
                params.on_budget(sum(1 + (budget - len(tokens[s]) if a not in going else 0) for a, s in enumerate(running)))
            if not going:
                running, decoding = [], None
                continue
            if len(going) != len(running):
                still = torch.tensor(going, dtype=torch.long, device=chosen.device)
                running = [running[a] for a in going]
                chosen, position = chosen[still], position[still]
                decoding.select_rows(still)
            position = position + 1
            scores = decoding.step(chosen, position)
        return tokens, logprobs

    def generate_branching(
        self, requests: Sequence[GenerationRequest], params: SamplingParams, rule: BranchRule,
        generator: torch.Generator | None = None,
    ) -> list[BranchTree]:
        """For each request (a prompt; ``n``: the tree's size), a tree of rows that branch while they decode
        under ``rule`` (LATR, arXiv:2510.24302; rlbench/rollout/engines/branching.py). Requests are decoded in
        the plain loop's order (longest first), ``batch_size // n`` trees per batch. Not for requests with a
        prefix, their own seed or a role adapter, a logits transform, or under FSDP (refused)."""
        _check_params(params)
        if any(r.prefix_ids or r.seed is not None or r.adapter is not None or r.n < 1 or not r.prompt_ids for r in requests):
            raise ValueError("generate_branching takes prompts with n >= 1 and no prefix, seed or role adapter")
        if params.logits_transform is not None or self.synced_gpus or role_adapters(self.model):
            raise ValueError("generate_branching does not run with a logits transform, under FSDP or with a per-role policy "
                             "(rollout.lookahead.mode=resample does)")
        if not requests:
            return []
        if self.reuses_kv and self._cached_weights != weights_version(self.model):
            self._clear_caches()
            self._cached_weights = weights_version(self.model)
        model, lean = self.model, self._lean_decoder()
        was_training = model.training
        model.eval()
        trees: list = [None] * len(requests)
        try:
            with torch.inference_mode(), fast_cpu_linears(model, self.cpu_kernels):
                sample_gen = torch.Generator(device=self.device)
                sample_gen.manual_seed(draw_seed(generator))
                order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids))
                per_batch = max(1, self.batch_size // max(r.n for r in requests))
                for batch in _chunks(order, per_batch):
                    for i, tree in zip(batch, self._decode_trees([requests[i] for i in batch], params, rule, sample_gen, lean)):
                        for c in tree.members:
                            c.request_index = i
                        trees[i] = tree
        finally:
            model.train(was_training)
        return trees

    def _decode_trees(self, requests: Sequence[GenerationRequest], params: SamplingParams, rule: BranchRule,
                      generator: torch.Generator, lean: LeanDecoder | None) -> list[BranchTree]:
        """The trees of one batch of ``requests`` (prompts only; ``n``: a tree's size); the model in eval
        mode under inference mode (the caller's)."""
        warpers = _warpers(params)
        inputs, row_input, seen = [], [], {}
        for req in requests:
            key = tuple(req.prompt_ids) if self.share_prefill else len(inputs)
            if key not in seen:
                seen[key] = len(inputs)
                inputs.append(tuple(req.prompt_ids))
            row_input.append(seen[key])
        logits, cache, mask, last_pos = self._prefill_reusing(inputs, [0] * len(inputs), 1)
        rows = [BranchRow(i, [], []) for i in range(len(requests))]
        live = [1] * len(requests)  # rows of each tree not pruned
        spawned = [0] * len(requests)
        budget = params.max_new_tokens
        sizes = [req.n for req in requests]
        returned = -1  # the tokens each row had when the batch returned (branching.py's docstring); -1: not yet
        if budget > 0:
            index = torch.tensor(row_input, dtype=torch.long, device=logits.device)
            scores = logits[:, -1].index_select(0, index)
            decoding = lean.steps(cache, mask, index, budget) if lean is not None else ModelSteps(self.model, cache, mask, index, len(inputs))
            del cache
            position = last_pos.index_select(0, index)
            eos = set(self.eos_ids)
            active = list(range(len(rows)))  # row ids in decoding order
            for step in range(budget):
                logp = warped_logprobs(scores, warpers)
                greedy = rule.parent_top1 and returned < 0
                if params.temperature == 0:
                    chosen = logp.argmax(-1)
                else:
                    uniforms = draw_uniforms(len(rows), generator, logp.device)  # one per row so far (module docstring)
                    if len(active) != len(rows):
                        uniforms = uniforms[torch.tensor(active, device=uniforms.device)]
                    chosen = logp.argmax(-1) if greedy else inverse_cdf_sample(logp, uniforms)
                chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1).tolist()
                branching = returned < 0 and step < rule.window and any(live[rows[r].tree] < sizes[rows[r].tree] for r in active)
                if branching:
                    top_lp, top_tok = logp.topk(min(rule.top_m, logp.shape[-1]), dim=-1)
                    top_p, top_tok, top_lp = top_lp.exp().tolist(), top_tok.tolist(), top_lp.tolist()
                followers = []  # (decoding index of the row whose state it continues, row id)
                for a, (r, t, lp) in enumerate(zip(active, chosen.tolist(), chosen_lp)):
                    row = rows[r]
                    followers.append((a, r))
                    if branching:
                        for v in spawn_tokens(top_tok[a], top_p[a], t, rule):
                            if live[row.tree] >= sizes[row.tree]:
                                break
                            rows.append(BranchRow(row.tree, row.tokens + [v], row.logprobs + [top_lp[a][top_tok[a].index(v)]], r, step))
                            live[row.tree] += 1
                            spawned[row.tree] += 1
                            followers.append((a, len(rows) - 1))
                    row.tokens.append(t)
                    row.logprobs.append(lp)
                kept, gone = [], set()
                for a, r in followers:
                    row = rows[r]
                    ended = row.tokens[-1] in eos or step == budget - 1
                    if returned < 0 and row.parent >= 0 and row.checked < len(rule.checkpoints):
                        due, pairs = checkpoint_due(rule, row.tokens, rows[row.parent].tokens, row.birth, row.checked, ended, eos)
                        row.checked += due
                        if any(rule.similar(a, b) for a, b in pairs):
                            gone.add(r)
                            continue
                    if not ended:
                        kept.append((a, r))
                if gone:  # the pruned rows and their descendants (children are born after their parents)
                    for r in range(min(gone), len(rows)):
                        if not rows[r].pruned and (r in gone or rows[r].parent in gone):
                            gone.add(r)
                            rows[r].pruned = True
                            live[rows[r].tree] -= 1
                    kept = [(a, r) for a, r in kept if r not in gone]
                if not kept:
                    break
                active = [r for _, r in kept]
                if returned < 0:
                    running = {rows[r].tree for r in active}
                    if step + 1 >= rule.window or (
                        nearly_full(live, sizes, [i not in running for i in range(len(requests))], step, budget, rule)
                        and all(max(row.birth, 0) + rule.checkpoints[-1] < step for row in rows if not row.pruned)
                    ):
                        returned = step + 1
                select = [a for a, _ in kept]
                if select != list(range(len(chosen_lp))):  # rows ended, were pruned or branched
                    where = torch.tensor(select, dtype=torch.long, device=position.device)
                    position = position[where]
                    decoding.select_rows(where)
                position = position + 1
                scores = decoding.step(torch.tensor([rows[r].tokens[-1] for r in active], dtype=torch.long, device=position.device), position)
        trees = [BranchTree(spawned=spawned[i], pruned=spawned[i] + 1 - live[i], returned=returned) for i in range(len(requests))]
        member: dict[int, int] = {}
        for r, row in enumerate(rows):
            if row.pruned:
                continue
            tree = trees[row.tree]
            member[r] = len(tree.members)
            completion = self._make_completion(row.tree, requests[row.tree], row.tokens, row.logprobs, [])
            if row.parent >= 0:
                completion.behaviour = "branch"
            tree.members.append(completion)
            tree.parents.append(member.get(row.parent, -1))
            tree.births.append(row.birth)
        return trees

    def _lean_decoder(self) -> LeanDecoder | None:
        """The :class:`~rlbench.rollout.engines.lean_decode.LeanDecoder` of the model's current weights (kept
        while they do not change); None when it or the CPU kernels are off, under FSDP, or the model is
        not supported (the reason logged once per model, where the CPU kernels apply at all)."""
        if not (self.lean_decode and self.cpu_kernels) or self.synced_gpus:
            return None
        model = self.model
        reason = lean_decode_unsupported(model)
        if reason is not None:
            self._lean = None
            if self._lean_refused != id(model) and layers_for_cpu_kernels(model):
                log.info("decoding through the model's forward (lean decoding: %s)", reason)
                self._lean_refused = id(model)
            return None
        if self._lean is None or self._lean.model is not model or not self._lean.current(model):
            self._lean = None  # the old copy goes before the new one is made
            self._lean = LeanDecoder(model)
        return self._lean

    def _make_completion(self, index, req, tokens: list[int], logprobs: list[float], prefix_lp) -> Completion:
        finished = bool(tokens) and tokens[-1] in self.eos_ids
        response = list(req.prefix_ids) + tokens
        if not req.score_prefix:
            prefix_lp = [float("nan")] * len(req.prefix_ids)
        return Completion(
            request_index=index,
            prompt_ids=tuple(req.prompt_ids),
            response_ids=response,
            logprobs=[float(x) for x in prefix_lp] + [float(x) for x in logprobs],
            finished=finished,
            text=self.tokenizer.decode(response, skip_special_tokens=True),
            prefix_len=len(req.prefix_ids),
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model`` from now on (the engine holds the object itself, no copy); the KV
        kept across calls and the lean decoder's concatenated weights are dropped (they belong to the
        old weights)."""
        self.model = model
        self._clear_caches()
        self._cached_weights = None
        self._lean = None
