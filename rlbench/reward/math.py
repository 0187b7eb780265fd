"""Math answer extraction and grading (verifiable reward for math problems).

Grading goes cheapest-first:

1. normalise both strings (units, ``\\%``, ``$``, spacing commands, ``dfrac``, thousands
   commas, a leading ``x =``) and compare them exactly;
2. if both are plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``) compare them
   numerically with a relative tolerance -- this decides the case either way;
3. otherwise ask ``math-verify`` (symbolic comparison: radicals, intervals, tuples, sets,
   equations, ...).

``math-verify`` is imported lazily (importing it takes ~0.5 s).  Its timeouts use
``signal.alarm``, which only works in the main thread; off the main thread this module
calls it without a timeout instead of letting it raise.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "Grade",
    "MathReward",
    "answers_equivalent",
    "canonical_answer",
    "extract_answer",
]

EXTRACTION_STYLES = ("auto", "boxed", "gsm8k", "last_number")

#: seconds math-verify may spend on one parse / one comparison (main thread only).
MATH_VERIFY_TIMEOUT_S = 5

# ---------------------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)")
# A number: optional sign (not when it is a binary minus such as "3-5" or "x-1"),
# digits with optional thousands commas, optional decimals, optional "/denominator".
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+(?!\d|\.\d))?"
)
_ANSWER_PHRASE_RE = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|:)\s*:?[ \t]*(?P<ans>[^\n]+)",
    re.IGNORECASE,
)
_LEADING_NUMBER_RE = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")


def _match_braces(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx``, or None if unbalanced."""
    depth = 0
    i = open_idx
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # skip escaped characters such as \{ and \}
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _extract_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    for m in reversed(list(_BOXED_RE.finditer(text))):
        i = m.end()
        if i < len(text) and text[i].isalpha():  # e.g. "\boxedx" is another command
            continue
        while i < len(text) and text[i] in " \t":
            i += 1
        if i >= len(text):
            continue
        if text[i] == "{":
            close = _match_braces(text, i)
            if close is None:
                continue
            content = text[i + 1 : close].strip()
        elif m.end() < i:  # "\boxed 5": the token after the space
            tok = re.match(r"[^\s$]+", text[i:])
            content = tok.group(0).rstrip(".,;") if tok else ""
        else:
            continue
        if content:
            return content
    return None


def _extract_gsm8k(text: str) -> str | None:
    """Text after the last ``####`` (to the end of that line), stripped, commas removed."""
    idx = text.rfind("####")
    if idx < 0:
        return None
    rest = text[idx + 4 :].strip()
    line = rest.split("\n", 1)[0].strip().replace(",", "")
    line = line.strip("$ ").rstrip(".").strip()
    return line or None


def _extract_last_number(text: str) -> str | None:
    """Last number in the text (``1,234`` -> ``1234``; ``3/4`` kept as a fraction)."""
    last = None
    for m in _NUMBER_RE.finditer(text):
        s = m.group(0)
        if any(ch.isdigit() for ch in s):
            last = s
    if last is None:
        return None
    return last.replace(",", "")


def _extract_phrase(text: str) -> str | None:
    """Answer after the last "the answer is X" / "Answer: X" phrase, lightly cleaned."""
    matches = list(_ANSWER_PHRASE_RE.finditer(text))
    if not matches:
        return None
    ans = matches[-1].group("ans").strip().strip("*").strip()
    if ans.startswith("$"):  # "$\frac{1}{2}$ apples." -> the maths between the dollars
        inner = re.match(r"\$+([^$]+)\$+", ans)
        if inner:
            return inner.group(1).strip() or None
    ans = re.split(r"\.(?:\s|$)", ans, maxsplit=1)[0].strip()  # first sentence only
    ans = ans.strip("*").strip()
    lead = _LEADING_NUMBER_RE.match(ans)
    if lead and re.match(r"\s+[A-Za-z]", ans[lead.end() :]):  # "42 apples" -> "42"
        ans = lead.group(0)
    ans = ans.rstrip(".").strip()
    return ans or None


