"""The ``rlbench`` console script: a Hydra app over conf/."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rlbench.errors import ConfigError, DataError

log = logging.getLogger("rlbench")

# conf/ sits next to the package (the repository layout mirrors config groups and packages).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def app(cfg: DictConfig) -> float | None:
    from rlbench.runner import run

    try:
        summary = run(cfg)
    except (ConfigError, DataError) as err:
        log.error("%s: %s", type(err).__name__, err)
        print(f"rlbench: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(2)
    after = summary.get("pass_at_1_after") or {}
    return sum(after.values()) / len(after) if after else None  # for sweepers that optimise


def main() -> None:
    app()


if __name__ == "__main__":
    main()
