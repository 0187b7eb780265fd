"""A run's status file, ``status.json``: whether the run finished or failed (with the error), and
the key of its configuration, so that a relaunched sweep skips the runs that finished.

    {"status": "running" | "finished" | "failed" | "interrupted", "config_key": "<sha1>", "error": "...", ...}

The config key is a hash of the resolved configuration without the keys that name where a run
writes (``output_dir``): two runs with the same key trained and evaluated the same thing. The
group key (the wandb ``group``) leaves out the seed as well, so the seeds of one configuration
share it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlbench.utils import atomic_write_json

STATUS_FILE = "status.json"
FINISHED, FAILED, RUNNING, INTERRUPTED = "finished", "failed", "running", "interrupted"
PLACE_KEYS = ("output_dir", "resume", "resume_allow")  # where a run writes and how it resumes, not what it does
SEED_KEYS = ("seed", "run_name")         # what differs between the seeds of one configuration


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra sweep (``rlbench -m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def command_line_overrides() -> list[str]:
    """The run's overrides as given on the command line (Hydra's ``overrides.task``)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def config_key(resolved: Mapping[str, Any], leave_out: Iterable[str] = PLACE_KEYS) -> str:
    """SHA-1 of the resolved config (JSON, sorted keys) without the top-level keys ``leave_out``."""
    kept = {key: value for key, value in resolved.items() if key not in set(leave_out) and key != "hydra"}
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def group_key(resolved: Mapping[str, Any]) -> str:
    """The config key without the seed (and the run name, which contains it)."""
    return config_key(resolved, (*PLACE_KEYS, *SEED_KEYS))


def write_status(out_dir: str | Path, status: str, key: str, **fields: Any) -> None:
    atomic_write_json(Path(out_dir) / STATUS_FILE, {"status": status, "config_key": key, **fields})


def read_status(out_dir: str | Path) -> dict[str, Any] | None:
    """The run's status record, or None when the folder has none (or an unreadable one)."""
    try:
        record = json.loads((Path(out_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def finished_runs(sweep_dirs: Iterable[str | Path]) -> dict[str, Path]:
    """config key -> run folder of every finished run directly below the given sweep folders."""
    found: dict[str, Path] = {}
    for sweep_dir in map(Path, sweep_dirs):
        for status_path in sorted(sweep_dir.glob(f"*/{STATUS_FILE}")):
            record = read_status(status_path.parent)
            if record and record.get("status") == FINISHED and record.get("config_key"):
                found[record["config_key"]] = status_path.parent
    return found
