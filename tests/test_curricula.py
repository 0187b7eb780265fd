"""Curricula (rlbench/training/curricula.py): the per-prompt statistics store, the prompt samplers against
their formulas on hand-made statistics tables, and the stage schedule's validation and effect."""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.groups import GradedGroups
from rlbench.config.schema import PromptSamplerConfig
from rlbench.config.typed import typed_node
from rlbench.training.curricula import HardFocusOptions, PromptSampler, WeightedOptions, hardest, make_prompt_sampler
from rlbench.training.prompt_stats import PromptStats, PromptStatsStore
from rlbench.training.stages import parse_stages

PROBLEMS = [Problem(str(i), f"q{i}", "a") for i in range(6)]


def sampler_config(spec: dict) -> PromptSamplerConfig:
    """``trainer.prompt_sampler`` as the run reads it (typed, the settings blocks collected)."""
    return typed_node(OmegaConf.create(spec), PromptSamplerConfig)


def table(rates):
    """A statistics store with 4 attempts per prompt uid -> pass rate (None: never seen)."""
    store = PromptStatsStore()
    for uid, rate in rates.items():
        if rate is not None:
            store.stats[uid] = PromptStats(attempts=4, correct=round(4 * rate), length_sum=40, last_seen=1)
    return store


def graded(problems, lengths, correct):
    groups = [[Completion(0, (1,), [5] * length, [0.0] * length, True) for length in group] for group in lengths]
    flat = [c for group in correct for c in group]
    grades = [Grade(reward=float(c), correct=bool(c), format_ok=True, extracted=None) for c in flat]
    n = len(flat)
    return GradedGroups(problems, groups, grades, torch.tensor(flat, dtype=torch.float32),
                        torch.tensor(flat, dtype=torch.float32), torch.ones(n, dtype=torch.bool), list(range(len(groups))))


def test_store_counts_attempts_pass_rate_lengths_and_last_seen():
    store = PromptStatsStore()
    store.observe(1, graded(PROBLEMS[:2], [[2, 4], [3]], [[1, 0], [1]]))
    store.observe(3, graded(PROBLEMS[:1], [[6, 8]], [[1, 1]]))
    a, b = store.get("0"), store.get("1")
    assert (a.attempts, a.correct, a.pass_rate, a.mean_length, a.last_seen) == (4, 3, 0.75, 5.0, 3)
    assert (b.attempts, b.pass_rate, b.last_seen) == (1, 1.0, 1)
    assert math.isnan(store.get("9").pass_rate)
    copy = PromptStatsStore()
    copy.load_state_dict(store.state_dict())
    assert copy.stats == store.stats


def test_uniform_sampler_is_the_loops_prompt_sampler_draw_for_draw():
    ours = make_prompt_sampler(sampler_config({"name": "uniform"}), PROBLEMS, 3, PromptStatsStore())
    reference = PromptSampler(PROBLEMS, 3)
    assert [p.uid for _ in range(5) for p in ours.next(4)] == [p.uid for _ in range(5) for p in reference.next(4)]


def test_weighted_sampler_probabilities_follow_the_gaussian_of_the_pass_rate():
    rates = {"0": 0.0, "1": 0.25, "2": 0.5, "3": 0.75, "4": 1.0, "5": None}  # "5" unseen: the prior 0.5
    cfg = sampler_config({"name": "weighted", "weighted": {"weighting": "gaussian", "target": 0.5, "width": 0.25, "prior": 0.5}})
    sampler = make_prompt_sampler(cfg, PROBLEMS, 0, table(rates))
    p = [0.0, 0.25, 0.5, 0.75, 1.0, 0.5]
    w = np.array([math.exp(-0.5 * ((x - 0.5) / 0.25) ** 2) for x in p])
    assert sampler.probabilities() == pytest.approx(w / w.sum())
    # and the draws follow them (one prompt per step, many steps)
    draws = 6000
    counts = np.bincount([int(sampler.next(1)[0].uid) for _ in range(draws)], minlength=6) / draws
    expected = w / w.sum()
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected * (1 - expected) / draws))


