"""Offline preference files (``rollout=offline rollout.offline.file=<path>``, rlbench/rollout/guided/offline_files.py):
pairs, responses and rankings read into the same groups (JSONL, JSON, Parquet, CSV), conversational records
(TRL's lists of chat messages, the implicit prompt too) as the text records they stand for, every kind of bad input
counted and reported in one line, ``on_bad=stop`` refusing with the counts, an empty set always refused, and a
DPO run from the command line on the tiny model."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config, model_preset  # noqa: E402

from rlbench.algorithm.aggregation import group_mean  # noqa: E402
from rlbench.algorithm.losses.preference import dpo_loss, preference_pairs  # noqa: E402
from rlbench.dataset.base import Problem  # noqa: E402
from rlbench.errors import ConfigError, DataError  # noqa: E402
from rlbench.utils import tokenizer_fingerprint  # noqa: E402
from rlbench.model import load_policy  # noqa: E402
from rlbench.rollout.engines.base import SamplingParams  # noqa: E402
from rlbench.rollout.groups import GroupSampler  # noqa: E402
from rlbench.rollout.guided.offline import Offline  # noqa: E402
from rlbench.rollout.guided.offline_files import (  # noqa: E402
    BAD_KINDS, chat_template_fingerprint, rank_rewards, read_offline_file,
)
from rlbench.rollout.strategy import RolloutSetup  # noqa: E402

ARITH_PROMPT = {"system": None, "user": "Compute {problem}. Reply with only the final number."}
PAIRS = [("2+3", "5", "6"), ("4+4", "8", "9 apples"), ("1+6", "The answer is 7", "It is 8")]


@pytest.fixture(scope="module")
def policy():
    """The tiny model (the policy) and another seed's weights (the reference), with their tokenizer."""
    model, tokenizer = load_policy(model_preset("tiny"), seed=0)
    reference, _ = load_policy(model_preset("tiny"), seed=1)
    return model, reference, tokenizer


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def offline(tokenizer, path, problems=(), max_new_tokens=32, **options):
    """The strategy on ``path`` with the file's groups built (nothing is sampled: no engine, no grader)."""
    sampler = GroupSampler(engine=None, grader=None, tokenizer=tokenizer, prompt_spec=ARITH_PROMPT, shape_rewards=lambda r, _: r)
    setup = RolloutSetup(sampler, n=2, params=SamplingParams(max_new_tokens=max_new_tokens), generator=None)
    strategy = Offline(setup, file=str(path), **options)
    return strategy, strategy.training_problems(list(problems))


def sequence_log_probs(model, graded):
    """[B, T] log pi(y_t | x, y_<t) of every response of ``graded`` under ``model``, and the response mask."""
    rows = [c for group in graded.groups for c in group]
    width = max(len(c.response_ids) for c in rows)
    logp, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    with torch.no_grad():
        for i, c in enumerate(rows):
            ids = torch.tensor([[*c.prompt_ids, *c.response_ids]])
            logits = model(ids).logits[0, len(c.prompt_ids) - 1:-1]
            response = torch.tensor(c.response_ids)
            logp[i, :len(response)] = F.log_softmax(logits.float(), -1).gather(-1, response[:, None])[:, 0]
            mask[i, :len(response)] = 1
    return logp, mask


def batch_of(graded):
    """What the trainer reads of a batch: per group its prompt ids, and per response its ids, reward and group."""
    return ([[(tuple(c.prompt_ids), tuple(c.response_ids)) for c in group] for group in graded.groups],
            graded.rewards.tolist(), graded.group_index.tolist())