def _extract(text: str, style: str) -> tuple[str | None, bool]:
    """(answer, format_ok) for ``style``; raises on unknown style or non-string input."""
    if style not in EXTRACTION_STYLES:
        raise ValueError(f"unknown extraction style {style!r}; use one of {EXTRACTION_STYLES}")
    if not isinstance(text, str):
        raise TypeError(f"completion must be a str, got {type(text).__name__}")
    if style == "boxed":
        ans = _extract_boxed(text)
        return ans, ans is not None
    if style == "gsm8k":
        ans = _extract_gsm8k(text)
        return ans, ans is not None
    if style == "last_number":
        ans = _extract_last_number(text)
        return ans, ans is not None
    # auto: boxed, then ####, then "the answer is", then last number
    ans = _extract_boxed(text)
    if ans is not None:
        return ans, True
    for fn in (_extract_gsm8k, _extract_phrase, _extract_last_number):
        ans = fn(text)
        if ans is not None:
            return ans, False
    return None, False


def extract_answer(text: str, style: str = "auto") -> str | None:
    """Extract the final answer from a model completion.

    Styles:
      * ``"boxed"``: content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces
        handled: ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``; also ``\\boxed 5`` -> ``5``);
      * ``"gsm8k"``: text after the last ``####`` (rest of that line), stripped, commas removed;
      * ``"last_number"``: last number in the text (integers, decimals, negatives, thousands
        commas ``1,234`` -> ``1234``, simple fractions ``3/4``);
      * ``"auto"``: boxed, else ``####``, else "the answer is X" / "Answer: X", else last number.

    Returns None when nothing is found (or on any error: this function never raises).
    """
    try:
        return _extract(text, style)[0]
    except Exception:  # noqa: BLE001 - documented: never raises
        logger.warning("answer extraction failed (style=%r)", style, exc_info=True)
        return None


# ---------------------------------------------------------------------------------------
# normalisation
# ---------------------------------------------------------------------------------------

_TEXT_CMD = r"\\(?:text|textbf|textrm|mbox|mathrm)\s*"
_WHOLE_TEXT_RE = re.compile(r"^" + _TEXT_CMD + r"\{([^{}]*)\}$")
_TRAILING_UNIT_RE = re.compile(r"\s*" + _TEXT_CMD + r"\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?\s*$")
_SPACING_RE = re.compile(r"\\[!,;:> ]|\\q?quad\b")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ\b|°")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGN_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?=[^=]+$)")
_NUMERIC_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:/\d+)?$")
_LATEX_FRAC_RE = re.compile(r"^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")


def _strip_outer_braces(s: str) -> str:
    """Remove one pair of braces wrapping the whole string, repeatedly."""
    while s.startswith("{") and _match_braces(s, 0) == len(s) - 1:
        s = s[1:-1].strip()
    return s


@lru_cache(maxsize=65536)
def _normalize(s: str) -> str:
    """Light LaTeX normalisation that keeps the expression parseable (spaces are kept).

    Removes ``$``/``\\$``, ``\\left``/``\\right``, spacing commands (``\\!``, ``\\,``, ...),
    degree marks, ``\\%``/``%``, trailing ``\\text{unit}``, a trailing ``.``, a leading
    ``x =``; maps ``\\dfrac``/``\\tfrac`` -> ``\\frac``; unwraps ``\\boxed{}`` and a
    whole-string ``\\text{}``; drops thousands commas in a plain number (``1,234``).
    """
    s = s.strip()
    boxed = _extract_boxed(s) if s.startswith(("\\boxed", "\\fbox")) else None
    if boxed is not None:
        s = boxed
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING_RE.sub(" ", s)
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip()
    whole = _WHOLE_TEXT_RE.match(s)
    if whole:
        s = whole.group(1).strip()
    prev = None
    while prev != s:  # "5\text{ cm}^2", "3 \text{m} \text{ long}"
        prev = s
        stripped = _TRAILING_UNIT_RE.sub("", s).strip()
        if stripped:
            s = stripped
    s = s.rstrip(".").strip()
    s = _ASSIGN_RE.sub("", s).strip()
    s = _strip_outer_braces(s)
    # \frac12 -> \frac{1}{2}, \sqrt3 -> \sqrt{3}
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if s.startswith("+") and _NUMERIC_RE.match(s):
        s = s[1:]
    return s


