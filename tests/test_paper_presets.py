"""Paper presets (conf/paper/*.yaml, used as ``rlbench +paper=<name>``).

Each paper file composes on top of the run config, passes the configuration validator, records the
paper's reported numbers with their provenance (``paper.reference``), lists what rlbench does not
match (``paper.deviations``), and sets the values its sources state. Compose + validate only: no
model or data is loaded. Papers whose algorithm preset is still being written are skipped until
conf/algorithm/<preset>.yaml exists.

Running this file as a script prints the README table of paper presets:
    .venv/bin/python tests/test_paper_presets.py
"""

from __future__ import annotations

import numbers
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest, also when run as a script
from conftest import CONF_DIR, ROOT, needs_data  # noqa: E402

from rlbench.config import validate_config  # noqa: E402
from rlbench.dataset.sources import resolve_data_dir  # noqa: E402
from rlbench.errors import DataError  # noqa: E402

PAPER_DIR = ROOT / "conf" / "paper"
PAPERS = sorted(path.stem for path in PAPER_DIR.glob("*.yaml"))

# One file per paper preset this file was written against (issue 3, "Presets").
EXPECTED = {
    "grpo", "dr_grpo", "dapo", "gspo", "gmpo", "cispo", "sapo", "rloo", "reinforce_pp", "opo", "gpg",
    "ngrpo", "edge_grpo", "gtpo", "grpo_s", "ce_gppo", "clip_cov", "kl_cov", "m2po", "mdpo", "spo_simple",
    "dppo", "hapo", "aepo", "intellect2", "rec",
    # presets written by colleagues at the same time: tested once conf/algorithm/<name>.yaml exists
    "ppo", "remax", "pvpo", "spo", "polychromic", "trpo", "ppo_ewma", "sfpo", "two_grpo", "thinkless",
}

# Top-level sections of a paper file that must reach the composed config unchanged.
RUN_SECTIONS = ("trainer", "rollout", "algorithm", "eval")
REFERENCE_KEYS = {"benchmark", "rlbench_benchmark", "metric", "value", "model", "source", "verified"}

