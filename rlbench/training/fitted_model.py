"""Models a run fits apart from its policy before the actor's first step, and keeps on disk: Direct Advantage PO's
step critic (rlbench/training/step_critic.py) and DRPO's preference model (rlbench/training/preference_model.py).

Each starts as a copy of the frozen reference pi_ref with a value head (rlbench/algorithm/value_model.py) and is
fitted on the fixed data set of ``rollout=offline``. :func:`load_or_fit` saves it, atomically, with its identity:
what the fitted weights depend on (:func:`fitted_model_identity`: the reference's weights, the settings, the seed,
the sampling and the reward, and the data set's digest, :func:`data_digest`). A run whose identity matches reads it
instead of fitting (a resumed run continues with the model it started with, never a refitted one); a file of
another identity is fitted again and overwritten (one logged line).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from rlbench.config.schema import RunConfig
from rlbench.errors import ConfigError
from rlbench.rollout import GradedGroups
from rlbench.rollout.engines.base import SamplingParams
from rlbench.training.reference_cache import weights_fingerprint
from rlbench.utils import atomic_write_bytes

log = logging.getLogger(__name__)

FORMAT = "rlbench-fitted-model-1"


@dataclass(kw_only=True)
class FittedModel:
    """A model fitted before the actor, at the first step (a subclass defines ``fit(data) -> numbers`` and ``WHAT``).
    ``sampler``: grades or labels the data set (the run's grader, reward terms and shaping, with its own composer and
    cost counter); ``identity``: :func:`fitted_model_identity`, completed by the data set's digest."""

    sampler: Any
    model: torch.nn.Module
    identity: dict[str, Any]
    path: Path
    seed: int
    fitted: bool = False
    WHAT: ClassVar[str] = "a fitted model"

    @property
    def pad_id(self) -> int:
        tokenizer = self.sampler.tokenizer
        return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    def prepare(self, dataset: Callable[[Any], GradedGroups]) -> None:
        """Once, before the first step: read the saved model of this identity, or fit it on the data set.
        ``dataset(sampler)``: every group of the fixed data set, graded or labelled by ``sampler``."""
        if self.fitted:
            return
        data = dataset(self.sampler)
        load_or_fit(self.path, {**self.identity, "data": data_digest(data)}, self.model, lambda: self.fit(data), self.WHAT)
        self.fitted = True


def check_fitted_model(config: RunConfig, key: str, what: str) -> None:
    """ConfigError, before the model loads, when ``algorithm.<key>`` (a model fitted before the actor, ``what``)
    cannot be: it needs the fixed data set of rollout=offline, one process and a full copy of the reference, and a
    reward that grades the same way every time."""
    if config.rollout.strategy != "offline":
        raise ConfigError(f"algorithm.{key} ({what}) is fitted on a fixed data set before the actor trains: use "
                          "rollout=offline with rollout.offline.file=<file> or a guidance library (rollout="
                          f"{config.rollout.strategy} samples new responses every step)")
    if config.model.lora is not None or config.trainer.parallelism != "single":
        raise ConfigError(f"algorithm.{key} ({what}) copies the frozen reference model and fits it in one process: "
                          "model.lora (the reference is the policy with adapters off) and trainer.parallelism="
                          f"{config.trainer.parallelism} (the model is neither sharded nor fitted per rank) are refused")
    if config.reward.judge is not None:
        raise ConfigError(f"algorithm.{key} ({what}) is fitted once, before training, on graded data, which a model "
                          "judge's verdicts (stateful, budgeted per step) are not: use reward terms without reward.judge")


def fitted_model_identity(config: RunConfig, reference: torch.nn.Module, settings: Any, params: SamplingParams,
                          shaping: Any) -> dict[str, Any]:
    """What a fitted model depends on besides its data: the reference's weights, its settings (``path`` aside), the
    run's seed, the sampling and the reward (terms and shaping)."""
    reward = json.dumps({"reward": dataclasses.asdict(config.reward), "shaping": repr(shaping)}, sort_keys=True, default=str)
    return {
        "reference": weights_fingerprint(reference),
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "path"},
        "seed": int(config.seed),
        "sampling": {"temperature": params.temperature, "top_p": params.top_p, "max_new_tokens": params.max_new_tokens},
        "reward": hashlib.sha256(reward.encode()).hexdigest(),
    }


def data_digest(graded: GradedGroups) -> str:
    """sha256 of the data set's prompts, responses, groups and rewards."""
    digest = hashlib.sha256()
    rewards = iter(graded.rewards.tolist())
    for g, group in enumerate(graded.groups):
        for completion in group:
            digest.update(json.dumps([g, list(completion.prompt_ids), list(completion.response_ids), float(next(rewards))]).encode())
    return digest.hexdigest()


def model_path(config: RunConfig, path: str | None, name: str) -> Path:
    """The model's file: ``path``, or ``<run folder>/<name>``."""
    return Path(path) if path else Path(config.output_dir) / name


def load_or_fit(path: Path, identity: dict[str, Any], model: torch.nn.Module, fit: Callable[[], dict[str, float]],
                what: str) -> tuple[dict[str, float], bool]:
    """(the fit's numbers, whether it was fitted now): ``model`` reads the file at ``path`` when its identity is
    ``identity``; otherwise ``fit()`` fits it and the model is saved there with its identity and numbers."""
    if path.exists():
        stored = torch.load(path, map_location="cpu", weights_only=False)
        if stored.get("format") == FORMAT and stored.get("identity") == identity:
            model.load_state_dict(stored["state"])
            model.eval()
            log.info("%s: read %s", what, path)
            return dict(stored["metrics"]), False
        log.info("%s %s: another identity, fitted again", what, path)
    metrics = fit()
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "identity": identity, "state": model.state_dict(), "metrics": metrics}, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    log.info("%s: saved to %s", what, path)
    return metrics, True
