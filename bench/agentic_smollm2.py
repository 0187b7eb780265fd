"""Every multi-turn method runs with SmolLM2 (issue 31: "every method and environment runs from the command line
on the CPU with the tiny model and with SmolLM2").

The presets are found, not listed: every algorithm preset and every paper preset whose composed config runs
``rollout.strategy=multi_turn`` (a paper preset whose algorithm, rollout and env nodes equal an algorithm
preset's is the same run and is left out). Each runs as its own ``rlbench`` command with SmolLM2-135M-Instruct,
one training step of ``--prompts`` prompts, turns cut to ``--turn-tokens`` policy tokens, and an evaluation after
training of ``--eval-problems`` problems x 2 samples, so what is measured is that the whole loop (episodes through
the environment, the update, the evaluation through the environment) runs, not how well it learns.

    HF_HUB_OFFLINE=1 python bench/agentic_smollm2.py --write

Prints a row per preset as it finishes (with an ETA); writes ``results/bench/agentic_smollm2.md`` and ``.json``
with ``--write``. A preset that fails is a row with its error's last line; the script exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def multi_turn_presets() -> list[tuple[str, str]]:
    """(group, option) of every algorithm and paper preset that runs multi-turn episodes, paper presets that
    repeat an algorithm preset's run left out."""
    sys.path.insert(0, str(ROOT))
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rlbench.listing import group_options

    def nodes(cfg) -> str:
        return json.dumps({key: OmegaConf.to_container(cfg[key], resolve=False) for key in ("algorithm", "rollout", "env")},
                          sort_keys=True, default=str)

    found, seen = [], set()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for group in ("algorithm", "paper"):
            for option in group_options()[group]:
                cfg = compose("config", overrides=[f"{group}={option}", "output_dir=/tmp/unused"])
                if cfg.rollout.strategy != "multi_turn":
                    continue
                key = nodes(cfg)
                if key not in seen:
                    seen.add(key)
                    found.append((group, option))
    return found


def run_preset(group: str, option: str, args: argparse.Namespace, out_dir: Path) -> dict:
    command = [sys.executable, "-m", "rlbench.cli", f"{group}={option}", f"model={args.model}", "trainer.steps=1",
               f"trainer.prompts_per_step={args.prompts}", f"env.turn_tokens={args.turn_tokens}",
               # rollout.max_new_tokens: a multi-turn episode's budgets are the env's; 256 only passes the guard of
               # the presets on math (a single-turn answer of 16 tokens is refused there)
               "rollout.max_new_tokens=256",
               "eval.before_training=false", f"eval.limit={args.eval_problems}", "eval.n=2", "eval.k=[1,2]",
               "logger=files", "trainer.save_model=false", f"seed={args.seed}", f"hydra.run.dir={out_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    row = {"preset": f"{group}={option}", "seconds": round(seconds, 1), "ok": proc.returncode == 0}
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        row["error"] = lines[-1][:300] if lines else f"exit {proc.returncode}"
        return row
    import yaml

    config = yaml.safe_load((out_dir / "config.yaml").read_text())
    step = json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])
    row.update({
        "env": config["env"]["name"],
        "algorithm": config["algorithm"]["name"],
        "episodes": int(step.get("generated_responses", 0)),
        "turns": round(float(step.get("multi_turn_turns", 0.0)), 2),
        "tool_calls": round(float(step.get("multi_turn_tool_calls", 0.0)), 2),
        "observation_share": round(float(step.get("multi_turn_observation_share", 0.0)), 3),
        "reward_mean": round(float(step.get("reward_mean", 0.0)), 3),
        "trained_tokens": int(step.get("trained_tokens", 0)),
    })
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts of the training step")
    parser.add_argument("--turn-tokens", type=int, default=32, help="policy tokens per turn (env.turn_tokens)")
    parser.add_argument("--eval-problems", type=int, default=2, help="problems of the evaluation after training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option (tiny: a quick check of the script)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run these presets only (group=option); with --write the other presets' rows of the "
                             "existing results/bench/agentic_smollm2.json are kept")
    parser.add_argument("--write", action="store_true", help="write results/bench/agentic_smollm2.{md,json}")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlbench.utils import atomic_write_json, atomic_write_text

    presets = every_preset = multi_turn_presets()
    if args.only:
        presets = [p for p in presets if f"{p[0]}={p[1]}" in args.only]
    print(f"{len(presets)} multi-turn presets: {' '.join(f'{g}={o}' for g, o in presets)}", flush=True)
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agentic_smollm2_") as tmp:
        for i, (group, option) in enumerate(presets, start=1):
            row = run_preset(group, option, args, Path(tmp) / f"{group}_{option}")
            rows.append(row)
            elapsed = time.perf_counter() - started
            eta = elapsed / i * (len(presets) - i)
            print(f"[{i}/{len(presets)}] {row['preset']}: {'ok' if row['ok'] else 'FAILED ' + row['error']} "
                  f"{row['seconds']} s (elapsed {elapsed / 60:.1f} min, ETA {eta / 60:.1f} min)", flush=True)
    written = ROOT / "results/bench/agentic_smollm2.json"
    if args.only and args.write and written.is_file():  # keep the earlier rows of the presets not run now
        ran = {r["preset"] for r in rows}
        kept = [r for r in json.loads(written.read_text())["rows"] if r["preset"] not in ran]
        order = [f"{g}={o}" for g, o in every_preset]
        rows = sorted(kept + rows, key=lambda r: order.index(r["preset"]) if r["preset"] in order else len(order))
    header = ("| preset | env | episodes | turns / episode | tool calls / episode | observation share | reward | "
              "trained tokens | wall s | |\n|---|---|---|---|---|---|---|---|---|---|\n")
    table = header + "".join(
        f"| `{r['preset']}` | {r.get('env', '')} | {r.get('episodes', '')} | {r.get('turns', '')} | {r.get('tool_calls', '')} | "
        f"{r.get('observation_share', '')} | {r.get('reward_mean', '')} | {r.get('trained_tokens', '')} | {r['seconds']} | "
        f"{'ok' if r['ok'] else 'failed: ' + r['error']} |\n" for r in rows)
    print(table)
    if args.write:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        settings = (f"model={args.model}, 1 training step of {args.prompts} prompts (each preset's group size), "
                    f"env.turn_tokens={args.turn_tokens}, evaluation after training on {args.eval_problems} problems "
                    f"x 2 samples, seed {args.seed}; {os.cpu_count()} CPU cores")
        atomic_write_text(ROOT / "results/bench/agentic_smollm2.md",
                          f"# Every multi-turn method with SmolLM2 ({stamp})\n\nWritten by `bench/agentic_smollm2.py "
                          f"--write`: {settings}. Wall seconds include loading the model and the evaluation, on a "
                          f"machine that may have been busy.\n\n{table}")
        atomic_write_json(written, {"written": stamp, "settings": settings, "rows": rows})
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
