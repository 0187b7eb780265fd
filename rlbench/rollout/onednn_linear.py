"""oneDNN for the output layer of the HF engine's forward passes on CPU.

A decoding step multiplies a few rows (the sequences still running) by the output layer, the
vocabulary x hidden matrix (49,152 x 576 for SmolLM2-135M). PyTorch's CPU ``linear`` calls MKL's
``sgemm``, which at a few rows costs about what reading and re-packing that whole matrix costs;
oneDNN's ``linear`` is faster there. Measured on this project's 2-core AMD EPYC (AVX2), float32, one
product with the weights in cache:

====================================  ==========  ===========
product                                MKL (ms)    oneDNN (ms)
====================================  ==========  ===========
16 x 576 @ 576 x 49152                    27.8        18.4
 4 x 576 @ 576 x 49152                    20.8        11.5
 1 x 576 @ 576 x 49152                    10.2         4.3
 16 x 576 @ 576 x 1536 (an MLP layer)     0.58        0.61
====================================  ==========  ===========

and in the engine (SmolLM2-135M, 4 prompts x 4 samples, 48 new tokens, 4 seeds): 12.4 ms per
generated token with MKL, 10.7 with oneDNN for the output layer (docs/performance.md). Running the
other layers through oneDNN as well gained 0.5 ms more per token at rows <= 8, not worth a second
kernel choice per layer, so only output layers of at least :data:`ONEDNN_MIN_VOCAB` rows use it.

The two libraries round differently (log-probs differ by about 4e-5 on SmolLM2-135M), so a draw whose
uniform number falls that close to a CDF boundary can differ; the sampling distribution is the same.
The tests compare log-probs to a tolerance. A model with a smaller output layer (the 512-id toy of
the learning tier) is unaffected.

Used only where it applies: CPU, float32 weights held as a plain tensor (not FSDP's or a quantized
model's), a PyTorch build with oneDNN. Elsewhere :func:`onednn_output_layer` changes nothing.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch

ONEDNN_MIN_VOCAB = 4096  # output layers with fewer rows keep PyTorch's default kernel


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN (``torch.nn.functional.linear`` up to float rounding)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return onednn_linear(x, self.weight, self.bias)


def output_layer_for_onednn(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output layer if oneDNN applies to it (module docstring), else None."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or "forward" in vars(head):
        return None
    w = head.weight
    plain = type(w) in (torch.Tensor, torch.nn.Parameter) and w.device.type == "cpu" and w.dtype == torch.float32
    return head if plain and w.shape[0] >= ONEDNN_MIN_VOCAB else None


@contextlib.contextmanager
def onednn_output_layer(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside, ``model``'s output layer runs through oneDNN where it applies (module docstring);
    restored on exit. For inference only: the engine uses it under ``torch.inference_mode``."""
    head = output_layer_for_onednn(model) if enabled else None
    if head is None:
        yield
        return
    head.forward = types.MethodType(_onednn_forward, head)
    try:
        yield
    finally:
        del head.forward
