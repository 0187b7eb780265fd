"""Judges and composed rewards (rlbench/reward/judges.py, rlbench/reward/terms.py,
rlbench/rollout/judge_backend.py; docs/judges.md): the composition's one-term case is the grader's
reward, weights add terms, each term logged; a model judge's verdicts (a label token's probability, a
parsed label), its cache, budgets and failures; the engine backend against a direct forward pass; the
runner end to end with a model judge."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import model_preset, smoke_cli_steps  # noqa: E402

from rlbench.config.schema import JudgeConfig, ModelConfig, RewardConfig  # noqa: E402
from rlbench.dataset.base import Problem  # noqa: E402
from rlbench.errors import ConfigError  # noqa: E402
from rlbench.reward.judges import (  # noqa: E402
    JudgeStats,
    ModelJudge,
    PairItem,
    ScriptedJudge,
    parse_label,
)
from rlbench.reward.math import Grade  # noqa: E402
from rlbench.reward.terms import RewardComposer, check_reward_config, check_reward_terms  # noqa: E402


def grade(reward: float, correct: bool = False, format_ok: bool = False) -> Grade:
    return Grade(correct=correct, extracted=None, reward=reward, format_ok=format_ok)


PROBLEMS = [Problem("p/0", "2 + 3", "5"), Problem("p/1", "4 + 4", "8")]
TEXTS = [["5", "2 + 3 = 5", "7"], ["8", "4 + 4 = 9"]]
GRADES = [grade(1.0, True, True), grade(1.0, True, False), grade(0.0), grade(1.0, True, True), grade(0.0, False, True)]


# ------------------------------------------------------------------------------------ composition


def test_the_default_composition_is_the_grader_reward_exactly():
    rewards = RewardComposer()(PROBLEMS, TEXTS, GRADES)
    assert torch.equal(rewards, torch.tensor([g.reward for g in GRADES], dtype=torch.float32))


def test_weights_add_terms_and_each_term_is_logged_under_its_name():
    composer = RewardComposer({"grader": 1.0, "format": 0.5})
    rewards = composer(PROBLEMS, TEXTS, GRADES)
    expected = torch.tensor([g.reward + 0.5 * g.format_ok for g in GRADES])
    assert torch.allclose(rewards, expected)
    metrics = composer.take()
    assert metrics["reward_term_grader"] == pytest.approx(3 / 5)
    assert metrics["reward_term_format"] == pytest.approx(3 / 5)
    assert composer.take() == {}  # taken: reset


def test_a_judge_term_is_a_weighted_penalty_beside_the_grader():
    flawed_if_bare = ScriptedJudge("bare_answer")
    composer = RewardComposer({"grader": 1.0, "fapo": 0.5}, flawed_if_bare)
    rewards = composer(PROBLEMS, TEXTS, GRADES)
    # correct and bare ("5", "8") lose 0.5; correct with working keeps 1; incorrect are not judged
    assert rewards.tolist() == pytest.approx([0.5, 1.0, 0.0, 0.5, 0.0])
    metrics = composer.take()
    assert metrics["judge_calls"] == 3 and metrics["reward_term_fapo_failed"] == 0


@pytest.mark.parametrize(
    "weights, has_judge, format_weight, message",
    [
        ({"grader": 1.0, "style": 1.0}, False, 0.0, "unknown term"),
        ({"fapo": 1.0}, False, 0.0, "ask a judge"),
        ({"grader": 1.0, "format": 0.2}, False, 0.1, "use one"),
        ({"grader": "high"}, False, 0.0, "a weight is a number"),
        ({}, False, 0.0, "empty"),
    ],
)
def test_bad_terms_are_refused_before_the_run(weights, has_judge, format_weight, message):
    with pytest.raises(ConfigError, match=message):
        check_reward_terms(weights, has_judge, format_weight)


def test_a_judge_that_cannot_answer_the_terms_question_is_refused():
    with pytest.raises(ConfigError, match="pairwise rule"):
        check_reward_config(RewardConfig(name="math", terms={"fapo": 1.0}, judge=JudgeConfig(kind="scripted", rule="shorter")))
    with pytest.raises(ConfigError, match="pointwise rule"):
        check_reward_config(RewardConfig(name="math", terms={"brpo": 1.0}, judge=JudgeConfig(kind="scripted", rule="bare_answer")))
    with pytest.raises(ConfigError, match=r"\+model@reward.judge.model"):
        check_reward_config(RewardConfig(name="math", terms={"brpo": 1.0}, judge=JudgeConfig(kind="model")))
    check_reward_config(RewardConfig(name="math", terms={"brpo": 1.0}, judge=JudgeConfig(kind="model", model=ModelConfig(name="tiny"))))


# ------------------------------------------------------------------------------------ model judge


class TableBackend:
    """A judge model given as a table: prompt -> (label probabilities, answer text); counts its calls."""

    def __init__(self, probabilities=None, answers=None, tokens: int = 10):
        self.probabilities, self.answers, self.tokens = probabilities or {}, answers or {}, tokens
        self.batches: list[int] = []

    def label_probabilities(self, prompts, labels):
        self.batches.append(len(prompts))
        return [(list(self.probabilities[p]), self.tokens) for p in prompts]

    def complete(self, prompts, max_new_tokens):
        self.batches.append(len(prompts))
        return [(self.answers[p], self.tokens) for p in prompts]


TEMPLATE = "{question}|{first}|{second}"


def test_probability_verdict_is_the_first_labels_share_of_the_two():
    backend = TableBackend({"q|a|b": (0.3, 0.1), "q|b|a": (0.0, 0.0), "q|a|c": (float("nan"), 0.2)})
    judge = ModelJudge(backend, pairwise_template=TEMPLATE)
    verdicts = judge.prefer([PairItem("q", "a", "b"), PairItem("q", "b", "a"), PairItem("q", "a", "c")])
    assert verdicts[0] == pytest.approx(0.75)
    assert verdicts[1] is None and verdicts[2] is None  # no probability on either label, NaN: a failure
    assert judge.stats.take()["judge_failures_unparseable"] == 2


@pytest.mark.parametrize(
    "text, expected", [("A", 0), (" B is better", 1), ("answer: b.", 1), ("AB", None), ("neither", None), ("", None)]
)
def test_parse_label_finds_the_first_whole_label(text, expected):
    assert parse_label(text, ("A", "B")) == expected


def test_label_verdicts_and_a_failure_gives_the_configured_reward_counted():
    answers = {"q|x|y": "A", "q|y|x": "B", "q|x|z": "I cannot tell", "q|z|x": "A"}
    judge = ModelJudge(TableBackend(answers=answers), verdict="label", pairwise_template=TEMPLATE)
    problems = [Problem("p", "q", "1")]
    composer = RewardComposer({"pairwise_rl": 1.0}, judge, failure_reward=-0.25)
    rewards = composer(problems, [["x", "y", "z"]], [grade(0.0)] * 3)
    # anchor x: y loses in both orders (0); z's first order is unparseable: the failure reward, not 1
    assert rewards.tolist() == pytest.approx([0.5, 0.0, -0.25])
    metrics = composer.take()
    assert metrics["reward_term_pairwise_rl_failed"] == 1 and metrics["judge_failures"] == 1


def test_the_cache_answers_a_repeated_prompt_without_a_call():
    backend = TableBackend({"q|a|b": (0.9, 0.1)})
    judge = ModelJudge(backend, pairwise_template=TEMPLATE, batch_size=4)
    judge.prefer([PairItem("q", "a", "b")])
    assert judge.prefer([PairItem("q", "a", "b")]) == [pytest.approx(0.9)]
    assert backend.batches == [1]
    stats = judge.stats.take()
    assert stats["judge_calls"] == 1 and stats["judge_cache_hits"] == 1 and stats["judge_tokens"] == 10
    uncached = ModelJudge(backend, pairwise_template=TEMPLATE, cache=False)
    uncached.prefer([PairItem("q", "a", "b")] * 2)
    assert uncached.stats.calls == 2


def test_budgets_fail_the_rest_of_the_step_then_restart():
    prompts = {f"q|a{i}|b": (0.8, 0.2) for i in range(6)}
    backend = TableBackend(prompts, tokens=10)
    judge = ModelJudge(backend, pairwise_template=TEMPLATE, batch_size=2, token_budget=30)
    verdicts = judge.prefer([PairItem("q", f"a{i}", "b") for i in range(6)])
    assert verdicts[:4] == [pytest.approx(0.8)] * 4 and verdicts[4:] == [None, None]  # 40 tokens >= 30 after two batches
    assert judge.stats.take()["judge_failures_budget"] == 2
    judge.new_step()
    judge.cache.clear()
    assert None not in judge.prefer([PairItem("q", "a4", "b")])
    ticks = iter(range(0, 100, 3))  # every reading of the clock 3 s later: each call takes 3 s
    timed = ModelJudge(TableBackend(prompts), pairwise_template=TEMPLATE, batch_size=1, time_budget_s=5.0,
                       clock=lambda: float(next(ticks)))
    verdicts = timed.prefer([PairItem("q", f"a{i}", "b") for i in range(4)])
    assert verdicts[:2] == [pytest.approx(0.8)] * 2 and verdicts[2:] == [None, None]  # 6 s of calls >= 5 s
    assert timed.stats.calls == 2
    timed.new_step()  # time outside the judge's calls (the step's generation) does not count
    assert timed.prefer([PairItem("q", "a2", "b")]) == [pytest.approx(0.8)]


def test_a_call_that_raises_fails_its_items_counted_not_the_run():
    class Broken(TableBackend):
        def label_probabilities(self, prompts, labels):
            raise RuntimeError("prompt longer than the context")

    judge = ModelJudge(Broken(), pairwise_template=TEMPLATE)
    composer = RewardComposer({"brpo": 1.0}, judge)
    rewards = composer([Problem("p", "q", "1")], [["a", "bb"]], [grade(0.0)] * 2)
    assert rewards.tolist() == [0.0, 0.0]  # brpo's neutral value, not a win
    metrics = composer.take()
    assert metrics["judge_failures_error"] == 2 and metrics["reward_term_brpo_failed"] == 1


def test_the_judge_sees_the_reference_only_when_the_method_says_so():
    seen = []
    judge = ScriptedJudge(pointwise=lambda q, r, ref: seen.append(ref) or 0.0)
    for sees in (False, True):
        RewardComposer({"fapo": 1.0}, judge, sees_reference=sees)(PROBLEMS[:1], [["5"]], [grade(1.0, True)])
    assert seen == [None, "5"]
    template_judge = ModelJudge(TableBackend({"Question: q\n\nSolution: r\n\nIs the": (1, 0)}))
    prompt = template_judge.pointwise_template.format(question="q", response="r", reference_line="", reference="")
    assert "5" not in prompt and "Reference" not in prompt


def test_judge_stats_reset_after_take():
    stats = JudgeStats(calls=2, tokens=5, seconds=0.5)
    stats.fail("budget", 3)
    assert stats.take()["judge_failures"] == 3
    assert stats.take()["judge_calls"] == 0


# ------------------------------------------------------------------------------------ engine backend


def test_engine_backend_label_probabilities_equal_a_direct_forward_pass():
    from rlbench.config.schema import RolloutConfig
    from rlbench.model import load_policy
    from rlbench.rollout import make_engine
    from rlbench.rollout.judge_backend import EngineJudgeBackend

    model, tokenizer = load_policy(model_preset("tiny"), seed=0)
    engine = make_engine(RolloutConfig(engine="hf"), model, tokenizer, "cpu")
    backend = EngineJudgeBackend(engine, tokenizer)
    prompt = "Which is better, A or B?\nAnswer:"
    [(probabilities, tokens)] = backend.label_probabilities([prompt], ["A", "B"])
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    for label, p in zip(["A", "B"], probabilities):
        label_ids = tokenizer.encode(" " + label, add_special_tokens=False)
        ids = torch.tensor([prompt_ids + label_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        direct = sum(logp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(label_ids))
        assert math.log(p) == pytest.approx(direct, abs=1e-4)
    assert tokens == len(prompt_ids) + 2
    [(text, answered_tokens)] = backend.complete([prompt], max_new_tokens=3)
    assert isinstance(text, str) and len(prompt_ids) < answered_tokens <= len(prompt_ids) + 3


@pytest.mark.slow
def test_a_model_judge_runs_end_to_end_with_its_calls_counted(tmp_path):
    steps = smoke_cli_steps(
        tmp_path / "run", "reward=pairwise_rl", "reward.judge.kind=model", "+model@reward.judge.model=tiny",
        "eval.before_training=false",
    )
    for step in steps:
        assert step["judge_calls"] > 0 and step["judge_tokens"] > 0 and step["judge_s"] >= 0
        assert 0.0 <= step["reward_term_pairwise_rl"] <= 1.0
        assert "reward_term_grader" in step
