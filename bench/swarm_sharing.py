"""SAPO's swarm on the toy task: 2 actors sharing rollouts (trainer.swarm.external=J) against the same 2
actors training alone (J = 0), a few seeds; writes results/bench/swarm.md and swarm.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/swarm_sharing.py                 # seeds 0 1 2, J = 0 and 2
    OMP_NUM_THREADS=1 .venv/bin/python bench/swarm_sharing.py --seeds 0 --external 0 2

Each run is ``torchrun --nproc_per_node 2 -m rlbench.cli experiment=toy_learning/grpo trainer.parallelism=swarm
trainer.swarm.external=J`` (4 prompts per step: I = 4 - J own groups, J shared ones). The reward of an
actor's OWN samples at each step (``swarm_local_reward_mean``; ``outcome_mean`` when J = 0) is what the
policy learned: the paper's cumulative reward (arXiv:2509.08721, section 5) is its sum over steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "bench"
ACTORS = 2


def own_rewards(folder: Path) -> list[float]:
    """Per step: the mean reward of the actor's own samples."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row.get("swarm_local_reward_mean", row["outcome_mean"]) for row in rows]


def swarm_run(seed: int, external: int, scratch: Path, steps: int) -> list[list[float]]:
    """Each actor's own-sample reward per step."""
    out = scratch / f"s{seed}-j{external}"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(ACTORS), "-m", "rlbench.cli",
         "experiment=toy_learning/grpo", f"seed={seed}", f"trainer.steps={steps}", "trainer.parallelism=swarm",
         f"trainer.swarm.external={external}", f"hydra.run.dir={out}"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    )
    return [own_rewards(out / f"actor{a}") for a in range(ACTORS)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--external", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for external in args.external:
                results[f"s{seed}-j{external}"] = swarm_run(seed, external, Path(scratch), args.steps)
                print(seed, external, [round(sum(r), 3) for r in results[f"s{seed}-j{external}"]], flush=True)
    from rlbench.utils import atomic_write_json, atomic_write_text

    atomic_write_json(OUT / "swarm.json", {"steps": args.steps, "actors": ACTORS, "runs": results})
    lines = [
        "# SAPO swarm on the toy task: 2 actors sharing rollouts vs training alone",
        "",
        f"`python bench/swarm_sharing.py` (experiment=toy_learning/grpo, {args.steps} steps, 4 prompts x 8 responses "
        "per step, I = 4 - J own groups + J shared). Reward of each actor's OWN samples; cumulative = summed "
        "over steps (the paper's measure), last-4 = mean of the last 4 steps. Actor 1 runs seed + 7919.",
        "",
        "| seed | J | actor | cumulative own reward | first step | last-4 mean |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, actors in results.items():
        seed, external = key[1:].split("-j")
        for a, rewards in enumerate(actors):
            lines.append(f"| {seed} | {external} | {a} | {sum(rewards):.3f} | {rewards[0]:.3f} | "
                         f"{sum(rewards[-4:]) / len(rewards[-4:]):.3f} |")
    lines += ["", "| J | mean cumulative own reward (over seeds and actors) | mean last-4 |", "| --- | --- | --- |"]
    for external in args.external:
        runs = [r for key, actors in results.items() if key.endswith(f"-j{external}") for r in actors]
        cumulative = sum(sum(r) for r in runs) / len(runs)
        last = sum(sum(r[-4:]) / len(r[-4:]) for r in runs) / len(runs)
        lines.append(f"| {external} | {cumulative:.3f} | {last:.3f} |")
    atomic_write_text(OUT / "swarm.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
