"""Checkpoints of a training run and what resuming needs: save, find the latest valid one, load,
and check that a resumed run has the configuration it was saved with.

A run folder's checkpoints (``trainer.checkpoint_every``; docs/resume.md, docs/scaling.md):

    <run>/checkpoints/step_000004/
        model.pt        the policy's weights           (model_state / load_model_state)
        optimizer.pt    the optimizer's state          (optimizer.state_dict())
        state.pt        everything else: step, lr schedule, random streams, prompt order, adaptive
                        coefficients, advantage-input trackers and caches, update state, strategy
                        state, the logger's run id and the metrics so far (rlbench.training.loop)
        state.rank1.pt  ... the same for rank 1, 2, ... of a ddp / fsdp run (its own random streams)
        sharded/        fsdp instead of model.pt and optimizer.pt: every rank's shards of both
                        (torch.distributed.checkpoint, one file per rank; save_sharded / load_sharded)
        manifest.json   step, every file's size, strategy and world size, config key and resolved
                        config, overrides, rlbench commit, each rank's write seconds

A checkpoint is written into a hidden temporary folder next to the others (every file fsynced),
which is renamed onto ``step_<N>`` only when complete, so a process killed while writing leaves the
previous checkpoints valid (the leftover ``.step_<N>.tmp-<hex>`` is removed by the next save). With
several ranks, rank 0 makes the temporary folder, every rank writes its files into it, and rank 0
writes the manifest and renames the folder only after every rank has finished. A checkpoint is
valid when its manifest reads and every file it lists has the size it records;
:func:`latest_checkpoint` falls back to the previous valid one and says why (and a resumed run
whose checkpoint file cannot be loaded does the same: rlbench.training.loop.TrainingRun.resume).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from rlbench import faults
from rlbench.errors import ConfigError
from rlbench.training.distributed import SINGLE, World, reshard, unwrap
from rlbench.utils import atomic_write_json, temporary_sibling

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.pt", "optimizer.pt", "state.pt"
SHARDED_DIR = "sharded"  # fsdp: the model's and the optimizer's shards (torch.distributed.checkpoint)
FORMAT = 1
# Top-level config keys that say how to resume, not what the run does: never compared. run_name is a
# label derived from the rest (rlbench/config/identity.py): a run named by an earlier rule still resumes.
RESUME_KEYS = ("resume", "resume_allow", "resume_evaluate_again", "output_dir", "hydra", "run_name")


class CheckpointError(ConfigError):
    """No usable checkpoint (missing, incomplete or unreadable); the message names the folder."""


# ------------------------------------------------------------------------------ model and optimizer state


def state_file(rank: int) -> str:
    """The file of a rank's own state: ``state.pt`` for rank 0 (and a single process), ``state.rank<r>.pt``."""
    return STATE_FILE if rank == 0 else f"state.rank{rank}.pt"


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights to save: the ``state_dict`` of the model (inside a DDP wrapper)."""
    return unwrap(model).state_dict()


def load_model_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    unwrap(model).load_state_dict(state, strict=True)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return optimizer.state_dict()


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    optimizer.load_state_dict(state)


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """FSDP: every rank writes its shards of the model and the optimizer state into
    ``folder/sharded`` (torch.distributed.checkpoint: one file per rank, rank 0 adds the metadata);
    collective, every rank calls it. No rank ever holds the whole state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    reshard(model)  # the registered parameters are the shards again after a generation
    model_sd, optimizer_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optimizer_sd}, checkpoint_id=folder / SHARDED_DIR)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load :func:`save_sharded`'s files into every rank's shards (the same world size; collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reshard(model)
    model_sd, optimizer_sd = get_state_dict(model, optimizer)  # the layout to read into
    state = {"model": model_sd, "optimizer": optimizer_sd}
    try:
        dcp.load(state, checkpoint_id=folder / SHARDED_DIR)
    except Exception as err:
        raise CheckpointError(f"checkpoint {folder}: {SHARDED_DIR}/ cannot be read ({type(err).__name__}: {err})") from err
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def check_resume_world(saved: "Checkpoint", parallelism: str, world_size: int) -> None:
    """A checkpoint continues on the parallelism (trainer.parallelism) and the number of processes that wrote it: each rank
    resumes its own random streams (and, under fsdp, its own shards)."""
    written = (saved.manifest.get("parallelism", saved.manifest.get("parallelism", "single")), int(saved.manifest.get("world_size", 1)))
    if written != (parallelism, world_size):
        raise ConfigError(
            f"resume: checkpoint {saved.path} was written with trainer.parallelism={written[0]} by {written[1]} "
            f"process(es), but this run has trainer.parallelism={parallelism} and {world_size} process(es); resume "
            f"with the same trainer.parallelism and world size (torchrun --nproc_per_node {written[1]} for ddp / fsdp)"
        )


# ------------------------------------------------------------------------------ random streams


def global_random_state() -> dict[str, Any]:
    """The global random generators: Python's, NumPy's legacy one, torch's CPU (and CUDA) ones."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def load_global_random_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def generator_state(generator: torch.Generator | None) -> torch.Tensor | None:
    return None if generator is None else generator.get_state()


def load_generator_state(generator: torch.Generator | None, state: torch.Tensor | None) -> None:
    if generator is not None and state is not None:
        generator.set_state(state)


# ------------------------------------------------------------------------------ the config


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def comparable_config(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config without :data:`RESUME_KEYS`."""
    return {key: value for key, value in resolved.items() if key not in RESUME_KEYS}


def changed_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (saved value, current value) for every key that differs (missing: None)."""
    old, new = flatten(comparable_config(saved)), flatten(comparable_config(current))
    return {key: (old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}


def is_allowed(key: str, allowed: Iterable[str]) -> bool:
    """``key`` is listed in ``resume_allow`` or lies below a listed node (``eval`` allows ``eval.n``)."""
    return any(key == a or key.startswith(a + ".") for a in allowed)


def check_resume_config(saved: Mapping[str, Any], current: Mapping[str, Any], allowed: Iterable[str],
                        checkpoint: Path) -> dict[str, tuple[Any, Any]]:
    """The changed keys ``resume_allow`` permits; ConfigError listing the others. ``trainer.steps``
    may grow (listed in ``resume_allow``) but not fall below the checkpoint's step."""
    allowed = list(allowed)
    changes = changed_keys(saved, current)
    refused = {k: v for k, v in changes.items() if not is_allowed(k, allowed)}
    if refused:
        listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise ConfigError(
            f"resume: the configuration differs from the one checkpoint {checkpoint} was saved with: {listing}. "
            f"Resume with the same configuration, or allow the change: "
            f"resume_allow=[{','.join(refused)}] (a resumed run is then no longer the uninterrupted run)"
        )
    return changes


# ------------------------------------------------------------------------------ files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> int:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint folders (complete or not, temporary ones left out), oldest step first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def load(self, name: str, map_location: str | torch.device = "cpu") -> Any:
        """One file of the checkpoint; CheckpointError naming it when it cannot be read."""
        try:
            return torch.load(self.path / name, map_location=map_location, weights_only=True)
        except Exception as err:
            raise CheckpointError(f"checkpoint {self.path}: {name} cannot be read ({type(err).__name__}: {err})") from err


def _file_sizes(folder: Path) -> dict[str, int]:
    """Every file below ``folder`` (relative path -> bytes), after fsyncing the subfolders."""
    for sub in (p for p in folder.rglob("*") if p.is_dir()):
        _fsync_dir(sub)
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def save_checkpoint(run_dir: str | Path, step: int, files: Mapping[str, Any], manifest: Mapping[str, Any],
                    keep: int | None = None, world: World = SINGLE,
                    write_shards: Callable[[Path], None] | None = None) -> Checkpoint:
    """Write ``files`` (name -> object for torch.save) and the manifest as checkpoint ``step`` of the
    run, atomically; keep only the last ``keep`` checkpoints (None: all). Returns it. With several
    ranks every rank calls it with its own ``files`` (and ``write_shards(folder)``, a collective
    writer such as :func:`save_sharded`); the checkpoint appears when every rank is done."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    target = root / checkpoint_name(step)
    tmp = None
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".step_*.tmp-*"):  # a writer killed earlier
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = temporary_sibling(target)
        tmp.mkdir()
    tmp = Path(world.broadcast(str(tmp) if tmp else None))
    try:
        started = time.perf_counter()
        for name, obj in files.items():
            _save_file(obj, tmp / name)
            faults.kill_point("checkpoint")  # fault injection: killed with the checkpoint half written
        if write_shards is not None:
            write_shards(tmp)
            faults.kill_point("checkpoint")
        seconds = world.gather([time.perf_counter() - started])  # every rank has written its files
        record = None
        if world.is_main:
            record = {**manifest, "format": FORMAT, "step": int(step), "files": _file_sizes(tmp),
                      "parallelism": world.parallelism, "world_size": world.size,
                      "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "write_seconds": max(seconds),
                      "rank_write_seconds": seconds}
            atomic_write_json(tmp / MANIFEST, record)
            _fsync_dir(tmp)
            if target.exists():  # the same step saved again (an interrupted run resumed and stopped at once)
                shutil.rmtree(target)
            os.rename(tmp, target)
            _fsync_dir(root)
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    record = world.broadcast(record)  # returns on every rank once the checkpoint is in place
    if keep is not None and world.is_main:
        for old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return Checkpoint(target, record)


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in ``path``; CheckpointError saying what is wrong when it is not valid."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} has no readable {MANIFEST} ({type(err).__name__})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a format-{FORMAT} manifest")
    for name, size in manifest["files"].items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            raise CheckpointError(f"checkpoint {path}: {name} has {actual} bytes, the manifest says {size}")
    return Checkpoint(path, manifest)


def latest_checkpoint(run_dir: str | Path, before_step: int | None = None) -> Checkpoint:
    """The newest valid checkpoint of the run (older than ``before_step`` when given); an invalid
    newer one is skipped with a warning saying why. CheckpointError when the folder has none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"resume: {run_dir} is not a folder")
    problems = []
    for path in reversed(checkpoint_dirs(run_dir)):
        if before_step is not None and int(path.name[5:]) >= before_step:
            continue
        try:
            checkpoint = read_checkpoint(path)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        for problem in problems:
            log.warning("%s; resuming from the previous valid checkpoint %s", problem, checkpoint.path)
        return checkpoint
    detail = f" (invalid: {'; '.join(problems)})" if problems else ""
    older = f" older than step {before_step}" if before_step is not None else ""
    raise CheckpointError(
        f"resume: {run_dir} has no valid checkpoint{older} in {CHECKPOINTS_DIR}/{detail}; a run writes one every "
        "trainer.checkpoint_every steps and when it is interrupted (Ctrl-C, SIGTERM). Start the run again instead"
    )


