"""What checkpoints cost: seconds and bytes per checkpoint of SmolLM2-135M (model=smollm2_135m) on
the CPU, beside the seconds of a training step, and the seconds to read one back. Writes
results/bench/resume.json and results/bench/resume.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/resume_cost.py            # ~3 min on a 2-core machine

A short run (3 steps of 2 prompts x 2 responses, 16 new tokens, a checkpoint after every step, no
evaluation before training, one evaluation problem after) writes its checkpoints; their manifests
record each file's bytes and the write seconds (rlbench.training.checkpoint). Reading is timed
by loading each file of the last checkpoint as a resumed run does.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "results" / "bench"

OVERRIDES = [
    "model=smollm2_135m", "trainer.steps=3", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=3",
    "trainer.prompts_per_step=2", "trainer.micro_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=16",
    "eval.before_training=false", "eval.limit=1", "eval.n=1", "eval.k=[1]", "logger=files", "trainer.save_model=false",
]


def main() -> None:
    import torch

    from conftest import compose_config
    from rlbench.runner import run
    from rlbench.training import checkpoint
    from rlbench.utils import atomic_write_json, atomic_write_text

    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        run(compose_config(OVERRIDES, run_dir))
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        saved = [checkpoint.read_checkpoint(path) for path in checkpoint.checkpoint_dirs(run_dir)]
        last = saved[-1]
        started = time.perf_counter()
        for name in last.manifest["files"]:
            last.load(name)
        read_seconds = time.perf_counter() - started
    files = last.manifest["files"]
    step_seconds = [s["step_s"] for s in steps]
    write_seconds = [c.manifest["write_seconds"] for c in saved]
    result = {
        "model": "smollm2_135m",
        "overrides": OVERRIDES,
        "bytes": {**files, "total": sum(files.values())},
        "write_seconds": write_seconds,
        "read_seconds": read_seconds,
        "step_seconds": step_seconds,
        "overhead_per_checkpoint": sum(write_seconds) / sum(step_seconds),
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "date": time.strftime("%Y-%m-%d"),
    }
    atomic_write_json(OUT / "resume.json", result)
    mib = 1024 * 1024
    lines = [
        "# Checkpoint cost: SmolLM2-135M on the CPU",
        "",
        f"Measured by `bench/resume_cost.py` on {result['date']} ({result['torch_threads']} torch thread(s)): "
        "a 3-step run with a checkpoint after every step (`trainer.checkpoint_every=1`).",
        "",
        "| file | bytes | MiB |",
        "|---|---:|---:|",
        *[f"| {name} | {size} | {size / mib:.1f} |" for name, size in files.items()],
        f"| **total per checkpoint** | **{sum(files.values())}** | **{sum(files.values()) / mib:.1f}** |",
        "",
        "| | seconds |",
        "|---|---:|",
        f"| write one checkpoint (mean of {len(write_seconds)}) | {sum(write_seconds) / len(write_seconds):.2f} |",
        f"| read one back (every file; just written, so from the page cache) | {read_seconds:.2f} |",
        f"| one training step (mean of {len(step_seconds)}) | {sum(step_seconds) / len(step_seconds):.2f} |",
        "",
        f"A checkpoint after every step adds {100 * result['overhead_per_checkpoint']:.0f}% to the step time here; "
        "`trainer.checkpoint_every=N` divides that by N. Writing is bound by the disk (every file is fsynced "
        "before the rename). The optimizer's file is twice the model's (AdamW's two moments in float32); "
        "`state.pt` (random streams, prompt order, metrics so far) is small for this algorithm (grpo).",
        "",
        "Seconds are wall clock on the machine it ran on (this project's is a 2-core machine shared with other jobs, "
        "where repeated runs differ by a third); the bytes do not vary.",
        "",
    ]
    atomic_write_text(OUT / "resume.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