def test_pairs_responses_and_rankings_give_the_same_batch_and_dpo_loss(tmp_path, policy):
    model, reference, tokenizer = policy
    files = {
        "pairs": write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]),
        "responses": write_jsonl(tmp_path / "responses.jsonl", [
            {"prompt": p, "responses": [{"text": c, "reward": 1}, {"text": r, "reward": 0}]} for p, c, r in PAIRS]),
        "ranking": write_jsonl(tmp_path / "ranking.jsonl", [{"prompt": p, "ranking": [c, r]} for p, c, r in PAIRS]),
    }
    batches, losses = {}, {}
    for name, path in files.items():
        assert read_offline_file(str(path)).format == name  # auto: the first record's keys
        strategy, problems = offline(tokenizer, path)
        assert [p.prompt for p in problems] == [p for p, _, _ in PAIRS]
        graded, metrics = strategy.rollout(problems)
        assert metrics == {"offline_skipped_prompts": 0.0, "offline_groups": 3.0}
        batches[name] = batch_of(graded)
        logp, mask = sequence_log_probs(model, graded)
        ref, _ = sequence_log_probs(reference, graded)
        matrix, _ = dpo_loss(logp, ref, mask, graded.rewards, graded.group_index, beta=0.1)
        losses[name] = group_mean(matrix, mask, batch_groups=len(graded.groups)).item()
        # the closed form: each group is (chosen, rejected), rewards (1, 0); l = -log sigma(beta (Delta_w - Delta_l))
        delta = ((logp - ref) * mask).sum(-1)
        closed = -F.logsigmoid(0.1 * (delta[0::2] - delta[1::2])).mean().item()
        assert losses[name] == pytest.approx(closed, rel=1e-5)
    assert batches["pairs"] == batches["responses"] == batches["ranking"]
    groups, rewards, index = batches["pairs"]
    assert rewards == [1.0, 0.0] * 3 and index == [0, 0, 1, 1, 2, 2]
    expected = tokenizer.encode("9 apples", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert groups[1][1][1] == tuple(expected)  # the text re-tokenised, EOS appended
    # the prompt is templated as online: the run's dataset template, then the chat template
    assert groups[0][0][0] == tuple(GroupSampler(None, None, tokenizer, ARITH_PROMPT, None).encode(
        [Problem("x", "2+3", "")])[0])
    assert losses["pairs"] == losses["responses"] == losses["ranking"]
    assert abs(losses["pairs"] - math.log(2)) > 1e-4  # another model as the reference: not the trivial log 2


def test_a_ranking_gives_rewards_by_rank_so_the_pairings_see_its_order(tmp_path, policy):
    _, _, tokenizer = policy
    path = write_jsonl(tmp_path / "ranking.jsonl", [{"prompt": "3*3", "ranking": ["9", "8", "10", "nine?"]}])
    strategy, problems = offline(tokenizer, path)
    graded, _ = strategy.rollout(problems)
    assert graded.rewards.tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    assert rank_rewards(2) == (1.0, 0.0)
    winners, losers, _ = preference_pairs(graded.rewards, graded.group_index, "adjacent")
    assert list(zip(winners.tolist(), losers.tolist())) == [(0, 1), (1, 2), (2, 3)]
    winners, losers, _ = preference_pairs(graded.rewards, graded.group_index, "all")
    assert sorted(zip(winners.tolist(), losers.tolist())) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert graded.correct.tolist() == [1.0, 0.0, 0.0, 0.0]  # correct: the top reward 1 only


def test_json_parquet_and_csv_files_read_as_the_jsonl_file(tmp_path):
    import datasets

    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    expected = read_offline_file(str(write_jsonl(tmp_path / "pairs.jsonl", records)))
    (tmp_path / "pairs.json").write_text(json.dumps(records))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "pairs.parquet"))
    datasets.Dataset.from_list(records).to_csv(str(tmp_path / "pairs.csv"), index=False)
    ranked = [{"prompt": p, "ranking": json.dumps([c, r])} for p, c, r in PAIRS]  # CSV: the list as JSON text
    datasets.Dataset.from_list(ranked).to_csv(str(tmp_path / "ranking.csv"), index=False)
    content = lambda source: [(g.prompt, g.texts, g.rewards) for g in source.groups]  # noqa: E731
    for name in ("pairs.json", "pairs.parquet", "pairs.csv", "ranking.csv"):
        source = read_offline_file(str(tmp_path / name))
        assert content(source) == content(expected), name
        assert source.groups[1].where == f"{tmp_path / name}:row 2"
    # CSV cells are text as written: a numeric column stays text, an empty cell is an empty response
    (tmp_path / "numbers.csv").write_text("prompt,chosen,rejected\n2+3,5,6\n4+4,8,\n")
    source = read_offline_file(str(tmp_path / "numbers.csv"))
    assert [(g.prompt, g.texts) for g in source.groups] == [("2+3", ("5", "6"))]
    assert source.counts["empty"] == 1 and source.examples["empty"].endswith("numbers.csv:row 2")
    with pytest.raises(ConfigError, match="reads .jsonl and"):
        read_offline_file(str(write_jsonl(tmp_path / "pairs.txt", records)))


