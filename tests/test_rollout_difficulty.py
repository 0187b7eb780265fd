"""DART's difficulty-adaptive rollout (rlbench/rollout/guided/difficulty_adaptive.py): the (n, budget) table on
a hand-made statistics store, the engine calls it makes, success injection, equivalence with iid when
every prompt is in the default tier, variable group sizes through the advantage, and the refusals."""

import json
import math

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.validation import validate_config
from rlbench.errors import ConfigError
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.guided.difficulty_adaptive import DifficultyOptions, difficulty_tier, rollout_plan
from rlbench.training.prompt_stats import PromptStats, PromptStatsStore
from rlbench.training.step import TIMING_METRICS, stamp_policy_version
from test_curricula import PROBLEMS, graded
from test_replay import ScriptedEngine, Tokenizer, problem


def table():
    """A hand-made statistics store: uid -> (attempts, correct) overall and at the last step."""
    store = PromptStatsStore()
    rows = {"hard": (10, 1, 4, 2), "low_edge": (10, 2, 4, 0), "mid": (10, 5, 4, 2), "high_edge": (10, 8, 4, 4),
            "easy": (10, 9, 4, 1)}
    for uid, (attempts, correct, recent_attempts, recent_correct) in rows.items():
        store.stats[uid] = PromptStats(attempts, correct, 0, 3, recent_attempts, recent_correct)
    return store


def test_the_tier_and_the_plan_follow_the_formula_on_a_hand_made_table():
    options = DifficultyOptions(n_min=2, n_max=8, acc_low=0.2, acc_high=0.8, hard_length_scale=1.5, easy_length_scale=0.5)
    store = table()
    uids = ["hard", "low_edge", "mid", "high_edge", "easy", "unseen"]
    rates = [store.get(u).pass_rate for u in uids]
    assert rates[:5] == [0.1, 0.2, 0.5, 0.8, 0.9] and math.isnan(rates[5])
    # a < 0.2 hard; a > 0.8 easy; the thresholds themselves and unseen prompts: default
    assert [difficulty_tier(a, 0.2, 0.8) for a in rates] == ["hard", "default", "default", "default", "easy", "default"]
    assert rollout_plan(rates, options, n=4, max_new_tokens=7) == [(8, 11), (4, 7), (4, 7), (4, 7), (2, 3), (4, 7)]
    # the recent pass rate (the last step's group): 0.5, 0, 0.5, 1, 0.25
    recent = [store.get(u).recent_pass_rate for u in uids[:5]]
    assert recent == [0.5, 0.0, 0.5, 1.0, 0.25]
    assert [n for n, _ in rollout_plan(recent, options, 4, 7)] == [4, 8, 4, 2, 4]


def test_the_store_keeps_the_last_steps_counts_as_the_recent_pass_rate():
    store = PromptStatsStore()
    store.observe(1, graded(PROBLEMS[:2], [[2, 4], [3]], [[1, 0], [1]]))
    store.observe(2, graded(PROBLEMS[:1], [[6, 8, 2]], [[0, 0, 1]]))
    store.observe(2, graded(PROBLEMS[:1], [[6]], [[0]]))  # drawn twice in step 2: its groups add up
    a, b = store.get("0"), store.get("1")
    assert (a.pass_rate, a.recent_attempts, a.recent_correct, a.recent_pass_rate) == (2 / 6, 4, 1, 0.25)
    assert (b.recent_attempts, b.recent_pass_rate) == (1, 1.0) and math.isnan(store.get("9").recent_pass_rate)


def strategy_for(script, block, store, n=4, max_new_tokens=4):
    class Sampler(GroupSampler):
        def sample(self, problems, n, params, generator, prompt_ids=None):
            self.engine.budgets.append(params.max_new_tokens)
            return super().sample(problems, n, params, generator, [(int(p.uid),) for p in problems])

    engine = ScriptedEngine(script)
    engine.budgets = []
    sampler = Sampler(engine, EvenTokenReward(threshold=0.75), Tokenizer(), {}, lambda r, _: r)
    cfg = rollout_config({"n": n, "strategy": "difficulty_adaptive", "difficulty_adaptive": block})
    validate_strategy(cfg, "grpo")
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, max_new_tokens), None, 0, None, store)
    return make_strategy(cfg, setup), engine


