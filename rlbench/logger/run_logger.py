"""Writes a run's results to its folder and mirrors them to wandb.

Files (all written atomically except the append-only metrics log):
    config.yaml        resolved configuration
    metrics.jsonl      one JSON object per training step (complete lines only)
    eval/passk.csv     benchmark, k, pass@k, 95% CI, maj@k, mean accuracy, n, problems, phase
    eval/problems.csv  phase, benchmark, uid, n, correct: per-problem counts (for paired comparisons)
    eval/samples.jsonl one line per sampled completion of the final evaluation
    eval/curve.csv     every evaluation with its training step: before (0), every eval.every steps, after
    summary.json       before/after pass@1 per benchmark, wall time, versions, git commit
    status.json        running / finished / failed (rlbench/logger/run_status.py)

wandb (docs/running.md): ``group`` = the run identity without the seed and a hash of the configuration
without the seed, ``job_type`` = train or eval, tags ``mode:``, ``algorithm:``, ``model:``,
``dataset:``, ``benchmark:`` (rlbench/config/identity.py), ``rollout:``; step metrics under
``actor/``, ``rollout/``, ``reward/`` and ``timing/`` (:func:`wandb_key`; the local metrics.jsonl
keeps the bare names); every evaluation as ``eval/<benchmark>/pass@k`` and ``maj@k`` at its step,
so pass@k has a curve and its summary is the final value; in a sweep the run name gets a short hash
of the configuration and wandb prints nothing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from rlbench.config.identity import run_identity
from rlbench.config.schema import LoggerConfig, RolloutConfig
from rlbench.logger.run_status import config_key, group_key
from rlbench.utils import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

# Step metrics by wandb section (the rest, the update's statistics, go to actor/).
REWARD_METRICS = ("reward_", "outcome_", "accuracy", "advantage_", "format_rate", "grader_errors")
ROLLOUT_METRICS = ("rollout_", "response_length", "truncated_rate", "frac_zero_std_groups")
TIMING_METRICS = ("_s", "tokens_per_s")
CURVE_COLUMNS = ["step", "phase", "benchmark", "k", "pass_at_k", "ci_low", "ci_high", "maj_at_k"]


def wandb_key(metric: str) -> str:
    """The wandb key of a step metric: ``timing/generate_s``, ``reward/outcome_mean``,
    ``rollout/response_length``, ``actor/clip_fraction``."""
    if metric.endswith(TIMING_METRICS):
        return f"timing/{metric}"
    if metric.startswith(REWARD_METRICS):
        return f"reward/{metric}"
    if metric.startswith(ROLLOUT_METRICS):
        return f"rollout/{metric}"
    return f"actor/{metric}"


def eval_keys(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``eval/<benchmark>/pass@k`` and ``eval/<benchmark>/maj@k`` of an evaluation's table rows
    (maj@k left out where answers cannot vote: NaN)."""
    values = {}
    for row in rows:
        values[f"eval/{row['benchmark']}/pass@{row['k']}"] = row["pass_at_k"]
        if row.get("maj_at_k") == row.get("maj_at_k"):
            values[f"eval/{row['benchmark']}/maj@{row['k']}"] = row["maj_at_k"]
    return values


def wandb_tags(config: Mapping[str, Any]) -> list[str]:
    """The run identity's tags (rlbench/config/identity.py) and ``rollout:<strategy>``."""
    rollout = config.get("rollout") or {}
    default = RolloutConfig.strategy  # the schema's: a config without rollout.strategy samples iid
    strategy = rollout.get("strategy", default) if isinstance(rollout, Mapping) else default
    return [*run_identity(config).tags(), f"rollout:{strategy}"]


def wandb_group(config: Mapping[str, Any]) -> str:
    """``<the run identity's group>-<hash of the config without the seed>`` (e.g.
    ``grpo+aggregation.token_mean-smollm2_135m-arith-1a2b3c4d``, ``eval-ckpt_<run>-gsm8k-...``): the
    seeds of one configuration share it, any other difference separates them."""
    return f"{run_identity(config).group}-{group_key(config)[:8]}"


def wandb_run_name(config: Mapping[str, Any], in_sweep: bool) -> str:
    """``run_name``; in a sweep with a short hash of the configuration, since a sweep over a key the
    run name does not show would give its runs one name."""
    name = str(config.get("run_name", "run"))
    return f"{name}-{config_key(config)[:6]}" if in_sweep else name


