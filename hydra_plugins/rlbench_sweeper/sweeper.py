"""A sweep that finishes: Hydra's basic sweeper (the cartesian product of ``key=a,b`` overrides,
any launcher) with three additions.

1. Every point is composed and validated (``rlbench.validation.validate_config``, no model loaded)
   before the first one starts; the invalid points are listed at once and left out.
2. A point whose configuration already finished where this sweep was launched before is skipped
   (``hydra.sweeper.skip_done``): in this sweep folder (a relaunch with the same ``hydra.sweep.dir``)
   or in the earlier sweep folders named by ``hydra.sweeper.skip_finished_in``; no other folder is
   read. A skipped run that finished elsewhere gets a link ``<job>_<name>`` in this sweep folder, so
   the folder holds every point's result (``rlbench-compare <sweep folder>`` sees them all). Failed
   points run again.
3. A failing run does not stop the sweep (rlbench/cli.py records it in the run's ``status.json``);
   at the end the sweep writes ``sweep_status.csv`` (one row per point: job, status, overrides,
   folder, error), prints the points that did not finish, and exits with status 1 if there are any.
"""

import copy
import csv
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

# rlbench is imported inside the methods: Hydra imports every plugin module when it starts, also for
# commands that never sweep, and rlbench.validation imports torch.
SWEEP_STATUS_FILE = "sweep_status.csv"
INVALID, SKIPPED = "invalid", "skipped"
SWEEP_CONFIG_FILE = "multirun.yaml"  # Hydra's record of a sweep, in every sweep folder


@dataclass
class Point:
    """One point of the sweep: its overrides and what became of it."""

    overrides: list[str]
    status: str = ""
    error: str = ""
    output_dir: str = ""
    job: Optional[int] = None


def next_job_number(sweep_dir: Path) -> int:
    """1 + the largest job number among the sweep folder's run folders (``<num>_<run_name>``), else
    0, so that a relaunch into the same folder never reuses a finished run's folder."""
    numbers = [int(m.group(1)) for p in sweep_dir.iterdir() if p.is_dir() and (m := re.match(r"(\d+)_", p.name))]
    return max(numbers, default=-1) + 1


def earlier_sweep_folders(folders: list | None) -> list[Path]:
    """The folders of ``hydra.sweeper.skip_finished_in``, each checked to be a sweep folder (it holds
    Hydra's ``multirun.yaml``), so a typo or an unrelated folder is refused before any point runs."""
    found = []
    for folder in map(Path, folders or []):
        if not (folder / SWEEP_CONFIG_FILE).is_file():
            raise ValueError(f"hydra.sweeper.skip_finished_in: {folder} is not a sweep folder (no {SWEEP_CONFIG_FILE}); "
                             "name the hydra.sweep.dir of an earlier launch of this sweep")
        found.append(folder)
    return found


def link_run(sweep_dir: Path, job: int, run_dir: Path) -> Path:
    """A relative link ``<job>_<run name>`` in ``sweep_dir`` to a run that finished in another sweep
    folder (to the run itself when ``run_dir`` is a link already)."""
    target = run_dir.resolve()
    link = sweep_dir / f"{job}_{re.sub(r'^[0-9]+_', '', run_dir.name)}"
    link.symlink_to(os.path.relpath(target, sweep_dir.resolve()), target_is_directory=True)
    return link


class RlbenchSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[dict] = None, skip_done: bool = True,
                 skip_finished_in: list | None = None):
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.skip_done = skip_done
        self.skip_finished_in = list(skip_finished_in or [])

    def sweep(self, arguments: list[str]) -> Any:
        from rlbench.logger.run_status import FINISHED, finished_runs, read_status

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        points = [Point(list(p)) for p in self.split_arguments(overrides, None)[0]]
        sweep_dir = Path(self.config.hydra.sweep.dir)
        earlier = earlier_sweep_folders(self.skip_finished_in) if self.skip_done else []
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / SWEEP_CONFIG_FILE)

        # the earlier launches first, so a run that finished in this folder is the one kept
        finished = finished_runs([*earlier, sweep_dir]) if self.skip_done else {}
        for point in points:
            key, error = self.check_point(point.overrides)
            if error:
                point.status, point.error = INVALID, error
            elif key in finished:
                point.status, point.output_dir = SKIPPED, str(finished[key])
        self.report_plan(points)

        first_job = next_job_number(sweep_dir)
        for point in points:
            if point.status == SKIPPED and Path(point.output_dir).parent.resolve() != sweep_dir.resolve():
                point.job, first_job = first_job, first_job + 1
                link_run(sweep_dir, point.job, Path(point.output_dir))
        to_run = [p for p in points if not p.status]
        returns = []
        batch_size = self.max_batch_size or len(to_run) or 1
        for start in range(0, len(to_run), batch_size):
            batch = to_run[start:start + batch_size]
            results = self.launcher.launch([p.overrides for p in batch], initial_job_idx=first_job + start)
            for offset, (point, result) in enumerate(zip(batch, results)):
                point.job = first_job + start + offset
                point.output_dir = str(result.hydra_cfg.hydra.runtime.output_dir) if result.hydra_cfg else ""
                record = read_status(point.output_dir) if point.output_dir else None
                point.status = (record or {}).get("status", "failed")
                if point.status != FINISHED:
                    point.error = (record or {}).get("error") or repr(getattr(result, "_return_value", ""))
            returns.append(results)
        self.report_end(points, sweep_dir)
        return returns

    def check_point(self, overrides: list[str]) -> tuple[str, str]:
        """(the point's config key, "") or ("", the message of the error that refuses it)."""
        from rlbench.validation import validate_config
        from rlbench.errors import error_message
        from rlbench.logger.run_status import config_key

        try:
            sweep_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(sweep_cfg):
                sweep_cfg.hydra.job.num = 0
                sweep_cfg.hydra.job.id = "validation"
                sweep_cfg.hydra.runtime.output_dir = str(Path(self.config.hydra.sweep.dir) / "validation")
            HydraConfig.instance().set_config(sweep_cfg)
            task_cfg = copy.deepcopy(sweep_cfg)
            with open_dict(task_cfg):
                del task_cfg["hydra"]
            resolved = OmegaConf.to_container(task_cfg, resolve=True)
            validate_config(task_cfg)
        except Exception as err:  # noqa: BLE001 - any refusal makes the point invalid, with its message
            from rlbench.cli import explain_override_error

            def compose(others: list[str]) -> Any:
                return self.hydra_context.config_loader.load_sweep_config(self.config, others)

            explained = explain_override_error(overrides, compose) if "Could not" in str(err) else None
            message = explained or error_message(err).split("Config search path:")[0]  # Hydra appends its search path
            return "", " ".join(message.split())  # one line (Hydra lists a group's options one per line)
        return config_key(resolved), ""

    def report_plan(self, points: list[Point]) -> None:
        invalid = [p for p in points if p.status == INVALID]
        skipped = [p for p in points if p.status == SKIPPED]
        print(f"sweep: {len(points)} points: {len(points) - len(invalid) - len(skipped)} to run, "
              f"{len(invalid)} invalid, {len(skipped)} already finished", file=sys.stderr)
        for point in invalid:
            print(f"  invalid: {' '.join(point.overrides)}\n    {point.error}", file=sys.stderr)
        for point in skipped:
            print(f"  skipped (finished in {point.output_dir}): {' '.join(point.overrides)}", file=sys.stderr)

    def report_end(self, points: list[Point], sweep_dir: Path) -> None:
        from rlbench.logger.run_status import FINISHED
        from rlbench.utils import atomic_write_text

        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["job", "status", "overrides", "output_dir", "error"])
        for point in points:
            writer.writerow(["" if point.job is None else point.job, point.status, " ".join(point.overrides),
                             point.output_dir, point.error])
        atomic_write_text(sweep_dir / SWEEP_STATUS_FILE, buffer.getvalue())
        bad = [p for p in points if p.status not in (FINISHED, SKIPPED)]
        done = sum(p.status == FINISHED for p in points)
        print(f"sweep: {done} finished, {sum(p.status == SKIPPED for p in points)} skipped (finished before), "
              f"{len(bad)} not finished; {sweep_dir / SWEEP_STATUS_FILE}", file=sys.stderr)
        for point in bad:
            print(f"  {point.status}: {' '.join(point.overrides)}\n    {point.error}", file=sys.stderr)
        if bad:
            sys.exit(1)
