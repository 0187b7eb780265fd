"""SPARK's judge accuracy on held-out rollouts (eval.judge_accuracy; arXiv:2509.22624, section 3): the evaluation's
samples posed to the same policy as the pointwise judge task of training, labelled by the verifier. A scripted
engine with known answers and verdicts gives hand-computed accuracy and balanced accuracy; an unreadable verdict
is counted and never right; the labels follow the verifier; with the option off nothing in the outputs changes."""

import math

import pytest
from conftest import CharTokenizer

from rlbench.dataset.base import Problem
from rlbench.eval.evaluate import Benchmark, evaluate
from rlbench.eval.judge_accuracy import JUDGE_COLUMNS, add_judge_accuracy, judge_by_benchmark, judge_figures
from rlbench.reward.judge_tasks import PAIRWISE_TASK, POINTWISE_TASK
from rlbench.reward.math import Grade, MathReward
from rlbench.rollout.engines.base import Completion, SamplingParams

ANSWERS = {"1+1?": ["\\boxed{2}", "\\boxed{3}"], "3-1?": ["\\boxed{4}", "\\boxed{5}"]}  # both references are 2
# the judge's verdict on each response: right on {2} (correct: yes) and {4} (wrong: no), wrong on {3}, unreadable on {5}
VERDICTS = {"\\boxed{2}": "yes", "\\boxed{3}": "so \\boxed{yes}", "\\boxed{4}": "No.", "\\boxed{5}": "I cannot tell"}


class ScriptedEngine:
    """Answers a problem with its scripted responses (sample k: the k-th), a pointwise judge task with the
    scripted verdict on the response it shows, and a pairwise one with 1, then an unreadable verdict; records the
    judge prompts and seeds."""

    def __init__(self):
        self.judge_calls, self.pair_calls = [], []

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            prompt = "".join(map(chr, r.prompt_ids))
            if "Response 1:" in prompt:  # pairwise: always the first position, readable only in the first call
                self.pair_calls.append(prompt)
                texts = ["\\boxed{1}" if len(self.pair_calls) == 1 else "the first"]
            elif "Proposed solution:" in prompt:
                self.judge_calls.append((prompt, r.seed))
                shown = prompt.split("Proposed solution:\n")[1].split("\n")[0]
                texts = [VERDICTS[shown]]
            else:
                texts = ANSWERS[prompt][: r.n]
            out.append([Completion(i, r.prompt_ids, [ord(c) for c in t], [0.0] * len(t), True, text=t) for t in texts])
        return out


class AllCorrect:
    """A verifier that grades every response correct."""

    def __call__(self, text, reference, response_ids=None, **kwargs):
        return Grade(correct=True, extracted=text, reward=1.0, format_ok=True)


def run(grader=None, judge=True):
    engine = ScriptedEngine()
    bench = Benchmark("toy", {"prompt": {"user": "{problem}"}}, [Problem("a", "1+1?", "2"), Problem("b", "3-1?", "2")],
                      grader or MathReward())
    params = SamplingParams(0.6, 0.95, 16)
    result = evaluate(engine, CharTokenizer(), [bench], n=2, ks=[1, 2], params=params, seed=3)
    if judge:
        add_judge_accuracy(result, engine, CharTokenizer(), [bench], params, seed=3)
    return result, engine


def test_figures_by_hand():
    # verifier: 2 correct, 4 wrong; judge: yes, yes | no, yes, unreadable, no -> right 1,1 | 1,0,0,1
    figures = judge_figures([True, True, False, False, False, False], [True, True, False, True, None, False])
    assert figures["judge_accuracy"] == pytest.approx(4 / 6)
    assert figures["judge_accuracy_on_correct"] == 1.0 and figures["judge_accuracy_on_incorrect"] == 0.5
    assert figures["judge_balanced_accuracy"] == pytest.approx(0.75)  # (1 + 0.5) / 2
    assert figures["judge_judged"] == 6 and figures["judge_unparsed"] == 1
    # "no" to everything scores the error rate in accuracy, and 0.5 balanced
    always_no = judge_figures([True, False, False, False], [False] * 4)
    assert always_no["judge_accuracy"] == 0.75 and always_no["judge_balanced_accuracy"] == 0.5


