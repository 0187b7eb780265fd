"""Tests for rlbench.reward.math: answer extraction, equivalence and the MathReward."""

from __future__ import annotations

import threading

import pytest

import rlbench.reward.math as rm
from rlbench.reward import MathReward, answers_equivalent, canonical_answer, extract_answer

# (completion, reference, expected extracted answer, expected correct)
GRADE_CASES = [
    # boxed
    (r"So the value is \boxed{\frac{\sqrt{3}}{2}}.", r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}", True),
    (r"First \boxed{3}, wait, actually \boxed{4}", "4", "4", True),
    (r"First \boxed{4}, wait, actually \boxed{3}", "4", "3", False),
    (r"\boxed{\dfrac{1}{2}}", "0.5", r"\dfrac{1}{2}", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", "0.5", True),
    (r"\boxed{1/2}", r"\frac12", "1/2", True),
    (r"\boxed 5", "5", "5", True),
    (r"\fbox{7}", "7", "7", True),
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", r"\{1, 2\}", True),
    (r"\boxed{10\text{ cm}}", "10", r"10\text{ cm}", True),
    (r"\boxed{12 \text{ inches}^2}", "12", r"12 \text{ inches}^2", True),
    (r"\boxed{1,234}", "1234", "1,234", True),
    (r"\boxed{1234}", "1,234", "1234", True),
    (r"\boxed{50\%}", "50", r"50\%", True),
    (r"\boxed{-3}", "-3", "-3", True),
    (r"\boxed{-3}", "3", "-3", False),
    (r"\boxed{0.333}", "1/3", "0.333", False),  # close but wrong at default tolerance
    (r"\boxed{0.3333333}", r"\frac{1}{3}", "0.3333333", True),  # within 1e-6
    (r"\boxed{27}", "27.0", "27", True),  # AMC float references
    (r"\boxed{27.0}", "27", "27.0", True),
    (r"\boxed{x = 5}", "5", "x = 5", True),
    (r"\boxed{5}", "x=5", "5", True),
    (r"\boxed{90^\circ}", "90", r"90^\circ", True),
    (r"\boxed{\$18.00}", "18", r"\$18.00", True),
    (r"\boxed{\text{(B)}}", r"\text{(B)}", r"\text{(B)}", True),
    # math-verify cases
    (r"\boxed{(1,2)}", r"(1, 2)", "(1,2)", True),
    (r"\boxed{(1, \frac{1}{2})}", r"(1,0.5)", r"(1, \frac{1}{2})", True),
    (r"\boxed{[1,2)}", r"[1,2]", "[1,2)", False),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", r"\sqrt{8}", True),
    (r"\boxed{\sqrt{8}}", r"3\sqrt{2}", r"\sqrt{8}", False),
    # GSM8K
    ("She pays 1000 + 234 = 1,234 dollars.\n#### 1,234", "1234", "1234", True),
    ("#### 72\n\nQuestion: next one #### is not", "72", "is not", False),
    # phrases and last number
    ("Adding them up, the answer is 42.", "42", "42", True),
    ("Answer: $\\frac{3}{4}$.", "0.75", r"\frac{3}{4}", True),
    ("The final answer is 18 apples.", "18", "18", True),
    ("We get 3 then 7 and finally -12", "-12", "-12", True),
    ("It costs $1,234.50 in total", "1234.5", "1234.50", True),
    # nothing at all
    ("I am not sure how to solve this.", "5", None, False),
    ("", "0", None, False),
]


@pytest.mark.parametrize(("completion", "reference", "extracted", "correct"), GRADE_CASES)
def test_grade_table(completion, reference, extracted, correct):
    grade = MathReward()(completion, reference)
    assert grade.extracted == extracted
    assert grade.correct is correct
    assert grade.reward == (1.0 if correct else 0.0)
    assert grade.error is None


def test_table_is_big_enough():
    assert len(GRADE_CASES) >= 30


@pytest.mark.parametrize(
    ("text", "style", "expected"),
    [
        (r"\boxed{\frac{1}{2}}", "boxed", r"\frac{1}{2}"),
        (r"\boxed{a} and \boxed{b}", "boxed", "b"),
        (r"no box 5", "boxed", None),
        (r"\boxed{unclosed", "boxed", None),
        ("#### 1,234", "gsm8k", "1234"),
        ("no hashes 5", "gsm8k", None),
        ("x-5 = 3-5", "last_number", "5"),  # binary minus, not a negative number
        ("value -5 here", "last_number", "-5"),
        ("ratio 3/4.", "last_number", "3/4"),
        ("total 1,234,567 items", "last_number", "1234567"),
        ("pi is 3.14", "last_number", "3.14"),
        ("no digits", "last_number", None),
        (r"\boxed{2} #### 3", "auto", "2"),
        ("#### 3\nThe answer is 4", "auto", "3"),
        ("The answer is 4, and then 5", "auto", "4, and then 5"),
        ("blah 9", "auto", "9"),
    ],
)
def test_extract_styles(text, style, expected):
    assert extract_answer(text, style) == expected


def test_extract_never_raises():
    assert extract_answer(None) is None  # type: ignore[arg-type]
    assert extract_answer("5", style="nope") is None


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        (None, "1", False),
        ("", "1", False),
        ("0.333", "1/3", False),
        ("1/3", "0.3333333333333", True),
        ("1e-9", "0", False),  # a zero reference is matched only by zero (absolute_tolerance 0)
        ("0", "0.0", True),
        ("5.8900001e-7", "5.89e-7", True),  # |diff| = 1e-14 <= 1e-6 * 5.89e-7
        ("5.8901e-7", "5.89e-7", False),  # relative at every magnitude
        ("100.00001", "100", True),  # |diff| = 1e-5 <= 1e-6 * 100
        ("100.001", "100", False),  # |diff| = 1e-3 > 1e-4
        ("-0.5", r"-\frac{1}{2}", True),
        ("-0.5", r"\frac{-1}{2}", True),
        ("0.5", r"-\frac{1}{2}", False),
    ],
)
def test_answers_equivalent_numeric(pred, ref, expected):
    assert answers_equivalent(pred, ref) is expected