# Values read in each paper's primary sources (the authors' scripts, READMEs or abstracts; the paper
# files cite them line by line). Written here independently of the YAML, so a preset that drifts
# from its source fails.
SOURCE_VALUES: dict[str, dict[str, Any]] = {
    # verl recipe/dapo/run_dapo_qwen2.5_32b.sh ("DAPO Full -- AIME 50" in the authors' README)
    "dapo": {
        "model.hub_id": "Qwen/Qwen2.5-32B", "algorithm.loss.clip_low": 0.2, "algorithm.loss.clip_high": 0.28,
        "algorithm.kl.coef": 0.0, "trainer.prompts_per_step": 512, "rollout.n": 16, "trainer.lr": 1e-6,
        "rollout.max_new_tokens": 20480, "algorithm.update.minibatches": 16, "trainer.weight_decay": 0.1,
        "algorithm.aggregation.name": "token_mean", "algorithm.reward_shaping.0.cache_fraction": 4096 / 20480,
    },
    # sail-sg/understand-r1-zero examples/qwen2.5-math-7b.sh
    "dr_grpo": {
        "model.hub_id": "Qwen/Qwen2.5-Math-7B", "algorithm.advantage.name": "dr_grpo", "rollout.n": 8,
        "trainer.prompts_per_step": 128, "rollout.max_new_tokens": 3000, "trainer.lr": 1e-6,
        "algorithm.kl.coef": 0.0, "algorithm.aggregation.norm_length": 3000, "eval.temperature": 0.0,
    },
    # callsys/GMPO scripts/qwen2.5-math-7b-gmpo.sh
    "gmpo": {
        "model.hub_id": "Qwen/Qwen2.5-Math-7B", "algorithm.loss.clip_low": 0.4, "algorithm.loss.clip_high": 0.4,
        "rollout.n": 8, "rollout.max_new_tokens": 3000, "eval.n": 16, "eval.temperature": 0.6, "eval.top_p": 0.95,
    },
    # TRL paper index, citing GSPO v2 section 5.1
    "gspo": {
        "model.hub_id": "Qwen/Qwen3-30B-A3B-Base", "algorithm.loss.clip_low": 3e-4, "algorithm.loss.clip_high": 4e-4,
        "algorithm.update.minibatches": 4, "algorithm.kl.coef": 0.0,
    },
    # nangongrui-ngr/NGRPO train_scripts/train_qwen2.5-math-7b_ngrpo.sh
    "ngrpo": {
        "model.hub_id": "Qwen/Qwen2.5-Math-7B", "algorithm.loss.clip_low": 0.16, "algorithm.loss.clip_high": 0.24,
        "algorithm.advantage.num_virtual": 1, "trainer.prompts_per_step": 1024, "rollout.n": 8,
        "algorithm.update.minibatches": 4, "rollout.max_new_tokens": 3072,
    },
    # Infini-AI-Lab/M2PO train-scripts/m2po-qwen-math-7b-s256.sh
    "m2po": {
        "model.hub_id": "Qwen/Qwen2.5-Math-7B", "algorithm.loss.m2_threshold": 0.04, "trainer.prompts_per_step": 256,
        "rollout.n": 8, "algorithm.update.minibatches": 4, "rollout.max_new_tokens": 2560, "trainer.steps": 1201,
        "eval.top_p": 0.7,
    },
    # verl recipe/entropy/7b_clip_cov.sh and 7b_kl_cov.sh
    "clip_cov": {
        "model.hub_id": "Qwen/Qwen2.5-7B", "algorithm.loss.clip_cov_ratio": 2e-4, "algorithm.loss.clip_cov_lb": 1.0,
        "algorithm.loss.clip_cov_ub": 5.0, "algorithm.loss.clip_low": 1.0, "trainer.prompts_per_step": 256,
        "rollout.n": 8, "algorithm.update.minibatches": 8, "rollout.max_new_tokens": 8192,
    },
    "kl_cov": {
        "model.hub_id": "Qwen/Qwen2.5-7B", "algorithm.loss.kl_cov_ratio": 0.002, "algorithm.loss.ppo_kl_coef": 1.0,
        "trainer.prompts_per_step": 256, "rollout.n": 8, "rollout.max_new_tokens": 8192,
    },
    # starriver030515/HAPO recipe/qwen2.5_math_7b.sh
    "hapo": {
        "trainer.prompts_per_step": 512, "rollout.n": 16, "algorithm.update.minibatches": 16,
        "rollout.max_new_tokens": 10240, "algorithm.loss.dual_clip": 10.0, "algorithm.loss.entropy_pivot": 0.8,
        "algorithm.reward_shaping.0.cache_fraction": 4096 / 10240, "eval.temperature": 0.5, "eval.n": 8,
    },
    # modelscope/Trinity-RFT examples/rec_gsm8k/gsm8k.yaml
    "rec": {
        "model.hub_id": "Qwen/Qwen2.5-3B-Instruct", "dataset.name": "gsm8k", "rollout.n": 8,
        "trainer.prompts_per_step": 96, "rollout.max_new_tokens": 1024, "algorithm.loss.clip_mode": "none",
    },
    # ZhangXJ199/EDGE-GRPO train_grpo.sh
    "edge_grpo": {"model.hub_id": "Qwen/Qwen2.5-Math-7B", "rollout.max_new_tokens": 1024, "algorithm.kl.coef": 0.0},
    # authors' README (AMAP-ML/GPG): GPG-7B is trained from Qwen2.5-Math-7B
    "gpg": {"model.hub_id": "Qwen/Qwen2.5-Math-7B"},
    # abstracts: the paper's own models
    "aepo": {"model.hub_id": "Qwen/Qwen3-14B"},
    "intellect2": {"model.hub_id": "Qwen/QwQ-32B"},
    "spo": {"model.hub_id": "Qwen/Qwen3-8B", "rollout.n": 1},
    "two_grpo": {"rollout.n": 2},
    # authors' README (deepseek-ai/DeepSeek-Math): RL starts from DeepSeekMath-Instruct 7B
    "grpo": {"model.hub_id": "deepseek-ai/deepseek-math-7b-instruct"},
}