def test_bucket_weighting_down_weights_easy_prompts():
    options = WeightedOptions(weighting="buckets", hard_below=0.2, easy_above=0.8, hard_weight=2.0, medium_weight=1.0, easy_weight=0.25)
    assert [options.weight(x) for x in (0.0, 0.2, 0.5, 0.79, 0.8, 1.0)] == [2.0, 2.0, 1.0, 1.0, 0.25, 0.25]
    cfg = sampler_config({"name": "weighted", "weighted": {"weighting": "buckets", "hard_weight": 2.0, "easy_weight": 0.25}})
    sampler = make_prompt_sampler(cfg, PROBLEMS[:3], 0, table({"0": 0.0, "1": 0.5, "2": 1.0}))
    assert sampler.probabilities() == pytest.approx(np.array([2.0, 1.0, 0.25]) / 3.25)


def test_hard_focus_keeps_the_hardest_share_and_the_pool_only_shrinks():
    rates = {"0": 0.9, "1": 0.1, "2": 0.5, "3": None, "4": 0.3, "5": 0.85}
    options = HardFocusOptions(phase_steps=2, keep_fraction=0.5, max_pass_rate=0.8, min_pool=1)
    kept = hardest(PROBLEMS, table(rates), options)
    assert [p.uid for p in kept] == ["1", "3", "4"]  # unseen counts as 0; 0.9 and 0.85 are above 0.8
    cfg = sampler_config({"name": "hard_focus", "hard_focus": {"phase_steps": 2, "keep_fraction": 0.5, "min_pool": 1}})
    store = table(rates)
    sampler = make_prompt_sampler(cfg, PROBLEMS, 0, store)
    sampler.end_step(1)
    assert len(sampler.pool) == 6  # not the end of a phase
    sampler.end_step(2)
    assert [p.uid for p in sampler.pool] == ["1", "3", "4"]
    assert {p.uid for p in sampler.next(9)} <= {"1", "3", "4"}
    store.stats["1"] = PromptStats(4, 4, 0, 3)  # prompt 1 got easy: it leaves at the next cut
    sampler.end_step(4)
    assert [p.uid for p in sampler.pool] == ["3", "4"]


def test_sampler_state_round_trip_continues_identically():
    cfg = sampler_config({"name": "weighted"})
    a = make_prompt_sampler(cfg, PROBLEMS, 1, table({"0": 0.5, "1": 0.0}))
    a.next(3)
    b = make_prompt_sampler(cfg, PROBLEMS, 2, PromptStatsStore())
    b.load_state_dict(a.state_dict())
    assert [p.uid for p in a.next(4)] == [p.uid for p in b.next(4)]


@pytest.mark.parametrize("sampler, message", [
    ({"name": "easiest"}, "trainer.prompt_sampler.name='easiest' is unknown"),
    ({"name": "weighted", "weighted": {"widht": 1}}, r"has no key\(s\) \['widht'\]"),
    ({"name": "weighted", "weighted": {"width": 0}}, "width > 0"),
    ({"name": "hard_focus", "hard_focus": {"keep_fraction": 0}}, "keep_fraction in"),
])
def test_bad_sampler_options_are_refused(sampler, message):
    with pytest.raises(ConfigError, match=message):
        make_prompt_sampler(sampler_config(sampler), PROBLEMS, 0, PromptStatsStore())


def test_stages_parse_nested_or_dotted_keys():
    stages = parse_stages([{"at": 3, "rollout": {"n": 8}}, {"at": 5, "rollout.max_new_tokens": 32}], steps=10)
    assert [(s.at, s.changes) for s in stages] == [(3, {"rollout.n": 8}), (5, {"rollout.max_new_tokens": 32})]


