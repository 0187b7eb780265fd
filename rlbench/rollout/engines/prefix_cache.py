"""The HF engine's KV cache across calls (``rollout.prefix_cache_mb``): the keys and values of
sequences the engine has already run through the model, kept so that a later request whose
``prompt + prefix`` extends one of them prefills only its new tokens.

Tree rollouts (rlbench/rollout/strategies/tree.py) call the engine once per round with ``prefix_ids`` = a
node's tokens so far; without this cache every round prefills the whole path again (TreePO's point
is prefix KV reuse: Li et al. 2025, arXiv:2508.17445, section 3.1).

* An entry is one token sequence and its per-layer ``(keys, values)`` (``[heads, length, head_dim]``
  each, on the model's device), stored by the engine for every row that was still running when its
  decoding stopped at ``max_new_tokens``: the sequence is the row's input and its sampled tokens but
  the last (whose KV was never computed). Rows that sampled EOS are not stored (nothing extends them).
* :meth:`PrefixKVCache.longest_prefix` finds the longest stored sequence that is a prefix of a
  request's input (exact token match, no partial overlap), up to a length the caller bounds (the
  engine needs the logits of the last token, and of the scored prefix, so those are always run).
* The budget is in bytes of stored keys and values; the least recently used entries go first.
  ``budget_bytes = 0`` turns the cache off (nothing is stored).
* The keys and values depend on the weights: :meth:`clear` empties the cache, and the engine
  calls it on ``sync_weights`` and whenever the model's parameters changed in place since the
  entries were stored (their version counters moved).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), each [heads, length, head_dim]


def weights_version(model) -> tuple[int, int]:
    """Changes when ``model`` is swapped or any of its parameters is written in place (an optimizer
    step, ``load_state_dict``): the object's id and the sum of the parameters' version counters."""
    return id(model), sum(p._version for p in model.parameters())


@dataclass
class PrefixCacheStats:
    """Counts since the engine was built (lookups that found an entry, tokens not prefilled again,
    entries stored and evicted, times the cache was emptied for new weights)."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    invalidations: int = 0


def kv_bytes(kv: KV) -> int:
    return sum(t.numel() * t.element_size() for layer in kv for t in layer)


class PrefixKVCache:
    """An LRU map from token sequences to their KV, bounded by ``budget_bytes`` (module docstring)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.lengths: dict[int, int] = {}  # stored sequence length -> how many entries have it
        self.bytes = 0
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self.entries)

    def longest_prefix(self, tokens: Sequence[int], limit: int) -> tuple[int, KV | None]:
        """``(length, kv)`` of the longest stored sequence that equals ``tokens[:length]`` with
        ``length <= limit`` (it becomes the most recently used), or ``(0, None)``."""
        tokens = tuple(tokens)
        for length in sorted((n for n in self.lengths if n <= limit), reverse=True):
            kv = self.entries.get(tokens[:length])
            if kv is not None:
                self.entries.move_to_end(tokens[:length])
                self.stats.hits += 1
                self.stats.reused_tokens += length
                return length, kv
        self.stats.misses += 1
        return 0, None

    def put(self, tokens: Sequence[int], kv: KV) -> None:
        """Store ``kv`` (the keys and values of every position of ``tokens``) and evict the least
        recently used entries beyond the budget; an entry larger than the whole budget is not stored."""
        key = tuple(tokens)
        size = kv_bytes(kv)
        if not key or size > self.budget_bytes:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self.entries[key] = kv
        self.lengths[len(key)] = self.lengths.get(len(key), 0) + 1
        self.bytes += size
        self.stats.stored += 1
        while self.bytes > self.budget_bytes:
            self._drop(next(iter(self.entries)))
            self.stats.evicted += 1

    def _drop(self, key: tuple[int, ...]) -> None:
        kv = self.entries.pop(key)
        self.bytes -= kv_bytes(kv)
        self.lengths[len(key)] -= 1
        if not self.lengths[len(key)]:
            del self.lengths[len(key)]

    def clear(self) -> None:
        """Forget every entry (new weights: the stored KV is stale)."""
        if self.entries:
            self.stats.invalidations += 1
        self.entries.clear()
        self.lengths.clear()
        self.bytes = 0
