"""The grader's probe battery (rlbench/reward/probe.py) over the shipped math benchmarks: every
reference accepted in several renderings, the canonical wrong answers rejected. The unit tier runs a
fixed subset (every reference of GSM8K, AIME and AMC, every 5th of MATH-500, every 50th of MATH
train); the slow tier runs all of them (bench/grader_probe.py writes the table)."""

from __future__ import annotations

import pytest
from conftest import ROOT, needs_data

from rlbench.reward import MathReward
from rlbench.reward.probe import BATTERY_SOURCES, battery_problems, probes_for, run_battery

UNIT_TIER_EVERY = {"math500": 5, "gsm8k": 1, "aime24": 1, "amc23": 1, "math_train": 50}


def test_probes_of_a_number():
    probes = {(p.kind, p.name): p.text for p in probes_for(r"-\frac{1}{3}")}
    assert probes["rendering", "plain"] == "-1/3" and probes["rendering", "decimal"] == "-0.333333333333"
    assert probes["wrong", "negation"] == r"\frac{1}{3}" and probes["wrong", "twice"] == r"-\frac{2}{3}"
    assert ("wrong", "minus_one") in probes and ("wrong", "zero") in probes


def test_wrong_answers_equal_to_the_reference_are_not_asked():
    names = {p.name for p in probes_for("0") if p.kind == "wrong"}
    assert names == {"one", "minus_one", "two"}  # 0, -0 and 2*0 equal the reference
    assert "two" not in {p.name for p in probes_for(r"\sqrt{4}") if p.kind == "wrong"}  # a constant equal to 2
    assert {p.name for p in probes_for("1") if p.kind == "wrong"} == {"zero", "minus_one", "two", "negation", "twice"}


def test_dropped_factor_and_units():
    assert ("factor_dropped", "3") in {(p.name, p.text) for p in probes_for(r"3\sqrt{13}")}
    assert ("factor_dropped", r"\frac{37}{4}") in {(p.name, p.text) for p in probes_for(r"\frac{37}{4} m")}
    assert ("unit_dropped", "864") in {(p.name, p.text) for p in probes_for(r"864 \mbox{ inches}^2")}


def test_battery_catches_a_lenient_grader():
    """A grader that accepts everything fails every wrong answer: the battery has teeth."""

    class Lenient(MathReward):
        def __call__(self, completion, reference, response_ids=(), **kwargs):
            grade = super().__call__(completion, reference, response_ids, **kwargs)
            grade.correct = True
            return grade

    result = run_battery("toy", ["5", r"3\sqrt{13}"], Lenient())
    assert result.renderings_accepted == result.renderings and result.wrong_rejected == 0 and result.wrong >= 10


def _check(name: str, every: int) -> None:
    references, grader = battery_problems(name, ROOT / "conf", every)
    result = run_battery(name, references, grader)
    assert result.references == len(references) > 0
    assert not result.failures, result.failures[:20]


@needs_data
@pytest.mark.parametrize("name", sorted(BATTERY_SOURCES))
def test_battery_subset(name):
    _check(name, UNIT_TIER_EVERY[name])


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n in BATTERY_SOURCES if UNIT_TIER_EVERY[n] > 1))
def test_battery_full(name):
    _check(name, 1)


def _agreement_script():
    import importlib.util

    pytest.importorskip("mathruler")
    pytest.importorskip("math_verify")
    spec = importlib.util.spec_from_file_location("grader_agreement", ROOT / "bench" / "grader_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreement_counts_and_classes():
    agreement = _agreement_script()
    grader = MathReward()
    boxed = "The answer is $\\boxed{{{}}}$.".format
    samples = [
        ("battery", "toy", "unit_word", boxed("5 J"), "5", True, grader),  # peers keep the unit: ours is right
        ("battery", "toy", "zero", boxed("0"), r"5.89\times10^{-7}", False, grader),  # everyone rejects
        ("model", "toy", "response", boxed(r"\frac{37}{4}"), r"\frac{37}{4} m", None, grader, True),
    ]
    result = agreement.run(samples)
    counts, classes = result["counts"], result["classes"]
    assert counts["samples"] == 3 and counts["battery_samples"] == 2 and counts["ours_right"] == 2
    assert classes["battery | unit_word | prm800k | ours accepts | ours"]["count"] == 1
    assert classes["model | response | math_verify | ours rejects | unknown"]["count"] == 1  # it drops the m
    assert "battery | zero | math_verify | ours rejects | ours" not in classes