def test_group_sizes_and_budgets_follow_each_prompts_accuracy_in_one_call_per_budget():
    store = PromptStatsStore()
    store.stats["0"] = PromptStats(4, 0)  # hard
    store.stats["1"] = PromptStats(4, 4)  # easy
    block = {"n_min": 2, "n_max": 6, "hard_length_scale": 2.0, "easy_length_scale": 0.5, "inject": 0}
    strategy, engine = strategy_for({0: [1, 3], 1: [2, 4], 2: [2, 2]}, block, store)
    graded, metrics = strategy.rollout([problem("0"), problem("1"), problem("2")])
    assert [len(g) for g in graded.groups] == [6, 2, 4]
    assert engine.budgets == [2, 4, 8] and engine.calls == [[(1, 2)], [(2, 4)], [(0, 6)]]  # ascending budgets
    assert metrics["difficulty_hard_fraction"] == metrics["difficulty_easy_fraction"] == 1 / 3
    assert metrics["difficulty_responses_per_prompt"] == 4.0
    assert graded.group_index.tolist() == [0] * 6 + [1] * 2 + [2] * 4


def test_groups_of_different_sizes_get_their_own_mean_and_std_in_the_advantage():
    # group 0: [1, 0] mean 1/2 std sqrt(1/2); group 1: [1, 1, 0] mean 2/3 std sqrt(1/3) (unbiased)
    adv = grpo_advantage(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1, 1]), torch.ones(5, 1))
    expected = [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), (1 / 3) / math.sqrt(1 / 3), (1 / 3) / math.sqrt(1 / 3),
                -(2 / 3) / math.sqrt(1 / 3)]
    assert torch.allclose(adv[:, 0], torch.tensor(expected), atol=1e-5)


def test_a_group_without_a_success_gets_a_stored_one_of_its_question():
    # prompt 0 is right at the first call, then always wrong: at step 2 its stored success is injected
    store = PromptStatsStore()
    strategy, engine = strategy_for({0: [[2, 4], [1, 3], [1, 3]], 1: [1, 3]}, {"inject": 1}, store, n=2, max_new_tokens=2)
    first, m1 = strategy.rollout([problem("0"), problem("1")])
    stamp_policy_version(first, 0)
    second, m2 = strategy.rollout([problem("0"), problem("1")])
    assert m1["replay_responses"] == 0 and m1["difficulty_unsolved_fraction"] == 0.5
    assert [len(g) for g in second.groups] == [3, 2] and m2["replay_responses"] == 1  # prompt 1 never had a success
    injected = second.groups[0][-1]
    assert injected.behaviour == "replay" and injected.policy_version == 0 and injected.response_ids == [2, 4]
    assert second.correct.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


class RandomEngine:
    """Responses drawn from the generator: equal outputs mean equal calls in equal order."""

    def generate(self, requests, params, generator=None):
        return [[Completion(i, r.prompt_ids, torch.randint(0, 10, (params.max_new_tokens,), generator=generator).tolist(),
                            [-1.0] * params.max_new_tokens, True) for _ in range(r.n)] for i, r in enumerate(requests)]


def test_every_prompt_in_the_default_tier_samples_what_iid_samples():
    store = table()  # hard, easy and default prompts, but thresholds 0 and 1 put every one in the default tier
    prompts = [problem(u) for u in ["hard", "mid", "easy", "unseen"]]
    out = {}
    for name, rollout in [("iid", {"strategy": "iid"}),
                          ("difficulty", {"strategy": "difficulty_adaptive",
                                          "difficulty_adaptive": {"acc_low": 0.0, "acc_high": 1.0, "inject": 0}})]:
        sampler = GroupSampler(RandomEngine(), EvenTokenReward(threshold=0.75), Tokenizer(), {}, lambda r, _: r)
        sampler.encode = lambda problems: [(7,) for _ in problems]  # no tokenizer needed
        setup = RolloutSetup(sampler, 4, SamplingParams(1.0, 1.0, 5), torch.Generator().manual_seed(3), 0, None, store)
        graded, _ = make_strategy(rollout_config({"n": 4, **rollout}), setup).rollout(prompts)
        out[name] = graded
    assert [[c.response_ids for c in g] for g in out["iid"].groups] == [[c.response_ids for c in g] for g in out["difficulty"].groups]
    assert torch.equal(out["iid"].rewards, out["difficulty"].rewards)


