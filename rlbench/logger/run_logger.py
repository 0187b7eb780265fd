"""Writes a run's results to its folder and mirrors them to wandb.

Files (all written atomically except the append-only metrics log):
    config.yaml        resolved configuration
    metrics.jsonl      one JSON object per training step (complete lines only)
    eval/passk.csv     benchmark, k, pass@k, 95% CI, maj@k, mean accuracy, n, problems, phase
    eval/problems.csv  phase, benchmark, uid, n, correct: per-problem counts (for paired comparisons)
    eval/samples.jsonl one line per sampled completion of the final evaluation
    summary.json       before/after pass@1 per benchmark, wall time, versions, git commit
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from rlbench.utils import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)


def wandb_mode(requested: str) -> str:
    """auto -> online when an API key is configured, else offline (never needs the network)."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class RunLogger:
    def __init__(self, out_dir: str | Path, config: Mapping[str, Any], config_yaml: str, logger_cfg: Mapping[str, Any]):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "eval").mkdir(exist_ok=True)
        atomic_write_text(self.out_dir / "config.yaml", config_yaml)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.metrics_path.write_text("")
        self.wandb_run = None
        if logger_cfg.get("name") == "wandb":
            mode = wandb_mode(str(logger_cfg.get("mode", "auto")))
            if mode != "disabled":
                import wandb

                self.wandb_run = wandb.init(
                    project=logger_cfg.get("project", "rlbench"),
                    entity=logger_cfg.get("entity"),
                    group=logger_cfg.get("group"),
                    tags=list(logger_cfg.get("tags") or []),
                    name=str(config.get("run_name", "run")),
                    config=dict(config),
                    dir=str(self.out_dir),
                    mode=mode,
                    reinit="finish_previous",
                )
                log.info("wandb run %s (%s mode)", self.wandb_run.id, mode)

    @property
    def wandb_dir(self) -> Path | None:
        return Path(self.wandb_run.dir).parent if self.wandb_run is not None else None

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def log_eval(
        self,
        rows: Sequence[Mapping[str, Any]],
        problems: Sequence[Mapping[str, Any]],
        samples: Sequence[Mapping[str, Any]],
        summary: Mapping[str, Any],
        step: int,
    ) -> None:
        table = pd.DataFrame(list(rows))
        atomic_write_text(self.out_dir / "eval" / "passk.csv", table.to_csv(index=False))
        problem_table = pd.DataFrame(list(problems), columns=["phase", "benchmark", "uid", "n", "correct"])
        atomic_write_text(self.out_dir / "eval" / "problems.csv", problem_table.to_csv(index=False))
        atomic_write_text(
            self.out_dir / "eval" / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples)
        )
        atomic_write_json(self.out_dir / "summary.json", summary)
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({"eval/passk": wandb.Table(dataframe=table)}, step=step)
            for row in rows:
                key = f"eval/{row['phase']}/{row['benchmark']}/pass@{row['k']}"
                self.wandb_run.summary[key] = row["pass_at_k"]
            for phase in ("before", "after"):
                for benchmark, value in (summary.get(f"pass_at_1_{phase}") or {}).items():
                    self.wandb_run.summary[f"pass@1/{phase}/{benchmark}"] = value

    def finish(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
