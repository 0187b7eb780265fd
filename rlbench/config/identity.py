"""What a run is, said once: :func:`run_identity` derives it from the composed config, and every
name and record of the run takes it from there (the default ``run_name`` and so the run folder,
the wandb group and tags, and the identity fields of ``summary.json``; ``rlbench-compare --by
algorithm`` labels runs with the same algorithm label).

    mode          train | eval | generate
    model         the model as named in run names: the preset's name, ``ckpt_<run>`` for a policy
                  folder a run wrote (``model=checkpoint model.path=...``; the run folder's name
                  without its time stamp), ``ckpt_<folder>`` for another local checkpoint, and
                  ``<owner>--<repo>`` for ``model=hub model.hub_id=...``
    model_source  where the weights came from: the checkpoint's absolute path (links such as
                  ``results/latest`` resolved), the Hub id (``@revision``), or the GGUF package
    algorithm     the preset, then every piece (advantage, loss, aggregation) that differs from the
                  preset's own: ``grpo+aggregation.token_mean``; None when nothing trains (mode eval)
    dataset       the training set (train, generate); None for an evaluation-only run
    benchmark     the evaluation suite (eval.name: gsm8k, math, all, custom, ...); None for generate

Run names: ``<algorithm>-<model>-<dataset>-s<seed>`` (with ``-eval.<suite>`` before the seed when
the suite is not the one named after the training set), ``eval-<model>-<suite>-s<seed>``,
``generate-<model>-<dataset>-s<seed>``; the wandb group is the name without the seed (and a hash of
the configuration, rlbench/logger/run_logger.py). Names hold no ``=`` (nor ``:``), so a run
folder can be passed as ``resume=<folder>`` unquoted (Hydra's override grammar) and tab-completes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlbench.config.origin import CONF_DIR

PIECES = ("advantage", "loss", "aggregation")  # the algorithm's sub-groups (conf/algorithm/<piece>/)
HYDRA_STAMP = re.compile(r"^\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_")  # hydra.run.dir's time stamp prefix
UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")  # what a folder name or wandb name should not hold


@dataclass(frozen=True)
class RunIdentity:
    mode: str
    model: str
    model_source: str
    algorithm: str | None
    dataset: str | None
    benchmark: str | None
    seed: Any

    @property
    def group(self) -> str:
        """The name without the seed: what the seeds of one configuration share."""
        if self.mode == "eval":
            return f"eval-{self.model}-{self.benchmark}"
        if self.mode == "generate":
            return f"generate-{self.model}-{self.dataset}"
        suite = f"-eval.{self.benchmark}" if self.benchmark not in (None, self.dataset) else ""
        return f"{self.algorithm}-{self.model}-{self.dataset}{suite}"

    @property
    def name(self) -> str:
        return f"{self.group}-s{self.seed}"

    def fields(self) -> dict[str, Any]:
        """The identity as summary.json records it."""
        return {key: value for key, value in asdict(self).items() if key != "seed"}

    def tags(self) -> list[str]:
        """wandb tags ``mode:``, ``algorithm:``, ``model:``, ``dataset:``, ``benchmark:`` (those that apply)."""
        shown = ("mode", "algorithm", "model", "dataset", "benchmark")
        return [f"{key}:{getattr(self, key)}" for key in shown if getattr(self, key) is not None]


def _get(config: Any, dotted: str) -> Any:
    """The value at ``dotted``, or None when absent or still ``???`` (a DictConfig or a plain mapping)."""
    if isinstance(config, DictConfig):
        return OmegaConf.select(config, dotted, default=None, throw_on_missing=False)
    node = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return None if node == "???" else node


def safe(text: str) -> str:
    return UNSAFE.sub("_", text).strip("_") or "_"


def model_identity(config: Any) -> tuple[str, str]:
    """(name in run names, where the weights came from); see the module docstring."""
    name, source = str(_get(config, "model.name")), _get(config, "model.source")
    if source == "path":
        raw = _get(config, "model.path")
        if raw is None:
            return name, "???"
        path = Path(str(raw)).expanduser().resolve()
        folder = path.parent.name if path.name == "policy" else path.name  # a run's policy/: the run
        return f"ckpt_{safe(HYDRA_STAMP.sub('', folder))}", str(path)
    if source == "hub":
        hub_id, revision = _get(config, "model.hub_id"), _get(config, "model.revision")
        where = f"{hub_id}@{revision}" if revision else str(hub_id)
        return (safe(str(hub_id).replace("/", "--")) if name == "hub" and hub_id else name), where
    if source == "gguf_package":
        return name, f"{_get(config, 'model.gguf_package')} (GGUF of {_get(config, 'model.hub_id')})"
    return name, str(source or name)


def preset_pieces(preset: str) -> dict[str, str]:
    """The pieces an algorithm preset chooses in its defaults list (conf/algorithm/<preset>.yaml);
    empty when there is no such file."""
    path = CONF_DIR / "algorithm" / f"{preset}.yaml"
    if not path.is_file():
        return {}
    defaults = OmegaConf.load(path).get("defaults") or []
    return {key: str(value) for entry in defaults if isinstance(entry, Mapping)
            for key, value in entry.items() if key in PIECES}


def algorithm_label(config: Any) -> str:
    """``<preset>`` plus ``+<piece>.<option>`` for every piece that differs from the preset's."""
    preset = str(_get(config, "algorithm.name"))
    chosen = preset_pieces(preset)
    swapped = [f"+{piece}.{actual}" for piece in PIECES
               if piece in chosen and (actual := _get(config, f"algorithm.{piece}.name")) is not None
               and str(actual) != chosen[piece]]
    return preset + "".join(swapped)


def run_identity(config: Any) -> RunIdentity:
    """The identity of the run ``config`` describes (the composed config, a DictConfig, or the
    resolved config as a mapping, e.g. a run folder's config.yaml)."""
    mode = str(_get(config, "mode") or "train")
    model, source = model_identity(config)
    return RunIdentity(
        mode=mode,
        model=model,
        model_source=source,
        algorithm=algorithm_label(config) if mode == "train" else None,
        dataset=None if mode == "eval" else _get(config, "dataset.name"),
        benchmark=None if mode == "generate" else _get(config, "eval.name"),
        seed=_get(config, "seed"),
    )
