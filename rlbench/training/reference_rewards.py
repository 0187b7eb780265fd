"""QRPO's reference set: K rewards of pi_ref samples per prompt, sampled once and kept on disk.

QRPO (Matrenok et al., arXiv 2507.08068, Sec. 3) turns a response's reward into its quantile among the
rewards of K responses y'_k ~ pi_ref(.|x) to the same prompt. pi_ref is frozen and the grader is fixed, so
those K rewards are a function of the prompt: :class:`ReferenceRewardCache` samples them once per prompt
(through a caller-supplied ``sample`` function: the frozen reference with its own seeded generator, graded
by the run's grader) and keeps them in a JSON file, so a second run or a resume does not resample.

The file is keyed by :func:`reference_rewards_identity`: the reference's identity (its weights'
fingerprint), K, the sampling settings and the grader. A file of another identity is never read: its
entries are dropped (one logged line) and resampled. Entries are keyed by a hash of the prompt's text.
This module is the cache only; wiring it into QRPO's step (``reference_rewards`` [B, K], consumed by
rlbench/algorithm/losses/quantile_reward.py) is the caller's job.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlbench.errors import ConfigError
from rlbench.utils import atomic_write_json

log = logging.getLogger(__name__)

FORMAT = "rlbench-reference-rewards-1"


def check_reference_samples(count: Any) -> int:
    """K as an int >= 0 (0: QRPO's in-group reference, no separate samples); a clear error otherwise."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"algorithm.qrpo.reference_samples must be an integer >= 0 (0 = the in-group "
                          f"reference set), got {count!r}")
    return count


def prompt_key(prompt: str) -> str:
    """sha256 of the prompt's text: an entry's key."""
    return hashlib.sha256(prompt.encode()).hexdigest()


def reference_rewards_identity(model_identity: str, samples: int, sampling: dict[str, Any],
                               grader: str) -> dict[str, Any]:
    """What the cached rewards depend on: the reference, K, the sampling settings and the grader."""
    return {"model": model_identity, "samples": check_reference_samples(samples),
            "sampling": {name: sampling[name] for name in sorted(sampling)}, "grader": grader}


class ReferenceRewardCache:
    """Per-prompt K reference rewards, loaded from and saved to ``path`` (``None``: in memory only)."""

    def __init__(self, identity: dict[str, Any], path: str | Path | None = None) -> None:
        self.identity = identity
        self.samples = int(identity["samples"])
        if self.samples < 1:
            raise ConfigError("a reference reward cache needs K >= 1 reference samples per prompt")
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, list[float]] = {}
        self.sampled = 0
        if self.path is not None and self.path.exists():
            stored = json.loads(self.path.read_text())
            if stored.get("format") == FORMAT and stored.get("identity") == identity:
                self.entries = {key: [float(r) for r in rewards] for key, rewards in stored["entries"].items()}
            else:
                log.info("reference reward cache %s: another identity (%s), its %d entries are dropped and "
                         "resampled", self.path, stored.get("identity"), len(stored.get("entries", {})))

    def rewards(self, prompts: Sequence[str],
                sample: Callable[[list[str]], Sequence[Sequence[float]]]) -> torch.Tensor:
        """[len(prompts), K] rewards; ``sample(missing prompts)`` is called once for the prompts not cached
        (never when all are) and must return K rewards per prompt. New entries are saved atomically."""
        keys = [prompt_key(prompt) for prompt in prompts]
        missing = list(dict.fromkeys(p for p, k in zip(prompts, keys) if k not in self.entries))
        if missing:
            fresh = sample(missing)
            if len(fresh) != len(missing) or any(len(row) != self.samples for row in fresh):
                raise ValueError(f"reference sampler returned {[len(row) for row in fresh]} rewards for "
                                 f"{len(missing)} prompts, expected {self.samples} each")
            for prompt, row in zip(missing, fresh):
                self.entries[prompt_key(prompt)] = [float(r) for r in row]
            self.sampled += len(missing)
            self.save()
        return torch.tensor([self.entries[key] for key in keys], dtype=torch.float64)

    def save(self) -> None:
        if self.path is not None:
            atomic_write_json(self.path, {"format": FORMAT, "identity": self.identity, "entries": self.entries})
