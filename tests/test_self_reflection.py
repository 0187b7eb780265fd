"""SPARK's test-time self-reflection (eval.self_reflection; arXiv:2509.22624, figure 2b): each sample is judged by the
policy with training's pointwise judge task and, unless the verdict is yes, revised with training's reflection task;
pass@k is on the final answers. A scripted engine with known answers, verdicts and revisions gives exact counters;
an answer judged right is kept without a revise call; with the option off the evaluation is unchanged."""

import pytest
from conftest import CharTokenizer

from rlbench.dataset.base import Problem
from rlbench.eval.evaluate import Benchmark, evaluate
from rlbench.eval.self_reflection import REFLECTION_COLUMNS
from rlbench.reward.judge_tasks import POINTWISE_TASK, REFLECTION_TASK, build_judge_tasks
from rlbench.reward.math import MathReward
from rlbench.rollout.engines.base import Completion, SamplingParams

ANSWERS = {"1+1?": ["\\boxed{2}", "\\boxed{3}"], "3-1?": ["\\boxed{4}", "so \\boxed{2}"]}  # both references are 2
# the judge's verdict on each answer it is shown: {2} right and judged yes (kept), {3} wrong and judged no, {4} wrong
# but judged yes (kept), "so {2}" right but unreadable (revised, as anything but yes is), {6} wrong and judged no
VERDICTS = {"\\boxed{2}": "yes", "\\boxed{3}": "No.", "\\boxed{4}": "\\boxed{yes}", "so \\boxed{2}": "I cannot tell",
            "\\boxed{6}": "no"}
REVISIONS = {"\\boxed{3}": "\\boxed{2}", "so \\boxed{2}": "\\boxed{6}", "\\boxed{6}": "\\boxed{8}"}


class ScriptedEngine:
    """Answers a problem with its scripted samples, a judge task with the scripted verdict on the answer it shows,
    and a reflection task with the scripted revision of the attempt it shows; records the judge and revise calls."""

    def __init__(self):
        self.judge_calls, self.revise_calls = [], []

    def generate(self, requests, params, generator=None):
        out = []
        for i, r in enumerate(requests):
            prompt = "".join(map(chr, r.prompt_ids))
            if "Proposed solution:" in prompt:
                shown = prompt.split("Proposed solution:\n")[1].split("\n")[0]
                self.judge_calls.append(shown)
                texts = [VERDICTS[shown]]
            elif "A previous attempt:" in prompt:
                self.revise_calls.append((prompt, r.seed))
                texts = [REVISIONS[prompt.split("A previous attempt:\n")[1].split("\n")[0]]]
            else:
                texts = ANSWERS[prompt][: r.n]
            out.append([Completion(i, r.prompt_ids, [ord(c) for c in t], [0.0] * len(t), True, text=t) for t in texts])
        return out


def run(reflection_rounds=None):
    engine = ScriptedEngine()
    bench = Benchmark("toy", {"prompt": {"user": "{problem}"}}, [Problem("a", "1+1?", "2"), Problem("b", "3-1?", "2")],
                      MathReward())
    extra = {} if reflection_rounds is None else {"reflection_rounds": reflection_rounds}
    result = evaluate(engine, CharTokenizer(), [bench], n=2, ks=[1, 2], params=SamplingParams(0.6, 0.95, 16), seed=3, **extra)
    return result, engine


