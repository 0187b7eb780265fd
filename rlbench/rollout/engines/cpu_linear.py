"""Faster linear layers for the HF engine's forward passes on CPU (float32, inference only).

A decoding step multiplies a few rows (the sequences still running) by every weight matrix of the
model. PyTorch's CPU ``linear`` calls MKL's ``sgemm``, which at a few rows is far from what the CPU can
do: it reads the weights at 7-9 GB/s at 4-16 rows. Two kernels replace it where they are faster:

* **the few-rows kernel** (``cpu_linear_kernel.cpp``, AVX2 + FMA, built on first use with
  ``torch.utils.cpp_extension`` and PyTorch's own thread pool): for inputs of at most
  :data:`FEW_ROWS_MAX` rows, every linear layer. Each block of 4 weight rows is read from memory once
  and multiplied by every input row while it sits in L1;
* **oneDNN** (``torch.ops.mkldnn._linear_pointwise``) for the output layer at more rows, or where the
  few-rows kernel is not available.

Measured on this project's 2-core AMD EPYC (Zen 3, AVX2), float32, 2 threads, weights read from memory
(30 distinct copies; ``docs/performance.md``), ms per product:

=======================  =======  =========  =======  =========  =======  =========
x @ W.T                  1 row              16 rows             64 rows
-----------------------  ------------------  ------------------  ------------------
W                        MKL      few-rows   MKL      few-rows   MKL      few-rows
=======================  =======  =========  =======  =========  =======  =========
576 x 576 (attention)    0.083    0.034      0.173    0.096      0.356    0.277
1536 x 576 (MLP up)      0.255    0.102      0.453    0.281      0.916    0.760
576 x 1536 (MLP down)    0.164    0.090      0.398    0.246      0.881    0.779
49152 x 576 (output)     7.38     3.42       19.3     9.13       35.0     24.1
=======================  =======  =========  =======  =========  =======  =========

(oneDNN's output layer: 4.3 ms at 1 row, 18.4 at 16.) In the engine (SmolLM2-135M, 4 prompts x 4
samples, 48 new tokens, 4 seeds): 16.5 s with MKL and the oneDNN output layer, 11.7 s with the
few-rows kernel, the same tokens in 62 of 64 rows.

**Rounding.** The kernels round differently from MKL (log-probs differ by up to about 6e-5 on
SmolLM2-135M), so a draw whose uniform number falls that close to a CDF boundary can differ; the
sampling distribution is the same. The few-rows kernel's output for one input row does not depend on
the other rows in the batch nor on the number of threads (each output is one dot product in a fixed
order). The tests compare log-probs to a tolerance.

**Where it applies.** Only to a model whose output layer is a plain float32 CPU ``Linear`` of at least
:data:`LARGE_VOCAB` rows: the learning tier's 512-id toy keeps PyTorch's kernels, so its calibrated
trajectories do not change. Then every plain float32 CPU ``Linear`` of the model (a LoRA adapter's
base and adapter layers included) runs through :func:`cpu_linear` inside :func:`fast_cpu_linears`.
The few-rows kernel needs an x86-64 CPU with AVX2 and FMA, a C++ compiler and ninja (a dependency of
the project); without them, or with ``RLBENCH_CPU_KERNEL=0``, the engine uses oneDNN for the output
layer and MKL elsewhere, and says why once in the log. ``make setup`` builds it (:func:`main`), into
PyTorch's extension cache
(``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

LARGE_VOCAB = 4096  # models with a smaller output layer keep PyTorch's default kernels
FEW_ROWS_MAX = 64  # inputs of at most this many rows go through the few-rows kernel (faster up to 64, measured)
KERNEL_SOURCE = Path(__file__).with_name("cpu_linear_kernel.cpp")
KERNEL_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def few_rows_kernel_unavailable() -> str | None:
    """Why the few-rows kernel cannot be used here, or None when it can (it may still fail to build)."""
    if os.environ.get("RLBENCH_CPU_KERNEL", "1") == "0":
        return "RLBENCH_CPU_KERNEL=0"
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform == "win32":
        return f"not an x86-64 Linux or macOS machine ({platform.machine()}, {sys.platform})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU has no AVX2 (PyTorch's CPU capability: {capability})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    if shutil.which("ninja") is None and not (Path(sys.executable).parent / "ninja").exists():
        return "ninja is not installed"
    return None


@functools.lru_cache(maxsize=None)
def few_rows_kernel():
    """The built few-rows kernel module (``few_rows_linear(x, w, bias)``), or None where it is not
    available (the reason is logged once). Builds it on first use (about 30 s; then cached on disk)."""
    reason = few_rows_kernel_unavailable()
    if reason is not None:
        log.info("few-rows CPU kernel off (%s): PyTorch's kernels are used", reason)
        return None
    from torch.utils.cpp_extension import load

    venv_bin = str(Path(sys.executable).parent)  # ninja installed by pip lives beside the interpreter
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    started = time.perf_counter()
    try:
        module = load(
            name="rlbench_cpu_linear", sources=[str(KERNEL_SOURCE)], extra_cflags=KERNEL_FLAGS, extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a failed build leaves the engine on PyTorch's kernels, and says so
        log.warning("few-rows CPU kernel failed to build, PyTorch's kernels are used: %s", str(exc).strip()[-2000:])
        return None
    seconds = time.perf_counter() - started
    if seconds > 2:
        log.info("few-rows CPU kernel built in %.0f s", seconds)
    return module


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN (``torch.nn.functional.linear`` up to float rounding)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, output_layer: bool) -> torch.Tensor:
    """``x @ weight.T + bias`` (float32, CPU, no autograd) through the fastest kernel for its shape:
    the few-rows kernel for at most :data:`FEW_ROWS_MAX` rows, oneDNN for an output layer, else
    ``torch.nn.functional.linear`` (module docstring)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):  # the kernels have no backward
        return torch.nn.functional.linear(x, weight, bias)
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    kernel = few_rows_kernel()
    if kernel is not None and 0 < rows <= FEW_ROWS_MAX and features % 8 == 0 and weight.is_contiguous():
        y = kernel.few_rows_linear(x.reshape(rows, features).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    if output_layer and onednn_available():
        return onednn_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def plain_float32_cpu_linear(layer: torch.nn.Module) -> bool:
    """An ``nn.Linear`` (not a subclass) whose forward is its own and whose weight is a plain float32
    CPU tensor (not FSDP's, not a quantized model's)."""
    if type(layer) is not torch.nn.Linear or "forward" in vars(layer):
        return False
    w = layer.weight
    return type(w) in (torch.Tensor, torch.nn.Parameter) and w.device.type == "cpu" and w.dtype == torch.float32


def layers_for_cpu_kernels(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers :func:`fast_cpu_linears` replaces (module docstring), output layer first;
    empty when the model's output layer is not a plain float32 CPU layer of at least
    :data:`LARGE_VOCAB` rows."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not plain_float32_cpu_linear(head) or head.weight.shape[0] < LARGE_VOCAB:
        return []
    return [head] + [m for m in model.modules() if m is not head and plain_float32_cpu_linear(m)]


def _output_layer_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return cpu_linear(x, self.weight, self.bias, output_layer=True)


def _hidden_layer_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return cpu_linear(x, self.weight, self.bias, output_layer=False)


@contextlib.contextmanager
def fast_cpu_linears(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside, ``model``'s linear layers run through :func:`cpu_linear` where it applies (module
    docstring); their own forwards are restored on exit. For inference only: the engine uses it under
    ``torch.inference_mode``."""
    layers = layers_for_cpu_kernels(model) if enabled else []
    for i, layer in enumerate(layers):
        layer.forward = types.MethodType(_output_layer_forward if i == 0 else _hidden_layer_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def main() -> int:
    """Build (or load) the few-rows kernel and say which
    kernels the engine will use. Exit status 0 either way: a machine without it falls back."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = few_rows_kernel_unavailable()
    if reason is None:
        print(f"building the few-rows CPU kernel ({KERNEL_SOURCE.name}) if it is not built yet ...", flush=True)
    kernel = few_rows_kernel()
    print("few-rows CPU kernel: " + ("ready" if kernel is not None else f"off ({reason or 'the build failed; see above'})"))
    return 0