def user(content):
    return {"role": "user", "content": content}


def assistant(content):
    return {"role": "assistant", "content": content}


def test_conversational_records_train_the_groups_of_the_text_records(tmp_path, policy):
    import datasets

    _, _, tokenizer = policy
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    # TRL's conversational format: a prompt of one user message, responses of one assistant message each
    explicit = [{"prompt": [user(p)], "chosen": [assistant(c)], "rejected": [assistant(r)]} for p, c, r in PAIRS]
    # TRL's implicit prompt: whole conversations sharing their leading messages
    implicit = [{"chosen": [user(p), assistant(c)], "rejected": [user(p), assistant(r)]} for p, c, r in PAIRS]
    files = {"conversational.jsonl": write_jsonl(tmp_path / "conversational.jsonl", explicit),
             "implicit.jsonl": write_jsonl(tmp_path / "implicit.jsonl", implicit)}
    for name, records in (("conversational.parquet", explicit), ("implicit.parquet", implicit)):
        datasets.Dataset.from_list(records).to_parquet(str(tmp_path / name))
        files[name] = tmp_path / name
    (tmp_path / "conversational.json").write_text(json.dumps(explicit))
    files["conversational.json"] = tmp_path / "conversational.json"
    strategy, problems = offline(tokenizer, text)
    expected = batch_of(strategy.rollout(problems)[0])
    for name, path in files.items():
        assert read_offline_file(str(path)).format == "pairs", name
        strategy, problems = offline(tokenizer, path)  # on_bad=stop: nothing left out
        assert [p.prompt for p in problems] == [p for p, _, _ in PAIRS], name
        assert batch_of(strategy.rollout(problems)[0]) == expected, name  # same prompt ids, response ids, rewards
    # the other formats: a ranking of assistant messages, responses whose texts are assistant messages
    ranking = write_jsonl(tmp_path / "ranking.jsonl", [{"prompt": [user(p)], "ranking": [[assistant(c)], [assistant(r)]]}
                                                       for p, c, r in PAIRS])
    responses = write_jsonl(tmp_path / "responses.jsonl", [
        {"prompt": [user(p)], "responses": [{"text": [assistant(c)], "reward": 1}, {"text": r, "reward": 0}]} for p, c, r in PAIRS])
    for path in (ranking, responses):
        strategy, problems = offline(tokenizer, path)
        assert batch_of(strategy.rollout(problems)[0]) == expected, path.name