def wandb_mode(requested: str) -> str:
    """auto -> online when an API key is configured, else offline (never needs the network)."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class RunLogger:
    """``resume_id``: a resumed run's wandb run id (its metrics.jsonl and curve come back with
    :meth:`load_state_dict`); None starts a new run and empties metrics.jsonl."""

    def __init__(self, out_dir: str | Path, config: Mapping[str, Any], config_yaml: str, logger: LoggerConfig,
                 *, job_type: str = "train", in_sweep: bool = False, resume_id: str | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "eval").mkdir(exist_ok=True)
        atomic_write_text(self.out_dir / "config.yaml", config_yaml)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []  # the step metrics so far (checkpoints keep them)
        self.curve: list[dict[str, Any]] = []
        if resume_id is None:
            self.metrics_path.write_text("")
        self.wandb_run = None
        if logger.name == "wandb":
            mode = wandb_mode(logger.mode)
            if mode != "disabled":
                import wandb

                options = dict(
                    project=logger.project,
                    entity=logger.entity,
                    group=logger.group or wandb_group(config),
                    job_type=job_type,
                    tags=[*logger.tags, *wandb_tags(config)],
                    name=wandb_run_name(config, in_sweep),
                    config=dict(config),
                    dir=str(self.out_dir),
                    mode=mode,
                    reinit="finish_previous",
                    settings=wandb.Settings(silent=True) if in_sweep else None,  # no footer per sweep job
                )
                resumed = {"id": resume_id, "resume": "allow"} if resume_id else {}
                self.wandb_run = wandb.init(**options, **resumed)
                log.info("wandb run %s (%s mode)", self.wandb_run.id, mode)

    @property
    def wandb_dir(self) -> Path | None:
        return Path(self.wandb_run.dir).parent if self.wandb_run is not None else None

    @property
    def run_id(self) -> str | None:
        """The wandb run's id (a resumed run continues it), None without wandb."""
        return self.wandb_run.id if self.wandb_run is not None else None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "metrics": list(self.records), "curve": list(self.curve)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A resumed run: metrics.jsonl and eval/curve.csv as they were at the checkpoint (the lines a
        killed process wrote after it are dropped; those steps run again)."""
        self.records, self.curve = list(state["metrics"]), list(state["curve"])
        atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._write_curve()

    def _write_curve(self) -> None:
        atomic_write_text(self.out_dir / "eval" / "curve.csv",
                          pd.DataFrame(self.curve, columns=CURVE_COLUMNS).to_csv(index=False))

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **metrics}
        self.records.append(record)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({wandb_key(k): v for k, v in metrics.items()}, step=step)

    def log_evaluation(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """One evaluation at a training step (0: before training): appended to eval/curve.csv and
        logged to wandb as eval/<benchmark>/pass@k and maj@k at that step."""
        self.curve += [{"step": step, **{c: row.get(c) for c in CURVE_COLUMNS[1:]}} for row in rows]
        self._write_curve()
        if self.wandb_run is not None:
            self.wandb_run.log(eval_keys(rows), step=step)

    def log_tables(self, rows: Sequence[Mapping[str, Any]], problems: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        """eval/passk.csv and eval/problems.csv with the evaluations so far (written when each ends)."""
        table = pd.DataFrame(list(rows))
        atomic_write_text(self.out_dir / "eval" / "passk.csv", table.to_csv(index=False))
        problem_table = pd.DataFrame(list(problems), columns=["phase", "benchmark", "uid", "n", "correct"])
        atomic_write_text(self.out_dir / "eval" / "problems.csv", problem_table.to_csv(index=False))
        return table

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """summary.json (also written for an interrupted or failed run, with its status and exit code)."""
        atomic_write_json(self.out_dir / "summary.json", summary)

    def log_eval(
        self,
        rows: Sequence[Mapping[str, Any]],
        problems: Sequence[Mapping[str, Any]],
        samples: Sequence[Mapping[str, Any]],
        summary: Mapping[str, Any],
        step: int,
    ) -> None:
        table = self.log_tables(rows, problems)
        atomic_write_text(
            self.out_dir / "eval" / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples)
        )
        self.log_summary(summary)
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({"eval/passk": wandb.Table(dataframe=table)}, step=step)

    def finish(self, exit_code: int = 0) -> None:
        """Close the wandb run; a non-zero ``exit_code`` marks it failed (interrupted: 130, 143)."""
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None


class SilentLogger:
    """The logger of ranks other than 0 under trainer.parallelism=ddp|fsdp: only rank 0 writes result
    files and logs to wandb; the other ranks call the same methods, which do nothing."""

    run_id = None

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def log_evaluation(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        pass

    def log_tables(self, rows: Sequence[Mapping[str, Any]], problems: Sequence[Mapping[str, Any]]) -> None:
        pass

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        pass

    def log_eval(self, *args: Any, **kwargs: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass
