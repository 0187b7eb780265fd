"""Whether a run fits here, checked before anything is loaded: the model's memory against the
device's, and (for paper presets) the response length against the task.

Training keeps fp32 master weights, their gradients and AdamW's two moments: 16 bytes per parameter,
plus 4 for each frozen model it loads beside the policy (the reference model of a KL term or of a loss that
reads pi_ref, RTO's DPO model, a model fitted before the actor and frozen while it trains: Direct Advantage PO's
step critic, DRPO's preference model; ``frozen_models``, counted by the caller from the composed algorithm; the
fit's own gradients and moments come before the policy's exist), plus 16 for each model trained beside the policy
with its own optimizer (OPRL's implicit PRM, trained online every step: ``trained_models``);
evaluation keeps the weights, 4 bytes.
Activations come on top, so a run that passes can still run out of memory; one that fails cannot run.
"""

from __future__ import annotations

import os

import torch

from rlbench.config.schema import RunConfig
from rlbench.errors import ConfigError

BYTES_PER_PARAMETER_TRAINING = 16  # fp32 weights, gradients, AdamW's first and second moments
BYTES_PER_PARAMETER_WEIGHTS = 4    # fp32 weights (evaluation, the frozen reference model)
MIN_REASONING_TOKENS = 256         # shortest response a paper preset may sample on a reasoning task
SHORT_ANSWER_DATASETS = ("arith",)  # tasks whose prompt asks for the answer alone


def device_memory_bytes(device: torch.device) -> int:
    """The device's total memory: the GPU's, or the machine's physical memory for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def memory_needed_bytes(parameters: int, training: bool, frozen_models: int, trained_models: int = 0) -> int:
    per_parameter = BYTES_PER_PARAMETER_TRAINING if training else BYTES_PER_PARAMETER_WEIGHTS
    if training:
        per_parameter += frozen_models * BYTES_PER_PARAMETER_WEIGHTS + trained_models * BYTES_PER_PARAMETER_TRAINING
    return parameters * per_parameter


def check_fits_here(config: RunConfig, device: torch.device, training: bool, frozen_models: int,
                    available_bytes: int | None = None, trained_models: int = 0) -> None:
    """ConfigError when the model cannot fit the device, or a paper preset samples responses too short
    for its task. ``frozen_models``: the frozen copies training loads beside the policy (reference model,
    RTO's DPO model); ``trained_models``: the models trained beside it (OPRL's PRM). ``available_bytes`` defaults
    to :func:`device_memory_bytes`."""
    parameters = config.model.parameters
    if parameters:
        needed = memory_needed_bytes(int(parameters), training, frozen_models, trained_models)
        available = device_memory_bytes(device) if available_bytes is None else available_bytes
        if needed > available:
            what = ("training needs about 16 bytes per parameter (fp32 weights, gradients and AdamW's two "
                    "moments" + (f", plus 4 for each of its {frozen_models} frozen model(s): reference, DPO model" if frozen_models else "")
                    + (f", plus 16 for each of its {trained_models} model(s) trained beside it: OPRL's PRM" if trained_models else "") + ")"
                    if training else "evaluation needs about 4 bytes per parameter (fp32 weights)")
            raise ConfigError(
                f"model {config.model.name} has about {int(parameters) / 1e9:.1f}B parameters: {what}, about "
                f"{needed / 2**30:.0f} GiB, more than the {available / 2**30:.0f} GiB of this {device.type}. "
                f"Choose a smaller model (model=qwen2_5_0_5b_instruct, model=smollm2_135m) or a larger device; "
                f"experiment=smoke runs the setting on the tiny model"
            )
    if config.paper and parameters and config.dataset.name not in SHORT_ANSWER_DATASETS:
        lengths = {"eval.max_new_tokens": config.eval.max_new_tokens}
        if training:
            lengths["rollout.max_new_tokens"] = config.rollout.max_new_tokens
        short = {key: value for key, value in lengths.items() if value < MIN_REASONING_TOKENS}
        if short:
            shown = ", ".join(f"{key}={value}" for key, value in short.items())
            raise ConfigError(
                f"paper={config.paper['name']} samples {shown} new tokens on {config.dataset.name}, too few for a reasoning "
                f"answer (where the paper's sources give no length, the preset keeps rlbench's default, made for the arith "
                f"toy); "
                f"set rollout.max_new_tokens=1024 (eval.max_new_tokens follows it), at least {MIN_REASONING_TOKENS}"
            )