def test_scripted_policy_judges_its_own_samples():
    result, engine = run()
    # verifier: {2} correct, {3} {4} {5} wrong; judge right on {2} and {4}, wrong on {3}, unreadable on {5}
    row = result.rows[0]
    assert row["judge_judged"] == 4 and row["judge_unparsed"] == 1
    assert row["judge_accuracy"] == 0.5  # 2 of 4; the unreadable verdict is not right
    assert row["judge_accuracy_on_correct"] == 1.0  # 1 of 1
    assert row["judge_accuracy_on_incorrect"] == pytest.approx(1 / 3)  # {4} of {3}, {4}, {5}
    assert row["judge_balanced_accuracy"] == pytest.approx(2 / 3)  # (1 + 1/3) / 2
    assert all(r[c] == row[c] for r in result.rows for c in JUDGE_COLUMNS)  # the same on every k's row
    assert row["pass_at_k"] == 0.25  # pass@1 beside it: 1 correct of 4
    # each sample's record: the verifier's label, the verdict as training reads it, whether it is right
    records = [(s["completion"], s["judge"]["label"], s["judge"]["verdict"], s["judge"]["correct"]) for s in result.samples]
    assert records == [("\\boxed{2}", "yes", "yes", True), ("\\boxed{3}", "no", "yes", False),
                       ("\\boxed{4}", "no", "no", True), ("\\boxed{5}", "no", None, False)]
    # the prompt is training's pointwise template on the question and the response, one stream per task
    prompts, seeds = zip(*engine.judge_calls)
    assert prompts[1] == POINTWISE_TASK.format(question="1+1?", response="\\boxed{3}")
    assert len(set(seeds)) == 4 and [s for _, s in run()[1].judge_calls] == list(seeds)
    # pairwise: only problem a is mixed ({2} right, {3} wrong), posed in both orders; "1" is right in the first
    assert engine.pair_calls == [PAIRWISE_TASK.format(question="1+1?", first="\\boxed{2}", second="\\boxed{3}"),
                                 PAIRWISE_TASK.format(question="1+1?", first="\\boxed{3}", second="\\boxed{2}")]
    assert row["judge_pairwise_judged"] == 2 and row["judge_pairwise_unparsed"] == 1 and row["judge_pairwise_accuracy"] == 0.5
    assert [r["verdict"] for r in result.samples[0]["judge"]["pairwise"]] == ["1", None]


def test_labels_come_from_the_verifier():
    result, _ = run(grader=AllCorrect())  # every response now verified correct: every label is yes
    assert [s["judge"]["label"] for s in result.samples] == ["yes"] * 4
    row = result.rows[0]
    assert row["judge_accuracy"] == 0.5 and row["judge_accuracy_on_correct"] == 0.5  # yes on {2} and {3}
    assert math.isnan(row["judge_accuracy_on_incorrect"]) and math.isnan(row["judge_balanced_accuracy"])  # no wrong responses
    assert row["judge_pairwise_judged"] == 0 and math.isnan(row["judge_pairwise_accuracy"])  # no mixed problem
    assert judge_by_benchmark(result)["toy"]["judge_balanced_accuracy"] is None  # JSON has no NaN


def test_option_off_changes_nothing():
    plain, engine = run(judge=False)
    judged, _ = run()
    assert not engine.judge_calls and not engine.pair_calls and judge_by_benchmark(plain) == {}
    assert all(not any(c in r for c in JUDGE_COLUMNS) for r in plain.rows)
    assert [{k: v for k, v in r.items() if k not in JUDGE_COLUMNS} for r in judged.rows] == plain.rows
    assert [{k: v for k, v in s.items() if k != "judge"} for s in judged.samples] == plain.samples


def test_the_option_is_a_checked_eval_key(make_cfg):
    from rlbench.config.typed import typed_config
    from rlbench.errors import ConfigError
    from rlbench.validation import validate_config

    assert typed_config(make_cfg("experiment=smoke")).eval.judge_accuracy is False
    assert typed_config(make_cfg("paper=spark", "experiment=smoke", "eval.judge_accuracy=true")).eval.judge_accuracy is True
    with pytest.raises(ConfigError, match="eval.judge_accuracy"):
        validate_config(make_cfg("mode=eval", "env=gridworld", "experiment=smoke", "eval.judge_accuracy=true"))
