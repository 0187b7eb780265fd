#!/usr/bin/env bash
# The GPU check (docs/scaling.md#gpu-check): on one CUDA GPU, in a few minutes, bench/gpu_check.py runs
#   training steps on CUDA in float32 and bf16, gradient checkpointing, DDP and FSDP2 with one rank on NCCL
#   (torchrun), LoRA, on the tiny model; the suite's tests marked gpu; one float32 loss and backward on the
#   CPU and on CUDA compared; and, where vLLM is installed, the vLLM engine end to end and LoRA with vLLM
#   (SmolLM2-135M). It writes gpu_check.md / .json (status, step seconds, peak memory, max |delta| CPU vs
#   CUDA per check) and logs.tar.gz. Without CUDA every check says skipped (tests/test_gpu_check.py).
#
#   bash bench/gpu_check.sh             # a machine with the project's .venv (pip install -e ".[gpu,dev]")
#   bash bench/gpu_check.sh --device    # the device tool's machine: its image's python3, no package index
#
# --device: `make gpu-wheels` here first (the wheels and the tiny model into .gpu/), then through the tool:
#   run(command="bash bench/gpu_check.sh --device", carry=[".gpu"], timeout_s=540)
# The wheels in $GPU_BUNDLE/wheels are installed into $GPU_SITE and put on PYTHONPATH with the repository.
# Output: $OUT_DIR, else $OUT (the device tool's folder that comes back), else results/bench/gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-venv}
BUNDLE=${GPU_BUNDLE:-.gpu}
OUT_DIR=${OUT_DIR:-${OUT:-results/bench/gpu}}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=offline PYTHONUNBUFFERED=1

case "$MODE" in
  --device)
    PY=${PY:-python3}
    SITE=${GPU_SITE:-/tmp/rlbench-gpu-site}
    shopt -s nullglob
    wheels=("$BUNDLE"/wheels/*.whl)
    if ((${#wheels[@]})); then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
      echo "installed ${#wheels[@]} wheels from $BUNDLE/wheels into $SITE"
      export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "no wheels in $BUNDLE/wheels (make gpu-wheels writes them): using the packages $PY already has"
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # rlbench is not installed there: run it from the tree
    ;;
  venv) PY=${PY:-.venv/bin/python} ;;
  *) echo "usage: bash bench/gpu_check.sh [--device]" >&2; exit 2 ;;
esac
exec "$PY" bench/gpu_check.py run --out "$OUT_DIR" --bundle "$BUNDLE"
