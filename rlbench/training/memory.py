"""Memory: peak memory of a training step (metric ``peak_memory_mb``) and activation (gradient)
checkpointing (``trainer.gradient_checkpointing``).

CUDA: ``torch.cuda.max_memory_allocated`` since the step began (the tensors' peak, reset at each
step). CPU: the process's peak resident set size so far (``getrusage`` ``ru_maxrss``, KiB on
Linux); the operating system keeps only the lifetime peak, so on CPU it never falls between steps.
"""

from __future__ import annotations

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
