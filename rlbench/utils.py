"""Small shared helpers: seeding, atomic file writes, progress lines with an ETA."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch


# torch >= 2.5: sdpa reads each key/value head once for its group of query heads (``enable_gqa``)
SDPA_GROUPED_HEADS = "enable_gqa" in (torch.nn.functional.scaled_dot_product_attention.__doc__ or "")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) and ask torch for deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


# Independent random streams derived from the run seed, one per purpose (make_generator).
STREAM_DATA_ORDER, STREAM_ROLLOUT, STREAM_EVAL, STREAM_MINIBATCH = 1, 2, 3, 4
STREAM_GREEDY, STREAM_REFERENCE = 11, 12  # extra rollouts of advantage inputs (ReMax, PVPO)
STREAM_REPLAY, STREAM_CURRICULUM = 21, 22  # replay-buffer draws (rollout/guided/replay.py), curriculum samplers (training/curricula.py)
STREAM_SWARM = 31  # a swarm actor's draw of shared groups (training/swarm.py)
STREAM_DIFFICULTY_FILTER = 41  # the initial policy's answers of trainer.difficulty_filter (training/curricula.py)
STREAM_AUX_TASKS = 51  # auxiliary-task builds and draws (training/aux_tasks.py)
STREAM_CLPO_REWRITES = 52  # CLPO's rewrites: the policy's rewriting and checking samples, the pool's draws (training/rewrites.py)
STREAM_STEP_CRITIC, STREAM_STEP_CRITIC_FIT = 61, 62  # Direct Advantage PO's critic: its pi_ref continuations, its fit's order (training/step_critic.py)
STREAM_PREFERENCE_MODEL_FIT = 63  # DRPO's preference model: its fit's order (training/preference_model.py)
STREAM_LOSS = 71  # the policy loss's draws, one generator per (step, rank, micro-batch) (loss_generator, training/update.py)


def make_generator(seed: int, stream: int) -> torch.Generator:
    """An independent torch generator per purpose (stream), all derived from the run seed."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def loss_generator(seed: int, step: int, micro_batch: int, rank: int = 0) -> torch.Generator:
    """The policy loss's random stream (the ``generator`` step input) for one micro-batch: a fresh
    generator seeded by a hash of (run seed, STREAM_LOSS, step, rank, micro-batch index). It is a pure
    function of those numbers, so a rerun draws the same, a resumed run draws what the uninterrupted
    one did (nothing to checkpoint), and each step and micro-batch draws afresh."""
    digest = hashlib.blake2b(repr((int(seed), STREAM_LOSS, int(step), int(rank), int(micro_batch))).encode(), digest_size=8)
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)


def temporary_sibling(path: Path) -> Path:
    """A fresh name next to ``path`` for a file or folder that is written and then renamed onto
    ``path``: ``.<name>.tmp-<random hex>`` (hidden; the ``.tmp-`` marks leftovers of a killed writer)."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and rename, so readers never see half a file.

    The temporary file is created (exclusively) with mode 0666 and the process umask applied, as
    ``open(path, "w")`` would create ``path`` (0644 under umask 022), so results stay readable by
    colleagues.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) atomically: see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """sha256 of the tokenizer's sorted vocabulary (token -> id): two tokenizers with the same fingerprint turn ids
    into the same tokens. None for a tokenizer without ``get_vocab``. Files of token ids (traces, replay pools, MCTS
    trees, offline groups) record it and are refused, or their ids dropped, under another tokenizer."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = sorted(get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, with an s unless the count is one: ``1 group``, ``2 groups``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m:02d}:{s:02d}"


class Progress:
    """A one-line progress report on stderr: ``[phase] 3/10 (30%) elapsed 00:12 ETA 00:28``."""

    def __init__(self, phase: str, total: int, stream=None, min_interval: float = 0.0, enabled: bool = True):
        self.phase = phase
        self.enabled = enabled
        self.total = max(int(total), 0)
        self.done = 0
        self.start = time.perf_counter()
        self.stream = stream or sys.stderr
        self.min_interval = min_interval
        self._last = 0.0

    def eta(self) -> float | None:
        if self.done == 0:
            return None
        elapsed = time.perf_counter() - self.start
        return elapsed / self.done * (self.total - self.done)

    def line(self) -> str:
        """The current progress line."""
        eta = self.eta()
        pct = 100.0 * self.done / self.total if self.total else 100.0
        elapsed = time.perf_counter() - self.start
        return (
            f"[{self.phase}] {self.done}/{self.total} ({pct:.0f}%) "
            f"elapsed {format_seconds(elapsed)} ETA {format_seconds(eta) if eta is not None else '--:--'}"
        )

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        now = time.perf_counter()
        if not self.enabled:
            return
        if self.done < self.total and now - self._last < self.min_interval:
            return
        self._last = now
        line = self.line()
        if note:
            line += f"  {note}"
        print(line, file=self.stream, flush=True)
