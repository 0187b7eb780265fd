"""Thinkless' warm-up (arXiv:2505.13379, section 3.1; rlbench/guidance/warmup.py): two teachers' responses paired
per prompt after their control tokens, the control tokens one id each in the student, teachers refused before
any model loads, and the chain warm-up data -> SFT -> DeGRPO from the SFT checkpoint on the tiny model."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config, model_preset  # noqa: E402

from rlbench.config.typed import typed_config  # noqa: E402
from rlbench.dataset import load_problems  # noqa: E402
from rlbench.dataset.base import Problem  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.guidance.warmup import paired_records  # noqa: E402
from rlbench.model import load_policy  # noqa: E402
from rlbench.prompting import encode_prompts  # noqa: E402
from rlbench.reward.math import Grade  # noqa: E402
from rlbench.rollout.engines.base import Completion  # noqa: E402
from rlbench.rollout.guided.offline_files import read_offline_file  # noqa: E402
from rlbench.runner import run  # noqa: E402
from rlbench.validation import validate_config  # noqa: E402

CONTROL = ["<short>", "<think>"]


def graded(uid: str, text: str, correct: bool) -> tuple[Problem, Completion, Grade]:
    problem = Problem(uid=uid, prompt=f"q {uid}", answer="1")
    completion = Completion(request_index=0, prompt_ids=(), response_ids=(1,), logprobs=[0.0], finished=True, text=text)
    return problem, completion, Grade(correct=correct, extracted="1" if correct else None, reward=float(correct), format_ok=True)


def test_each_kept_prompt_has_a_think_response_of_the_reasoner_and_a_short_one_of_the_instruct_model():
    responses = {
        "think": [graded("a", " long a ", True), graded("b", "long b", True), graded("c", "long c", False)],
        "short": [graded("a", "short a", True), graded("b", "short b", False), graded("c", "short c", True)],
    }
    tokens, teachers = {"think": "<think>", "short": "<short>"}, {"think": "R1", "short": "Qwen-Math"}
    # correct only: a keeps both; b lost its short answer and c its long one, so neither is a pair
    records = paired_records(responses, tokens, teachers, keep_incorrect=False)
    assert [(r["uid"], r["text"], r["teacher"], r["mode"]) for r in records] == [
        ("a", "<think>\nlong a", "R1", "think"), ("a", "<short>\nshort a", "Qwen-Math", "short")]
    every = paired_records(responses, tokens, teachers, keep_incorrect=True)
    assert [r["text"].split("\n")[0] for r in every] == ["<think>", "<short>"] * 3
    assert [r["correct"] for r in every] == [True, True, True, False, False, True]


def test_add_tokens_gives_each_control_token_one_id_that_decoded_text_keeps():
    model, tokenizer = load_policy(dataclasses.replace(model_preset("tiny"), add_tokens=CONTROL))
    plain, _ = load_policy(model_preset("tiny"))
    ids = tokenizer.convert_tokens_to_ids(CONTROL)
    assert ids == [len(plain.get_input_embeddings().weight), len(plain.get_input_embeddings().weight) + 1]
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == ids[1] + 1
    encoded = tokenizer.encode("<short>\n7", add_special_tokens=False)
    assert encoded[0] == ids[0] and tokenizer.decode(encoded[:1], skip_special_tokens=True) == "<short>"
    # the old rows are untouched, and a token the tokenizer has is not added twice
    assert torch.equal(model.get_input_embeddings().weight[: ids[0]], plain.get_input_embeddings().weight)
    again, tokenizer_again = load_policy(dataclasses.replace(model_preset("tiny"), add_tokens=[*CONTROL, "<short>"]))
    assert len(tokenizer_again) == len(tokenizer)


@pytest.mark.parametrize("overrides, message", [
    (["+model@warmup.short=tiny"], r"warmup\.think \(the reasoning teacher\) is not set: add \+model@warmup\.think"),
    (["+model@warmup.think=tiny", "+model@warmup.short=checkpoint", "warmup.short.path=/no/such/teacher"],
     r"warmup\.short \(the concise teacher\): warmup\.short\.path='/no/such/teacher' does not exist"),
    (["+model@warmup.think=tiny", "+model@warmup.short=tiny", "+warmup.short_token='<think>'"], "two different"),
])
def test_a_missing_teacher_is_refused_before_any_model_loads(tmp_path, monkeypatch, overrides, message):
    import rlbench.model.loading as loading

    monkeypatch.setattr(loading, "load_policy", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(["mode=generate", "model=tiny", f"out={tmp_path / 'w.jsonl'}", *overrides], tmp_path / "run"))
    with pytest.raises(ConfigError, match="written by mode=generate"):
        validate_config(compose_config(["+model@warmup.think=tiny", "+model@warmup.short=tiny"], tmp_path / "train"))


def control_probability(model_cfg, problems, prompt) -> float:
    """Mean over the prompts of P(first response token is <short> or <think>)."""
    model, tokenizer = load_policy(model_cfg)
    ids = tokenizer.convert_tokens_to_ids(CONTROL)
    with torch.no_grad():
        return sum(float(model(torch.tensor([p])).logits[0, -1].softmax(-1)[ids].sum())
                   for p in encode_prompts(tokenizer, problems, prompt)) / len(problems)


@pytest.mark.slow
def test_the_chain_warmup_data_then_sft_then_degrpo_emits_control_tokens(tmp_path):
    out, tiny = tmp_path / "warmup.jsonl", "tiny.vocab_size=512"
    # 1. the paired data: two different tiny teachers (the concise one narrower), one response each per prompt
    summary = run(compose_config(["mode=generate", "model=tiny", f"model.{tiny}", "+model@warmup.think=tiny", f"warmup.think.{tiny}",
                                  "+model@warmup.short=tiny", f"warmup.short.{tiny}", "warmup.short.tiny.hidden_size=32",
                                  "dataset.limit=8", "rollout.n=1", "rollout.max_new_tokens=8", "guidance.keep_incorrect=true",
                                  f"out={out}"], tmp_path / "gen"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["paired_prompts"] == 8 and summary["written"] == len(records) == 16
    for uid in {r["uid"] for r in records}:
        pair = [r for r in records if r["uid"] == uid]
        assert sorted((r["mode"], r["text"].split("\n")[0]) for r in pair) == [("short", "<short>"), ("think", "<think>")]
    assert [r["text"] for r in records if r["mode"] == "think"] != [r["text"] for r in records if r["mode"] == "short"]
    assert read_offline_file(str(out), "auto").format == "traces"  # what rollout=offline reads
    # 2. SFT on both responses of each prompt (min_reward -1: every response, as the paper's warm-up)
    sft = ["experiment=toy_learning/sft", "rollout=offline", f"rollout.offline.file={out}", "rollout.n=2",
           "rollout.max_new_tokens=32", "model.add_tokens=['<short>','<think>']", "model.tiny.initializer_range=0.02",
           "algorithm.loss.min_reward=-1", "trainer.steps=24", "trainer.lr=0.03", "trainer.save_model=true",
           "dataset.arith.train_size=8", "eval.before_training=false"]
    cfg = compose_config(sft, tmp_path / "sft")
    run(cfg)
    config = typed_config(cfg)
    problems = load_problems(cfg.dataset, seed=0)[:8]
    before = control_probability(config.model, problems, cfg.dataset.prompt)
    after = control_probability(dataclasses.replace(config.model, source="path", path=str(tmp_path / "sft" / "policy")),
                                problems, cfg.dataset.prompt)
    assert before < 0.01 and after > 0.1  # 2 of 514 ids at the mean-initialised start: 0.004; measured after: 0.24
    # 3. DeGRPO from the SFT checkpoint: its samples open with a control token
    run(compose_config(["experiment=toy_learning/thinkless", "model.source=path", f"model.path={tmp_path / 'sft' / 'policy'}",
                        "rollout.max_new_tokens=8", "trainer.steps=1", "eval.before_training=false"], tmp_path / "rl"))
    samples = [json.loads(line) for line in (tmp_path / "rl" / "eval" / "samples.jsonl").read_text().splitlines()]
    assert any(s["completion"].startswith(tuple(CONTROL)) for s in samples)