def test_conversational_records_that_are_not_one_prompt_and_one_answer_are_counted(tmp_path, policy):
    _, _, tokenizer = policy
    system = {"role": "system", "content": "You are a calculator."}
    records = [
        {"prompt": [user("2+3")], "chosen": [assistant("5")], "rejected": [assistant("6")]},                  # kept
        {"prompt": [system, user("1+1")], "chosen": [assistant("2")], "rejected": [assistant("3")]},          # system_message
        {"prompt": [user("1+1"), assistant("2"), user("1+2?")], "chosen": [assistant("3")],
         "rejected": [assistant("4")]},                                                                      # multi_turn_prompt
        {"prompt": [user("1+1"), user("1+2?")], "chosen": [assistant("3")], "rejected": [assistant("4")]},    # multi_turn_prompt
        {"prompt": [user("1+3")], "chosen": [assistant("4"), assistant("sure?")], "rejected": [assistant("5")]},  # multi_turn_response
        {"prompt": [user("1+4")], "chosen": [assistant("5")], "rejected": [user("6")]},                       # multi_turn_response
        {"chosen": [system, user("1+5"), assistant("6")], "rejected": [system, user("1+5"), assistant("7")]},  # system_message (implicit)
        {"prompt": [user("1+6")], "chosen": [{"role": "assistant"}], "rejected": [assistant("8")]},           # missing_fields: no content
        {"prompt": [system], "chosen": [assistant("8")], "rejected": [assistant("9")]},                       # missing_fields: no user
        {"chosen": [user("1+8"), assistant("9")], "rejected": [user("1+9"), assistant("10")]},  # missing_fields: prompts differ
        {"prompt": [user("1+9")], "ranking": [[assistant("10")], [assistant("11"), assistant("12")]]},        # multi_turn_response
        {"prompt": [user("2+9")], "responses": [{"text": [assistant("11")], "reward": 1}, {"text": [user("12")], "reward": 0},
                                                {"text": "13", "reward": 0}]},  # one entry multi_turn_response, the rest kept
    ]
    path = write_jsonl(tmp_path / "conversations.jsonl", records)
    source = read_offline_file(str(path), "pairs")
    # format=pairs: the ranking and responses records lack chosen/rejected
    assert source.bad == {"missing_fields": 5, "multi_turn_prompt": 2, "system_message": 2, "multi_turn_response": 2}
    assert [g.prompt for g in source.groups] == ["2+3"]
    summary = source.summary()
    for kind, line in (("system_message", 2), ("multi_turn_prompt", 3), ("multi_turn_response", 5), ("missing_fields", 8)):
        assert f"{kind} {source.counts[kind]} (e.g. {path}:{line})" in summary, kind
    ranked = read_offline_file(str(write_jsonl(tmp_path / "ranked.jsonl", records[10:])), "ranking")
    assert ranked.bad == {"multi_turn_response": 1, "missing_fields": 1} and not ranked.groups
    answered = read_offline_file(str(write_jsonl(tmp_path / "answered.jsonl", records[10:])), "responses")
    assert answered.bad == {"multi_turn_response": 1, "missing_fields": 1}
    assert [(g.prompt, g.texts, g.rewards) for g in answered.groups] == [("2+9", ("11", "13"), (1.0, 0.0))]
    with pytest.raises(DataError, match=r"multi_turn_prompt 2 .*system_message 2 .*multi_turn_response 2 .*on_bad=skip"):
        offline(tokenizer, path, format="pairs")


def bad_file(tmp_path, tokenizer):
    """Two good records and one record (or entry) of each kind of bad input."""
    good = [{"prompt": "2+3", "chosen": "5", "rejected": "6"},
            {"prompt": "4+4", "chosen": "8", "rejected": "9", "tokenizer": tokenizer_fingerprint(tokenizer),
             "chat_template": chat_template_fingerprint(tokenizer)}]  # the run's own: accepted
    bad = [
        {"prompt": "1+1", "chosen": "2"},                                    # missing_fields
        {"chosen": "2", "rejected": "3"},                                    # missing_fields: no prompt, no uid
        {"prompt": "1+2", "chosen": "3", "rejected": "  "},                  # empty
        {"prompt": "1+3", "chosen": "4", "rejected": "4 "},                  # identical (chosen = rejected)
        {"prompt": "1+4", "chosen": "5", "rejected": "6" * 200},             # too_long
        {"prompt": "1+5", "chosen": "6", "rejected": "7", "tokenizer": "0123456789abcdef"},      # tokenizer_mismatch
        {"prompt": "1+6", "chosen": "7", "rejected": "8", "chat_template": "0123456789abcdef"},  # chat_template_mismatch
        {"prompt": "<|im_start|>user\n1+7<|im_end|>", "chosen": "8", "rejected": "9"},          # templated_prompt
        {"prompt": "1+8", "responses": [{"text": "9", "reward": 1}, {"text": "ten", "reward": 1}]},  # no_pair (ties)
    ]
    return write_jsonl(tmp_path / "bad.jsonl", [good[0], *bad, good[1]])