def load_paper_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((PAPER_DIR / f"{name}.yaml").read_text())


def _included_papers(raw: dict[str, Any]) -> list[str]:
    """Entries of the defaults list that include another paper file (e.g. kl_cov includes clip_cov)."""
    return [entry for entry in raw.get("defaults") or [] if isinstance(entry, str) and entry != "_self_"]


def algorithm_of(name: str) -> str:
    """The algorithm preset a paper file selects (``override /algorithm: <preset>``); a file's own
    override wins over one in a paper file it includes, as in Hydra's defaults list."""
    raw = load_paper_file(name)
    for entry in raw.get("defaults") or []:
        if isinstance(entry, dict) and "override /algorithm" in entry:
            return str(entry["override /algorithm"])
    for included in _included_papers(raw):
        return algorithm_of(included)
    raise AssertionError(f"paper/{name}.yaml selects no algorithm (needs 'override /algorithm: <preset>')")


def paper_body(name: str) -> DictConfig:
    """The paper file merged with the paper files it includes (included first, then its own keys)."""
    raw = load_paper_file(name)
    merged = OmegaConf.create({})
    for included in _included_papers(raw):
        merged = OmegaConf.merge(merged, paper_body(included))
    own = {key: value for key, value in raw.items() if key != "defaults"}
    return OmegaConf.merge(merged, own)


def require_algorithm_preset(name: str) -> None:
    preset = algorithm_of(name)
    if not (ROOT / "conf" / "algorithm" / f"{preset}.yaml").is_file():
        pytest.skip(
            f"conf/algorithm/{preset}.yaml does not exist yet (the '{preset}' preset is being written); "
            f"paper/{name}.yaml is composed and validated once it is merged"
        )


