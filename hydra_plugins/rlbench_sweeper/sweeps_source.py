"""The config group ``sweep`` read from the top-level ``sweeps/`` folder.

Sweep definitions sit beside the cluster launch files in ``sweeps/`` (sweeps/README.md), not in
``conf/``. Hydra reads a group from ``<config root>/<group>/``, so two plugins map the folder onto the
group: ``SweepsConfigSource`` (the scheme ``rlbench-sweeps://``) shows exactly one group, ``sweep``,
whose options are ``sweeps/<name>.yaml``; ``SweepsSearchPath`` appends it to the search path of every
composition (the ``rlbench`` command, ``--cfg``, and the compose API), so ``sweep=<name>`` works from
any working directory. Hydra finds both in the ``hydra_plugins`` package, like the sweeper.
"""

from __future__ import annotations

import os

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from rlbench.config.origin import SWEEP_GROUP, SWEEPS_DIR

SCHEME = "rlbench-sweeps"


class SweepsConfigSource(ConfigSource):
    """A config root holding the single group ``sweep``, backed by the files of one folder."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _inside(self, config_path: str) -> str | None:
        """The path inside the folder for a path of the group ('sweep' -> '', 'sweep/x' -> 'x'), else None."""
        group, _, rest = config_path.strip("/").partition("/")
        return rest if group == SWEEP_GROUP else None

    def load_config(self, config_path: str) -> ConfigResult:
        inside = self._inside(self._normalize_file_name(config_path))
        full_path = os.path.join(self.path, inside or "")
        if not inside or not os.path.isfile(full_path):
            raise ConfigLoadError(f"Config not found : {full_path}")
        with open(full_path, encoding="utf-8") as f:
            header = ConfigSource._get_header_dict(f.read(512))
            f.seek(0)
            return ConfigResult(config=OmegaConf.load(f), path=self.full_path(), provider=self.provider, header=header)

    def available(self) -> bool:
        return os.path.isdir(self.path)

    def is_group(self, config_path: str) -> bool:
        if config_path.strip("/") == "":
            return True
        inside = self._inside(config_path)
        return inside is not None and os.path.isdir(os.path.join(self.path, inside))

    def is_config(self, config_path: str) -> bool:
        inside = self._inside(self._normalize_file_name(config_path))
        return bool(inside) and os.path.isfile(os.path.join(self.path, inside))

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        if config_path.strip("/") == "":
            return [SWEEP_GROUP] if results_filter in (None, ObjectType.GROUP) else []
        files: list[str] = []
        for name in os.listdir(os.path.join(self.path, self._inside(config_path) or "")):
            self._list_add_result(files=files, file_path=f"{config_path.rstrip('/')}/{name}", file_name=name,
                                  results_filter=results_filter)
        return sorted(set(files))


class SweepsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="rlbench-sweeps", path=f"{SCHEME}://{SWEEPS_DIR}")
