"""The math grader on a table of tricky cases; the policy behind each verdict is in the
docstring of rlbench/reward/math.py.  Also: extraction end to end, hostile inputs, timeouts
and grading from worker threads."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
from pathlib import Path

import pytest

import rlbench.reward.symbolic as symbolic
from rlbench.reward import MathReward, answers_equivalent
from rlbench.reward.math import MAX_ANSWER_CHARS

MATH500 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "math500" / "test.jsonl"


def case(pred: str, ref: str, expected: bool, name: str):
    return pytest.param(pred, ref, expected, id=name)


# (prediction, reference, expected verdict)
TABLE = [
    # --- equivalent forms of numbers
    case(r"\frac{1}{2}", "0.5", True, "frac-vs-decimal"),
    case("1/2", r"\frac12", True, "slash-vs-frac-shorthand"),
    case(r"\dfrac{1}{2}", r"\tfrac{1}{2}", True, "dfrac-vs-tfrac"),
    case("0.5", r"\dfrac{1}{2}", True, "decimal-vs-dfrac"),
    case(r"1\frac{1}{2}", r"\frac{3}{2}", True, "mixed-number-vs-improper"),
    case(r"-1\frac{1}{2}", "-1.5", True, "negative-mixed-number"),
    case("007", "7", True, "leading-zeros"),
    case(".5", "0.50", True, "no-leading-zero-vs-trailing-zero"),
    case("2.50", "2.5", True, "trailing-zero"),
    case("1.5e3", "1500", True, "e-notation"),
    case(r"1.5 \times 10^{3}", "1500", True, "times-ten-power"),
    case("1e-7", r"10^{-7}", True, "e-notation-vs-negative-power"),
    case("1,000", "1000", True, "thousands-comma"),
    case("1{,}000", "1000", True, "thousands-braced-comma"),
    case(r"1\,000", "1000", True, "thousands-thin-space"),
    case("1,000,000", "10^6", True, "millions-vs-power"),
    case("2,5", "2.5", False, "decimal-comma-is-a-list"),
    case(r"\sqrt{2}/2", r"\frac{\sqrt2}{2}", True, "sqrt-slash-vs-frac"),
    case(r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", True, "rationalised-denominator"),
    case(r"\sqrt{8}", r"2\sqrt{2}", True, "simplified-radical"),
    case(r"\pi/2", r"\frac{\pi}{2}", True, "pi-slash-vs-frac"),
    case(r"2 \pi", r"2\pi", True, "pi-spacing"),
    case("\u22125", "-5", True, "unicode-minus"),
    case("- 5", "-5", True, "space-after-minus"),
    case("x = 3", "3", True, "assignment-vs-number"),
    case("3", "k=3", True, "number-vs-assignment"),
    case(r"The final answer is \boxed{3}", "3", True, "boxed-inside-text"),
    case(r"\left( 1, 2 \right)", "(1,2)", True, "left-right-delimiters"),
    case("( 1 , 2 )", "(1,2)", True, "spaces-in-tuple"),
    # --- units and text
    case("5 cm", "5", True, "plain-unit"),
    case("5 dollars", "5", True, "plain-unit-word"),
    case(r"5 \text{ dollars}", "5", True, "text-unit"),
    case(r"12\text{ cm}^2", "12", True, "text-unit-squared"),
    case(r"30^\circ", "30", True, "degrees-circ"),
    case("30 degrees", r"30^{\circ}", True, "degrees-word-vs-circ"),
    case(r"\frac{\pi}{6}", r"30^\circ", False, "radians-are-not-degrees"),
    case(r"\$5", "5", True, "escaped-dollar"),
    case(r"\$18.00", "18", True, "dollar-and-cents"),
    # --- percentages
    case(r"50\%", "50", True, "percent-vs-number"),
    case("50%", "0.5", True, "percent-vs-fraction"),
    case("0.5", r"50\%", True, "fraction-vs-percent-reference"),
    case("50 percent", "50", True, "percent-word"),
    case("0.5", "50", False, "bare-fraction-is-not-bare-percent-number"),
    case("0.5%", "50%", False, "both-percent-compared-as-written"),
    # --- intervals and sets
    case("(1, 2]", "(1,2]", True, "interval-spacing"),
    case("[1,2]", "(1,2)", False, "closed-vs-open-interval"),
    case("(1,2]", "(1,2)", False, "half-open-vs-open"),
    case(r"\{1,2\}", r"\{2,1\}", True, "set-order-irrelevant"),
    case(r"\{1,2\}", r"\{1,3\}", False, "different-sets"),
    case(r"(1,\infty)\cup(-\infty,0)", r"(-\infty,0)\cup(1,\infty)", True, "union-order"),
    case(r"(-\infty, 0] \cup (1, \infty)", r"(-\infty,0)\cup(1,\infty)", False, "union-endpoint"),
    case("(0,inf)", r"(0,\infty)", True, "inf-vs-infty"),
    case(r"-\infty", r"\infty", False, "minus-infinity"),
    case(r"\varnothing", r"\emptyset", True, "empty-set-symbols"),
    # --- tuples, ordered vs unordered
    case("(1,2)", "(2,1)", False, "tuple-order-matters"),
    case("(1,2,3)", "(1,2)", False, "tuple-length"),
    case(r"(1, \frac{1}{2})", "(1,0.5)", True, "tuple-entry-forms"),
    case("1, 2", "2, 1", True, "bare-list-is-unordered"),
    case("(1,2)", r"\{1,2\}", False, "tuple-is-not-set"),
    case(r"\{1,2\}", "(1,2)", False, "set-is-not-interval"),
    # --- matrices
    case(
        r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",
        r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
        True,
        "matrix-spacing",
    ),
    case(
        r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",
        r"\begin{pmatrix}1&2\\4&3\end{pmatrix}",
        False,
        "matrix-different",
    ),
    case(
        r"\begin{bmatrix}1&2\\3&4\end{bmatrix}",
        r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",
        True,
        "bmatrix-vs-pmatrix",
    ),
    case(
        r"\begin{pmatrix}0.3333333\\1\end{pmatrix}",
        r"\begin{pmatrix}\frac13\\1\end{pmatrix}",
        True,
        "matrix-entries-within-tolerance",
    ),
    case(
        r"\begin{pmatrix}0.333\\1\end{pmatrix}",
        r"\begin{pmatrix}\frac13\\1\end{pmatrix}",
        False,
        "matrix-entries-outside-tolerance",
    ),
    # --- multiple choice, AMC floats, AIME integers
    case("(A)", "A", True, "choice-parenthesised"),
    case("A", "(A)", True, "choice-bare-vs-parenthesised"),
    case(r"\textbf{(C)}", "C", True, "choice-bold"),
    case("(B)", "(A)", False, "choice-different"),
    case("27", "27.0", True, "amc-float-reference"),
    case("27.000001", "27.0", True, "amc-within-relative-tolerance"),
    case("27.001", "27.0", False, "amc-outside-tolerance"),
    case("033", "33", True, "aime-leading-zero"),
    case("33", "033", True, "aime-leading-zero-reference"),
    case("1000001", "1000000", False, "integers-compared-exactly"),
    # --- wrong but close
    case("0.333", "1/3", False, "0.333-is-not-one-third"),
    case("0.3333333", r"\frac{1}{3}", True, "one-third-within-1e-6"),
    case("3.14", r"\pi", False, "3.14-is-not-pi"),
    case("3.1415927", r"\pi", True, "pi-within-1e-6"),
    case(r"\frac{355}{113}", r"\pi", False, "exact-forms-not-matched-by-closeness"),
    case("1.4142", r"\sqrt{2}", False, "sqrt2-too-coarse"),
    case("1.41421356", r"\sqrt{2}", True, "sqrt2-within-1e-6"),
    case("1/2", "2", False, "reciprocal"),
    case("x^2", "2x", False, "power-vs-multiple"),
    case("-3", "3", False, "off-by-sign"),
    case(r"-\frac{1}{2}", r"\frac{1}{2}", False, "off-by-sign-fraction"),
    case(r"-\frac{1}{2}", r"\frac{-1}{2}", True, "sign-placement"),
    # --- expressions
    case("2x+1", "1+2x", True, "commuted-sum"),
    case("(x+1)^2", "x^2+2x+1", True, "expanded-square"),
    case("(x+1)^2", "x^2+2x+2", False, "wrong-expansion"),
    case(r"\frac{a}{b}", "a/b", True, "symbolic-fraction-forms"),
    case(r"\frac{2a}{2b}", r"\frac ab", True, "unreduced-symbolic-fraction"),
    case(r"\frac{a}{b}", r"\frac{b}{a}", False, "inverted-symbolic-fraction"),
    case("y = 2x+1", "2x+1", True, "equation-label"),
    # --- nan / inf text, long answers
    case("NaN", "1", False, "nan-text"),
    case("inf", "1", False, "inf-text"),
    case("1e999999", "1", False, "huge-e-notation"),
    case("1" * 5000, "1", False, "very-long-number"),
    case("{" * 300 + "1" + "}" * 300, "1", True, "deep-braces-are-grouping"),
    # --- issue 16: false positives and parsing slips found on unseen benchmarks (regressions)
    case("0", r"5.89\times10^{-7}", False, "tiny-reference-rejects-zero"),
    case(r"1.178\times10^{-6}", r"5.89\times10^{-7}", False, "tiny-reference-rejects-twice"),
    case(r"-5.89\times10^{-7}", r"5.89\times10^{-7}", False, "tiny-reference-rejects-negation"),
    case("5.89e-7", r"5.89\times10^{-7}", True, "tiny-reference-e-notation"),
    case("-1", "-1./3", False, "trailing-dot-fraction-is-not-minus-one"),
    case(r"-\frac{1}{3}", "-1./3", True, "trailing-dot-fraction"),
    case(r"\frac{37}{4}", r"\frac{37}{4} m", False, "lowercase-letter-is-a-variable"),
    case(r"\frac{37}{4} m", r"\frac{37}{4}m", True, "variable-kept-both-sides"),
    case("5", "5r^5", False, "variable-with-power-kept"),
    case("2", r"\text{Evelyn}", False, "no-number-read-from-a-name"),
    case("2", "2x+1", False, "no-number-read-from-an-expression"),
    case("E_1", "E_{1}", True, "subscript-braces"),
    case(r"E_{2}, E_{1}", r"E_{1},E_{2}", True, "unordered-list-of-symbols"),
    case(r"E_{2}, E_{2}", r"E_{1},E_{2}", False, "unordered-list-needs-every-element"),
    case("5 J", "5", True, "unit-joule"),
    case(r"3\ \mathrm{V}", "3", True, "unit-volt-mathrm"),
    case("3 V", "3", True, "unit-volt"),
    case("4 m/s", "4", True, "unit-compound-slash"),
    case(r"2\times10^{3} cm^{-3}", "2000", True, "unit-after-power-of-ten"),
    case("1.5e3 kg", "1500", True, "unit-after-e-notation"),
    case(r"5 kg \cdot m/s^2", "5", True, "unit-product"),
    case("5 cm", "5 m", False, "different-units"),
    case(r"12 \text{ inches}", "12 inch", True, "unit-plural"),
    case("4", "4 m/s", True, "unit-on-reference-only"),
]


@pytest.mark.parametrize(("pred", "ref", "expected"), TABLE)
def test_verdict(pred, ref, expected, caplog):
    caplog.set_level(logging.WARNING, logger="rlbench.reward")
    assert answers_equivalent(pred, ref) is expected
    assert not caplog.records  # decided, not a swallowed grader error


def test_table_size_and_unique_ids():
    ids = [p.id for p in TABLE]
    assert len(ids) >= 60
    assert len(set(ids)) == len(ids)


def test_tolerance_also_applies_to_constants():
    assert answers_equivalent("3.14", r"\pi", tolerance=1e-3)
    assert not answers_equivalent("3.14", r"\pi", tolerance=1e-4)


# ---------------------------------------------------------------------------------------
# extraction end to end (completion -> MathReward)
# ---------------------------------------------------------------------------------------

# (completion, extraction style, reference, expected extracted, expected correct)
COMPLETIONS = [
    pytest.param(
        "First, 3 + 4 = 7. Then we double it: 2 * 7 = 14.\nSo the result is $\\boxed{14}$.",
        "auto", "14", "14", True, id="reasoning-then-boxed",
    ),
    pytest.param(
        "The ratio is \\frac{1}{2} of 8, i.e. 4, so the answer is \\boxed{\\frac{\\sqrt{3}}{2}}.",
        "auto", "\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", True, id="boxed-nested-braces",
    ),
    pytest.param(
        "We have 6 apples and eat 2.\nThe answer is 4.", "auto", "4", "4", True,
        id="the-answer-is",
    ),
    pytest.param(
        "Adding gives 0.5.\n**Final Answer:** $\\frac{1}{2}$", "auto", "0.5", "\\frac{1}{2}", True,
        id="final-answer-phrase-with-dollars",
    ),
    pytest.param(
        "Try \\boxed{3}. Hmm, that fails the check. Correct: \\boxed{5}", "auto", "5", "5", True,
        id="several-boxed-last-wins",
    ),
    pytest.param(
        "Try \\boxed{3}. Hmm, that fails the check. Correct: \\boxed{5}", "auto", "3", "5", False,
        id="several-boxed-earlier-not-used",
    ),
    pytest.param(
        "\\boxed{4} and then \\boxed{5", "auto", "4", "4", True, id="unclosed-last-box-skipped",
    ),
    pytest.param(
        "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72",
        "gsm8k", "72", "72", True, id="gsm8k-hashes",
    ),
    pytest.param(
        "He pays 1,000 + 200 = 1,200 dollars.\n#### 1,200", "auto", "1200", "1200", True,
        id="gsm8k-hashes-auto-with-comma",
    ),
    pytest.param(
        "It costs 5 dollars, then 7 dollars, 12 in total", "last_number", "12", "12", True,
        id="last-number",
    ),
    pytest.param("\\boxed{}", "auto", "1", None, False, id="empty-boxed"),
    pytest.param("I don't know.", "auto", "1", None, False, id="no-answer"),
]


@pytest.mark.parametrize(("completion", "style", "ref", "extracted", "correct"), COMPLETIONS)
def test_completion_end_to_end(completion, style, ref, extracted, correct):
    reward = MathReward(extraction=style)
    grade = reward(completion, ref)
    assert grade.extracted == extracted
    assert grade.correct is correct
    assert grade.reward == (1.0 if correct else 0.0)
    assert grade.error is None and reward.failures == 0


# ---------------------------------------------------------------------------------------
# hostile inputs: never raise; errors and timeouts are counted, recorded and logged
# ---------------------------------------------------------------------------------------

HOSTILE = [
    pytest.param("\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "1", id="5000-nested-braces"),
    pytest.param("\\boxed{" * 20000, "1", id="20000-unclosed-boxes"),
    # the fallback reads \frac{1}{2} whole, never the 2 inside it
    pytest.param("\\boxed{\\frac{1}{2}", "2", id="unbalanced-braces"),
    pytest.param("x" * 200_000 + " \\boxed{6}", "5", id="very-long-text"),
    pytest.param("\\(" * 50_000 + "1", "2", id="50000-unclosed-maths"),
    pytest.param("$" * 100_001 + "1 " + "\\frac{" * 30_000 + "1", "2", id="100000-dollars"),
    pytest.param("\\boxed{" + "x" * 5000 + "}", "x", id="very-long-answer"),
    pytest.param("\\boxed{NaN}", "1", id="nan"),
    pytest.param("\\boxed{\\infty}", "1", id="infinity"),
    pytest.param("\\boxed{10^{10^{10}}}", "1", id="huge-exponent"),
    pytest.param("\\boxed{9^{9^{9}}}", "1", id="power-tower"),
    pytest.param("\\boxed{10!!!!!!}", "1", id="factorial-chain"),
]


#: The two ways a math-verify check ends in a timeout: the worker's own timer fires ("timed out after
#: 1.0 s"), or, when a long C-level step delays that timer (more likely on a loaded machine), the parent
#: stops waiting REPLY_GRACE_S later and kills the worker ("did not answer within 3 s").
TIMEOUT_ERROR = re.compile(r"timed out|did not answer")


@pytest.mark.parametrize(("completion", "ref"), HOSTILE)
def test_hostile_input_never_raises(completion, ref, caplog):
    reward = MathReward(verify_timeout_s=1)
    grade = reward(completion, ref)
    assert grade.correct is False and grade.reward == 0.0
    assert reward.failures == (0 if grade.error is None else 1)
    counted = [r for r in caplog.records if "[failures=1]" in r.getMessage()]
    assert len(counted) == reward.failures


def test_long_answers_compared_as_exact_strings():
    long_answer = "x+" * (MAX_ANSWER_CHARS // 2) + "1"
    assert answers_equivalent(long_answer, long_answer)
    assert not answers_equivalent(long_answer, "1+" + long_answer[:-1] + "x")


def test_timeout_is_a_counted_and_logged_failure(caplog):
    reward = MathReward(verify_timeout_s=1, format_weight=0.5)
    grade = reward("\\boxed{x^{10^{10^{10}}}}", "1")
    assert grade.correct is False and grade.format_ok is True
    assert grade.reward == pytest.approx(0.5)
    assert TIMEOUT_ERROR.search(grade.error)
    assert reward.failures == 1
    grade = reward(None, "1")  # type: ignore[arg-type] - not even a string
    assert grade.error.startswith("TypeError") and grade.extracted is None
    assert reward.failures == 2
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("[failures=1]" in m and TIMEOUT_ERROR.search(m) for m in messages)
    assert any("[failures=2]" in m for m in messages)
    # the worker (shared by all graders) still answers; an ample limit, so a loaded machine cannot time it out
    ample = MathReward(verify_timeout_s=60)
    assert ample(r"\boxed{\sqrt{8}}", r"2\sqrt{2}").correct and ample.failures == 0
    assert reward.failures == 2


def test_timeout_from_a_worker_thread_does_not_hang():
    reward = MathReward(verify_timeout_s=1)
    grades = []
    thread = threading.Thread(target=lambda: grades.append(reward("\\boxed{x^{10^{10^{10}}}}", "1")))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert grades[0].correct is False and TIMEOUT_ERROR.search(grades[0].error)
    assert reward.failures == 1


def test_concurrent_threads_get_their_own_verdicts():
    cases = [
        (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", True),
        (r"\boxed{\sqrt{8}}", r"3\sqrt{2}", False),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", True),
        (r"\boxed{[1,2)}", "[1,2]", False),
        (r"\boxed{\{1,2\}}", r"\{2,1\}", True),
        (r"\boxed{2x}", "x^2", False),
    ] * 3
    reward = MathReward()
    results: dict[int, bool] = {}

    def grade(i: int) -> None:
        completion, ref, _ = cases[i]
        results[i] = reward(completion, ref).correct

    threads = [threading.Thread(target=grade, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {i: expected for i, (_, _, expected) in enumerate(cases)}
    assert reward.failures == 0


def test_stuck_worker_is_killed_and_replaced(monkeypatch):
    monkeypatch.setattr(symbolic, "REPLY_GRACE_S", 0.5)
    assert answers_equivalent(r"\sqrt{8}", r"2\sqrt{2}")  # a running worker
    stuck = symbolic._WORKER.pid
    os.kill(stuck, signal.SIGSTOP)  # stops answering; its own timer cannot fire either
    try:
        with pytest.raises(symbolic.SymbolicCheckError, match="did not answer"):
            symbolic.symbolic_equal(r"\sqrt{18}", r"3\sqrt{2}", tolerance=1e-6, timeout_s=0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # already killed unless the test failed
            os.kill(stuck, signal.SIGCONT)
    assert symbolic._WORKER.pid is None  # killed
    assert answers_equivalent(r"\sqrt{18}", r"3\sqrt{2}")  # a fresh worker
    assert symbolic._WORKER.pid != stuck


def test_dead_worker_is_restarted_transparently():
    assert answers_equivalent(r"\sqrt{8}", r"2\sqrt{2}")
    dead = symbolic._WORKER.pid
    os.kill(dead, signal.SIGKILL)
    reward = MathReward()
    assert reward(r"\boxed{\sqrt{12}}", r"2\sqrt{3}").correct
    assert reward.failures == 0 and symbolic._WORKER.pid != dead


# ---------------------------------------------------------------------------------------
# real data: every MATH-500 solution's boxed answer matches the released answer
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not MATH500.is_file(), reason="shared MATH-500 data not present")
def test_math500_solutions_match_their_answers():
    rows = [json.loads(line) for line in MATH500.read_text().splitlines() if line.strip()]
    reward = MathReward(extraction="boxed")
    wrong = [r["unique_id"] for r in rows if not reward(r["solution"], r["answer"]).correct]
    assert len(rows) == 500
    assert wrong == [] and reward.failures == 0


# (prediction, reference, answer_type, expected verdict): the benchmark's answer_type changes the reading
ANSWER_TYPE_TABLE = [
    pytest.param("5", "5 m", "number", True, id="number-lone-letter-is-a-unit"),
    pytest.param("5", "5 m", "math", False, id="math-lone-letter-is-a-variable"),
    pytest.param(r"\frac{37}{4}", r"\frac{37}{4} m", "number", True, id="number-fraction-unit"),
    pytest.param("1e3 m", "1000", "number", True, id="number-unit-after-e-notation"),
    pytest.param("2", "2mg", "number", True, id="number-glued-unit"),
    pytest.param("5", "5 cm", "expression", False, id="expression-strips-no-unit"),
    pytest.param(r"\{2, 1\}", "1, 2", "set", True, id="set-braced-vs-bare"),
    pytest.param(r"E_{2}, E_{1}", r"\{E_1, E_2\}", "set", True, id="set-of-symbols"),
    pytest.param("3", r"\{3\}", "set", True, id="set-of-one"),
    pytest.param("1, 2", r"\{1, 2, 3\}", "set", False, id="set-missing-element"),
    pytest.param("1, 2", "2, 1", "math", True, id="math-bare-list-unordered"),
    pytest.param("evelyn", r"\text{Evelyn}", "text", True, id="text-case-insensitive"),
    pytest.param("2", r"\text{2 cats}", "text", False, id="text-no-number-reading"),
    pytest.param("0.5", r"\frac{1}{2}", "text", False, id="text-no-numeric-equivalence"),
]


@pytest.mark.parametrize(("pred", "ref", "answer_type", "expected"), ANSWER_TYPE_TABLE)
def test_verdict_by_answer_type(pred, ref, answer_type, expected, caplog):
    caplog.set_level(logging.WARNING, logger="rlbench.reward")
    assert answers_equivalent(pred, ref, answer_type=answer_type) is expected
    assert not caplog.records


def test_unknown_answer_type_is_a_grader_error():
    assert answers_equivalent("1", "1", answer_type="nope") is False


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        pytest.param(r"-\left(\frac{1}{2^{98}}\right)", r"\frac{1}{2^{98}}", False, id="tiny-exact-constant-negation"),
        pytest.param(r"2\left(\frac{1}{2^{98}}\right)", r"\frac{1}{2^{98}}", False, id="tiny-exact-constant-twice"),
        pytest.param(r"2^{-98}", r"\frac{1}{2^{98}}", True, id="tiny-exact-constant-other-form"),
        pytest.param("0", "x + y + z = 0", False, id="equation-is-not-its-right-side"),
        pytest.param(r"10^{10^{10}}", "1", False, id="huge-exact-power-decided-by-value"),
        pytest.param("x+y+z=0", "x + y + z = 0", True, id="equation-vs-equation"),
    ],
)
def test_found_by_the_probe_battery(pred, ref, expected):
    """False positives the battery found in MATH train (regressions)."""
    assert answers_equivalent(pred, ref) is expected


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        pytest.param("5.4 cm", r"5.4 \text{ cents}", False, id="wrapped-unit-compared"),
        pytest.param(r"5.4\text{ cents}", "5.4 cents", True, id="wrapped-vs-bare-unit"),
        pytest.param("864", r"864 \mbox{ inches}^2", True, id="wrapped-unit-on-reference-only"),
        pytest.param(r"864 \text{ cm}^2", r"864 \mbox{ inches}^2", False, id="wrapped-units-differ"),
        pytest.param("2", "2s", False, id="lone-s-is-a-variable"),
        pytest.param("2", "2mg", False, id="glued-letters-are-variables-not-milligrams"),
        pytest.param("2", "2 mg", True, id="spaced-unit-word"),
        pytest.param(r"5 \text{ apples}", "5", True, id="wrapped-label-is-dropped"),
    ],
)
def test_units_in_text_wrappers(pred, ref, expected):
    """Found by the agreement run: a unit inside \\text{} is compared like a bare one."""
    assert answers_equivalent(pred, ref) is expected