@pytest.mark.parametrize("block, message", [
    ({"n_min": 8, "n_max": 4}, "n_min=8 > n_max=4"),
    ({"n_min": 1}, "n_min=1: a group needs >= 2"),
    ({"n_min": 2, "n_max": 3}, r"n_min=2 <= rollout.n=4 <= n_max=3 is required"),
    ({"acc_low": 0.8, "acc_high": 0.2}, "0 <= acc_low <= acc_high <= 1"),
    ({"acc_high": 1.5}, "0 <= acc_low <= acc_high <= 1"),
    ({"accuracy": "ema"}, "accuracy='ema'"),
    ({"hard_length_scale": 0.5}, "hard_length_scale=0.5 must be >= 1"),
    ({"easy_length_scale": 0.0}, r"easy_length_scale=0.0 must be in \(0, 1\]"),
    ({"inject": -1}, "inject=-1 must be >= 0"),
    ({"inject_behaviour": "fresh"}, "inject_behaviour='fresh'"),
    ({"n_mx": 8}, "has no key"),
])
def test_bad_options_are_refused_before_anything_loads(block, message):
    with pytest.raises(ConfigError, match=message):
        validate_strategy(rollout_config({"strategy": "difficulty_adaptive", "n": 4, "difficulty_adaptive": block}), "grpo")


@pytest.mark.parametrize("overrides, message", [
    (["trainer.prompts_per_step=1", "rollout.n=4", "algorithm.update.minibatches=4", "trainer.micro_batch_size=1"],
     r"every prompt easy a step has trainer.prompts_per_step \* n_min = 1 \* 2 = 2 responses, fewer than"),
    (["trainer.stages=[{at:2,rollout.n:16}]"], r"from trainer.stages at step 2: .*rollout.n=16 <= n_max=8"),
    (["rollout.difficulty_adaptive.hard_length_scale=2",
      "algorithm.reward_shaping=[{name: dapo_overlong, cache_fraction: 0.25}]"], r"reads one budget \(max_length\)"),
])
def test_a_run_whose_batch_cannot_be_formed_is_refused(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg("experiment=smoke", "algorithm=dart", *overrides))
    validate_config(make_cfg("experiment=smoke", "algorithm=dart"))


@pytest.mark.slow
def test_with_every_prompt_default_and_no_injection_a_run_equals_the_iid_run(tmp_path):
    from conftest import compose_config
    from rlbench.runner import run

    def metrics(name, *overrides):
        run(compose_config(["experiment=smoke", "trainer.steps=3", "eval.before_training=false", "logger=files",
                            *overrides], tmp_path / name))
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    iid = metrics("iid")
    adaptive = metrics("adaptive", "rollout=difficulty_adaptive", "rollout.difficulty_adaptive.acc_low=0",
                       "rollout.difficulty_adaptive.acc_high=1", "rollout.difficulty_adaptive.inject=0")
    for a, b in zip(iid, adaptive, strict=True):
        ours = {k for k in b if k.startswith("difficulty_") or k.startswith("replay_")}
        assert {k: v for k, v in a.items() if k not in TIMING_METRICS} == \
               {k: v for k, v in b.items() if k not in TIMING_METRICS | ours}


# ---------------------------------------------------------------- DART's pre-collected successes (pool)


def test_a_pool_is_injected_only_into_groups_without_a_success_and_only_with_its_own_token_ids(tmp_path):
    from test_replay_cores import collect_pool

    from rlbench.rollout.guided.replay_pool import read_pool

    # before training: questions 0 and 1 solved ([2, 4], [6, 8]), question 2 never (not in the pool)
    path = tmp_path / "pool.json"
    collect_pool(path, {0: [2, 4], 1: [6, 8], 2: [1, 3]}, ["0", "1", "2"], 1)
    pool = read_pool(path)
    assert sorted(pool["questions"]) == ["0", "1"]
    # the run: 0 always wrong; 1 right with another answer ([2, 2]), then wrong; 2 and 3 always wrong
    script = {0: [1, 3], 1: [[2, 2], [1, 1]], 2: [1, 1], 3: [1, 5]}
    strategy, _ = strategy_for(script, {"inject": 1, "pool": str(path)}, PromptStatsStore(), n=2, max_new_tokens=2)
    prompts = [problem(u) for u in "0123"]
    first, m1 = strategy.rollout(prompts)
    stamp_policy_version(first, 0)
    second, m2 = strategy.rollout(prompts)
    stamp_policy_version(second, 1)
    # step 1: only group 0 (no success, in the pool) gets one; 1 is solved; 2 and 3 have nothing in the pool
    assert [len(g) for g in first.groups] == [3, 2, 2, 2] and m1["replay_responses"] == 1
    # step 2: 1 fails now and gets the pool's [6, 8], never its own success of step 1 ([2, 2]): nothing online
    assert [len(g) for g in second.groups] == [3, 3, 2, 2] and m2["replay_responses"] == 2
    for step, group, tokens in ((first, 0, [2, 4]), (second, 0, [2, 4]), (second, 1, [6, 8])):
        injected = step.groups[group][-1]
        stored = pool["questions"][str(group)]["responses"][0]
        assert injected.response_ids == tokens == stored["response_ids"]
        assert list(injected.prompt_ids) == stored["prompt_ids"] == list(step.groups[group][0].prompt_ids)
        assert injected.logprobs == stored["logprobs"] and injected.behaviour == "replay" and injected.policy_version == -1
    assert m1["replay_buffer_size"] == m2["replay_buffer_size"] == 6 == len(strategy.buffer)  # the pool: 2 x 3
    assert second.correct.tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0, 0]