def test_each_kind_of_bad_input_is_counted_in_one_line(tmp_path, policy, caplog):
    _, _, tokenizer = policy
    path = bad_file(tmp_path, tokenizer)
    with caplog.at_level("INFO", logger="rlbench.rollout.guided.offline"):
        _, problems = offline(tokenizer, path, on_bad="skip", format="pairs")
    counts = {"missing_fields": 3, "multi_turn_prompt": 0, "system_message": 0, "multi_turn_response": 0,
              "unknown_uid": 0, "empty": 1, "identical": 1, "too_long": 1, "tokenizer_mismatch": 1,
              "chat_template_mismatch": 1, "templated_prompt": 1, "no_pair": 0}
    # format=pairs: the responses record lacks chosen/rejected (missing_fields); auto reads the first record's keys too
    source = read_offline_file(str(path))
    assert source.format == "pairs"
    assert [p.prompt for p in problems] == ["2+3", "4+4"]
    lines = [r.getMessage() for r in caplog.records if "rollout.offline.file" in r.getMessage()]
    assert len(lines) == 1 and "11 records, 2 groups kept" in lines[0]
    for kind in BAD_KINDS:
        assert (f"{kind} {counts[kind]} (e.g. {path}:" in lines[0]) == bool(counts[kind]), kind
    # the responses record read as responses: the tie is a prompt without a pair
    ties = write_jsonl(tmp_path / "ties.jsonl", [
        {"prompt": "1+8", "responses": [{"text": "9", "reward": 1}, {"text": "ten", "reward": 1}]},
        {"prompt": "1+9", "responses": [{"text": "10", "reward": 1}, {"text": "", "reward": 0}, {"text": "11"}]},
        {"prompt": "2+9", "responses": [{"text": "11", "reward": 1}, {"text": "12", "reward": 0}, {"text": "12", "reward": 1}]},
        {"prompt": "3+9", "responses": [{"text": "12", "reward": 1}, {"text": "12", "reward": 1}, {"text": "13", "reward": 0}]},
    ])
    source = read_offline_file(str(ties))
    assert {k: n for k, n in source.counts.items() if n} == {"no_pair": 1, "empty": 1, "missing_fields": 1, "identical": 1}
    # a repeated sample with one reward is kept; a text with two rewards is dropped, every copy
    assert [(g.prompt, g.texts) for g in source.groups] == [("3+9", ("12", "12", "13"))]


def test_on_bad_stop_refuses_with_the_counts_and_an_empty_set_is_always_refused(tmp_path, policy):
    _, _, tokenizer = policy
    path = bad_file(tmp_path, tokenizer)
    with pytest.raises(DataError, match=r"missing_fields 3 .*identical 1 .*templated_prompt 1.*on_bad=skip"):
        offline(tokenizer, path, on_bad="stop", format="pairs")
    nothing = write_jsonl(tmp_path / "nothing.jsonl", [{"prompt": "1+3", "chosen": "4", "rejected": "4"}])
    with pytest.raises(DataError, match="0 groups kept; left out: identical 1.*nothing to train on"):
        offline(tokenizer, nothing, on_bad="skip")
    with pytest.raises(DataError, match="cannot tell the file's format"):
        read_offline_file(str(write_jsonl(tmp_path / "odd.jsonl", [{"question": "1+1", "answer": "2"}])))


