"""Memory and precision options: gradient checkpointing changes no gradient, bf16 autocast (tested on
CPU; the CUDA path is the same code) stays close to fp32, and the step's peak memory is measured."""

import resource

import pytest
import torch

from rlbench.training.forward import activation_checkpointing, autocast_context, forward_precision, token_outputs
from rlbench.training.memory import PeakMemory, enable_activation_checkpointing
from rlbench.training.update import standard_update

from test_trainer import RecordingOptimizer, algo, prepared_batch, tiny_lm

UPDATE = dict(micro_batch_size=5, max_grad_norm=None, temperature=1.0, norm_length=6)
# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.002 per operation); measured on this tiny
# model: max |log-prob difference| 0.02, loss difference 1e-3 relative.
BF16_LOGP_TOLERANCE = 0.05
BF16_LOSS_TOLERANCE = 0.01  # relative


def test_gradient_checkpointing_gives_the_same_gradient():
    algorithm = algo("token_mean")
    batch = prepared_batch(algorithm)
    plain, checkpointed = tiny_lm(0), tiny_lm(0)
    enable_activation_checkpointing(checkpointed)
    assert activation_checkpointing(checkpointed) and not activation_checkpointing(plain)
    recorded = [RecordingOptimizer(plain), RecordingOptimizer(checkpointed)]
    standard_update(plain, recorded[0], batch, algorithm, **UPDATE)
    standard_update(checkpointed, recorded[1], batch, algorithm, **UPDATE)
    for a, b in zip(*(r.steps[0] for r in recorded)):
        assert torch.allclose(a, b, atol=1e-6)


def test_bf16_autocast_on_cpu_is_close_to_fp32():
    algorithm = algo("token_mean")
    batch = prepared_batch(algorithm)
    model = tiny_lm(0)
    results = {}
    for precision in ("fp32", "bf16"):
        with forward_precision(precision):
            results[precision] = standard_update(model, RecordingOptimizer(model), batch, algorithm, **UPDATE)
            with torch.no_grad():
                results[precision]["logp"] = token_outputs(model, batch).logp
    fp32, bf16 = results["fp32"], results["bf16"]
    difference = (fp32["logp"] - bf16["logp"]).abs().max()
    assert 0 < difference < BF16_LOGP_TOLERANCE  # bf16 did run, and stays close
    assert bf16["policy_loss"] == pytest.approx(fp32["policy_loss"], rel=BF16_LOSS_TOLERANCE, abs=1e-4)


def test_precision_auto_is_bf16_on_cuda_only():
    with forward_precision("auto"):
        assert not isinstance(autocast_context("cpu"), torch.autocast)
        assert isinstance(autocast_context("cuda"), torch.autocast)
    with forward_precision("bf16"):
        assert isinstance(autocast_context("cpu"), torch.autocast)
    with forward_precision("fp32"):
        assert not isinstance(autocast_context("cuda"), torch.autocast)
    with pytest.raises(ValueError, match="precision"):
        with forward_precision("fp8"):
            pass


def test_peak_memory_on_cpu_is_the_process_peak_rss():
    peak = PeakMemory("cpu").megabytes()
    assert peak == pytest.approx(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rel=0.05)
    assert peak > 50  # torch alone is more than 50 MiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_on_cuda_counts_the_step_tensors():
    meter = PeakMemory("cuda")
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert meter.megabytes() >= 64
    del block
