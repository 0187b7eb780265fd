"""Does GRPO with LoRA learn the toy task? The learning tier's criterion (tests/learning/toy_check.py:
peak and end rise over seeds 0, 1, 2 against one control run at lr 1e-12) on
``experiment=toy_learning/grpo model/lora=default`` plus the overrides given; appends a row to
results/bench/lora_toy.md.

    OMP_NUM_THREADS=1 python bench/lora_toy.py trainer.lr=5e-2
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "learning")]

import toy_check  # noqa: E402

SEEDS = (0, 1, 2)
RESULT = ROOT / "results" / "bench" / "lora_toy.md"
HEADER = (
    "# GRPO with LoRA on the toy task\n\n"
    "`experiment=toy_learning/grpo model/lora=default` (the tiny random model, hidden 64, adapters r = 8 on\n"
    "q, k, v, o: 7,168 trained parameters of about 3.2M) judged by the learning tier's criterion\n"
    "(tests/learning/toy_check.py: median peak rise over seeds 0-2 at least 0.05 above one control run at\n"
    "lr 1e-12, median end rise at least -0.02). `python bench/lora_toy.py <overrides>` adds a row.\n\n"
    "| overrides | peak rise (seeds 0, 1, 2) | end rise | control peak | learns | CPU s per run |\n"
    "|---|---|---|---:|---|---|\n"
)


def main(extra: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs, cpu = [], []
        for seed in SEEDS:
            started = time.process_time()
            metrics = toy_check.toy_run(work / f"learn{seed}", "grpo", f"seed={seed}", "model/lora=default", *extra)
            runs.append(toy_check.step_rewards(metrics))
            cpu.append(time.process_time() - started)
        control = toy_check.toy_run(work / "control", "grpo", f"seed={SEEDS[0]}", "model/lora=default", *extra, "trainer.lr=1e-12")
        verdict = toy_check.judge("grpo+lora", SEEDS, runs, [toy_check.step_rewards(control)])
    row = (f"| {' '.join(extra) or '(none: lr 1e-2)'} | {', '.join(f'{p:.3f}' for p in verdict.peak)} | "
           f"{', '.join(f'{e:.3f}' for e in verdict.end)} | {verdict.median_control_peak:.3f} | "
           f"{'yes' if verdict.learns else 'no'} | {', '.join(f'{c:.1f}' for c in cpu)} |\n")
    text = RESULT.read_text() if RESULT.exists() else HEADER
    RESULT.write_text(text + row)
    print(row)


if __name__ == "__main__":
    main(sys.argv[1:])
