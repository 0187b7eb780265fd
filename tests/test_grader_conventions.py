"""The math grader's fixes and per-benchmark conventions of issue 29 (docs/evaluation.md, "Grading
conventions"), and the cases that catch planted bugs in the numeric rule: integers compared exactly,
the tolerance rule's ``<=`` at a boundary exact in binary, and constant expressions equal to 0."""

from __future__ import annotations

import pytest

from rlbench.config.schema import DatasetConfig, RewardConfig
from rlbench.config.typed import typed_config, typed_node
from rlbench.dataset.base import Problem
from rlbench.dataset.sources import validate_spec
from rlbench.errors import ConfigError
from rlbench.reward import (
    MathReward,
    answers_equivalent,
    extract_answer,
    grade_completions,
)
from rlbench.reward.graders import make_grader
from rlbench.reward.math import asks_for_order
from rlbench.reward.symbolic import within_tolerance
from rlbench.rollout.engines.base import Completion

# --- thousands separators as MATH writes them: read before spacing commands are normalised


@pytest.mark.parametrize("ref", [r"10,\!080", r"10{,}\!080", "10{,}080", "10,080", r"\$10,\!080"])
def test_marked_thousands_separator_is_one_number(ref):
    assert answers_equivalent("10080", ref)
    assert answers_equivalent(ref, "10080")
    assert answers_equivalent(r"10,\!080", ref)


@pytest.mark.parametrize("pred", ["80, 10", "10, 080", "80,10", r"\{10, 80\}"])
def test_marked_thousands_separator_is_not_a_list(pred):
    assert not answers_equivalent(pred, r"10,\!080")


def test_millions_with_marked_separators():
    assert answers_equivalent("1000000", r"1,\!000,\!000")
    assert answers_equivalent(r"1{,}000{,}000", r"1,\!000,\!000")
    assert not answers_equivalent("1000", r"1,\!000,\!000")


def test_last_number_reads_marked_separators():
    assert extract_answer(r"so she pays $10,\!080$ in total", "last_number") == "10080"
    assert extract_answer(r"the count is 12{,}345", "auto") == "12345"


# --- the last-number fallback never reads a digit inside a word


@pytest.mark.parametrize("text", ["H2O", "AZYUK2A", "the 2nd one", "x2y", "Route66b"])
def test_no_number_inside_a_word(text):
    assert extract_answer(text, "last_number") is None
    assert not MathReward()(text, "2").correct


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("It weighs 5cm less: 7", "7"),
        ("we get 1.5\\times10 so 15", "15"),
        ("It is 5cm", "5"),  # a unit against the number is still a number
        ("H2O has mass 18", "18"),
        (r"$x^2$ at $x = 3$", "3"),
    ],
)
def test_numbers_beside_words(text, number):
    assert extract_answer(text, "last_number") == number


def test_last_number_fallback_is_a_per_benchmark_choice():
    on, off = MathReward(), MathReward(last_number_fallback=False)
    assert on("we find 42", "42").correct
    assert not off("we find 42", "42").correct and off("we find 42", "42").extracted is None
    assert off(r"so \boxed{42}", "42").correct and off("The answer is 42.", "42").correct
    assert off("#### 42", "42").correct
    # an explicit extraction style is not a fallback
    assert MathReward(extraction="last_number", last_number_fallback=False)("we find 42", "42").correct


# --- answer phrases, text wrappers and lists written with "and"


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Final Answer: The final answer is 12,000,023. I hope it is correct.", "12,000,023"),
        ("Final Answer: The answer is: 7", "7"),
        ("**Final Answer** the answer is 3/4.", "3/4"),
    ],
)
def test_nested_answer_phrase(text, answer):
    assert extract_answer(text) == answer


def test_nested_phrase_grades():
    assert MathReward()("Final Answer: The final answer is 12,000,023. I hope it is correct.", "12000023").correct


@pytest.mark.parametrize("wrapper", ["text", "textnormal", "textit", "textsf", "textrm", "mbox", "mathrm", "textbf"])
def test_text_wrappers_are_dropped_as_units(wrapper):
    ref = rf"5\{wrapper}{{ miles}}"
    assert answers_equivalent("5", ref)
    assert answers_equivalent(ref, "5")
    assert not answers_equivalent("6", ref)