def _compact(s: str) -> str:
    """Normalised string with all whitespace removed: the exact-match key."""
    return re.sub(r"\s+", "", s)


def _to_fraction(s: str) -> Fraction | None:
    """Exact value of a normalised plain number (``-2``, ``0.5``, ``1/2``, ``\\frac{1}{2}``)."""
    s = _compact(s)
    if not s or len(s) > 200:
        return None
    if _NUMERIC_RE.match(s):
        exp = re.search(r"[eE]([+-]?\d+)", s)
        if exp and abs(int(exp.group(1))) > 400:  # keep Fraction() cheap
            return None
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = _LATEX_FRAC_RE.match(s)
    if m:
        num, den = _to_fraction(m.group(2)), _to_fraction(m.group(3))
        if num is None or den is None or den == 0:
            return None
        val = num / den
        return -val if m.group(1) else val
    return None


def _fraction_key(x: Fraction) -> str:
    """Canonical string of a number: integers exactly, others to 12 significant digits."""
    if x.denominator == 1:
        return str(x.numerator)
    try:
        s = format(float(x), ".12g")
    except OverflowError:
        return f"{x.numerator}/{x.denominator}"
    return "0" if s in ("-0", "0") else s


def canonical_answer(ans: str | None) -> str | None:
    """Normalised key under which equal answers vote together (majority voting).

    Numeric answers map to one canonical number string (``\\frac{1}{2}``, ``1/2`` and
    ``0.5`` -> ``"0.5"``; ``27.0`` -> ``"27"``); other answers map to their normalised
    string with whitespace removed. None (or an empty answer) -> None. Never raises.
    """
    if ans is None:
        return None
    try:
        norm = _normalize(str(ans))
        value = _to_fraction(norm)
        if value is not None:
            return _fraction_key(value)
        key = _compact(norm)
        return key or None
    except Exception:  # noqa: BLE001 - documented: never raises
        logger.warning("canonical_answer failed", exc_info=True)
        return None


# ---------------------------------------------------------------------------------------
# equivalence
# ---------------------------------------------------------------------------------------


def _mv_timeout() -> int | None:
    """math-verify timeout: signal-based, so only usable on the main thread."""
    if threading.current_thread() is threading.main_thread():
        return MATH_VERIFY_TIMEOUT_S
    return None


@lru_cache(maxsize=8192)
def _mv_parse(expr: str, timeout: int | None):
    """math-verify parse of one bare expression (wrapped in ``$...$``); cached."""
    from math_verify import parse

    return parse(f"${expr}$", parsing_timeout=timeout)


def _mv_verify(pred: str, ref: str) -> bool:
    """Symbolic check ``pred == ref`` with math-verify (gold = ref, target = pred)."""
    from math_verify import verify

    timeout = _mv_timeout()
    gold = _mv_parse(ref, timeout)
    target = _mv_parse(pred, timeout)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=timeout))


def _numbers_close(a: Fraction, b: Fraction, tolerance: float) -> bool:
    """``|a - b| <= tolerance * max(1, |b|)``, evaluated exactly."""
    return abs(a - b) <= Fraction(tolerance) * max(Fraction(1), abs(b))


def _equivalent(pred: str | None, ref: str, tolerance: float) -> bool:
    """Core of :func:`answers_equivalent`; may raise (callers decide what to do)."""
    if pred is None or ref is None:
        return False
    p_norm, r_norm = _normalize(str(pred)), _normalize(str(ref))
    p_key, r_key = _compact(p_norm), _compact(r_norm)
    if not p_key or not r_key:
        return False
    if p_key == r_key:
        return True
    p_val, r_val = _to_fraction(p_norm), _to_fraction(r_norm)
    if p_val is not None and r_val is not None:
        return _numbers_close(p_val, r_val, tolerance)
    return _mv_verify(p_norm, r_norm)


