#!/usr/bin/env bash
# The GPU check (docs/scaling.md): on one CUDA GPU, in under 10 minutes, runs
#   1. the vLLM engine end to end with SmolLM2-135M (rollouts, weight sync after every step, evaluation),
#   2. bf16 training steps (trainer.precision=bf16, the HF engine),
#   3. FSDP2 with one rank (torchrun --nproc_per_node 1, trainer.strategy=fsdp),
#   4. LoRA (model/lora=default) with the vLLM engine (merged-weight sync),
# and writes each run's folder and a table of step time, peak memory and pass@1 to results/bench/gpu/.
# Needs the .venv with the gpu extra (pip install -e ".[gpu,dev]"). Usage: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-results/bench/gpu}
PY=${PY:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=offline
COMMON=(device=cuda logger=files trainer.steps=4 trainer.prompts_per_step=8 eval.limit=20 eval.n=4 "eval.k=[1,4]")

run() {  # name, then the overrides; each run at most 150 s
  local name=$1; shift
  echo "== $name"
  timeout 150 "$@" hydra.run.dir="$OUT/$name" >"$OUT/$name.log" 2>&1 && echo ok || echo "FAILED (see $OUT/$name.log)"
}

run vllm_end_to_end "$PY" -m rlbench.cli "${COMMON[@]}" rollout.engine=vllm
run bf16_steps "$PY" -m rlbench.cli "${COMMON[@]}" trainer.precision=bf16 trainer.gradient_checkpointing=true
run fsdp_one_rank "$TORCHRUN" --nproc_per_node 1 -m rlbench.cli "${COMMON[@]}" trainer.strategy=fsdp
run lora_vllm "$PY" -m rlbench.cli "${COMMON[@]}" rollout.engine=vllm model/lora=default trainer.lr=1e-4

"$PY" - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| run | status | step_s (median) | peak_memory_mb (max) | pass@1 before | pass@1 after |", "|---|---|---:|---:|---:|---:|"]
for name in ("vllm_end_to_end", "bf16_steps", "fsdp_one_rank", "lora_vllm"):
    run = out / name
    status = json.loads((run / "status.json").read_text())["status"] if (run / "status.json").exists() else "missing"
    steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    step_s = f"{statistics.median(s['step_s'] for s in steps):.2f}" if steps else "-"
    peak = f"{max(s['peak_memory_mb'] for s in steps):.0f}" if steps else "-"
    before, after = summary.get("pass_at_1_before") or {}, summary.get("pass_at_1_after") or {}
    rows.append(f"| {name} | {status} | {step_s} | {peak} | {before.get('arith', '-')} | {after.get('arith', '-')} |")
(out / "README.md").write_text("# GPU check (bench/gpu_check.sh)\n\n" + "\n".join(rows) + "\n")
print("\n".join(rows))
PY