def test_a_uid_of_the_dataset_takes_its_problem_and_template(tmp_path, policy):
    _, _, tokenizer = policy
    dataset = [Problem("arith/train/0", "12+30", "42", meta={"level": 2})]
    path = write_jsonl(tmp_path / "uid.jsonl", [{"uid": "arith/train/0", "chosen": "42", "rejected": "41"},
                                                {"uid": "arith/train/9", "chosen": "1", "rejected": "2"},
                                                {"prompt": "12+30", "chosen": "42", "rejected": "40"},
                                                {"prompt": "12+31", "chosen": "43", "rejected": "40"}])
    strategy, problems = offline(tokenizer, path, problems=dataset, on_bad="skip")
    assert [p.uid for p in problems] == ["offline/0", "offline/1", "offline/2"]
    for problem in problems[:2]:  # by uid, and by a prompt equal to the dataset problem's statement
        assert (problem.prompt, problem.answer, problem.meta["dataset_uid"], problem.meta["level"]) == ("12+30", "42", "arith/train/0", 2)
    assert (problems[2].prompt, problems[2].answer, "dataset_uid" in problems[2].meta) == ("12+31", "", False)
    graded, _ = strategy.rollout(problems)
    sampler = GroupSampler(None, None, tokenizer, ARITH_PROMPT, None)
    assert graded.groups[0][0].prompt_ids == sampler.encode(dataset)[0]  # as the dataset's problem is asked online
    # an unknown uid without a prompt text has no prompt
    with pytest.raises(DataError, match=r"3 groups kept; left out: unknown_uid 1 \(e.g. .*uid.jsonl:2\)"):
        offline(tokenizer, path, problems=dataset, on_bad="stop")


def run_offline(tmp_path, file, *extra):
    from rlbench.runner import run

    overrides = ["experiment=toy_learning/dpo", "rollout=offline", f"rollout.offline.file={file}", "rollout.max_new_tokens=16",
                 "trainer.steps=3", "trainer.prompts_per_step=2", "eval.limit=1", "eval.k=[1]", "eval.n=1", *extra]
    run(compose_config(overrides, tmp_path / "run"))
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_dpo_trains_from_a_pairs_file_from_the_command_line(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS[:2]])
    rows = run_offline(tmp_path, path)
    for row in rows:
        assert row["generated_responses"] == 0 and row["responses_offline"] == 4 and row["offline_groups"] == 2
    assert rows[0]["policy_loss"] == pytest.approx(math.log(2), abs=1e-4)  # pi_theta = pi_ref at the start
    assert rows[-1]["policy_loss"] < rows[0]["policy_loss"] and rows[-1]["preference_accuracy"] == 1.0


def test_a_bad_file_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import rlbench.runner

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(rlbench.runner, "load_policy", no_model)
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+3", "chosen": "4", "rejected": "4"},
                                                  {"prompt": "1+4", "chosen": "5", "rejected": "6"}])
    with pytest.raises(DataError, match="1 groups kept; left out: identical 1"):
        run_offline(tmp_path, path)
    with pytest.raises(ConfigError, match="rollout.offline.format=pairs reads rollout.offline.file"):
        run_offline(tmp_path, "null", "rollout.offline.format=pairs")


def test_a_traces_file_is_read_as_the_guidance_library(tmp_path):
    # what rlbench mode=generate writes: uid and text; graded by the run's grader (the toy's share of even token ids)
    texts = ["a b c", "1 2 3 4", "hello there", "x"]
    path = write_jsonl(tmp_path / "traces.jsonl", [{"uid": f"arith/train/{i}", "text": t} for i in range(2) for t in texts])
    assert read_offline_file(str(path)).format == "traces"
    rows = run_offline(tmp_path, path, "dataset.arith.train_size=2", "rollout.n=4")
    for row in rows:
        assert row["generated_responses"] == 0 and row["responses_teacher"] == 8 and row["offline_groups"] == 2
    assert rows[0]["policy_loss"] == pytest.approx(math.log(2), abs=1e-4)


def test_a_resumed_run_refuses_a_file_that_changed_since_the_checkpoint(tmp_path, policy):
    _, _, tokenizer = policy
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    state = offline(tokenizer, path)[0].state_dict()
    offline(tokenizer, path)[0].load_state_dict(state)  # the same file: restored
    write_jsonl(path, [{"prompt": p, "chosen": r, "rejected": c} for p, c, r in PAIRS])  # the labels flipped
    with pytest.raises(DataError, match="changed since the checkpoint"):
        offline(tokenizer, path)[0].load_state_dict(state)
