"""The frozen reference's log-probs of offline data, computed once and kept (``rollout=offline``).

An offline run (docs/preference.md) trains epoch after epoch on the same file of responses, and pi_ref is
frozen, so log pi_ref of a (prompt, response) is the same number every time it is drawn. The cache keeps
it per response, keyed by the row's tokens (:func:`row_key`: the prompt and response ids and the trained
positions), so each response costs one reference forward pass per run, not one per epoch; with
``rollout.offline.reference_cache=<file>`` the entries are saved (atomically) and a later run on the same
model and data starts with them.

A cache file is keyed by its identity (:func:`cache_identity`): the reference's weights (a hash of its
parameters), the data (``rollout.offline.file``'s sha256, or a hash of the guidance library's responses and
rewards) and the temperature the log-probs are taken at. A file of another identity is never used: with ``reference_cache_mismatch: recompute`` (the
default) its entries are dropped and recomputed, counted in one logged line; with ``stop`` the run is
refused before training, naming what differs.

Only a reference that stays frozen is cached: the runner leaves the cache off for a reference that changes
during the run (ReMix's reincarnation, SALSA's weight soup) and under FSDP (sharded weights).
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlbench.errors import ConfigError, DataError
from rlbench.rollout.guided.offline import file_digest, offline_options
from rlbench.training.batch import TrainBatch
from rlbench.training.forward import batch_outputs
from rlbench.utils import atomic_write_bytes

log = logging.getLogger(__name__)

MISMATCH_POLICIES = ("recompute", "stop")
FORMAT = "rlbench-reference-logp-1"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the module's parameters and buffers (names, dtypes, shapes and bytes): the model's identity."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def data_fingerprint(responses: Iterable[tuple[str, Iterable[int], float]]) -> str:
    """sha256 of the data's (uid, response token ids, reward) entries, in a canonical order."""
    digest = hashlib.sha256()
    for uid, ids, reward in sorted((uid, tuple(ids), float(reward)) for uid, ids, reward in responses):
        digest.update(f"{uid}|{','.join(map(str, ids))}|{reward!r}\n".encode())
    return digest.hexdigest()


def cache_identity(model: torch.nn.Module, data: str, temperature: float) -> dict[str, str]:
    """What a cache's entries depend on: the reference's weights, the data's fingerprint and the temperature."""
    return {"model": weights_fingerprint(model), "data": data, "temperature": repr(float(temperature))}


