"""The cores of the replay methods: RLEP's two-phase pool (arXiv:2507.07451, section 2;
rlbench/rollout/guided/replay_pool.py) and ExGRPO's buckets, retirement and mix with questions already in
the buffer (arXiv:2510.02245, section 3.2; rlbench/rollout/guided/replay.py)."""

import json
import math

import pytest
from conftest import smoke_cli_steps
from test_replay import problem, response, run_steps, strategy_for

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.guided.replay import ReplayBuffer, bucket_weight
from rlbench.rollout.guided.replay_pool import (
    POOL_FORMAT,
    check_pool_questions,
    check_pool_tokenizer,
    read_pool,
)
from rlbench.utils import tokenizer_fingerprint

# ------------------------------------------------------------------------------------------------ RLEP


def collect_pool(path, script, prompts, steps, n=3):
    """RLEP's first run on the scripted engine: no replay, every verified success written to ``path``."""
    strategy, _ = strategy_for(script, {"strategy": "replay", "replay": {"per_group": 0, "pool_save": str(path)}}, n=n)
    runs = run_steps(strategy, prompts, steps)
    assert all(m["replay_responses"] == 0 for _, m in runs)  # the first run replays nothing
    return runs


def test_the_first_run_writes_every_verified_success_keyed_by_question(tmp_path):
    # prompt 0 is right, then wrong; prompt 1 always wrong; prompt 2 wrong, then right (EvenTokenReward: all even)
    script = {0: [[2, 4], [1, 3]], 1: [1, 3], 2: [[1, 1], [6, 8]]}
    runs = collect_pool(tmp_path / "pool.json", script, ["0", "1", "2"], 2)
    pool = read_pool(tmp_path / "pool.json")
    assert pool["format"] == POOL_FORMAT and pool["rollouts"] == 2 and not list(tmp_path.glob(".*tmp-*"))
    assert sorted(pool["questions"]) == ["0", "2"]  # a question enters with its first success
    for uid, tokens, accuracy in (("0", [2, 4], 0.0), ("2", [6, 8], 1.0)):
        entry = pool["questions"][uid]
        assert entry["prompt"] == f"question {uid}" and entry["accuracy"] == accuracy  # the latest fresh accuracy
        assert [r["response_ids"] for r in entry["responses"]] == [tokens] * 3
    # exactly the responses the grader marked correct
    graded = [(g.problems[i].uid, c.response_ids) for g, _ in runs for i, group in enumerate(g.groups)
              for c, ok in zip(group, g.correct.view(len(g.groups), -1)[i].tolist()) if ok > 0]
    stored = [(uid, r["response_ids"]) for uid, e in pool["questions"].items() for r in e["responses"]]
    assert sorted(graded) == sorted(stored)


def test_the_second_run_replays_exactly_the_first_runs_successes_and_fills_nothing_online(tmp_path):
    path = tmp_path / "pool.json"
    collect_pool(path, {0: [2, 4], 1: [1, 3], 2: [[2, 2], [1, 1]]}, ["0", "1", "2"], 2)
    pool = read_pool(path)
    # 2 rollouts of 3: question 0 right 6 times, question 2 right 3 times (its first rollout), question 1 never
    # the second run's own answers are all correct, on questions in and out of the pool: none may be replayed
    rollout = {"strategy": "replay", "replay": {"per_group": 8, "pool": str(path), "behaviour": "recomputed"}}
    strategy, _ = strategy_for({0: [8, 8], 1: [6, 6], 2: [4, 4], 3: [2, 6]}, rollout, n=2)
    steps = run_steps(strategy, ["0", "1", "2", "3"], 3)
    for graded, metrics in steps:
        replayed = {g.problems[i].uid: sorted(c.response_ids for c in group[2:]) for g in [graded]
                    for i, group in enumerate(g.groups)}
        expected = {uid: sorted(r["response_ids"] for r in pool["questions"][uid]["responses"])
                    if uid in pool["questions"] else [] for uid in replayed}
        assert replayed == expected and replayed["0"] == [[2, 4]] * 6 and replayed["2"] == [[2, 2]] * 3
        assert all(c.behaviour == "replay_recomputed" and c.policy_version == -1
                   for group in graded.groups for c in group[2:])
        assert metrics["replay_responses"] == 9 and metrics["replay_buffer_size"] == 9
    assert sorted(strategy.buffer.problems) == ["0", "2"]  # nothing entered online