def test_judged_right_is_kept_judged_wrong_is_revised_and_counted():
    result, engine = run(reflection_rounds=2)
    finals = [s["completion"] for s in result.samples]
    # {2} and {4} judged yes: kept, no revise call on them; {3} -> {2} (wrong -> right); so {2} -> {6} -> {8} (right -> wrong)
    assert finals == ["\\boxed{2}", "\\boxed{2}", "\\boxed{4}", "\\boxed{8}"]
    assert [p.split("A previous attempt:\n")[1].split("\n")[0] for p, _ in engine.revise_calls] == ["\\boxed{3}", "so \\boxed{2}", "\\boxed{6}"]
    # round 1 judges the 4 samples, round 2 the 2 revisions; the last revision ({8}) is not judged (2 rounds at most)
    assert engine.judge_calls == ["\\boxed{2}", "\\boxed{3}", "\\boxed{4}", "so \\boxed{2}", "\\boxed{2}", "\\boxed{6}"]
    assert [s["correct"] for s in result.samples] == [True, True, False, False]  # graded on the final answers
    row = result.rows[0]
    assert row["pass_at_k"] == 0.5  # pass@1: 2 of 4 final answers
    assert (row["reflection_revised"], row["reflection_revisions"]) == (0.5, 3)
    assert (row["reflection_wrong_to_right"], row["reflection_right_to_wrong"]) == (1, 1)
    assert all(r[c] == row[c] for r in result.rows for c in REFLECTION_COLUMNS)  # the same on every k's row
    record = result.samples[3]["reflection"]
    assert record == {"initial_correct": True, "initial": "so \\boxed{2}", "verdicts": [None, "no"], "revisions": 2}
    assert result.samples[0]["reflection"] == {"initial_correct": True, "initial": "\\boxed{2}", "verdicts": ["yes"], "revisions": 0}
    assert [s for _, s in run(reflection_rounds=2)[1].revise_calls] == [s for _, s in engine.revise_calls]  # seeded streams


def test_one_round_stops_after_the_first_revision():
    result, engine = run(reflection_rounds=1)
    assert [s["completion"] for s in result.samples] == ["\\boxed{2}", "\\boxed{2}", "\\boxed{4}", "\\boxed{6}"]
    assert len(engine.judge_calls) == 4 and len(engine.revise_calls) == 2
    row = result.rows[0]
    assert (row["reflection_revised"], row["reflection_revisions"], row["reflection_wrong_to_right"], row["reflection_right_to_wrong"]) == (0.5, 2, 1, 1)


def test_the_revise_prompt_is_trainings_reflection_task_with_the_verdict():
    _, engine = run(reflection_rounds=1)
    asked = engine.revise_calls[0][0]
    assert asked == REFLECTION_TASK.format(question="1+1?", response="\\boxed{3}")
    assert "\\boxed{3}" in asked and "final answer is incorrect" in asked  # the attempt and the verdict on it
    # training's reflection task on the same wrong response reads the same (said once: rlbench/reward/judge_tasks.py)
    import numpy as np
    grades = MathReward()("\\boxed{2}", "2"), MathReward()("\\boxed{3}", "2")
    tasks = build_judge_tasks(Problem("a", "1+1?", "2"), ["\\boxed{2}", "\\boxed{3}"], grades, ["reflection"], 1, np.random.default_rng(0))
    assert [t.prompt for t in tasks] == [asked]
    assert POINTWISE_TASK.format(question="1+1?", response="\\boxed{3}").startswith("Question:\n1+1?")


def test_off_is_todays_evaluation():
    plain, engine = run()
    off, _ = run(reflection_rounds=0)
    assert not engine.judge_calls and not engine.revise_calls
    assert off.rows == plain.rows and off.samples == plain.samples
    assert all(not any(c in r for c in REFLECTION_COLUMNS) for r in plain.rows)
    assert all("reflection" not in s for s in plain.samples)
    assert [s["completion"] for s in plain.samples] == ["\\boxed{2}", "\\boxed{3}", "\\boxed{4}", "so \\boxed{2}"]
    assert plain.rows[0]["pass_at_k"] == 0.5


def test_the_option_is_a_checked_eval_key(make_cfg):
    from rlbench.config.typed import typed_config
    from rlbench.errors import ConfigError
    from rlbench.validation import validate_config

    config = typed_config(make_cfg("experiment=smoke"))
    assert config.eval.self_reflection is False and config.eval.reflection_rounds == 2
    assert typed_config(make_cfg("paper=spark", "experiment=smoke")).eval.self_reflection is True
    with pytest.raises(ConfigError, match="eval.self_reflection"):
        validate_config(make_cfg("mode=eval", "env=gridworld", "experiment=smoke", "eval.self_reflection=true"))
    with pytest.raises(ConfigError, match="eval.self_reflection"):
        validate_config(make_cfg("mode=eval", "experiment=smoke", "eval.self_reflection=true", "eval.rounds=2"))