@pytest.mark.parametrize("stages, message", [
    ([{"at": 5, "rollout.n": 8}, {"at": 3, "rollout.n": 4}], "at=3 comes before the previous stage's at=5"),
    ([{"at": 5, "rollout.n": 8}, {"at": 5, "rollout.n": 4}], "at=5 overlaps the previous stage's at=5"),
    ([{"rollout.n": 8}], "needs exactly one of 'at'"),
    ([{"at": 1, "rollout.n": 8}], "must be a step in 2..trainer.steps=10"),
    ([{"at": 11, "rollout.n": 8}], "must be a step in 2..trainer.steps=10"),
    ([{"at": 4, "dataset.name": "gsm8k"}], "may change"),
    ([{"at": 4, "rollout.n": 0}], "must be a positive number"),
])
def test_bad_stage_schedules_are_refused(stages, message):
    with pytest.raises(ConfigError, match=message):
        parse_stages(stages, steps=10)


def test_a_stage_may_start_on_a_metric_instead_of_a_step():
    stages = parse_stages([{"at": 3, "rollout.n": 8},
                           {"when": {"metric": "truncated_rate", "above": 0.5, "for_steps": 2}, "rollout": {"max_new_tokens": 64}},
                           {"when": {"metric": "accuracy", "below": 0.1}, "rollout.n": 2}], steps=10)
    assert [(s.at, s.changes) for s in stages] == [(3, {"rollout.n": 8}), (None, {"rollout.max_new_tokens": 64}),
                                                   (None, {"rollout.n": 2})]
    trigger = stages[1].when
    assert (trigger.metric, trigger.threshold, trigger.above, trigger.for_steps) == ("truncated_rate", 0.5, True, 2)
    assert trigger.holds(0.6) and not trigger.holds(0.5) and stages[2].when.holds(0.05) and not stages[2].when.holds(0.1)
    assert stages[1].label == "when truncated_rate above 0.5 for 2 step(s)" and stages[0].label == "at step 3"


@pytest.mark.parametrize("stages, message", [
    ([{"at": 3, "when": {"metric": "accuracy", "above": 0.5}, "rollout.n": 8}], "exactly one of 'at'"),
    ([{"when": {"metric": "kl", "above": 0.5}, "rollout.n": 8}], "metric='kl' must be one of"),
    ([{"when": {"metric": "accuracy", "above": 0.5, "below": 0.2}, "rollout.n": 8}], "exactly one of 'above' or 'below'"),
    ([{"when": {"metric": "accuracy"}, "rollout.n": 8}], "exactly one of 'above' or 'below'"),
    ([{"when": {"metric": "accuracy", "above": 0.5, "for_steps": 0}, "rollout.n": 8}], "for_steps=0 must be"),
    ([{"when": {"metric": "accuracy", "above": 0.5, "patience": 2}, "rollout.n": 8}], "unknown keys"),
    ([{"when": {"metric": "accuracy", "above": 0.5}}], "may change"),
    ([{"when": {"metric": "accuracy", "above": 0.5}, "rollout.n": 8}, {"at": 4, "rollout.n": 4}], "put the 'at' stages first"),
])
def test_bad_stage_triggers_are_refused(stages, message):
    with pytest.raises(ConfigError, match=message):
        parse_stages(stages, steps=10)


@dataclass
class _Setup:  # the two fields of RolloutSetup a stage changes
    n: int
    params: Any


def _curriculum(stages):
    from types import SimpleNamespace

    from rlbench.rollout.engines.base import SamplingParams
    from rlbench.training.curricula import Curriculum

    trainer = SimpleNamespace(prompt_sampler=None, stages=stages, steps=20, prompts_per_step=2, aux_tasks=None)
    params = SamplingParams(max_new_tokens=16)
    ctx = SimpleNamespace(params=params, strategy=SimpleNamespace(setup=_Setup(4, params)))
    return Curriculum(trainer, 0, PROBLEMS), ctx


