"""Memory: peak memory of a training step (metric ``peak_memory_mb``), activation (gradient)
checkpointing (``trainer.gradient_checkpointing``) and the CPU heap's reuse of freed memory
(``trainer.reuse_freed_memory``).

CUDA: ``torch.cuda.max_memory_allocated`` since the step began (the tensors' peak, reset at each
step). CPU: the process's peak resident set size so far (``getrusage`` ``ru_maxrss``, KiB on
Linux); the operating system keeps only the lifetime peak, so on CPU it never falls between steps.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

import torch


class PeakMemory:
    """Started at the beginning of a step; :meth:`megabytes` reads the peak at its end."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self.device = device

    def megabytes(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (Hugging Face's non-reentrant
    checkpointing; transformers >= 5 names it activation checkpointing)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


# Freed memory kept in the process for reuse (:func:`keep_freed_memory`): blocks below this size come from
# the heap and stay there when freed. As environment variables, they reach processes started from here.
FREED_MEMORY_KEPT_BYTES = 1 << 30
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": FREED_MEMORY_KEPT_BYTES, "MALLOC_TRIM_THRESHOLD_": FREED_MEMORY_KEPT_BYTES}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (<malloc.h>)


def keep_freed_memory(children: bool = False) -> bool:
    """Keep freed memory in the process for the next allocation instead of handing it back to the
    operating system: glibc's mmap and trim thresholds at :data:`FREED_MEMORY_KEPT_BYTES` (1 GiB).

    By default glibc serves a block above 128 KiB-32 MiB with its own ``mmap`` and unmaps it when freed
    (or trims the heap), so each new large tensor (SmolLM2's 49,152 x 576 embedding gradient, a
    micro-batch's [12, 48, 49,152] log-softmax: 113 MB each) starts on fresh pages, which the kernel
    zeroes and maps one page fault per 4 KiB at first touch: zero-filling one took 38-40 ms instead of
    18-23. On a SmolLM2-135M GRPO step (docs/performance.md) the update went from 6.4 to 5.05 s (5 steps
    each); the peak resident memory rose 3% (the process keeps its peak, as a GPU caching allocator
    does). Placement cannot change a result: the toy runs stay bit-identical.

    Process-wide and not undone. ``make_step_context`` calls it for CPU training when
    ``trainer.reuse_freed_memory`` is on; the test suite for its processes (``children``: also set
    :data:`MALLOC_TUNING` in the environment, which glibc reads when a started process begins).
    Returns whether it took effect (False where the C library has no mallopt, e.g. macOS)."""
    if children:
        for name, value in MALLOC_TUNING.items():
            os.environ.setdefault(name, str(value))
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    except OSError:
        return False
    if mallopt is None:
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, FREED_MEMORY_KEPT_BYTES) and mallopt(M_MMAP_THRESHOLD, FREED_MEMORY_KEPT_BYTES))
