"""Run discovery: find run folders, read their files (config, per-problem counts, pass@k, metrics),
select and group them by config keys, and check that they scored the same problems."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

from rlbench.config.identity import run_identity
from rlbench.errors import ConfigError, DataError
from rlbench.logger.run_status import FINISHED, read_status

log = logging.getLogger(__name__)


@dataclass
class Run:
    """One run folder: its resolved config, per-problem counts, pass@k table and step metrics."""

    path: Path
    config: dict
    problems: pd.DataFrame  # phase, benchmark, uid, n, correct
    passk: pd.DataFrame     # phase, benchmark, k, pass_at_k, ...
    metrics: pd.DataFrame   # one row per training step (may be empty)

    @property
    def name(self) -> str:
        return str(self.path)


def folders_holding(root: Path, relative: Path) -> set[Path]:
    """The real paths of ``root`` and every folder below it that hold ``relative``, following links
    to folders (a sweep folder links the runs it skipped because they finished in an earlier
    launch, hydra_plugins/rlbench_sweeper); each real folder is visited once, so a link cycle ends."""
    found, seen = set(), set()
    for folder, subfolders, _ in os.walk(root, followlinks=True):
        real = Path(folder).resolve()
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        if (real / relative).is_file():
            found.add(real)
    return found


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Every folder at or below ``paths`` that holds ``eval/problems.csv``, sorted, without repeats;
    a run whose status.json says it did not finish (interrupted, failed, or killed while running:
    its files hold the evaluation before training only) is left out with a warning."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if not path.exists():
            raise DataError(f"{path} does not exist; pass run folders or folders that contain them")
        found.update(folders_holding(path, Path("eval") / "problems.csv"))
    unfinished = {run for run in found if (read_status(run) or {}).get("status", FINISHED) != FINISHED}
    for run in sorted(unfinished):
        log.warning("%s is left out: its run did not finish (status.json: %s; resume it: rlbench resume=%s)",
                    run, read_status(run)["status"], run)
    return sorted(found - unfinished)


def _read_csv(path: Path, required: Sequence[str]) -> pd.DataFrame:
    if not path.is_file():
        raise DataError(f"{path} is missing; is this a complete rlbench run folder?")
    try:
        frame = pd.read_csv(path, dtype={"uid": str, "benchmark": str, "phase": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DataError(f"{path} cannot be read as CSV: {err}") from err
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise DataError(f"{path} lacks the columns {missing}; it was not written by this rlbench version")
    return frame


def _read_metrics(path: Path) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame()
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError as err:
                raise DataError(f"{path}:{number} is not valid JSON: {err}") from err
    return pd.DataFrame(records)


def load_run(path: str | Path) -> Run:
    """Read a run folder written by :mod:`rlbench.runner`."""
    path = Path(path)
    config_path = path / "config.yaml"
    if not config_path.is_file():
        raise DataError(f"{config_path} is missing; every run folder holds its resolved config.yaml")
    config = OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)
    if not isinstance(config, dict):
        raise DataError(f"{config_path} is not a mapping")
    problems = _read_csv(path / "eval" / "problems.csv", ["phase", "benchmark", "uid", "n", "correct"])
    passk = _read_csv(path / "eval" / "passk.csv", ["phase", "benchmark", "k", "pass_at_k"])
    return Run(path, config, problems, passk, _read_metrics(path / "metrics.jsonl"))


def config_value(config: Mapping[str, Any], key: str) -> Any:
    """The value at dotted ``key``; a node with a ``name`` (e.g. ``algorithm``) stands for its name.

    Raises KeyError when a part of the key is missing, ValueError for a node without a name.
    """
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    if isinstance(node, Mapping):
        if "name" not in node:
            raise ValueError(f"{key} is a config node without a 'name'; name one of its keys, e.g. {key}.<key>")
        return node["name"]
    return node


def format_value(value: Any) -> str:
    """A config value as it is written on the command line: true/false, null, 0.28, grpo."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


EVAL_ONLY = "eval-only"


def run_key(run: Run, key: str) -> str:
    """:func:`config_value` of a run as text, with errors that name the run and the key. For an
    evaluation-only run (``mode=eval``) every ``algorithm`` key reads ``eval-only``: nothing was
    trained, so the composed algorithm is not what distinguishes it. ``algorithm`` itself reads as
    the run identity's label: ``grpo``, or ``grpo+aggregation.token_mean`` when a piece was swapped."""
    if str(run.config.get("mode", "train")) == "eval" and key.split(".")[0] == "algorithm":
        return EVAL_ONLY
    if key == "algorithm":  # the preset with the pieces swapped in it (rlbench/config/identity.py)
        return run_identity(run.config).algorithm or EVAL_ONLY
    try:
        return format_value(config_value(run.config, key))
    except KeyError:
        raise ConfigError(
            f"key {key!r} is not in {run.path / 'config.yaml'}; use a dotted key of the resolved config "
            f"(top-level keys: {', '.join(sorted(run.config))})"
        ) from None
    except ValueError as err:
        raise ConfigError(f"{err} (in {run.path / 'config.yaml'})") from None