@pytest.mark.parametrize(
    "written",
    [r"7, -2, \text{ and } -5", r"7, -2\text{, and }-5", "7, -2, and -5", r"7, -2 \textnormal{ and } -5"],
)
def test_and_in_a_list(written):
    assert answers_equivalent("-5, -2, 7", written)
    assert answers_equivalent(written, "7,-2,-5")
    assert not answers_equivalent("7, -2", written)
    assert not answers_equivalent("7, -2, 5", written)


# --- ordered answers


@pytest.mark.parametrize(
    ("problem", "ordered"),
    [
        ("Enter the solutions in increasing order, separated by commas.", True),
        ("List them from least to greatest.", True),
        ("The roots, in alphabetical order of their names.", True),
        ("They form a geometric sequence, in that order. Enter all solutions, separated by commas.", False),
        ("The roots are a and b, not necessarily in that order. Enter all possible values.", False),
        ("Not necessarily in increasing order.", False),
        ("Give the roots in decreasing order.", True),
        ("Enter all the solutions, separated by commas.", False),
        ("In order to win, how many games must she play?", False),
        ("", False),
    ],
)
def test_asks_for_order(problem, ordered):
    assert asks_for_order(problem) is ordered


def test_ordered_lists():
    assert answers_equivalent("2, 1", "1, 2")
    assert not answers_equivalent("2, 1", "1, 2", ordered=True)
    assert answers_equivalent(r"1, \frac{4}{2}", "1, 2", ordered=True)
    assert not answers_equivalent("1, 2, 3", "1, 2", ordered=True)
    # answer type set: a set stays unordered
    assert answers_equivalent("2, 1", "1, 2", ordered=True, answer_type="set")


def test_list_order_per_benchmark_and_problem():
    increasing = "Find all x. Enter them in increasing order."
    default = MathReward()
    assert not default(r"\boxed{3, 1}", "1, 3", problem=increasing).correct
    assert default(r"\boxed{1, 3}", "1, 3", problem=increasing).correct
    assert default(r"\boxed{3, 1}", "1, 3", problem="Find all x.").correct
    assert MathReward(list_order="unordered")(r"\boxed{3, 1}", "1, 3", problem=increasing).correct
    assert not MathReward(list_order="ordered")(r"\boxed{3, 1}", "1, 3", problem="Find all x.").correct


# --- labels


@pytest.mark.parametrize(
    ("pred", "ref"),
    [("4", "AB=4"), ("(3,2)", "(p,q)=(3,2)"), ("1", "f(x)=1"), ("30", r"\angle ABC = 30"), ("5", "a_1 = 5")],
)
def test_any_label_is_a_per_benchmark_option(pred, ref):
    assert answers_equivalent(pred, ref, labels="any")
    assert answers_equivalent(ref, pred, labels="any")
    if ref != "a_1 = 5":  # one letter (with a subscript) is dropped by default
        assert not answers_equivalent(pred, ref)  # default: only a one-letter label is dropped


@pytest.mark.parametrize(("pred", "ref"), [("0", "x + y + z = 0"), ("4", "2x = 4"), ("6", "AB + BC = 6")])
def test_an_expression_is_never_a_label(pred, ref):
    assert not answers_equivalent(pred, ref, labels="any")


# --- the numeric rule: cases that catch planted bugs


def test_integers_are_compared_exactly_far_beyond_float_precision():
    # 10**17 + 1 and 10**17 are the same float; a float comparison, or a relative rule at 1e-6,
    # accepts them: the grader must not
    assert float(10**17 + 1) == float(10**17)
    assert not answers_equivalent(str(10**17 + 1), str(10**17))
    assert not answers_equivalent("123456789012345678901", "123456789012345678900")
    assert answers_equivalent("123456789012345678901", "123456789012345678901.0")


@pytest.mark.parametrize(
    ("pred", "ref", "tolerance"), [("1.25", "1", 0.25), ("0.75", "1", 0.25), ("2.5", "2", 0.25), ("0.625", "0.5", 0.25)]
)
def test_tolerance_boundary_is_inclusive(pred, ref, tolerance):
    # every number here is exact in binary, so |pred - ref| == tolerance * |ref| exactly: "<=" accepts, "<" would not
    assert abs(float(pred) - float(ref)) == tolerance * abs(float(ref))
    assert answers_equivalent(pred, ref, tolerance=tolerance)
    assert not answers_equivalent(pred, ref, tolerance=tolerance / 2)
    assert within_tolerance(float(pred), float(ref), tolerance)