def test_tolerance_argument():
    assert answers_equivalent("0.333", "1/3", tolerance=1e-2)
    assert not answers_equivalent("0.333", "1/3", tolerance=1e-4)


def test_absolute_tolerance_closed_form():
    # |pred - ref| <= tolerance * |ref| + absolute_tolerance, at the boundary and just past it
    assert answers_equivalent("0.001", "0", absolute_tolerance=1e-3)
    assert not answers_equivalent("0.0011", "0", absolute_tolerance=1e-3)
    assert answers_equivalent("10.2", "10", tolerance=0.01, absolute_tolerance=0.1)  # 0.2 <= 0.1 + 0.1
    assert not answers_equivalent("10.21", "10", tolerance=0.01, absolute_tolerance=0.1)


def test_cheap_paths_skip_math_verify(monkeypatch):
    def boom(pred, ref, **limits):
        raise AssertionError("math-verify should not be needed")

    monkeypatch.setattr(rm, "_mv_verify", boom)
    assert answers_equivalent(r"\frac{1}{2}", "0.5")
    assert not answers_equivalent("0.333", "1/3")
    assert answers_equivalent(r"5 \text{ cm}", "5")


def test_grader_exception_is_counted(monkeypatch, caplog):
    def boom(pred, ref, **limits):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(rm, "_mv_verify", boom)
    reward = MathReward(format_weight=0.1)
    grade = reward(r"\boxed{\sqrt{8}}", r"2\sqrt{2}")
    assert grade.correct is False
    assert grade.reward == pytest.approx(0.1)  # format still counted
    assert grade.format_ok is True
    assert "sympy exploded" in grade.error
    assert reward.failures == 1
    assert any("math grader failed" in r.message for r in caplog.records)
    # answers_equivalent swallows it too
    assert answers_equivalent(r"\sqrt{8}", r"2\sqrt{2}") is False
    # cheap paths still work and do not count failures
    assert reward(r"\boxed{4}", "4").correct
    assert reward.failures == 1


def test_format_reward_weight():
    reward = MathReward(correct_reward=1.0, incorrect_reward=-0.5, format_weight=0.25)
    assert reward(r"\boxed{4}", "4").reward == pytest.approx(1.25)
    assert reward(r"\boxed{5}", "4").reward == pytest.approx(-0.25)
    unboxed = reward("The answer is 4", "4")
    assert unboxed.correct and not unboxed.format_ok
    assert unboxed.reward == pytest.approx(1.0)
    assert reward("no answer", "4").reward == pytest.approx(-0.5)


@pytest.mark.parametrize(
    ("style", "text", "format_ok"),
    [
        ("gsm8k", "#### 4", True),
        ("gsm8k", r"\boxed{4}", False),
        ("last_number", "it is 4", True),
        ("last_number", "none", False),
        ("boxed", r"\boxed{4}", True),
        ("auto", "#### 4", False),
    ],
)
def test_format_ok_per_style(style, text, format_ok):
    assert MathReward(extraction=style)(text, "4").format_ok is format_ok


def test_bad_config_raises():
    with pytest.raises(ValueError, match="extraction"):
        MathReward(extraction="xml")


@pytest.mark.parametrize(
    ("answers", "same"),
    [
        ([r"\frac{1}{2}", "1/2", "0.5", r"\dfrac12", "0.50"], True),
        (["27", "27.0", "x = 27", r"27\text{ cm}", "27 J", "27 m/s"], True),
        ([r"\frac{37}{4}", r"\frac{37}{4} m"], False),  # m is a variable
        (["1,234", "1234"], True),
        (["1/3", "0.333"], False),
        ([r"\sqrt{2}", r"\sqrt 2", r"\sqrt{2} "], True),
    ],
)
def test_canonical_answer(answers, same):
    keys = {canonical_answer(a) for a in answers}
    assert (len(keys) == 1) is same
    assert canonical_answer(r"\frac{1}{2}") == "0.5"
    assert canonical_answer(None) is None


def test_math_verify_off_main_thread():
    """math-verify's signal timeouts fail off the main thread; its worker process does not care."""
    out = []
    t = threading.Thread(target=lambda: out.append(answers_equivalent(r"\sqrt{8}", r"2\sqrt{2}")))
    t.start()
    t.join()
    assert out == [True]


def test_even_token_toy_reward():
    from rlbench.reward.toy import EvenTokenReward

    grade = EvenTokenReward(threshold=0.75)("ignored text", "ignored", [2, 4, 7, 10])
    assert grade.reward == 0.75 and grade.correct and grade.format_ok
    assert EvenTokenReward()("", "", []).reward == 0.0
    assert not EvenTokenReward(threshold=0.75)("", "", [1, 3, 4]).correct
