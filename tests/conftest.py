import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "conf")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

from rlbench.training.memory import keep_freed_memory  # noqa: E402  (after the environment above)

# Freed memory stays in the process instead of going back to the kernel (rlbench.training.memory.
# keep_freed_memory, which CPU training also applies): every toy step's logits over the 49k-token vocabulary
# were fresh pages that the kernel zeroes again, a sixth to a quarter of a toy run's CPU time (grpo: 4.4 s of
# 17.7 s was system time in two runs; docs/testing.md). The toy runs stay bit-identical. The environment
# variables reach the processes the tests start (CLI runs, spawned ranks). Without glibc nothing changes.
keep_freed_memory(children=True)


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


def algorithm_from(values):
    """Algorithm.from_config of an algorithm mapping (a test's partial dict, or a composed cfg.algorithm) with
    the schema's defaults filled in, as the run fills them (rlbench.config.typed.algorithm_settings)."""
    from rlbench.algorithm import Algorithm
    from rlbench.config.typed import algorithm_settings

    return Algorithm.from_config(algorithm_settings(values))


def model_preset(name):
    """conf/model/<name>.yaml as the typed node load_policy takes (rlbench.config.schema.ModelConfig)."""
    from omegaconf import OmegaConf

    from rlbench.config.typed import model_config

    return model_config(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))


@pytest.fixture
def make_cfg(tmp_path):
    return lambda *overrides: compose_config(list(overrides), tmp_path / "run")


# The learning tier (tests/learning) starts its most expensive checks first (longest-processing-time-first
# order), so that pytest-xdist's two workers finish together instead of one waiting on TRPO. The CPU
# seconds of one toy run per preset come from bench/learning_costs.py; a preset without a figure counts as
# the most expensive. After them come the integration tests (marker slow: seconds to minutes each), and
# the unit tests last, so a long integration test never starts while the other worker has only the end
# of the queue left. Ordering only: nothing here changes what a test checks; within each kind tests keep
# their order.
RUN_SECONDS = ROOT / "results" / "learning" / "run_seconds.json"


# Toy runs per test, in full 16-step runs: a learning check runs 3 seeds and one control; the determinism
# check runs its preset twice for 4 steps.
TOY_RUNS_PER_TEST = {"test_preset_learns_and_its_control_does_not": 4.0, "test_preset_run_is_deterministic": 0.5}


#: a tiny model on arithmetic with the even-token reward and 6-token responses (graded responses differ)
TOY_OFFLINE = ["model=tiny", "model.tiny.vocab_size=512", "reward=even_tokens", "rollout.max_new_tokens=6", "logger=files"]


@pytest.fixture(scope="module")
def toy_traces(tmp_path_factory):
    """4 graded responses of the base model for each of the first 6 toy problems (``rlbench mode=generate``;
    the even-token reward: they differ): the offline data set of tests/test_preference_offline.py and
    tests/test_step_critic.py."""
    from rlbench.runner import run

    root = tmp_path_factory.mktemp("offline")
    out = root / "traces.jsonl"
    run(compose_config([*TOY_OFFLINE, "mode=generate", "dataset.limit=6", "rollout.n=4", "guidance.keep_incorrect=true",
                        f"out={out}"], root / "gen"))
    return out


def learning_check_cost(item, seconds: dict) -> float:
    """The expected CPU seconds of a test item: toy runs x one run's cost for the learning tier, else 0."""
    callspec = getattr(item, "callspec", None)
    if item.get_closest_marker("learning") is None or callspec is None or "preset" not in callspec.params:
        return 0.0
    runs = TOY_RUNS_PER_TEST.get(item.originalname, 4.0)
    return runs * seconds.get(callspec.params["preset"], float("inf"))


def pytest_collection_modifyitems(session, config, items):
    import json

    seconds = json.loads(RUN_SECONDS.read_text()) if RUN_SECONDS.exists() else {}
    items.sort(key=lambda item: schedule_key(item, seconds))  # stable: ties keep their order


def schedule_key(item, seconds: dict) -> tuple[float, int]:
    """Learning checks by decreasing cost, then integration tests, then unit tests."""
    return -learning_check_cost(item, seconds), 0 if item.get_closest_marker("slow") else 1


def smoke_cli_steps(out: Path, *overrides: str) -> list[dict]:
    """Run `rlbench experiment=smoke <overrides>` through the CLI (files logger, no saved model, a one-sample
    evaluation) into ``out`` and return its per-step metrics (metrics.jsonl)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "experiment=smoke", *overrides, "logger=files", "trainer.save_model=false",
         "eval.n=1", "eval.k=[1]", "eval.limit=1", f"hydra.run.dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class CharTokenizer:
    """A stand-in tokenizer for rollout tests: the chat template is the last (user) message's characters
    as token ids; decode maps ids back to characters."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [ord(ch) for ch in messages[-1]["content"]]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def has_vllm_gpu() -> bool:
    """CUDA and an importable vLLM (the tests of rollout.engine=vllm need both)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True