def test_a_pool_of_another_dataset_or_another_generated_set_is_refused(tmp_path):
    path = tmp_path / "pool.json"
    collect_pool(path, {0: [2, 4]}, ["0"], 1)
    check_pool_questions(path, [problem("0"), problem("5")])  # this run's problems: accepted
    with pytest.raises(ConfigError, match=r"collected on 0 .*this run trains on gsm8k/train: 1 of its 1 questions "
                                          r"do not match \(first: 0: it is not among this run's problems\)"):
        check_pool_questions(path, [Problem("gsm8k/train/0", "q", "1")])
    edited = Problem("0", "question 0, another seed", "a")
    with pytest.raises(ConfigError, match="here it is 'question 0, another seed'"):
        check_pool_questions(path, [edited])


def test_a_pool_of_another_tokenizer_or_prompt_is_refused(tmp_path):
    class Vocab:
        def __init__(self, vocab):
            self.vocab, self.name_or_path = vocab, "tok"

        def get_vocab(self):
            return dict(self.vocab)

    path = tmp_path / "pool.json"
    collect_pool(path, {0: [2, 4]}, ["0"], 1)
    pool = read_pool(path)
    assert pool["tokenizer"] is None  # the scripted tokenizer has no vocabulary
    pool["tokenizer"] = tokenizer_fingerprint(Vocab({"a": 0}))
    check_pool_tokenizer(path, pool, Vocab({"a": 0}))
    with pytest.raises(ConfigError, match="vocabulary differs"):
        check_pool_tokenizer(path, pool, Vocab({"a": 1}))
    # a response sampled under prompt (0,) replayed where this run renders question 0 as another prompt
    data = json.loads(path.read_text())
    for r in data["questions"]["0"]["responses"]:
        r["prompt_ids"] = [99]
    path.write_text(json.dumps(data))
    strategy, _ = strategy_for({0: [2, 4]}, {"strategy": "replay", "replay": {"per_group": 1, "pool": str(path)}})
    with pytest.raises(ConfigError, match="sampled under another prompt"):
        strategy.rollout([problem("0")])


@pytest.mark.parametrize("block, message", [
    ({"per_group": 0}, r"per_group=0 replays nothing.*pool_save=<file>"),
    ({"pool": "x.json", "pool_save": "y.json"}, "set one of them"),
    ({"pool": "/nonexistent/pool.json"}, "no such file"),
])
def test_bad_pool_settings_are_refused_before_anything_loads(block, message):
    from rlbench.config.typed import rollout_config
    from rlbench.rollout import validate_strategy

    with pytest.raises(ConfigError, match=message):
        validate_strategy(rollout_config({"strategy": "replay", "n": 2, "replay": block}), "grpo")


def test_a_file_that_is_not_a_pool_is_refused(tmp_path):
    (tmp_path / "p.json").write_text('{"items": []}')
    with pytest.raises(ConfigError, match="has format None"):
        read_pool(tmp_path / "p.json")