def test_absolute_tolerance_boundary_is_inclusive():
    assert answers_equivalent("0.5", "0", absolute_tolerance=0.5)
    assert answers_equivalent("1.75", "1", tolerance=0.25, absolute_tolerance=0.5)
    assert not answers_equivalent("1.875", "1", tolerance=0.25, absolute_tolerance=0.5)


@pytest.mark.parametrize("pred", [r"\sqrt{4}-2", r"\sin(\pi)", r"\cos(\frac{\pi}{2})", r"\ln(1)", r"2^{0}-1"])
def test_constant_expressions_equal_to_zero(pred):
    assert answers_equivalent(pred, "0")
    assert answers_equivalent("0", pred)


@pytest.mark.parametrize(("pred", "ref"), [(r"2^{-98}", "0"), (r"2^{-200}", r"-2^{-200}"), (r"\sin(\pi)+10^{-40}", "0")])
def test_tiny_constants_are_not_zero(pred, ref):
    assert not answers_equivalent(pred, ref)


# --- the conventions travel from a benchmark spec to its grader


def _spec(**grading):
    return {
        "name": "conv", "loader": "jsonl", "files": {"test": "conv.jsonl"}, "split": "test",
        "fields": {"problem": "problem", "answer": "answer"}, "answer_type": "math", **grading,
    }


def test_spec_options_reach_the_grader():
    reward = RewardConfig(name="math")
    grader = make_grader(reward, typed_node(_spec(last_number_fallback=False, answer_labels="any", list_order="unordered"), DatasetConfig))
    assert (grader.last_number_fallback, grader.answer_labels, grader.list_order) == (False, "any", "unordered")
    default = make_grader(reward, typed_node(_spec(), DatasetConfig))
    assert (default.last_number_fallback, default.answer_labels, default.list_order) == (True, "letter", "problem")

    problem = Problem(uid="conv/test/0", prompt="Enter the roots in increasing order.", answer="1, 3")

    def grade(grader, text):
        completion = Completion(request_index=0, prompt_ids=(1,), response_ids=[1], logprobs=[0.0], finished=True, text=text)
        return grade_completions(grader, [problem], [completion])[0].correct

    assert not grade(default, r"\boxed{3, 1}") and grade(default, r"\boxed{1, 3}")  # the prompt asks for an order
    assert grade(grader, r"\boxed{3, 1}")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("answer_labels", "all", "answer_labels"),
        ("list_order", "sorted", "list_order"),
        ("last_number_fallback", "no", "last_number_fallback"),
    ],
)
def test_bad_convention_is_a_config_error(key, value, message):
    with pytest.raises(ConfigError, match=message):
        validate_spec(_spec(**{key: value}), source="local")


def test_bad_convention_in_the_grader():
    with pytest.raises(ValueError, match="answer_labels"):
        MathReward(answer_labels="all")
    with pytest.raises(ValueError, match="list_order"):
        MathReward(list_order="sorted")


def test_conventions_from_the_command_line(make_cfg, monkeypatch):
    """Overrides of a composed run reach the graders; a bad value stops the run before any model loads."""
    from rlbench import runner
    from rlbench.reward.graders import training_grader

    # last_number_fallback is stated in conf/dataset/math.yaml; keys a YAML does not state take a "+"
    cfg = make_cfg("dataset=math", "dataset.last_number_fallback=false", "+dataset.answer_labels=any")
    grader = training_grader(typed_config(cfg))
    assert (grader.last_number_fallback, grader.answer_labels, grader.list_order) == (False, "any", "problem")
    cfg = make_cfg("eval=math", "+eval.benchmarks.math500.list_order=unordered")
    assert training_grader(typed_config(cfg)).list_order == "problem"  # the training set's own
    config = typed_config(cfg)
    assert make_grader(config.reward, config.eval.benchmarks["math500"]).list_order == "unordered"

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the configuration was validated")

    monkeypatch.setattr(runner, "load_policy", refuse)
    with pytest.raises(ConfigError, match="answer_labels"):
        runner.run(make_cfg("dataset=math", "+dataset.answer_labels=every"))
    with pytest.raises(ConfigError, match="list_order"):
        runner.run(make_cfg("eval=math", "+eval.benchmarks.amc23.list_order=sorted"))
