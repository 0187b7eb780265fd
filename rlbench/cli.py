"""The ``rlbench`` console script: a Hydra app over conf/."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue

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
        fail(f"{type(err).__name__}: {err}")
    except MissingMandatoryValue as err:  # a ??? left in the config
        key = getattr(err, "full_key", "") or str(err)
        fail(f"ConfigError: {key} must be set (it is ??? in the config); add {key}=<value> to the command line")
    after = summary.get("pass_at_1_after") or {}
    if "macro_avg" in after:  # for sweepers that optimise: the macro average over benchmarks
        return after["macro_avg"]
    return sum(after.values()) / len(after) if after else None


def fail(message: str) -> None:
    log.error("%s", message)
    print(f"rlbench: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
