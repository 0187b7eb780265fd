"""The engine's logits transform (rlbench/rollout/engines/base.py ``LogitsTransform``) inside vLLM's sampler.

vLLM V1 (>= 0.10.2) applies *logits processors* to the batch's logits at every decoding step
(``vllm.v1.sample.logits_processor.LogitsProcessor``, passed to ``vllm.LLM(logits_processors=[cls])``;
the engine instantiates it with ``(vllm_config, device, is_pin_memory)``). A processor that declares
itself not argmax-invariant (``is_argmax_invariant() -> False``) receives the model's raw float32
logits of every running request, before temperature, top-k/top-p and the log-probs
(``logprobs_mode="processed_logprobs"`` reports the log-probs of the processed distribution): the
place where the HF engine calls ``params.logits_transform``. So one processor serves every transform:

* :meth:`VLLMEngine.generate <rlbench.rollout.engines.vllm.VLLMEngine.generate>` registers the call's
  transform (:func:`register_transform`) and tags its requests with the registration key
  (``SamplingParams.extra_args[EXTRA_ARG]``, a plain int that survives any copy of the params);
* :class:`TransformRows` (no vLLM dependency, tested on CPU) follows vLLM's persistent batch through
  its ``BatchUpdate`` (requests removed, added, moved or swapped between rows) and, per step, calls
  each registered transform on its rows' logits with their contexts (prompt and tokens so far; the
  prompt when this vLLM passes it, else the tokens so far only);
* :func:`processor_class` wraps it in vLLM's base class.

The transform objects live in this process: the engine core must run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the vLLM engine sets, as its weight sync already needs);
a key the registry does not hold is an error that says so.

What differs from the HF engine: vLLM schedules chunked prefills, and its sampler also runs on a
request whose prompt is only partly prefilled (the token is discarded). The transform sees such a
row too, so a transform that records statistics of the rows it sees (adaptive_temperature's
entropies) may record a few extra prompt positions; the sampled tokens are transformed exactly as on
the HF engine.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch

from rlbench.rollout.engines.base import LogitsTransform

EXTRA_ARG = "rlbench_logits_transform"  # SamplingParams.extra_args key: the registered transform's key

_TRANSFORMS: dict[int, LogitsTransform] = {}
_KEYS = itertools.count()


def register_transform(transform: LogitsTransform) -> int:
    """Hold ``transform`` for the vLLM processor; returns its key (:func:`release_transform` drops it)."""
    key = next(_KEYS)
    _TRANSFORMS[key] = transform
    return key


def release_transform(key: int) -> None:
    _TRANSFORMS.pop(key, None)


def registered_transform(key: int) -> LogitsTransform:
    try:
        return _TRANSFORMS[key]
    except KeyError:
        raise RuntimeError(
            f"vLLM asked for logits transform {key}, which this process does not hold: the vLLM engine core runs "
            "in another process; run it in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported)"
        ) from None


class _Contexts(Sequence):
    """Each row's tokens so far (prompt + generated), built when a transform reads them."""

    def __init__(self, rows: list[tuple[Sequence[int] | None, list[int]]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        prompt, output = self.rows[i]
        return tuple(prompt or ()) + tuple(output)


class TransformRows:
    """Which rows of vLLM's persistent batch carry which transform (module docstring), and applying
    them. ``lookup(key)`` gives the transform registered under ``key``."""

    def __init__(self, lookup: Callable[[int], LogitsTransform] = registered_transform):
        self.lookup = lookup
        self.rows: dict[int, tuple[int, Sequence[int] | None, list[int]]] = {}  # row -> (key, prompt, output)

    def update(self, batch_update: Any) -> None:
        """Follow a ``BatchUpdate`` (``removed`` row indices; ``added`` tuples ``(row, params, [prompt
        ids,] output ids)``, the output list a live reference; ``moved`` ``(a, b, direction)``: a swap
        of rows a and b, or a one-way move of a's request to row b), in that order."""
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for added in batch_update.added:
            row, params, output = added[0], added[1], added[-1]
            prompt = added[2] if len(added) > 3 else None
            key = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARG)
            if key is None:
                self.rows.pop(row, None)
            else:
                self.rows[row] = (int(key), prompt, output)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if second is not None and getattr(direction, "name", str(direction)).upper().endswith("SWAP"):
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[rows, V]`` with each transform applied to its rows (in place; returned)."""
        by_key: dict[int, list[int]] = {}
        for row in sorted(self.rows):
            by_key.setdefault(self.rows[row][0], []).append(row)
        for key, rows in by_key.items():
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            contexts = _Contexts([self.rows[r][1:] for r in rows])
            logits[index] = self.lookup(key)(logits.index_select(0, index), contexts).to(logits.dtype)
        return logits


_PROCESSOR: type | None = None


def loaded_processor() -> type | None:
    """The class :func:`processor_class` built, None before (or when vLLM lacks logits processors)."""
    return _PROCESSOR


def processor_class() -> type:
    """The vLLM logits processor class running :class:`TransformRows` (imports vLLM)."""
    global _PROCESSOR
    if _PROCESSOR is None:
        from vllm.v1.sample.logits_processor import LogitsProcessor

        class RlbenchLogitsTransforms(LogitsProcessor):
            """rlbench's logits transforms inside vLLM's sampler (rlbench/rollout/engines/vllm_logits.py)."""

            def __init__(self, vllm_config, device, is_pin_memory):
                self.transform_rows = TransformRows()

            def is_argmax_invariant(self) -> bool:
                return False  # applied to the raw logits, before temperature, as the HF engine's hook

            def update_state(self, batch_update) -> None:
                self.transform_rows.update(batch_update)

            def apply(self, logits: torch.Tensor) -> torch.Tensor:
                return self.transform_rows.apply(logits)

        _PROCESSOR = RlbenchLogitsTransforms
    return _PROCESSOR