def _leaves(node: Any, prefix: str = ""):
    """(dotted key, value) for every leaf of a plain dict; lists count as leaves."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def _uses_local_data(cfg: DictConfig) -> bool:
    specs = [cfg.dataset, *cfg.eval.benchmarks.values()] if cfg.mode == "train" else list(cfg.eval.benchmarks.values())
    return any(spec.get("loader", "jsonl") == "jsonl" for spec in specs)


def compose_paper(name: str, output_dir: Path) -> DictConfig:
    """``compose_config(["+paper=<name>"], ...)`` inside an initialised Hydra."""
    return compose("config", overrides=[f"+paper={name}", f"output_dir={output_dir}"])


@pytest.fixture(scope="module")
def paper_cfg(tmp_path_factory):
    """name -> composed run config; each paper is composed once per module (one Hydra init)."""
    output_dir = tmp_path_factory.mktemp("papers")
    cache: dict[str, DictConfig] = {}

    def get(name: str) -> DictConfig:
        require_algorithm_preset(name)
        if name not in cache:
            cache[name] = compose_paper(name, output_dir / name)
        return cache[name]

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield get


def test_expected_papers_exist():
    missing = EXPECTED - set(PAPERS)
    assert not missing, f"paper presets missing from conf/paper/: {sorted(missing)}"


@pytest.mark.parametrize("name", PAPERS)
@needs_data
def test_paper_composes_and_validates(paper_cfg, name):
    cfg = paper_cfg(name)
    if _uses_local_data(cfg):
        try:
            resolve_data_dir(cfg.data_dir)
        except DataError:
            pytest.skip("shared data directory not present (needed to validate jsonl datasets)")
    algorithm = validate_config(cfg)  # loads no model: hub models need only their hub_id here
    assert cfg.paper.name == name
    assert cfg.paper.algorithm == algorithm_of(name) == cfg.algorithm.name == algorithm.name
    assert str(cfg.paper.arxiv) in str(cfg.paper.url)


@pytest.mark.parametrize("name", PAPERS)
def test_paper_values_reach_the_composed_config(paper_cfg, name):
    """Every run value a paper file sets (its own and those of a paper file it includes) survives
    composition: no algorithm preset, model or experiment default overrides it."""
    cfg = paper_cfg(name)
    body = OmegaConf.to_container(paper_body(name))
    for section in RUN_SECTIONS:
        for key, value in _leaves(body.get(section, {}), section):
            composed = OmegaConf.select(cfg, key)
            if OmegaConf.is_config(composed):
                composed = OmegaConf.to_container(composed)
            assert composed == value, f"paper/{name}.yaml sets {key}={value!r}, composed config has {composed!r}"


@pytest.mark.parametrize("name", sorted(SOURCE_VALUES))
def test_paper_matches_its_sources(paper_cfg, name):
    cfg = paper_cfg(name)
    for key, expected in SOURCE_VALUES[name].items():
        value = OmegaConf.select(cfg, key)
        if isinstance(expected, float):
            assert value == pytest.approx(expected), f"{name}: {key}={value}, source says {expected}"
        else:
            assert value == expected, f"{name}: {key}={value}, source says {expected}"


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@pytest.mark.parametrize("name", PAPERS)
def test_reference_block(name):
    """Each paper records its reported numbers with provenance: verified entries carry a number
    and the source it was read in; unverified ones say what was tried."""
    paper = OmegaConf.to_container(paper_body(name).paper)
    entries = paper.get("reference")
    assert isinstance(entries, list) and entries, f"{name}: paper.reference must be a non-empty list"
    for entry in entries:
        missing = REFERENCE_KEYS - set(entry)
        assert not missing, f"{name}: reference entry lacks {sorted(missing)}: {entry}"
        assert isinstance(entry["verified"], bool), f"{name}: 'verified' must be true or false: {entry}"
        assert isinstance(entry["source"], str) and entry["source"].strip(), f"{name}: empty source: {entry}"
        value = entry["value"]
        if entry["verified"]:
            is_range = isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))
            assert _is_number(value) or is_range, f"{name}: a verified entry needs a number (or [low, high]): {entry}"
        else:
            assert value is None or _is_number(value), f"{name}: unverified value must be a number or null: {entry}"
            assert str(entry.get("tried") or "").strip(), f"{name}: an unverified entry must say what was tried: {entry}"
        benchmark = entry["rlbench_benchmark"]
        if benchmark is not None:
            assert (ROOT / "conf" / "benchmark" / f"{benchmark}.yaml").is_file(), f"{name}: no benchmark {benchmark}"


@pytest.mark.parametrize("name", PAPERS)
def test_deviations_listed(name):
    deviations = paper_body(name).paper.get("deviations")
    assert deviations is not None and len(deviations) > 0, f"{name}: paper.deviations must list what is not matched"
    assert all(isinstance(item, str) and item.strip() for item in deviations), f"{name}: empty deviation"


def test_cli_prints_composed_paper_config(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "+paper=dapo", "--cfg", "job"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["paper"]["name"] == "dapo"
    assert printed["algorithm"]["name"] == "dapo"
    assert printed["algorithm"]["loss"]["clip_high"] == pytest.approx(0.28)
    assert printed["model"]["hub_id"] == "Qwen/Qwen2.5-32B"
    assert printed["paper"]["reference"][0]["value"] == 50


def papers_table(names: list[str]) -> str:
    """The README table: paper, preset, how many reference numbers are verified, the command."""
    rows = ["| paper | preset | verified numbers | run |", "|---|---|---|---|"]
    for name in names:
        paper = paper_body(name).paper
        verified = sum(bool(entry.verified) for entry in paper.reference)
        cell = f"yes ({verified} of {len(paper.reference)})" if verified else "no"
        title = f"{paper.title} (arXiv:{paper.arxiv})".replace("|", "\\|")
        rows.append(f"| {title} | `{algorithm_of(name)}` | {cell} | `rlbench +paper={name}` |")
    return "\n".join(rows) + "\n"


def test_readme_lists_every_paper():
    readme = (ROOT / "README.md").read_text()
    table = papers_table(PAPERS)
    missing = [row for row in table.splitlines()[2:] if row not in readme]
    assert not missing, "README 'Paper presets' table is out of date; regenerate it with " \
        "`python tests/test_paper_presets.py`:\n" + "\n".join(missing)


if __name__ == "__main__":
    print(papers_table(PAPERS), end="")
