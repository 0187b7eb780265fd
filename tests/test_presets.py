"""Every algorithm preset (a YAML file directly in conf/algorithm/) composes with the smoke experiment
and passes the configuration validator. Compose + validate only: no model or data is loaded.

Running this file as a script prints the README-ready table of all presets:
    .venv/bin/python tests/test_presets.py > algorithms_table.md
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest, also when run as a script
from conftest import CONF_DIR, ROOT  # noqa: E402

from rlbench.config import validate_config  # noqa: E402

PRESETS = sorted(path.stem for path in (ROOT / "conf" / "algorithm").glob("*.yaml"))

# Presets this file was written against (others added later are tested too, via PRESETS).
EXPECTED = {
    "grpo", "dr_grpo", "dapo", "gspo", "gmpo", "cispo", "sapo", "rloo", "reinforce_pp", "opo", "gpg",
    "ngrpo", "edge_grpo", "gtpo", "grpo_s", "ce_gppo", "clip_cov", "kl_cov", "m2po", "mdpo", "spo_simple",
    "dppo", "hapo", "aepo", "intellect2", "rec", "thinkless", "ppo", "trpo", "sfpo", "ppo_ewma",
    "remax", "pvpo", "spo", "polychromic", "two_grpo",
}

TABLE_HEADER = "| name | advantage | loss | aggregation | KL | update | paper | run |"
COLUMNS = TABLE_HEADER.count("|") - 1
FIRST_ROWS = ["grpo", "dr_grpo"]  # the baselines lead the table; the rest is alphabetical


def compose_preset(name: str, output_dir: Path) -> DictConfig:
    """``compose_config(["algorithm=<name>", "experiment=smoke"], ...)`` inside an initialised Hydra."""
    return compose("config", overrides=[f"algorithm={name}", "experiment=smoke", f"output_dir={output_dir}"])


@pytest.fixture(scope="module")
def preset_cfg(tmp_path_factory):
    """name -> composed run config; each preset is composed once per module (one Hydra init)."""
    output_dir = tmp_path_factory.mktemp("presets")
    cache: dict[str, DictConfig] = {}

    def get(name: str) -> DictConfig:
        if name not in cache:
            cache[name] = compose_preset(name, output_dir / name)
        return cache[name]

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield get


def _params(node) -> str:
    items = [f"{key}={value}" for key, value in node.items() if key != "name" and value is not None]
    return f" ({', '.join(items)})" if items else ""


def update_cell(update) -> str:
    """The schedule, its settings block, and the update knobs that differ from one on-policy step."""
    schedule = str(update.get("schedule", "standard"))
    knobs = {
        key: value for key, value in update.items()
        if key != "schedule" and not isinstance(value, DictConfig) and not (key in ("epochs", "minibatches") and value == 1)
    }
    knobs.update(update.get(schedule) or {})
    return f"`{schedule}`{_params(knobs)}"


def table_row(name: str, cfg: DictConfig) -> str:
    algorithm = cfg.algorithm
    kl = algorithm.kl
    kl_cell = "off" if float(kl.coef) == 0 else f"{kl.estimator}, β={kl.coef}"
    critic = algorithm.get("critic")
    cells = [
        f"`{name}`",
        f"`{algorithm.advantage.name}`" + (f" + value head{_params(critic)}" if critic else ""),
        f"`{algorithm.loss.name}`{_params(algorithm.loss)}",
        f"`{algorithm.aggregation.name}`",
        kl_cell,
        update_cell(algorithm.get("update") or {}),
        str(algorithm.paper),
        f"`rlbench algorithm={name}`",
    ]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _row_order(name: str) -> tuple[int, str]:
    return (FIRST_ROWS.index(name), "") if name in FIRST_ROWS else (len(FIRST_ROWS), name)


def algorithms_table(cfgs: dict[str, DictConfig]) -> str:
    """The README-ready Markdown table: one row per preset."""
    rows = [TABLE_HEADER, "|" + "---|" * COLUMNS]
    rows += [table_row(name, cfgs[name]) for name in sorted(cfgs, key=_row_order)]
    return "\n".join(rows) + "\n"


def test_expected_presets_exist():
    missing = EXPECTED - set(PRESETS)
    assert not missing, f"presets missing from conf/algorithm/: {sorted(missing)}"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_and_validates(preset_cfg, name):
    cfg = preset_cfg(name)
    algorithm = validate_config(cfg)  # loads no model: ConfigError on any bad piece or parameter
    assert cfg.algorithm.name == name
    assert algorithm.name == name
    paper = cfg.algorithm.get("paper")
    assert isinstance(paper, str) and paper.strip(), f"{name}: 'paper' must be a non-empty string"
    deviations = cfg.algorithm.get("deviations")
    if deviations is not None:
        deviations = list(deviations)
        assert all(isinstance(item, str) and item.strip() for item in deviations), (
            f"{name}: 'deviations' must be a list of non-empty strings"
        )


def test_dapo_and_gspo_values(preset_cfg):
    dapo = preset_cfg("dapo").algorithm
    assert dapo.loss.name == "ppo_clip"
    assert dapo.loss.clip_low == pytest.approx(0.2)
    assert dapo.loss.clip_high == pytest.approx(0.28)
    assert dapo.aggregation.name == "token_mean"
    assert dapo.kl.coef == 0
    assert preset_cfg("dapo").rollout.strategy == "dynamic_sampling"
    assert preset_cfg("dapo").rollout.dynamic_sampling.metric == "correct"
    assert dapo.overlong_filter is True
    assert not any("not implemented" in item for item in dapo.deviations)

    gspo = preset_cfg("gspo").algorithm
    assert gspo.loss.name == "gspo"
    assert gspo.aggregation.name == "seq_mean_token_mean"


def test_critic_and_schedule_presets(preset_cfg):
    ppo = preset_cfg("ppo").algorithm
    assert (ppo.advantage.name, ppo.loss.name, ppo.critic.coef, ppo.critic.clip) == ("gae", "ppo_clip", 0.5, 0.2)
    assert validate_config(preset_cfg("ppo")).critic is not None
    assert validate_config(preset_cfg("sfpo")).schedule == "sfpo"
    trpo = validate_config(preset_cfg("trpo"))
    assert (trpo.schedule, trpo.loss.name, trpo.schedule_settings.max_kl) == ("trpo", "is_surrogate", 0.01)
    assert not trpo.uses_optimizer and validate_config(preset_cfg("grpo")).uses_optimizer
    ewma = validate_config(preset_cfg("ppo_ewma"))
    assert ewma.needs_proximal_policy and ewma.proximal_decay == 0.6
    assert not validate_config(preset_cfg("grpo")).needs_proximal_policy


def test_every_preset_has_a_table_row(preset_cfg):
    table = algorithms_table({name: preset_cfg(name) for name in PRESETS})
    lines = table.splitlines()
    assert lines[0] == TABLE_HEADER
    assert len(lines) == 2 + len(PRESETS)
    for name in PRESETS:
        rows = [line for line in lines if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, f"{name}: expected one table row"
        cells = rows[0].strip("|").split(" | ")
        assert len(cells) == COLUMNS and all(cell.strip() for cell in cells), rows[0]
        assert cells[-1].strip() == f"`rlbench algorithm={name}`"


if __name__ == "__main__":
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        out = Path(tempfile.mkdtemp())
        print(algorithms_table({name: compose_preset(name, out / name) for name in PRESETS}), end="")
