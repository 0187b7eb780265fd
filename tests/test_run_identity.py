"""Names and summaries say what ran (rlbench/config/identity.py): the run name (and folder), the
wandb group and tags, summary.json and rlbench-compare's algorithm label all come from one
function of the composed config."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from rlbench import runner
from rlbench.analysis.runs import Run, group_runs, run_key
from rlbench.config.identity import run_identity
from rlbench.logger.run_logger import wandb_group, wandb_tags


def _resolved(cfg):
    return OmegaConf.to_container(cfg, resolve=True)


def test_a_training_run_is_named_by_algorithm_model_and_dataset(make_cfg):
    cfg = make_cfg("seed=3")
    assert cfg.run_name == "grpo-smollm2_135m-arith-s3"
    identity = run_identity(cfg)
    assert (identity.mode, identity.algorithm, identity.dataset, identity.benchmark) == ("train", "grpo", "arith", "arith")
    assert wandb_group(_resolved(cfg)).startswith("grpo-smollm2_135m-arith-")
    assert {"mode:train", "algorithm:grpo", "model:smollm2_135m", "dataset:arith", "benchmark:arith"} <= set(wandb_tags(_resolved(cfg)))


def test_a_swapped_piece_is_in_the_name_group_and_compare_label(make_cfg):
    preset, swapped = make_cfg(), make_cfg("algorithm/aggregation=token_mean")
    assert swapped.run_name == "grpo+aggregation.token_mean-smollm2_135m-arith-s0"
    group = wandb_group(_resolved(swapped))
    assert group.startswith("grpo+aggregation.token_mean-smollm2_135m-arith-") and group != wandb_group(_resolved(preset))
    # choosing the preset's own piece explicitly is no swap
    assert make_cfg("algorithm/aggregation=seq_mean_token_mean").run_name == preset.run_name
    assert make_cfg("algorithm=dr_grpo", "algorithm/loss=ppo_clip").run_name == "dr_grpo-smollm2_135m-arith-s0"
    # rlbench-compare --by algorithm keeps them apart (each run folder's config.yaml is the resolved config)
    runs = [Run(path, _resolved(cfg), None, None, None) for path, cfg in (("a", preset), ("b", swapped))]
    assert [run_key(run, "algorithm") for run in runs] == ["grpo", "grpo+aggregation.token_mean"]
    assert set(group_runs(runs, ["algorithm"])) == {"grpo", "grpo+aggregation.token_mean"}


def test_an_evaluation_of_a_checkpoint_is_named_by_the_checkpoint(make_cfg, tmp_path):
    policy = tmp_path / "results" / "runs" / "2026-12-04_10-00-00_grpo-smollm2_135m-arith-s0" / "policy"
    policy.mkdir(parents=True)
    latest = tmp_path / "results" / "latest"
    latest.symlink_to(policy.parent)
    cfg = make_cfg("mode=eval", "model=checkpoint", f"model.path={latest / 'policy'}", "eval=gsm8k")
    assert cfg.run_name == "eval-ckpt_grpo-smollm2_135m-arith-s0-gsm8k-s0"
    identity = run_identity(cfg)
    assert identity.model_source == str(policy.resolve())  # the link resolved: 'latest' moves on
    assert (identity.mode, identity.algorithm, identity.dataset, identity.benchmark) == ("eval", None, None, "gsm8k")
    assert wandb_group(_resolved(cfg)).startswith("eval-ckpt_grpo-smollm2_135m-arith-s0-gsm8k-")
    other = make_cfg("mode=eval", "model=checkpoint", f"model.path={tmp_path / 'my model'}")
    assert run_identity(other).model == "ckpt_my_model"


def test_a_hub_model_is_named_by_its_id_and_each_mode_by_what_it_does(make_cfg):
    hub = make_cfg("mode=eval", "model=hub", "model.hub_id=Qwen/Qwen2.5-0.5B-Instruct", "eval=math")
    assert hub.run_name == "eval-Qwen--Qwen2.5-0.5B-Instruct-math-s0"
    assert run_identity(hub).model_source == "Qwen/Qwen2.5-0.5B-Instruct"
    generate = make_cfg("mode=generate", "out=/tmp/unused.jsonl", "dataset=gsm8k")
    assert generate.run_name == "generate-smollm2_135m-gsm8k-s0"
    assert run_identity(generate).algorithm is None and run_identity(generate).benchmark is None
    assert make_cfg("eval=math").run_name == "grpo-smollm2_135m-arith-eval.math-s0"  # a suite not named after the data
    assert make_cfg("run_name=mine").run_name == "mine"  # an explicit name still wins


@pytest.mark.slow
def test_an_evaluation_only_summary_records_the_suite_not_the_default_training_set(make_cfg, tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": f"{i} + {i}", "answer": str(2 * i)}) + "\n" for i in range(3)))
    cfg = make_cfg("mode=eval", "model=tiny", "eval=custom", f"eval.benchmarks.custom.files.test={data}", "logger=files",
                   "eval.n=1", "eval.k=[1]", "rollout.max_new_tokens=4")
    summary = runner.run(cfg)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    for record in (summary, written):
        assert record["run_name"] == "eval-tiny-custom-s0"
        assert (record["mode"], record["algorithm"], record["dataset"], record["benchmark"]) == ("eval", None, None, "custom")
        assert record["model"] == "tiny"


def test_every_run_name_is_a_valid_resume_value(make_cfg, tmp_path):
    """``rlbench resume=<run folder>`` unquoted: Hydra's override grammar refuses ``=`` in a value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    names = [make_cfg("algorithm/aggregation=token_mean", "eval=math").run_name,
             make_cfg("mode=eval", "model=checkpoint", f"model.path='{tmp_path / 'a=b:c d'}'").run_name,
             make_cfg("mode=eval", "model=hub", "model.hub_id=Qwen/Qwen2.5-0.5B-Instruct").run_name]
    for name in names:
        folder = f"results/runs/2026-12-04_10-00-00_{name}"
        assert parser.parse_override(f"resume={folder}").value() == folder