def test_a_metric_stage_starts_after_its_metric_held_for_its_steps_and_resumes_where_it_was():
    """CAMPO's switch on a training signal (arXiv:2507.14683): truncated_rate above 0.5 for 2 steps in a row; a
    step below resets the count. The stage starts at the step after the second, and a curriculum restored from
    a checkpoint taken between the two steps or after the switch continues as the uninterrupted one."""
    stages = [{"when": {"metric": "truncated_rate", "above": 0.5, "for_steps": 2}, "rollout": {"n": 8, "max_new_tokens": 64}}]
    rates = [0.6, 0.4, 0.7, 0.9, 0.1, 0.2]
    curriculum, ctx = _curriculum(stages)
    states, lengths = {}, []
    for step, rate in enumerate(rates, start=1):
        curriculum.prompts(step, ctx)
        lengths.append((ctx.strategy.setup.n, ctx.params.max_new_tokens))
        curriculum.watch({"truncated_rate": rate})
        states[step] = curriculum.state_dict()
    assert curriculum.entered_at == [5]  # steps 3 and 4 above 0.5 (step 2 broke the first run)
    assert lengths == [(4, 16)] * 4 + [(8, 64)] * 2
    assert curriculum.metrics()["stages_entered"] == 1.0
    for saved in (3, 4, 5):
        resumed, resumed_ctx = _curriculum(stages)
        resumed.load_state_dict(states[saved], resumed_ctx, saved)
        for step, rate in enumerate(rates[saved:], start=saved + 1):
            resumed.prompts(step, resumed_ctx)
            assert (resumed_ctx.strategy.setup.n, resumed_ctx.params.max_new_tokens) == lengths[step - 1]
            resumed.watch({"truncated_rate": rate})
        assert resumed.entered_at == [5]


def test_a_stage_whose_batch_does_not_split_is_refused_before_the_model_loads(make_cfg):
    from rlbench.validation import validate_config

    cfg = make_cfg("experiment=smoke", "algorithm.update.minibatches=2", "trainer.stages=[{at:2,rollout.n:3}]",
                   "trainer.prompts_per_step=1")
    with pytest.raises(ConfigError, match="from trainer.stages at step 2"):
        validate_config(cfg)


@pytest.mark.slow
def test_a_stage_changes_the_group_size_and_length_from_its_step_on(make_cfg):
    import json

    from rlbench.runner import run

    cfg = make_cfg("experiment=smoke", "trainer.steps=3", "eval.before_training=false", "prompt_sampler=hard_focus",
                   "trainer.stages=[{at:2,rollout:{n:3,max_new_tokens:4}}]")
    run(cfg)
    steps = [json.loads(line) for line in open(f"{cfg.output_dir}/metrics.jsonl")]
    assert [s["generated_responses"] for s in steps] == [4.0, 6.0, 6.0]  # 2 prompts x n
    assert steps[0]["response_length"] == 8.0 and steps[1]["response_length"] <= 4.0


def test_a_metric_stage_is_refused_where_processes_or_a_generator_thread_would_disagree(make_cfg):
    from rlbench.validation import validate_config

    stage = "trainer.stages=[{when:{metric:truncated_rate,above:0.5},rollout:{n:3}}]"
    validate_config(make_cfg("experiment=smoke", stage))
    with pytest.raises(ConfigError, match="needs trainer.parallelism=single and trainer.max_staleness=null"):
        validate_config(make_cfg("experiment=smoke", stage, "trainer.max_staleness=0"))


@pytest.mark.slow
def test_a_metric_stage_starts_in_a_run(make_cfg):
    """The tiny random model never ends before the 8-token budget, so truncated_rate is 1 at step 1 and the
    stage starts at step 2 (rlbench.training.loop feeds each step's metrics to the curriculum)."""
    import json

    from rlbench.runner import run

    cfg = make_cfg("experiment=smoke", "trainer.steps=3", "eval.before_training=false",
                   "trainer.stages=[{when:{metric:truncated_rate,above:0.5},rollout:{n:3}}]")
    run(cfg)
    steps = [json.loads(line) for line in open(f"{cfg.output_dir}/metrics.jsonl")]
    assert [s["truncated_rate"] for s in steps][:1] == [1.0]
    assert [s["generated_responses"] for s in steps] == [4.0, 6.0, 6.0]
    assert [s["stages_entered"] for s in steps] == [0.0, 1.0, 1.0]