def test_a_pool_sampled_under_another_prompt_is_refused_when_injected(tmp_path):
    from test_replay_cores import collect_pool

    path = tmp_path / "pool.json"
    collect_pool(path, {0: [2, 4]}, ["0"], 1)
    data = json.loads(path.read_text())
    for r in data["questions"]["0"]["responses"]:
        r["prompt_ids"] = [99]
    path.write_text(json.dumps(data))
    strategy, _ = strategy_for({0: [1, 3]}, {"inject": 1, "pool": str(path)}, PromptStatsStore(), n=2, max_new_tokens=2)
    with pytest.raises(ConfigError, match=r"rollout.difficulty_adaptive.pool=.*question 0 was sampled under another prompt"):
        strategy.rollout([problem("0")])


@pytest.mark.parametrize("overrides, message", [
    (["rollout.difficulty_adaptive.pool=/nonexistent/pool.json"], r"rollout.difficulty_adaptive.pool=/nonexistent/pool.json: no such file"),
    (["rollout.difficulty_adaptive.pool={malformed}"], r"rollout.difficulty_adaptive.pool=.* is malformed: a response of question arith/train/0 lacks response_ids"),
    (["rollout.difficulty_adaptive.pool={not_a_pool}"], r"rollout.difficulty_adaptive.pool=.* has format None"),
    (["rollout.difficulty_adaptive.pool={other_questions}"], r"rollout.difficulty_adaptive.pool=.* 1 of its 1 questions do not match"),
    (["rollout.difficulty_adaptive.pool={other_questions}", "rollout.difficulty_adaptive.inject=0"], "with inject=0 injects nothing"),
])
def test_a_missing_or_malformed_pool_is_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, message):
    from conftest import compose_config

    import rlbench.runner
    from rlbench.rollout.guided.replay_pool import POOL_FORMAT
    from rlbench.runner import run

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(rlbench.runner, "load_policy", no_model)
    response = {"prompt_ids": [1], "response_ids": [2], "logprobs": [-1.0], "finished": True, "text": "2", "policy_version": 0}
    files = {"malformed": {"arith/train/0": {"prompt": "p", "answer": "1", "meta": {}, "accuracy": 1.0,
                                             "responses": [{"prompt_ids": [1], "text": "x"}]}},
             "other_questions": {"gsm8k/train/0": {"prompt": "p", "answer": "1", "meta": {}, "accuracy": 1.0,
                                                   "responses": [response]}}}
    paths = {}
    for name, questions in files.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"format": POOL_FORMAT, "model": "tiny", "tokenizer": None,
                                           "datasets": ["x"], "rollouts": 1, "questions": questions}))
    paths["not_a_pool"] = tmp_path / "not_a_pool.json"
    paths["not_a_pool"].write_text('{"items": []}')
    overrides = [o.format(**paths) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        run(compose_config(["experiment=smoke", "algorithm=dart", "eval.before_training=false", "logger=files", *overrides],
                           tmp_path / "run"))


@pytest.mark.slow
def test_paper_dart_with_experiment_smoke_runs_asynchronously(tmp_path):
    """paper=dart sets trainer.max_staleness=1 and weight_sync_every=2 (DART's decoupled trainer and rollout
    service): its smoke run goes through the generator thread (rlbench/training/async_pipeline.py), so batch 2 is
    sampled by version 0 while version 1 trains (staleness 1), and the summary reports the pipeline."""
    from conftest import compose_config

    from rlbench.runner import run

    summary = run(compose_config(["paper=dart", "experiment=smoke", "dataset=arith", "eval.before_training=false",
                                  "eval.limit=1", "eval.n=1", "eval.k=[1]", "trainer.save_model=false", "logger=files"],
                                 tmp_path))
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["max_staleness"] == 1 and summary["weight_sync_every"] == 2
    assert summary["async_weight_syncs"] == 1 and summary["async_dropped_batches"] == 0  # versions 0 (g = 0, 0)
    assert [s["staleness"] for s in steps] == [0.0, 1.0]
    assert all(s["token_mask_kept"] < 1 for s in steps)  # DART's high-entropy token mask is on
