import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "conf")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def _data_available() -> bool:
    from rlbench.dataset import resolve_data_dir
    from rlbench.errors import DataError

    try:
        return (resolve_data_dir() / "gsm8k" / "test.jsonl").is_file()
    except DataError:
        return False


# Tests that read the benchmark files (../shared/data or RLBENCH_DATA_DIR) skip without them.
needs_data = pytest.mark.skipif(not _data_available(), reason="benchmark data not found (set RLBENCH_DATA_DIR)")


def compose_config(overrides, output_dir):
    """The run configuration the CLI would build from these overrides."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[*overrides, f"output_dir={output_dir}"])


@pytest.fixture
def make_cfg(tmp_path):
    return lambda *overrides: compose_config(list(overrides), tmp_path / "run")
