"""Where a config value came from: a command-line override, or the YAML file of a group option.

Hydra keeps the command line (``hydra.overrides.task``) and the chosen option of every group
(``hydra.runtime.choices``); a key is traced to the last override that names it or, failing that,
to the last composed YAML file that holds it (files are read raw, with their ``@package``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"
# The config group `sweep` lives in the top-level sweeps/ folder, beside the cluster launch files, and
# not in conf/ (hydra_plugins/rlbench_sweeper/sweeps_source.py puts it on Hydra's search path).
SWEEP_GROUP, SWEEPS_DIR = "sweep", CONF_DIR.parent / "sweeps"


def option_file(group: str, option: str) -> Path:
    """The YAML file of a group option: ``conf/<group>/<option>.yaml``, ``sweeps/<option>.yaml`` for sweeps."""
    return SWEEPS_DIR / f"{option}.yaml" if group == SWEEP_GROUP else CONF_DIR / group / f"{option}.yaml"


@dataclass(frozen=True)
class ComposedFile:
    """A YAML file of the composition: its path, the package its keys land in, and how it was chosen."""

    path: Path
    package: str  # dotted prefix of its keys in the composed config ("" for _global_)
    chosen_by: str  # "algorithm=grpo", or "the primary config"

    def holds(self, key_path: str) -> bool:
        relative = _relative(key_path, self.package)
        if relative is None or not self.path.is_file():
            return False
        node: Any = OmegaConf.load(self.path)
        for part in relative.split(".") if relative else []:
            if not isinstance(node, DictConfig) or part not in node:
                return False
            node = node._get_node(part)
        return True

    def describe(self) -> str:
        shown = self.path.relative_to(CONF_DIR.parent) if self.path.is_relative_to(CONF_DIR.parent) else self.path
        return f"{shown} ({self.chosen_by})"


@dataclass(frozen=True)
class ValueOrigins:
    """The command-line overrides and composed files of one run, in the order they were applied."""

    overrides: tuple[str, ...] = ()
    files: tuple[ComposedFile, ...] = ()

    @classmethod
    def from_hydra(cls) -> "ValueOrigins":
        """From Hydra's record of the current composition (empty when there is none)."""
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return cls()
        hydra_cfg = HydraConfig.get()
        choices = OmegaConf.to_container(hydra_cfg.runtime.choices)
        return cls(tuple(hydra_cfg.overrides.task), tuple(composed_files(choices)))

    def of(self, key_path: str) -> str:
        """'the command-line override ...' / 'conf/... (group=option)' / '' when unknown."""
        for override in reversed(self.overrides):
            key = override_key(override)
            if key is not None and _related(key, key_path):
                return f"the command-line override '{override}'"
        for composed in reversed(self.files):
            if composed.holds(key_path):
                return composed.describe()
        return ""


# A dotted config key inside a message ("rollout.n", "algorithm.update.minibatches").
DOTTED_KEY = re.compile(r"\b[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+")


def with_origins(message: str, cfg: DictConfig, origins: ValueOrigins) -> str:
    """``message`` plus where each config key it names came from (unchanged when it already says,
    or when none of its keys can be traced)."""
    if "(set by " in message:
        return message
    notes = []
    for key in dict.fromkeys(DOTTED_KEY.findall(message)):
        try:
            present = OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT
        except Exception:  # an interpolation that resolves only inside a Hydra run
            present = False
        origin = origins.of(key) if present else ""
        if origin:
            notes.append(f"{key} set by {origin}")
    return f"{message} [{'; '.join(notes)}]" if notes else message


_ABSENT = object()


def override_key(override: str) -> str | None:
    """The dotted key an override sets ('++trainer.lr=1' -> 'trainer.lr'); None for a group choice
    ('algorithm=dapo', 'algorithm/loss=gspo'), which loads a file instead."""
    key = override.split("=", 1)[0].lstrip("~+")
    if "/" in key or "@" in key:
        return None
    if "." not in key and key in GROUPS:
        return None
    return key


def _related(override_key_path: str, key_path: str) -> bool:
    """The override sets the key itself, a node above it, or a key below it."""
    return (
        override_key_path == key_path
        or key_path.startswith(override_key_path + ".")
        or override_key_path.startswith(key_path + ".")
    )


def _relative(key_path: str, package: str) -> str | None:
    if not package:
        return key_path
    if key_path == package:
        return ""
    if key_path.startswith(package + "."):
        return key_path[len(package) + 1:]
    return None


def _declared_package(path: Path) -> str | None:
    """The ``# @package`` header of a YAML file, if it has one."""
    if not path.is_file():
        return None
    for line in path.read_text().splitlines()[:5]:
        if line.startswith("# @package"):
            return line.split(None, 2)[2].strip()
    return None


def composed_files(choices: dict[str, Any]) -> Iterable[ComposedFile]:
    """The primary config, then each chosen group option's file, in the order they were merged
    (``hydra.runtime.choices`` lists the last merged first)."""
    yield ComposedFile(CONF_DIR / "config.yaml", "", "the primary config")
    for group_key, option in reversed(list(choices.items())):
        if option is None or group_key.startswith("hydra"):
            continue
        group, _, package = group_key.partition("@")
        path = option_file(group, option)
        declared = _declared_package(path)
        if declared == "_global_":
            package = ""
        elif declared:
            package = declared
        elif not package:
            package = group.replace("/", ".")
        yield ComposedFile(path, package, f"{group}={option}")


GROUPS = frozenset({SWEEP_GROUP, *(path.name for path in CONF_DIR.iterdir() if path.is_dir())}) if CONF_DIR.is_dir() else frozenset()