def row_key(batch: TrainBatch, row: int) -> str:
    """A response's key: its prompt's and its own token ids (padding left out) and its trained positions."""
    attended = batch.input_ids[row][batch.attention_mask[row].bool()]
    mask = batch.response_mask[row]
    length = int(mask.nonzero().max().item()) + 1 if bool(mask.any()) else 0
    digest = hashlib.sha256(attended.cpu().to(torch.int64).numpy().tobytes())
    digest.update(mask[:length].cpu().to(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class ReferenceLogProbCache:
    """log pi_ref per response (a [L] float tensor, L up to its last trained position), for one identity.

    ``hits``/``misses`` count the lookups of the run; ``dropped`` the entries of a file of another identity
    that were discarded (``recompute``)."""

    identity: dict[str, str]
    path: Path | None = None
    entries: dict[str, torch.Tensor] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    dropped: int = 0
    unsaved: int = 0

    @classmethod
    def open(cls, identity: dict[str, str], path: str | Path | None = None, on_mismatch: str = "recompute") -> ReferenceLogProbCache:
        """The cache of ``identity``, with the entries of the file at ``path`` when it was computed for the same
        identity; a file of another identity is dropped and counted (``recompute``) or refused (``stop``)."""
        if on_mismatch not in MISMATCH_POLICIES:
            raise ConfigError(f"reference_cache_mismatch must be one of {MISMATCH_POLICIES}, got {on_mismatch!r}")
        cache = cls(identity=dict(identity), path=None if path is None else Path(path))
        if cache.path is None or not cache.path.is_file():
            return cache
        stored = torch.load(cache.path, map_location="cpu", weights_only=True)
        if stored.get("format") != FORMAT:
            raise DataError(f"reference cache {cache.path}: not a reference log-prob cache (format {stored.get('format')!r})")
        differs = [key for key in sorted(set(identity) | set(stored["identity"])) if stored["identity"].get(key) != identity.get(key)]
        if not differs:
            cache.entries = dict(stored["entries"])
            log.info("reference cache %s: %d responses' log pi_ref loaded", cache.path, len(cache.entries))
            return cache
        what = ", ".join(differs)
        if on_mismatch == "stop":
            raise DataError(f"reference cache {cache.path} was computed for another {what} than this run's; delete it, "
                            "point rollout.offline.reference_cache elsewhere or set reference_cache_mismatch=recompute")
        cache.dropped = len(stored["entries"])
        log.warning("reference cache %s: computed for another %s: its %d entries are dropped and recomputed",
                    cache.path, what, cache.dropped)
        return cache

    def save(self) -> None:
        """Write the entries to ``path`` (atomically) when some were added since the last save."""
        if self.path is None or self.unsaved == 0:
            return
        buffer = io.BytesIO()
        torch.save({"format": FORMAT, "identity": self.identity, "entries": self.entries}, buffer)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, buffer.getvalue())
        self.unsaved = 0

    def log_probs(self, reference: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, temperature: float) -> torch.Tensor:
        """log pi_ref [B, T] of the batch (zero off the trained positions, as ``batch_outputs``): cached rows
        from the cache, the others from one reference pass over them, then kept."""
        keys = [row_key(batch, row) for row in range(batch.size)]
        missing = [row for row, key in enumerate(keys) if key not in self.entries]
        self.hits += batch.size - len(missing)
        self.misses += len(missing)
        if missing:
            rows = torch.tensor(missing, dtype=torch.long, device=batch.input_ids.device)
            computed = batch_outputs(reference, batch.select(rows), micro_batch_size, temperature).logp
            for k, row in enumerate(missing):
                mask = batch.response_mask[row]
                length = int(mask.nonzero().max().item()) + 1 if bool(mask.any()) else 0
                self.entries[keys[row]] = computed[k, :length].detach().cpu().clone()
            self.unsaved += len(missing)
        result = torch.zeros_like(batch.response_mask)
        for row, key in enumerate(keys):
            values = self.entries[key]
            result[row, : len(values)] = values.to(result.device, result.dtype)
        return result * batch.response_mask

    def metrics(self) -> dict[str, float]:
        """The run's counts so far: lookups served from the cache and computed."""
        return {"reference_cache_hits": float(self.hits), "reference_cache_misses": float(self.misses)}


def reference_log_probs(
    reference: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, temperature: float,
    cache: ReferenceLogProbCache | None,
) -> torch.Tensor:
    """log pi_ref [B, T] of the batch: through the cache when the run has one, else one reference pass."""
    if cache is None:
        return batch_outputs(reference, batch, micro_batch_size, temperature).logp
    logp = cache.log_probs(reference, batch, micro_batch_size, temperature)
    cache.save()
    return logp


def offline_reference_cache(config: Any, reference: torch.nn.Module | None, guidance: Any, temperature: float,
                            sharded: bool) -> ReferenceLogProbCache | None:
    """The run's cache: for ``rollout=offline`` with a reference that stays frozen (no reincarnation, no weight
    soup, not sharded); None otherwise. ``config``: the typed run config; ``guidance``: its library (the data
    when ``rollout.offline.file`` is not set)."""
    if reference is None or config.rollout.strategy != "offline" or sharded:
        return None
    if config.algorithm.reincarnate_at is not None or config.algorithm.reference_soup is not None:
        return None
    options = offline_options(config.rollout)
    if options.file is not None:
        data = f"file sha256 {file_digest(options.file)}"
    elif guidance is not None:
        data = data_fingerprint((t.uid, t.token_ids, t.reward) for traces in guidance.traces.values() for t in traces)
    else:
        return None
    identity = cache_identity(reference, data, temperature)
    return ReferenceLogProbCache.open(identity, options.reference_cache, options.reference_cache_mismatch)