def answers_equivalent(pred: str | None, ref: str, tolerance: float = 1e-6) -> bool:
    """True if ``pred`` is mathematically equal to ``ref``.

    Order: normalised exact string match; if both are plain numbers,
    ``|pred - ref| <= tolerance * max(1, |ref|)`` (decides either way, so ``0.333`` is
    not ``1/3`` at the default tolerance); otherwise math-verify's symbolic comparison.
    ``pred=None`` -> False. Never raises: an exception inside the grader -> False.
    """
    try:
        return _equivalent(pred, ref, tolerance)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - math-verify's TimeoutException is a BaseException
        logger.warning("answer comparison failed; counted as incorrect", exc_info=True)
        return False


# ---------------------------------------------------------------------------------------
# reward
# ---------------------------------------------------------------------------------------


@dataclass
class Grade:
    """Outcome of grading one completion.

    correct:   the extracted answer equals the reference.
    extracted: the extracted answer (None if none was found).
    reward:    the scalar reward given to the policy.
    format_ok: an answer in the expected format was found (``\\boxed`` for styles
               auto/boxed; ``####`` for gsm8k; any number for last_number).
    error:     exception text if the grader crashed on this output.
    details:   grader-specific detail (the code grader: per-test outcomes and the sandbox
               status); None for graders that have none.
    """

    correct: bool
    extracted: str | None
    reward: float
    format_ok: bool
    error: str | None = None
    details: dict | None = None


class MathReward:
    """Binary correctness reward plus optional format reward.

    ``reward = (correct_reward if correct else incorrect_reward) + format_weight * format_ok``.
    Grader exceptions are logged, counted in ``failures`` and graded as incorrect.
    """

    def __init__(
        self,
        correct_reward: float = 1.0,
        incorrect_reward: float = 0.0,
        format_weight: float = 0.0,
        tolerance: float = 1e-6,
        extraction: str = "auto",
    ) -> None:
        if extraction not in EXTRACTION_STYLES:
            raise ValueError(
                f"reward extraction={extraction!r} is unknown; use one of {EXTRACTION_STYLES}"
            )
        if tolerance < 0:
            raise ValueError(f"reward tolerance must be >= 0, got {tolerance}")
        self.correct_reward = float(correct_reward)
        self.incorrect_reward = float(incorrect_reward)
        self.format_weight = float(format_weight)
        self.tolerance = float(tolerance)
        self.extraction = extraction
        self.failures = 0
        self._lock = threading.Lock()

    def __call__(self, completion: str, reference: str, response_ids: Sequence[int] = ()) -> Grade:
        """Grade ``completion`` against ``reference``; never raises (see ``failures``).
        ``response_ids`` is part of the grader interface; this grader reads the text only."""
        extracted: str | None = None
        format_ok = False
        correct = False
        error: str | None = None
        try:
            extracted, format_ok = _extract(completion, self.extraction)
            correct = _equivalent(extracted, reference, self.tolerance)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - incl. math-verify TimeoutException
            correct = False
            error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.failures += 1
            logger.warning(
                "math grader failed (%s); graded as incorrect [failures=%d]", error, self.failures
            )
        reward = self.correct_reward if correct else self.incorrect_reward
        reward += self.format_weight * float(format_ok)
        return Grade(
            correct=correct, extracted=extracted, reward=reward, format_ok=format_ok, error=error
        )

    def __repr__(self) -> str:
        return (
            f"MathReward(correct_reward={self.correct_reward}, "
            f"incorrect_reward={self.incorrect_reward}, format_weight={self.format_weight}, "
            f"tolerance={self.tolerance}, extraction={self.extraction!r})"
        )