@pytest.mark.slow
def test_rlep_two_runs_from_the_command_line(tmp_path):
    """Phase 1 writes the pool; phase 2 (algorithm=rlep) replays it; a pool of another generated set
    (arith level 2) is refused before the model loads."""
    import subprocess
    import sys

    common = ("dataset.arith.train_size=4", "eval.before_training=false")
    pool = tmp_path / "pool.json"
    smoke_cli_steps(tmp_path / "p1", *common, "rollout=replay_rlep_collect", f"rollout.replay.pool_save={pool}")
    questions = read_pool(pool)["questions"]
    assert questions and all(q["responses"] for q in questions.values())
    steps = smoke_cli_steps(tmp_path / "p2", *common, "algorithm=rlep", "rollout.n=4", f"rollout.replay.pool={pool}")
    stored = sum(len(q["responses"]) for q in questions.values())
    assert all(s["replay_buffer_size"] == stored for s in steps) and sum(s["replay_responses"] for s in steps) > 0
    proc = subprocess.run([sys.executable, "-m", "rlbench.cli", "experiment=smoke", "algorithm=rlep", *common,
                           "dataset.arith.level=2", f"rollout.replay.pool={pool}", f"hydra.run.dir={tmp_path / 'p3'}"],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "do not match" in proc.stderr and "here it is" in proc.stderr
    assert not (tmp_path / "p3" / "metrics.jsonl").exists()


# RLEP's first phase the paper's way: the first run's saved policy sampled on the training questions
# (rlbench mode=generate ... rollout.replay.pool_save, rlbench/guidance/generate.py). The tiny model with the toy
# reward (share of even token ids >= 0.75): of 3 samples per question some questions get successes, some none.
POOL_RUN = ["experiment=smoke", "dataset.arith.train_size=6", "eval.before_training=false", "eval.limit=1", "logger=files"]
SAMPLES = 3


@pytest.fixture(scope="module")
def rlep_checkpoint(tmp_path_factory):
    """A tiny-model policy saved as a run saves it (rlbench.runner.save_policy): the checkpoint to sample."""
    import torch
    from conftest import model_preset

    from rlbench.model import load_policy
    from rlbench.runner import save_policy

    target = tmp_path_factory.mktemp("phase1") / "policy"
    model, tokenizer = load_policy(model_preset("tiny"), device="cpu", dtype=torch.float32, seed=7)
    save_policy(model, tokenizer, target)
    return target


def sample_checkpoint(checkpoint, tmp_path, *extra):
    """``rlbench mode=generate model=checkpoint`` on the training questions: the pool (or, with out=, the traces)."""
    from conftest import compose_config

    from rlbench.runner import run

    return run(compose_config([*POOL_RUN, "mode=generate", "model=checkpoint", f"model.path={checkpoint}",
                               f"rollout.n={SAMPLES}", *extra], tmp_path / f"gen{len(list(tmp_path.iterdir()))}"))


@pytest.mark.slow
def test_a_pool_sampled_from_a_checkpoint_holds_exactly_its_verified_successes_per_question(tmp_path, rlep_checkpoint, caplog):
    from rlbench.reward.toy import EvenTokenReward

    path = tmp_path / "pool.json"
    with caplog.at_level("WARNING", logger="rlbench.guidance.generate"):
        summary = sample_checkpoint(rlep_checkpoint, tmp_path, "rollout=replay_rlep_collect", f"rollout.replay.pool_save={path}")
    # the same samples (one random stream per question) written as graded traces, every verdict kept
    sample_checkpoint(rlep_checkpoint, tmp_path, f"out={tmp_path / 'all.jsonl'}", "guidance.keep_incorrect=true")
    traces = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    uids = sorted({t["uid"] for t in traces})
    assert len(uids) == 6 and all(sum(t["uid"] == uid for t in traces) == SAMPLES for uid in uids)  # k per question
    pool = read_pool(path)
    assert pool["format"] == POOL_FORMAT and pool["rollouts"] == 1 and not list(tmp_path.glob(".*tmp-*"))
    solved = sorted({t["uid"] for t in traces if t["correct"]})
    assert sorted(pool["questions"]) == solved and 0 < len(solved) < len(uids)  # some questions have no success
    grader = EvenTokenReward()
    for uid, entry in pool["questions"].items():
        wanted = [t["response_ids"] for t in traces if t["uid"] == uid and t["correct"]]
        assert [r["response_ids"] for r in entry["responses"]] == wanted  # exactly its verified successes, in order
        assert all(grader("", "", r["response_ids"]).correct for r in entry["responses"])
        assert entry["accuracy"] == len(wanted) / SAMPLES and entry["prompt"] == traces[[t["uid"] for t in traces].index(uid)]["prompt"]
    unsolved = len(uids) - len(solved)
    assert summary["no_success"] == unsolved and summary["questions"] == len(solved) and summary["responses"] == 6 * SAMPLES
    assert summary["written"] == sum(t["correct"] for t in traces)
    assert any(f"{unsolved} of 6 questions have no verified success" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_phase_two_replays_the_token_ids_of_the_checkpoints_pool(tmp_path, rlep_checkpoint, monkeypatch):
    from conftest import compose_config

    from rlbench.rollout.guided.replay import ReplayItem
    from rlbench.runner import run

    path = tmp_path / "pool.json"
    easier = "reward.threshold=0.5"  # successes are likelier: some question holds more than the 2 replayed per group
    sample_checkpoint(rlep_checkpoint, tmp_path, easier, "rollout=replay_rlep_collect", f"rollout.replay.pool_save={path}")
    pool = read_pool(path)
    stored = {(uid, tuple(r["response_ids"])) for uid, e in pool["questions"].items() for r in e["responses"]}
    assert max(len(e["responses"]) for e in pool["questions"].values()) > 2
    replayed = []
    to_completion = ReplayItem.completion

    def recorded(item, request_index, recompute=False):
        completion = to_completion(item, request_index, recompute)
        replayed.append((item.uid, tuple(completion.response_ids), completion.behaviour))
        return completion

    monkeypatch.setattr(ReplayItem, "completion", recorded)
    summary = run(compose_config([*POOL_RUN, easier, "algorithm=rlep", "rollout.n=2", "trainer.prompts_per_step=6",
                                  "trainer.save_model=false", f"rollout.replay.pool={path}"], tmp_path / "phase2"))
    steps = [json.loads(line) for line in (tmp_path / "phase2" / "metrics.jsonl").read_text().splitlines()]
    assert summary and len(steps) == 2
    # every question of the pool is in every step (6 prompts of 6): each gets min(2, its successes) replayed
    per_step = sum(min(2, len(e["responses"])) for e in pool["questions"].values())
    assert len(replayed) == 2 * per_step and all(s["replay_responses"] == per_step for s in steps)
    assert {(uid, ids) for uid, ids, _ in replayed} <= stored and {b for *_, b in replayed} == {"replay_recomputed"}
    assert len({(uid, ids) for uid, ids, _ in replayed}) > len(pool["questions"])  # more than one stored response of some
    assert all(s["replay_buffer_size"] == len(stored) for s in steps)


def test_sampling_a_checkpoint_with_other_settings_than_its_run_is_named(tmp_path, caplog):
    """RLEP samples the first run's policy with that run's rollout settings on its training questions: a
    difference from the config.yaml of the run that saved the policy is named in a warning."""
    from conftest import compose_config
    from omegaconf import OmegaConf

    from rlbench.guidance.generate import warn_unlike_training_run

    run_dir = tmp_path / "phase1"
    (run_dir / "policy").mkdir(parents=True)
    OmegaConf.save(compose_config(POOL_RUN, run_dir), run_dir / "config.yaml", resolve=True)
    assert warn_unlike_training_run(compose_config([*POOL_RUN, "rollout.n=8"], tmp_path / "g"), run_dir / "policy") == []
    other = compose_config([*POOL_RUN, "rollout.temperature=0.7", "dataset.arith.level=2"], tmp_path / "g")
    with caplog.at_level("WARNING", logger="rlbench.guidance.generate"):
        assert warn_unlike_training_run(other, run_dir / "policy") == ["dataset.arith.level", "rollout.temperature"]
    assert "rollout.temperature: 1.0 there, 0.7 here" in caplog.text
    assert warn_unlike_training_run(other, tmp_path / "elsewhere" / "policy") == []  # not a run's saved policy


@pytest.mark.parametrize("overrides, message", [
    (["mode=generate", "model=checkpoint", "model.path=/nonexistent/run/policy", "rollout=replay_rlep_collect",
      "rollout.replay.pool_save=pool.json"], "does not exist"),
    (["mode=generate", "rollout=replay_rlep_collect", "rollout.replay.pool_save=pool.json", "out=t.jsonl"],
     "writes one file"),
    (["mode=generate", "rollout=replay_rlep_collect", "rollout.replay.pool_save=pool.json", "guidance.keep_incorrect=true"],
     "verified successes only"),
    (["algorithm=rlep", "rollout.replay.pool=/nonexistent/pool.json"], "no such file"),
    (["algorithm=rlep", "rollout.replay.pool={malformed}"], "a response of question arith/train/0 lacks response_ids"),
])
def test_a_bad_checkpoint_or_pool_is_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, message):
    from conftest import compose_config

    import rlbench.guidance.generate
    import rlbench.runner
    from rlbench.runner import run

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(rlbench.runner, "load_policy", no_model)
    monkeypatch.setattr(rlbench.guidance.generate, "load_policy", no_model)
    malformed = tmp_path / "malformed.json"
    entry = {"prompt": "p", "answer": "1", "meta": {}, "accuracy": 1.0, "responses": [{"prompt_ids": [1], "text": "x"}]}
    malformed.write_text(json.dumps({"format": POOL_FORMAT, "model": "tiny", "tokenizer": None, "datasets": ["arith/train"],
                                     "rollouts": 1, "questions": {"arith/train/0": entry}}))
    overrides = [o.replace("{malformed}", str(malformed)) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        run(compose_config([*POOL_RUN, *overrides], tmp_path / "run"))


# ---------------------------------------------------------------------------------------------- ExGRPO


def exgrpo_buffer(**kw):
    return ReplayBuffer(capacity=1000, seed=0, weighting="accuracy_gaussian", weight_mean=0.5, weight_std=0.125,
                        trajectory="lowest_entropy", retire_solved=True, **kw)


def observe_k_of_8(buffer, uid, k):
    """A fresh group of 8 for question ``uid`` with ``k`` correct responses."""
    buffer.observe(problem(uid), [response([2 * i + 2]) for i in range(8)], [i < k for i in range(8)])


def test_exgrpo_a_question_lands_in_the_bucket_of_its_latest_accuracy():
    buffer = exgrpo_buffer()
    for k in range(9):
        observe_k_of_8(buffer, str(k), k)
    # k = 0: no success, never held; k = 8: retired; 1..7 held, each in its own bucket k/8
    assert sorted(buffer.problems) == [str(k) for k in range(1, 8)] and buffer.retired == {"8"}
    probs = buffer.question_probabilities()
    weights = {str(k): math.exp(-0.5 * ((k / 8 - 0.5) / 0.125) ** 2) for k in range(1, 8)}  # N(k; 4, 1) over k
    assert probs == pytest.approx({uid: w / sum(weights.values()) for uid, w in weights.items()})
    assert max(probs, key=probs.get) == "4" and probs["3"] == pytest.approx(probs["5"])  # peaks at k = n/2
    assert bucket_weight(5 / 8, 0.5, 0.125) == pytest.approx(math.exp(-0.5))
    # question 3 is answered 6 of 8 now: it moves to bucket 6/8, sharing it with question 6
    observe_k_of_8(buffer, "3", 6)
    probs = buffer.question_probabilities()
    assert buffer.accuracy["3"] == 0.75 and probs["3"] == pytest.approx(probs["6"])
    assert probs["3"] + probs["6"] == pytest.approx(weights["6"] / (sum(weights.values()) - weights["3"]))


def test_exgrpo_a_question_failing_every_fresh_response_now_is_not_drawn():
    """ExGRPO's eligibility 0 < k (arXiv:2510.02245, section 3.2): a held question answered 0 of 8 now keeps its
    stored successes but is not drawn. Before the fix it kept the weight N(0; 0.5, 0.125) = e^-8 of bucket 0."""
    buffer = exgrpo_buffer()
    observe_k_of_8(buffer, "a", 4)
    observe_k_of_8(buffer, "b", 2)
    observe_k_of_8(buffer, "b", 0)
    assert len(buffer.stored("b")) == 2 and buffer.accuracy["b"] == 0.0
    assert buffer.question_probabilities() == {"a": 1.0}
    assert {p.uid for _ in range(50) for p in buffer.sample_questions(2)} == {"a"}


def test_exgrpo_always_solved_questions_are_retired_and_never_come_back():
    buffer = exgrpo_buffer()
    observe_k_of_8(buffer, "a", 3)
    observe_k_of_8(buffer, "b", 5)
    assert len(buffer.stored("a")) == 3
    observe_k_of_8(buffer, "a", 8)  # solved by every fresh response: retired, its successes dropped
    assert buffer.retired == {"a"} and not buffer.stored("a") and "a" not in buffer.question_probabilities()
    observe_k_of_8(buffer, "a", 2)  # it fails again later: still retired
    assert not buffer.stored("a") and list(buffer.question_probabilities()) == ["b"]
    assert all(p.uid == "b" for _ in range(20) for p in buffer.sample_questions(1))


@pytest.mark.parametrize("prompts_per_step, buffer_questions", [(4, 2), (8, 4), (2, 1)])
def test_exgrpo_mixes_half_buffer_questions_each_with_one_replayed_and_n_minus_one_fresh(prompts_per_step, buffer_questions):
    """The mix of every step once replay has started (arXiv:2510.02245, section 3.2: 50% experiential
    questions with 1 replayed + 7 fresh responses, 50% fresh questions with 8 fresh)."""
    rollout = {"strategy": "replay", "replay": {"per_group": 1, "questions": "buffer", "buffer_share": 0.5, "replace_fresh": True,
                                                 "weighting": "accuracy_gaussian", "weight_std": 0.125,
                                                 "trajectory": "lowest_entropy", "retire_solved": True}}
    held = [str(100 + i) for i in range(8)]
    script = {int(uid): [[2, 4], [1, 3]] for uid in held} | {i: [1, 3] for i in range(8)}
    strategy, engine = strategy_for(script, rollout, n=8)
    for uid in held:  # questions already in the buffer, each answered 4 of 8 before
        observe_k_of_8(strategy.buffer, uid, 4)
    fresh = [str(i) for i in range(prompts_per_step)]
    for graded, metrics in run_steps(strategy, fresh, 2):
        replayed = [sum(c.behaviour == "replay" for c in group) for group in graded.groups]
        assert [p.uid for p in graded.problems][: prompts_per_step - buffer_questions] == fresh[: prompts_per_step - buffer_questions]
        assert all(p.uid in held for p in graded.problems[prompts_per_step - buffer_questions:])
        assert replayed == [0] * (prompts_per_step - buffer_questions) + [1] * buffer_questions
        assert [len(g) for g in graded.groups] == [8] * prompts_per_step
        assert metrics["replay_responses"] == buffer_questions and metrics["replay_shortfall"] == 0
    assert engine.calls[-1][-1][1] == 7  # a buffer question's fresh responses: n - 1