def parse_filters(filters: Sequence[str]) -> list[tuple[str, set[str]]]:
    """``key=value`` (or ``key=a,b``: either value) strings -> (key, accepted values)."""
    parsed = []
    for item in filters:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"--filter {item!r}: write key=value, e.g. --filter model=tiny or dataset.name=arith")
        parsed.append((key.strip(), {v.strip() for v in value.split(",")}))
    return parsed


def select_runs(runs: Sequence[Run], filters: Sequence[str]) -> list[Run]:
    """The runs whose config matches every filter (see :func:`parse_filters`)."""
    parsed = parse_filters(filters)
    return [run for run in runs if all(run_key(run, key) in accepted for key, accepted in parsed)]


def group_runs(runs: Sequence[Run], by: Sequence[str]) -> dict[str, list[Run]]:
    """Runs grouped by the values of the ``by`` keys, joined with '/' (e.g. ``grpo`` or ``grpo/tiny``),
    the groups in :func:`natural_key` order (numeric labels by value: 0.2, 0.24, 0.28, 0.32)."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        label = "/".join(run_key(run, key) for key in by)
        groups.setdefault(label, []).append(run)
    return {label: groups[label] for label in sorted(groups, key=natural_key)}


def natural_key(label: str) -> tuple:
    """Sort key that orders numeric labels by value (0.2 before 0.28 before 1e-3 as numbers) and before
    the other labels, which sort as text."""
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = format_value(value)
    return flat


RUN_SPECIFIC_KEYS = {"seed", "run_name", "output_dir"}


def group_warnings(groups: Mapping[str, Sequence[Run]]) -> list[str]:
    """Warnings about groups that mix settings (config keys other than the seed that differ between
    their runs) or repeat a seed (the same run twice would count as two seeds)."""
    warnings = []
    for label, runs in groups.items():
        flat = [_flatten(run.config) for run in runs]
        keys = sorted(set().union(*flat) - RUN_SPECIFIC_KEYS)
        differing = [k for k in keys if len({f.get(k) for f in flat}) > 1]
        if differing:
            shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
            warnings.append(
                f"group {label!r} mixes runs whose configs differ in {shown}; add the key to --by or --filter"
            )
        seeds = [f.get("seed") for f in flat]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1}, key=str)
        if repeated:
            warnings.append(f"group {label!r} holds several runs with seed {', '.join(map(str, repeated))}")
    return warnings


def effective_phase(run: Run, phase: str) -> str:
    """``phase``, except that an evaluation-only run (``mode=eval``) has one phase, ``eval``, which
    stands in for ``before`` and ``after``, so a base model or a checkpoint can be the baseline of
    trained runs."""
    phases = set(run.problems["phase"].unique())
    if phase in ("before", "after") and phase not in phases and phases == {"eval"}:
        return "eval"
    return phase


def phase_problems(run: Run, phase: str) -> pd.DataFrame:
    """The run's problems.csv rows of ``phase`` (:func:`effective_phase`); a clear error when the
    phase is absent."""
    phase = effective_phase(run, phase)
    rows = run.problems[run.problems["phase"] == phase]
    if rows.empty:
        available = ", ".join(sorted(run.problems["phase"].unique())) or "none"
        raise DataError(f"run {run.name} has no '{phase}' evaluation (it has: {available}); choose --phase")
    duplicated = rows[rows.duplicated(["benchmark", "uid"], keep=False)]
    if not duplicated.empty:
        first = duplicated.iloc[0]
        raise DataError(f"{run.path / 'eval' / 'problems.csv'}: problem {first['uid']!r} of {first['benchmark']} "
                        f"appears more than once in phase {phase}")
    return rows


def shared_problem_sets(runs: Sequence[Run], phase: str) -> dict[str, list[str]]:
    """benchmark -> its problem uids (sorted), checked to be identical in every run.

    Pairing problems across runs is only possible when all runs scored the same problems, so any
    disagreement (a benchmark missing in a run, or a different set of problems) is a DataError that
    names the two runs and the problems that differ.
    """
    reference = runs[0]
    reference_sets = {
        bench: set(rows["uid"]) for bench, rows in phase_problems(reference, phase).groupby("benchmark", sort=False)
    }
    for run in runs[1:]:
        sets = {bench: set(rows["uid"]) for bench, rows in phase_problems(run, phase).groupby("benchmark", sort=False)}
        if set(sets) != set(reference_sets):
            raise DataError(
                f"runs evaluate different benchmarks, so they cannot be compared: {reference.name} has "
                f"{sorted(reference_sets)}, {run.name} has {sorted(sets)}; select comparable runs with --filter"
            )
        for bench, uids in sets.items():
            if uids != reference_sets[bench]:
                only_here = sorted(uids - reference_sets[bench])
                only_there = sorted(reference_sets[bench] - uids)
                raise DataError(
                    f"runs scored different {bench} problems, so pairing is impossible: {run.name} has "
                    f"{len(only_here)} problems that {reference.name} lacks (e.g. {only_here[:3]}) and lacks "
                    f"{len(only_there)} that it has (e.g. {only_there[:3]}); check eval.limit and the benchmark data"
                )
    return {bench: sorted(uids, key=natural_key) for bench, uids in reference_sets.items()}
