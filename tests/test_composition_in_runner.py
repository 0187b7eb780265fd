"""Pieces composed through the real runner: optional inputs are wired, impossible ones refused early."""

import json

import pytest

import rlbench.runner as runner
from rlbench.errors import ConfigError

pytestmark = pytest.mark.slow  # integration tier: runs the runner or the CLI


def test_estimator_reading_entropy_runs_end_to_end(make_cfg, tmp_path):
    cfg = make_cfg("experiment=smoke", "algorithm/advantage=edge_grpo", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false")
    runner.run(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all("advantage_std" in s for s in steps)


@pytest.mark.parametrize("override,needed", [
    ("algorithm/advantage=gae", "values"),
])
def test_piece_needing_an_input_the_trainer_lacks_is_refused_before_loading(make_cfg, monkeypatch, override, needed):
    monkeypatch.setattr(runner, "load_policy", lambda *a, **k: pytest.fail("model loaded before validation"))
    with pytest.raises(ConfigError, match=needed):
        runner.run(make_cfg(override))


@pytest.mark.parametrize("overrides,message", [
    (["algorithm/loss=gspo", "algorithm/aggregation=token_mean"], "gspo' needs algorithm/aggregation=seq_mean_token_mean"),
    (["algorithm/loss=gspo", "algorithm/aggregation=seq_mean_token_mean", "algorithm/advantage=reinforce_pp"],
     "token-level"),
    (["algorithm/loss=degrpo", "algorithm/aggregation=token_mean"], "degrpo' needs algorithm/aggregation=seq_mean_token_sum"),
])
def test_incompatible_pieces_are_refused_with_the_conflict_named(make_cfg, monkeypatch, overrides, message):
    monkeypatch.setattr(runner, "load_policy", lambda *a, **k: pytest.fail("model loaded before validation"))
    with pytest.raises(ConfigError, match=message):
        runner.run(make_cfg(*overrides))


@pytest.mark.parametrize("loss", ["mdpo", "hapo", "aepo"])
def test_losses_reading_progress_or_entropy_run_through_the_runner(make_cfg, loss):
    cfg = make_cfg("experiment=smoke", f"algorithm/loss={loss}", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false", "trainer.steps=1")
    summary = runner.run(cfg)
    assert summary["pass_at_1_after"].keys() == {"arith"}


@pytest.mark.parametrize("preset,extra,check", [
    ("remax", [], lambda s: 0.0 <= s["baseline_reward_mean"] <= 1.0),
    ("pvpo", [], lambda s: s["reference_responses"] == 0.0),  # every anchor estimated by the pre-sampling
    ("pvpo", ["algorithm.baseline.presample=false", "rollout=iid"],
     lambda s: s["reference_responses"] in (0.0, 8.0, 16.0)),  # lazily: 8 per newly drawn prompt
    ("spo", [], lambda s: "tracker_baseline_mean" in s and "tracker_policy_change_mean" in s),
    ("polychromic", [], lambda s: "advantage_std" in s),
    # with the math grader the tiny model never answers right, so every group is dropped: all rounds run,
    # then the batch is filled
    ("dapo", ["reward=math", "rollout.dynamic_sampling.max_rounds=2"],
     lambda s: s["dynamic_sampling_rounds"] == 2 and s["dynamic_sampling_filled_groups"] == 2),
])
def test_presets_reading_extra_rollout_inputs_run_end_to_end(make_cfg, tmp_path, preset, extra, check):
    cfg = make_cfg("experiment=smoke", f"algorithm={preset}", "logger=files", "trainer.save_model=false",
                   "eval.before_training=false", "eval.n=2", "eval.k=[1]", "eval.limit=2", *extra)
    runner.run(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(check(s) for s in steps), steps
    if preset == "spo":
        assert steps[0]["tracker_baseline_mean"] == 0.5  # every prompt starts at Beta(0.5, 0.5)
    if preset == "pvpo" and extra:
        assert steps[0]["reference_responses"] == 16.0  # 2 new prompts x 8 reference responses
