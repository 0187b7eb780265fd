"""Bad input fails fast, before any model is loaded, with a message that says what to change."""

import subprocess
import sys

import pytest

import rlbench.runner as runner
from rlbench.errors import ConfigError, DataError

from conftest import ROOT


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the configuration was validated")

    monkeypatch.setattr(runner, "load_policy", refuse)


def test_k_larger_than_n(make_cfg):
    with pytest.raises(ConfigError, match=r"eval.k contains 8.*eval.n = 4"):
        runner.run(make_cfg("eval.n=4", "eval.k=[1,8]"))


def test_impossible_batch_arithmetic(make_cfg):
    with pytest.raises(ConfigError, match=r"micro_batch_size=4; use one of \[1, 2, 3, 6\]"):
        runner.run(make_cfg("trainer.prompts_per_step=3", "rollout.n=2", "trainer.micro_batch_size=4"))
    with pytest.raises(ConfigError, match="minibatches=5"):
        runner.run(make_cfg("trainer.prompts_per_step=3", "rollout.n=2", "algorithm.update.minibatches=5"))


def test_group_relative_advantage_needs_two_responses(make_cfg):
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        runner.run(make_cfg("rollout.n=1", "trainer.micro_batch_size=1"))


@pytest.mark.parametrize("override,key", [
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("eval.max_new_tokens=-5", "eval.max_new_tokens"),
    ("trainer.prompts_per_step=0", "trainer.prompts_per_step"),
    ("trainer.lr=0", "trainer.lr"),
    ("rollout.top_p=0", "rollout.top_p"),
])
def test_non_positive_values(make_cfg, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        runner.run(make_cfg(override))


def test_missing_model_path(make_cfg, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(ConfigError, match=str(missing)):
        runner.run(make_cfg("model.source=path", f"model.path={missing}"))


def test_checkpoint_model_without_a_path(make_cfg):
    with pytest.raises(ConfigError, match="model.path"):
        runner.run(make_cfg("mode=eval", "model=checkpoint"))


def test_unknown_algorithm_piece_parameter(make_cfg):
    with pytest.raises(ConfigError, match="clip_hihg"):
        runner.run(make_cfg("+algorithm.loss.clip_hihg=0.3"))


def test_missing_data_file_names_path_variable_and_hub_id(make_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("RLBENCH_DATA_DIR", raising=False)
    with pytest.raises(DataError) as err:
        runner.run(make_cfg("dataset=gsm8k", f"data_dir={tmp_path}", "data_source=local"))
    message = str(err.value)
    assert str(tmp_path / "gsm8k" / "train.jsonl") in message
    assert "RLBENCH_DATA_DIR" in message and "openai/gsm8k" in message


def test_malformed_jsonl_names_file_and_line(make_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("RLBENCH_DATA_DIR", raising=False)
    (tmp_path / "gsm8k").mkdir()
    good = '{"question": "1+1?", "answer": "#### 2"}\n'
    (tmp_path / "gsm8k" / "train.jsonl").write_text(good + good + '{"question": "broken"\n')
    with pytest.raises(DataError, match=r"train\.jsonl:3|line 3"):
        runner.run(make_cfg("dataset=gsm8k", "eval=arith", f"data_dir={tmp_path}", "data_source=local"))


def test_unknown_group_option_from_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlbench.cli", "algorithm=nope", f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    out = proc.stderr + proc.stdout
    assert "algorithm" in out and "nope" in out
    assert "did you mean" in out and "rlbench-list shows all" in out, "the error should name the nearest options and where all are"


def test_config_error_from_command_line_exits_2_with_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlbench.cli", "eval.n=2", "eval.k=[4]", f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "eval.k contains 4" in proc.stderr