def find_latest_run(root: str | Path) -> Path:
    """``resume=auto``: the run folder directly below ``root`` whose newest valid checkpoint was
    written last (by the checkpoint folder's modification time; a swarm's folder by its actor 0's)."""
    best: tuple[float, Path] | None = None
    root = Path(root)
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        for path in reversed(checkpoint_dirs(checkpoint_home(run_dir))):
            try:
                read_checkpoint(path)
            except CheckpointError:
                continue
            written = path.stat().st_mtime
            if best is None or written > best[0]:
                best = (written, run_dir)
            break
    if best is None:
        raise CheckpointError(f"resume=auto: no run folder below {root} has a valid checkpoint")
    return best[1]


def actor_folder(swarm_folder: str | Path, actor: int) -> Path:
    """The run folder of actor ``actor`` in the swarm's folder."""
    return Path(swarm_folder) / f"actor{actor}"


def checkpoint_home(run_folder: str | Path) -> Path:
    """The folder holding a run's checkpoints: the run folder, or, for a swarm's folder (whose actors
    checkpoint their own folders at the same steps), its actor 0's (what ``resume=`` reads the
    overrides from)."""
    run_folder = Path(run_folder)
    swarm = actor_folder(run_folder, 0)
    return swarm if not checkpoint_dirs(run_folder) and checkpoint_dirs(swarm) else run_folder
