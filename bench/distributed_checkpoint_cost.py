"""What a checkpoint costs each rank of a 2-process run (torchrun, trainer.parallelism=ddp and fsdp):
the seconds every rank spends writing its files and the bytes it writes. Writes
results/bench/distributed_checkpoint.json and results/bench/distributed_checkpoint.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/distributed_checkpoint_cost.py                  # SmolLM2-135M
    OMP_NUM_THREADS=1 .venv/bin/python bench/distributed_checkpoint_cost.py --model tiny     # the tiny model

A 2-step run per strategy with a checkpoint after every step (no evaluation before training, one
evaluation problem after). The manifests record every file's bytes and each rank's write seconds
(rlbench.training.checkpoint.save_checkpoint); a file belongs to the rank that wrote it: under ddp
rank 0 writes model.pt, optimizer.pt and state.pt, every other rank its state.rank<r>.pt; under fsdp
every rank writes its shard file sharded/__<r>_0.distcp and its state file, rank 0 also the shards'
metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "results" / "bench"
PROCESSES = 2
OVERRIDES = [
    "trainer.steps=2", "trainer.checkpoint_every=1", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4",
    "rollout.n=2", "rollout.max_new_tokens=16", "eval.before_training=false", "eval.limit=1", "eval.n=1",
    "eval.k=[1]", "logger=files", "trainer.save_model=false",
]


def writer_rank(name: str) -> int:
    """The rank that writes checkpoint file ``name`` (see the module's docstring)."""
    state = re.fullmatch(r"state\.rank(\d+)\.pt", name)
    shard = re.fullmatch(r"sharded/__(\d+)_\d+\.distcp", name)
    return int(state.group(1)) if state else int(shard.group(1)) if shard else 0


def run_strategy(model: str, strategy: str, run_dir: Path) -> dict:
    from rlbench.training import checkpoint

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(PROCESSES), "-m",
               "rlbench.cli", f"model={model}", *OVERRIDES, f"trainer.parallelism={strategy}", f"hydra.run.dir={run_dir}"]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    saved = [checkpoint.read_checkpoint(path) for path in checkpoint.checkpoint_dirs(run_dir)]
    files = saved[-1].manifest["files"]
    ranks = range(PROCESSES)
    steps = [json.loads(line)["step_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "files": files,
        "bytes_per_rank": [sum(size for name, size in files.items() if writer_rank(name) == r) for r in ranks],
        "write_seconds_per_rank": [  # mean over the run's checkpoints
            sum(c.manifest["rank_write_seconds"][r] for c in saved) / len(saved) for r in ranks],
        "checkpoint_seconds": sum(c.manifest["write_seconds"] for c in saved) / len(saved),
        "step_seconds": sum(steps) / len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model name (default smollm2_135m)")
    args = parser.parse_args()
    from rlbench.utils import atomic_write_json, atomic_write_text

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for strategy in ("ddp", "fsdp"):
            results[strategy] = run_strategy(args.model, strategy, Path(scratch) / strategy)
    record = {"model": args.model, "processes": PROCESSES, "overrides": OVERRIDES, "strategies": results,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average": os.getloadavg()[0],
              "date": time.strftime("%Y-%m-%d")}
    atomic_write_json(OUT / "distributed_checkpoint.json", record)
    mib = 1024 * 1024
    rows = [f"| {strategy} | {rank} | {r['bytes_per_rank'][rank] / mib:.1f} | {r['write_seconds_per_rank'][rank]:.2f} | "
            f"{r['checkpoint_seconds']:.2f} | {r['step_seconds']:.2f} |"
            for strategy, r in results.items() for rank in range(PROCESSES)]
    lines = [
        f"# Checkpoint cost per rank: {PROCESSES} processes, model={args.model}, CPU (gloo)",
        "",
        f"Measured by `bench/distributed_checkpoint_cost.py --model {args.model}` on {record['date']} "
        f"({record['machine']}, load average {record['load_average']:.1f}: other jobs shared the cores, so the "
        "seconds are indicative; the bytes do not vary). A 2-step run per strategy with a checkpoint after every "
        "step; seconds are the mean over its 2 checkpoints.",
        "",
        "| strategy | rank | MiB written | write s (rank) | checkpoint s (slowest rank) | step s |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Under ddp rank 0 writes the whole model and optimizer state (every rank holds the same) and the other "
        "rank only its own state (random streams, trackers); under fsdp every rank writes its shard of the model "
        "and optimizer (torch.distributed.checkpoint), so the bytes and seconds are spread over the ranks. "
        "Files of the last checkpoint (bytes):",
        "",
        *[f"- {strategy}: " + ", ".join(f"`{name}` {size}" for name, size in r["files"].items())
          for strategy, r in results.items()],
        "",
    ]
    atomic_write_text(OUT / "distributed_checkpoint.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
