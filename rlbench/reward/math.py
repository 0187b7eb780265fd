"""Math answer extraction and grading (verifiable reward for math problems).

Grading goes cheapest-first:

1. normalise both strings (units, ``\\%``, ``$``, spacing commands, ``dfrac``, thousands
   commas, a leading ``x =``) and compare them exactly;
2. if both are plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``, mixed numbers,
   ``1.5e3``, ``1.5\\times10^{3}``) compare them numerically -- this decides either way;
3. otherwise ask ``math-verify`` (symbolic comparison: radicals, intervals, tuples, sets,
   matrices, equations, ...) in a worker process with a hard timeout
   (:mod:`rlbench.reward.symbolic`; safe from any thread).

Policy (each rule is a choice; ``tests/test_grader_table.py`` and ``tests/test_grader_conventions.py``
pin every one; docs/evaluation.md, "Grading conventions", says where peers decide otherwise):

* Numbers: two integers must be equal exactly (``1000001`` is not ``1000000``); otherwise
  ``|pred - ref| <= tolerance * |ref| + absolute_tolerance`` (defaults 1e-6 and 0: relative at
  every magnitude, so ``0.333`` is not ``1/3`` but ``0.3333333`` is, ``27.000001`` matches the
  AMC reference ``27.0``, a reference of ``5.89\\times10^{-7}`` accepts neither ``0`` nor twice
  the value, and a reference of ``0`` only ``0``).  ``-1./3`` is ``-1/3``.  The same rule
  applies when one side is a decimal and the other a constant expression (``3.14`` is not
  ``\\pi``, ``1.41421356`` is ``\\sqrt{2}``).  Two exact forms never match by closeness
  (``355/113`` is not ``\\pi``); near zero they are compared exactly (``\\sin(\\pi)`` = ``0``).
  Leading zeros are ignored (``033`` = ``33``).
* Percentages: the sign is dropped as in MATH (``50\\%`` = ``50``); a percentage on exactly
  one side may also be read as a fraction (``50\\%`` = ``0.5``, ``0.5`` = ``50\\%``), but a
  bare ``0.5`` never equals a bare ``50``.
* Units and labels are dropped: ``\\text{...}`` after the answer, plain unit words after a
  number (``5 dollars``), units of the maintained list (``5 J``, ``4 m/s``, ``2\\times10^{3}
  cm^{-3}``; :mod:`rlbench.reward.units`, which also states when a letter is a variable:
  ``\\frac{37}{4} m`` is not ``\\frac{37}{4}`` unless the answer type is ``number``), ``^\\circ``
  (no radian conversion: ``\\frac{\\pi}{6}`` is not ``30^\\circ``), ``\\$``, and a one-letter
  ``x =`` label (so ``x = 3`` = ``3`` = ``y = 3``; a benchmark's ``answer_labels: any`` also drops
  ``AB =``, ``f(x) =``, ``(p,q) =``).  When both sides carry a listed unit, the units must agree
  (``5 cm`` is not ``5 m``).  Every wrapper of :data:`rlbench.reward.units.TEXT_WRAPPERS` counts
  (``\\textnormal{ miles}``, ``\\textit``, ``\\textsf``, ...).
* Thousands separators: ``1,234``, ``1{,}234`` and MATH's ``10,\\!080`` / ``10{,}\\!080`` are one number
  (the marked forms are read before spacing commands are normalised: ``80, 10`` is not ``10,\\!080``).
* Extraction: the last-number fallback reads no digit inside a word (``H2O``), and a number inside a
  LaTeX maths span or ``\\frac``/``\\sqrt`` gives that maths (``$\\frac{10}{9}$`` is not ``9``); a benchmark's
  ``last_number_fallback: false`` turns that fallback off; a phrase inside a phrase is read
  innermost ("Final Answer: The final answer is 12.").
* Subscripts: ``E_1`` = ``E_{1}``.
* Mixed numbers: ``1\\frac{1}{2}`` = ``3/2`` (proper fraction after the integer).
* Expressions are compared symbolically: ``(x+1)^2`` = ``x^2+2x+1``; ``x^2`` is not ``2x``.
* Collections: parenthesised tuples/points are ordered (``(1,2)`` is not ``(2,1)``); sets and
  bare comma lists (lists of solutions) are unordered (``\\{1,2\\}`` = ``\\{2,1\\}``,
  ``1, 2`` = ``2, 1``, compared element by element: ``E_{2}, E_{1}`` = ``E_{1},E_{2}``; ``7, -2,
  \\text{ and } -5`` is a list; a list is never one number) unless the problem asks for an order
  ("in increasing order": :func:`asks_for_order`) or the benchmark's ``list_order`` says so; a finite
  set never equals a tuple or an interval (``\\{1,2\\}`` is not ``(1,2)``); interval ends matter
  (``[1,2]`` is not ``(1,2)``).
* Equations: a one-letter label ``x =`` is dropped, so an answer that still has ``=`` is an
  equation and equals only an equation (``x + y + z = 0`` is not ``0``).
* Answer types (a benchmark's ``answer_type``): ``math`` (the rules above), ``number`` (a lone
  letter after the value is a unit), ``expression`` (no unit is stripped), ``set`` (the answer is
  an unordered collection, with or without ``\\{ \\}``: compared as a multiset of elements), and
  ``text`` (normalised strings compared without letter case; no number or symbolic reading, so no
  stray number is ever read out of a name).
* Multiple choice: ``(A)`` = ``A`` = ``\\text{(A)}`` (math-verify also ignores letter case).
* Answers longer than ``MAX_ANSWER_CHARS`` after extraction are compared as exact strings
  only (normalising or parsing them could take very long).
* Errors: a grader error or a math-verify timeout never raises; the answer is graded
  incorrect (``MathReward`` records it in ``Grade.error`` and counts it in ``failures``).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Sequence

from rlbench.reward.symbolic import symbolic_equal, within_tolerance
from rlbench.reward.units import TEXT_WRAPPER_RE, UNIT_WORDS, split_unit, unit_key
from rlbench.reward.xml_format import answer_tag_content

logger = logging.getLogger(__name__)

__all__ = [
    "Grade",
    "MathReward",
    "answers_equivalent",
    "asks_for_order",
    "canonical_answer",
    "extract_answer",
]

EXTRACTION_STYLES = ("auto", "boxed", "gsm8k", "last_number", "answer_tag")
#: how a reference is read (a benchmark's ``answer_type``; ``math``: decide from the answer)
ANSWER_TYPES = ("math", "number", "expression", "set", "text")
#: which ``label =`` before an answer is dropped (a benchmark's ``answer_labels``): ``letter``, one
#: letter (``x = 3``); ``any``, also a name, a function or a tuple of names (``AB = 4``,
#: ``f(x) = 1``, ``(p,q) = (3,2)``), as Numina-style references and most peer graders read them
ANSWER_LABELS = ("letter", "any")
#: whether a bare comma list is ordered (a benchmark's ``list_order``): ``problem``, ordered when
#: the problem asks for an order (:func:`asks_for_order`), else unordered; ``ordered``; ``unordered``
LIST_ORDERS = ("problem", "ordered", "unordered")

#: seconds math-verify may spend on one comparison (parsing included).
MATH_VERIFY_TIMEOUT_S = 5.0
#: longer answers (after extraction) are only compared as exact strings.
MAX_ANSWER_CHARS = 1000

# ---------------------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)")
#: a thousands separator as MATH writes it: ``1,234``, ``1{,}234``, ``10,\!080``, ``10{,}\!080``
#: (``\!`` is a negative thin space; read before spacing commands are normalised away)
_THOUSANDS_SEP = r"(?:,|\{,\})(?:\\!)?"
_THOUSANDS_SEP_RE = re.compile(r"(?<=\d)" + _THOUSANDS_SEP + r"(?=\d{3}(?!\d))")
_GROUPED_DIGITS = r"\d{1,3}(?:" + _THOUSANDS_SEP + r"\d{3})+(?!\d)"
# A number: optional sign (not when it is a binary minus such as "3-5" or "x-1"),
# digits with optional thousands separators, optional decimals, optional "/denominator".
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?:(?:" + _GROUPED_DIGITS + r"|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+(?!\d|\.\d))?"
)
_PHRASE = r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|:)\s*:?"
_ANSWER_PHRASE_RE = re.compile(_PHRASE + r"[ \t]*(?P<ans>[^\n]+)", re.IGNORECASE)
# "Final Answer: The final answer is 12." -> the phrase inside the phrase is dropped too
_LEADING_PHRASE_RE = re.compile(r"^(?:the\s+)?" + _PHRASE + r"\s*", re.IGNORECASE)
_LEADING_NUMBER_RE = re.compile(r"^-?(?:" + _GROUPED_DIGITS + r"|\d+)(?:\.\d+)?(?:/\d+)?")


def _closing_braces(text: str) -> dict[int, int]:
    """Map from the index of each balanced ``{`` to the index of its ``}`` (one linear pass;
    escaped braces such as ``\\{`` are skipped)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _extract_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    pairs: dict[int, int] | None = None
    for m in reversed(list(_BOXED_RE.finditer(text))):
        i = m.end()
        if i < len(text) and text[i].isalpha():  # e.g. "\boxedx" is another command
            continue
        while i < len(text) and text[i] in " \t":
            i += 1
        if i >= len(text):
            continue
        if text[i] == "{":
            if pairs is None:
                pairs = _closing_braces(text)
            close = pairs.get(i)
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


def _inside_word(text: str, start: int, end: int) -> bool:
    """The number ``text[start:end]`` is part of a word: letters before it (``H2O``, ``AZYUK2A``;
    not a LaTeX command such as ``\\times10``) or letters after it that are not a unit (``2nd``,
    ``2x``; ``5cm`` is a number)."""
    j = start
    while j > 0 and text[j - 1].isalpha():
        j -= 1
    if j < start and not (j > 0 and text[j - 1] == "\\"):
        return True
    after = re.match(r"[^\W\d_]+", text[end:])
    return bool(after) and after.group(0) not in UNIT_WORDS


def _plain_digits(number: str) -> str:
    """``12,000`` / ``10{,}\\!080`` -> ``12000`` / ``10080``: thousands separators removed."""
    return _THOUSANDS_SEP_RE.sub("", number)


# a LaTeX maths span: $$...$$, $...$, \(...\), \[...\] (an escaped \$ is money, not a delimiter)
# (at most 200 characters each: a linear scan of any text, and an answer is short)
_MATH_SPAN_RE = re.compile(
    r"(?<!\\)\$\$(.{1,200}?)(?<!\\)\$\$|(?<!\\)\$(.{1,200}?)(?<!\\)\$|\\\((.{1,200}?)\\\)|\\\[(.{1,200}?)\\\]",
    re.DOTALL,
)
_LATEX_NUMBER_RE = re.compile(r"-?\\(?:[dtc]?frac\{[^{}]*\}\{[^{}]*\}|sqrt\{[^{}]*\})")
_PROSE_RE = re.compile(r"[A-Za-z]{3,}")  # a word of prose (after LaTeX commands and \text{} are removed)


def _math_span_answer(text: str, start: int, end: int) -> str | None:
    """The maths of the LaTeX span holding the number ``text[start:end]``, after its last ``=``
    (``$k = \\frac{10}{9}$`` -> ``\\frac{10}{9}``, not ``9``; ``$-[0,1)$`` -> ``-[0,1)``, not ``1``);
    None when the number is in no span or the span reads as prose (dollars of money)."""
    for m in _MATH_SPAN_RE.finditer(text):
        if m.start() > start:
            return None
        if end <= m.end():
            content = next(g for g in m.groups() if g is not None)
            equals = list(_EQUATION_RE.finditer(content))
            if equals:
                content = content[equals[-1].end() :]
            content = content.strip().rstrip(".,;").strip()
            prose = re.sub(_TEXT_CMD + r"\{[^{}]*\}|\\[A-Za-z]+", "", content)
            if not content or len(content) > 80 or _PROSE_RE.search(prose):
                return None
            return content
    return None


def _extract_last_number(text: str) -> str | None:
    """Last number in the text that is not part of a word (``1,234`` and ``10,\\!080`` -> plain
    digits; ``3/4`` kept as a fraction; nothing from ``H2O``). A number inside a LaTeX maths span
    gives the span's maths after its last ``=`` (``$\\frac{10}{9}$`` is not read as ``9``)."""
    last = None
    for m in _NUMBER_RE.finditer(text):
        if any(ch.isdigit() for ch in m.group(0)) and not _inside_word(text, m.start(), m.end()):
            last = m
    if last is None:
        return None
    span = _math_span_answer(text, last.start(), last.end())
    if span is not None and span != last.group(0):
        return span
    for m in _LATEX_NUMBER_RE.finditer(text):  # a bare \frac{10}{9} is not 9 either
        if m.start() <= last.start() and last.end() <= m.end():
            return m.group(0)
    return _plain_digits(last.group(0))


def _extract_phrase(text: str) -> str | None:
    """Answer after the last "the answer is X" / "Answer: X" phrase, lightly cleaned."""
    matches = list(_ANSWER_PHRASE_RE.finditer(text))
    if not matches:
        return None
    ans = matches[-1].group("ans").strip().strip("*").strip()
    while _LEADING_PHRASE_RE.match(ans):  # "Final Answer: The final answer is 12."
        ans = _LEADING_PHRASE_RE.sub("", ans, count=1).strip().strip("*").strip()
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


#: the extractors by the name ``Grade.extraction`` (and samples.jsonl) reports; the first two are
#: explicit answer markers, the last two fallbacks
_EXTRACTORS = {
    "boxed": _extract_boxed,
    "gsm8k": _extract_gsm8k,
    "phrase": _extract_phrase,
    "last_number": _extract_last_number,
}
_FALLBACKS = ("phrase", "last_number")


def _extract(
    text: str, style: str, fallbacks: bool = True, last_number: bool = True
) -> tuple[str | None, bool, str | None]:
    """(answer, format_ok, extractor name) for ``style``; raises on unknown style or non-string
    input. ``fallbacks=False`` (a truncated response whose benchmark says so) uses only the
    explicit markers: ``\\boxed{}`` and ``####``; ``last_number=False`` (a benchmark's
    ``last_number_fallback: false``) leaves the last-number fallback out of style ``auto``."""
    if style not in EXTRACTION_STYLES:
        raise ValueError(f"unknown extraction style {style!r}; use one of {EXTRACTION_STYLES}")
    if not isinstance(text, str):
        raise TypeError(f"completion must be a str, got {type(text).__name__}")
    if style == "answer_tag":  # the answer part of a <reasoning>/<answer> response, read as auto
        answer, format_ok, name = _extract(answer_tag_content(text), "auto", fallbacks, last_number)
        return answer, format_ok and "<answer>" in text, name
    # auto: boxed, then ####, then "the answer is", then last number
    order = ("boxed", "gsm8k", "phrase", "last_number") if style == "auto" else (style,)
    for name in order:
        if (not fallbacks and name in _FALLBACKS) or (not last_number and style == "auto" and name == "last_number"):
            continue
        ans = _EXTRACTORS[name](text)
        if ans is not None:
            return ans, style != "auto" or name == "boxed", name
    return None, False, None


def extract_answer(text: str, style: str = "auto") -> str | None:
    """Extract the final answer from a model completion.

    Styles:
      * ``"boxed"``: content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces
        handled: ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``; also ``\\boxed 5`` -> ``5``);
      * ``"gsm8k"``: text after the last ``####`` (rest of that line), stripped, commas removed;
      * ``"last_number"``: last number in the text that is not inside a word (integers, decimals,
        negatives, thousands separators ``1,234`` / ``10,\\!080`` -> plain digits, simple fractions
        ``3/4``); inside a LaTeX maths span, that span after its last ``=`` (``$k=\\frac{1}{3}$`` ->
        ``\\frac{1}{3}``);
      * ``"auto"``: boxed, else ``####``, else "the answer is X" / "Answer: X", else last number;
      * ``"answer_tag"``: ``auto`` inside the answer part of a ``<reasoning>``/``<answer>`` response
        (after the last ``<answer>``, up to ``</answer>``; a response without ``<answer>`` is read whole:
        :func:`rlbench.reward.xml_format.answer_tag_content`, MOTIF's reading); its format is kept only
        with an ``<answer>`` tag.

    Returns None when nothing is found (or on any error: this function never raises).
    """
    try:
        return _extract(text, style)[0]
    except Exception:  # noqa: BLE001 - documented: never raises
        logger.warning("answer extraction failed (style=%r)", style, exc_info=True)
        return None


# "in increasing order", "from least to greatest" ("in that order" is left out: in MATH it speaks of the
# problem's terms, "form an arithmetic sequence, in that order", or says "not necessarily in that order")
_ORDER_REQUEST_RE = re.compile(
    r"(?<!necessarily\s)\bin\s+(?:increasing|decreasing|ascending|descending|numerical|alphabetical)\s+order"
    r"|\bfrom\s+(?:least|smallest|lowest|greatest|largest|highest)\s+to\s+(?:greatest|largest|highest|least|smallest|lowest)",
    re.IGNORECASE,
)


def asks_for_order(problem: str | None) -> bool:
    """The problem asks for its answers in an order ("list them in increasing order", "from least
    to greatest"), so a bare comma list is graded as a sequence."""
    return bool(problem) and _ORDER_REQUEST_RE.search(problem) is not None


# ---------------------------------------------------------------------------------------
# normalisation
# ---------------------------------------------------------------------------------------

_TEXT_CMD = TEXT_WRAPPER_RE
_WHOLE_TEXT_RE = re.compile(r"^" + _TEXT_CMD + r"\{([^{}]*)\}$")
_TRAILING_UNIT_RE = re.compile(r"\s*" + _TEXT_CMD + r"\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?\s*$")
# "\\\\" (a matrix row break) is matched first so that "\\\\ " is not read as "\\" + "\\ ".
# "10,\!080", "10{,}080", "10{,}\!080": never a list (a plain "1,000" is read by _THOUSANDS_RE)
_MARKED_THOUSANDS_RE = re.compile(r"(?<=\d)(?:\{,\}(?:\\!)?|,\\!)(?=\d{3}(?!\d))")
# "7, -2, \text{ and } -5", "6, 8\text{, and }10", "2, 3, and 4": the last item of a list
_AND_ITEM_RE = re.compile(r"\s*,?\s*" + _TEXT_CMD + r"\{\s*,?\s*and\s*\}\s*|\s*,\s*and\s+")
_SPACING_RE = re.compile(r"\\\\|\\[!,;:> ]|\\q?quad\b")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ\b|°")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGN_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?=[^=]+$)")
# answer_labels=any: "AB =", "a_1 =", "f(x) =", "(p, q) =", "\angle ABC =" (a name, never an expression)
_NAME = r"(?:\\[A-Za-z]+\s*)?[A-Za-z]+(?:_\{?\w+\}?)?"
_ANY_LABEL_RE = re.compile(
    r"^(?:" + _NAME + r"(?:\s*\(\s*" + _NAME + r"(?:\s*,\s*" + _NAME + r")*\s*\))?"
    r"|\(\s*" + _NAME + r"(?:\s*,\s*" + _NAME + r")+\s*\))\s*=\s*(?=[^=]+$)"
)
_NUMERIC_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:/\d+)?$")
_LATEX_FRAC_RE = re.compile(r"^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_MIXED_NUMBER_RE = re.compile(r"^(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")
# "1.5\times10^{3}", "3\cdot 10^{-2}", "10^{6}", "10^6" (LaTeX: "10^23" is 10^2 * 3)
_POWER_OF_TEN_RE = re.compile(
    r"^(?:([+-]?(?:\d+\.?\d*|\.\d+))(?:\\times|\\cdot|\*))?10\^(?:\{([+-]?\d+)\}|(\d))$"
)
_PLAIN_NUMBER = r"[+-]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?"
# "5 dollars", "12 square feet": a plain number followed by one or two words
_TRAILING_WORDS_RE = re.compile(
    r"^(" + _PLAIN_NUMBER + r")\s+([A-Za-z]{2,}(?:\s+[A-Za-z]{2,})?)(?:\^\{?\d\}?)?\.?$"
)
# words after a number that are mathematics, not units
_NOT_UNITS = frozenset(
    "and or to pi mod times plus minus over more less than not inf infty infinity cdot".split()
)
_PERCENT_RE = re.compile(r"%|\bpercent\b", re.IGNORECASE)
# a finite set without nested brackets, and a pair/tuple/interval without nested brackets
_FLAT_SET_RE = re.compile(r"^\\\{[^()\[\]]*\\\}$")
_FLAT_TUPLE_RE = re.compile(r"^[(\[][^()\[\]]*,[^()\[\]]*[)\]]$")
_SCIENTIFIC_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d+)$")


def _strip_outer_braces(s: str) -> str:
    """Remove braces wrapping the whole string, repeatedly (``{ {1} }`` -> ``1``)."""
    pairs = _closing_braces(s)
    start, end = 0, len(s) - 1
    while start < end and s[start] == "{" and pairs.get(start) == end:
        start, end = start + 1, end - 1
        while start <= end and s[start].isspace():
            start += 1
        while end >= start and s[end].isspace():
            end -= 1
    return s[start : end + 1]


@lru_cache(maxsize=65536)
def _normalize(s: str, strip_units: bool = True, labels: str = "letter") -> str:
    """Light LaTeX normalisation that keeps the expression parseable (spaces are kept).

    Removes ``$``/``\\$``, ``\\left``/``\\right``, spacing commands (``\\!``, ``\\,``, ...),
    degree marks, ``\\%``/``%``, trailing ``\\text{unit}``, plain unit words after a number
    (``5 dollars``), a trailing ``.``, a leading ``x =``; maps ``\\dfrac``/``\\tfrac`` ->
    ``\\frac`` and the unicode minus to ``-``; unwraps ``\\boxed{}`` and a whole-string
    ``\\text{}``; drops thousands commas in a plain number (``1,234``).  ``strip_units=False``
    keeps trailing ``\\text{...}`` and words (answer types ``expression`` and ``text``);
    ``labels="any"`` also drops a longer label (:data:`ANSWER_LABELS`).
    """
    s = s.replace("\u2212", "-")  # unicode minus sign
    s = _MARKED_THOUSANDS_RE.sub("", s)  # before spacing: "10,\!080" is not "10, 080"
    # spacing commands first: "10\ " keeps its value when the string is stripped
    s = _SPACING_RE.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else " ", s).strip()
    boxed = _extract_boxed(s) if s.startswith(("\\boxed", "\\fbox")) else None
    if boxed is not None:
        s = boxed
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\varnothing", "\\emptyset")
    s = _AND_ITEM_RE.sub(", ", s)
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip()
    whole = _WHOLE_TEXT_RE.match(s)
    if whole:
        s = whole.group(1).strip()
    prev = None if strip_units else s
    while prev != s:  # "5\text{ cm}^2", "3 \text{m} \text{ long}"
        prev = s
        stripped = _TRAILING_UNIT_RE.sub("", s).strip()
        if stripped:
            s = stripped
    s = s.rstrip(".").strip()
    words = _TRAILING_WORDS_RE.match(s)
    if strip_units and words and not _NOT_UNITS.intersection(words.group(2).lower().split()):
        s = words.group(1)
    s = (_ANY_LABEL_RE if labels == "any" else _ASSIGN_RE).sub("", s).strip()
    s = _strip_outer_braces(s)
    # \frac12 -> \frac{1}{2}, \frac ab -> \frac{a}{b}, \sqrt3 -> \sqrt{3}
    s = re.sub(r"\\frac\s*([0-9A-Za-z])\s*([0-9A-Za-z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*([0-9A-Za-z])", r"\\sqrt{\1}", s)
    s = re.sub(r"_\s*([0-9A-Za-z])", r"_{\1}", s)  # E_1 -> E_{1}
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if s.startswith("+") and _NUMERIC_RE.match(s):
        s = s[1:]
    return s


def _compact(s: str) -> str:
    """Normalised string with all whitespace removed: the exact-match key."""
    return re.sub(r"\s+", "", s)


def _to_fraction(s: str) -> Fraction | None:
    """Exact value of a normalised plain number: ``-2``, ``0.5``, ``1/2``, ``1e3``,
    ``\\frac{1}{2}``, the mixed number ``1\\frac{1}{2}`` (= 3/2; proper fractions only) and
    ``1.5\\times10^{3}`` / ``10^{6}``.  None for anything else."""
    s = _compact(s)
    if not s or len(s) > 200:
        return None
    if _NUMERIC_RE.match(s):
        exp = re.search(r"[eE]([+-]?\d+)", s)
        if exp and abs(int(exp.group(1))) > 400:  # keep Fraction() cheap
            return None
        try:
            num, _, den = s.partition("/")  # "-1./3": Fraction() reads neither "1." nor "1./3"
            value = Fraction(re.sub(r"\.(?=$|[eE])", "", num))
            return value / Fraction(den) if den else value
        except (ValueError, ZeroDivisionError):
            return None
    m = _LATEX_FRAC_RE.match(s)
    if m:
        num, den = _to_fraction(m.group(2)), _to_fraction(m.group(3))
        if num is None or den is None or den == 0:
            return None
        val = num / den
        return -val if m.group(1) else val
    m = _MIXED_NUMBER_RE.match(s)
    if m and int(m.group(3)) < int(m.group(4)):
        val = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
        return -val if m.group(1) else val
    m = _POWER_OF_TEN_RE.match(s)
    if m:
        exponent = int(m.group(2) or m.group(3))
        if abs(exponent) > 400:  # keep Fraction() cheap
            return None
        return Fraction(m.group(1) or 1) * Fraction(10) ** exponent
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
        norm = _value_and_unit(str(ans), "math")[0]  # "5 J" votes with "5"
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


def _is_percent(answer: str) -> bool:
    """The answer is written as a percentage (``50\\%``, ``50%``, ``50 percent``)."""
    return bool(_PERCENT_RE.search(answer))


def _numbers_close(a: Fraction, b: Fraction, tolerance: float, absolute_tolerance: float) -> bool:
    """``a == b`` exactly when both are integers, else :func:`within_tolerance` (evaluated exactly)."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return within_tolerance(a, b, Fraction(tolerance), Fraction(absolute_tolerance))


def _numbers_match(
    pred: Fraction, ref: Fraction, pred_percent: bool, ref_percent: bool, tolerance: float, absolute_tolerance: float
) -> bool:
    """Numeric verdict; a percentage on exactly one side may also be read as a fraction
    (``50\\%`` matches ``50`` and ``0.5``)."""
    if _numbers_close(pred, ref, tolerance, absolute_tolerance):
        return True
    if pred_percent and not ref_percent:
        return _numbers_close(pred / 100, ref, tolerance, absolute_tolerance)
    if ref_percent and not pred_percent:
        return _numbers_close(pred, ref / 100, tolerance, absolute_tolerance)
    return False


def _set_versus_tuple(a_key: str, b_key: str) -> bool:
    """One side is a finite set ``\\{1,2\\}``, the other a tuple/interval ``(1,2)``."""
    return bool(
        (_FLAT_SET_RE.match(a_key) and _FLAT_TUPLE_RE.match(b_key))
        or (_FLAT_SET_RE.match(b_key) and _FLAT_TUPLE_RE.match(a_key))
    )


def _latex_for_math_verify(norm: str) -> str:
    """``1.5e3`` -> ``1.5\\times10^{3}`` (math-verify reads ``1e-7`` as ``1\\cdot e - 7``)."""
    m = _SCIENTIFIC_RE.match(_compact(norm))
    return f"{m.group(1)}\\times10^{{{int(m.group(2))}}}" if m else norm


def _mv_verify(pred: str, ref: str, *, tolerance: float, timeout_s: float, absolute_tolerance: float = 0.0) -> bool:
    """Symbolic check ``pred == ref`` with math-verify (isolated worker; may raise
    :class:`~rlbench.reward.symbolic.SymbolicCheckError`)."""
    return symbolic_equal(pred, ref, tolerance=tolerance, timeout_s=timeout_s, absolute_tolerance=absolute_tolerance)


_OPENERS, _CLOSERS = "([{", ")]}"
_EQUATION_RE = re.compile(r"(?<![<>!\\])=")  # "=" left after the normaliser dropped "x =" labels


def _top_level_items(s: str) -> list[str]:
    """``s`` split at the commas outside every bracket (``\\{``/``\\}`` count as brackets)."""
    items, depth, current, i = [], 0, [], 0
    while i < len(s):
        two = s[i : i + 2]
        if two in ("\\{", "\\}"):
            depth += 1 if two == "\\{" else -1
            current.append(two)
            i += 2
            continue
        ch = s[i]
        if ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
        i += 1
    items.append("".join(current).strip())
    return items


def _set_items(norm: str, answer_type: str) -> list[str] | None:
    """The elements of an unordered answer: a bare comma list (``1, 2``), or for answer type
    ``set`` also a braced set (``\\{1, 2\\}``); None when ``norm`` is not one."""
    key = _compact(norm)
    if answer_type == "set" and key.startswith("\\{") and key.endswith("\\}"):
        norm = norm.strip()[2:-2]
    items = _top_level_items(norm)
    if len(items) < 2 and answer_type != "set":
        return None
    return items if all(items) else None


def _multiset_equal(pred_items: list[str], ref_items: list[str], equal) -> bool:
    """Every reference element matched by its own predicted element (order ignored)."""
    if len(pred_items) != len(ref_items):
        return False
    unmatched = list(pred_items)
    for ref in ref_items:
        hit = next((i for i, pred in enumerate(unmatched) if equal(pred, ref)), None)
        if hit is None:
            return False
        unmatched.pop(hit)
    return True


_UNIT_WRAPPER_RE = re.compile(TEXT_WRAPPER_RE + r"\{([^{}]*)\}")


@lru_cache(maxsize=65536)
def _value_and_unit(s: str, answer_type: str, labels: str = "letter") -> tuple[str, str]:
    """The normalised answer split into value and unit (``rlbench.reward.units``; a unit may be
    bare, ``5 J``, or wrapped, ``5.4 \\text{ cents}``); the unit is "" when there is none (a
    wrapped word that is not in the unit list is a label: dropped, not compared), and always for
    answer types ``expression`` and ``text``."""
    if answer_type in ("expression", "text"):
        return _normalize(s, False, labels), ""
    plain = _UNIT_WRAPPER_RE.sub(r" \1", s.replace("$", "")).strip()
    head, unit = split_unit(plain, lambda h: _to_fraction(_normalize(h)) is not None, answer_type == "number")
    if unit:
        return _normalize(head, True, labels), unit_key(unit)
    return _normalize(s, True, labels), ""


# leading and trailing whitespace, except the space of an escaped space "10\ " (normalised later)
_OUTER_SPACE_RE = re.compile(r"^\s+|(?<!\\)\s+$")


def _equivalent(
    pred: str | None,
    ref: str,
    tolerance: float,
    timeout_s: float = MATH_VERIFY_TIMEOUT_S,
    *,
    absolute_tolerance: float = 0.0,
    answer_type: str = "math",
    labels: str = "letter",
    ordered: bool = False,
) -> bool:
    """Core of :func:`answers_equivalent`; may raise (callers decide what to do)."""
    if pred is None or ref is None:
        return False
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"unknown answer_type {answer_type!r}; use one of {ANSWER_TYPES}")
    if labels not in ANSWER_LABELS:
        raise ValueError(f"unknown answer_labels {labels!r}; use one of {ANSWER_LABELS}")
    pred, ref = _OUTER_SPACE_RE.sub("", str(pred)), _OUTER_SPACE_RE.sub("", str(ref))
    if len(pred) > MAX_ANSWER_CHARS or len(ref) > MAX_ANSWER_CHARS:
        return bool(pred) and pred == ref
    (p_norm, p_unit), (r_norm, r_unit) = _value_and_unit(pred, answer_type, labels), _value_and_unit(ref, answer_type, labels)
    p_key, r_key = _compact(p_norm), _compact(r_norm)
    if not p_key or not r_key:
        return False
    if p_unit and r_unit and p_unit != r_unit:
        return False
    if answer_type == "text":
        return p_key.casefold() == r_key.casefold()
    if p_key == r_key:
        return True
    p_val, r_val = _to_fraction(p_norm), _to_fraction(r_norm)
    if p_val is not None and r_val is not None:
        return _numbers_match(p_val, r_val, _is_percent(pred), _is_percent(ref), tolerance, absolute_tolerance)

    def same(a: str, b: str) -> bool:
        element_type = "math" if answer_type == "set" else answer_type
        return _equivalent(
            a, b, tolerance, timeout_s, absolute_tolerance=absolute_tolerance, answer_type=element_type, labels=labels
        )

    p_items, r_items = _set_items(p_norm, answer_type), _set_items(r_norm, answer_type)
    if p_items is not None and r_items is not None:
        if ordered and answer_type != "set":  # "in increasing order": the list is a sequence
            return len(p_items) == len(r_items) and all(map(same, p_items, r_items))
        return _multiset_equal(p_items, r_items, same)
    if (p_items is not None and r_val is not None) or (r_items is not None and p_val is not None):
        return False  # a list of answers is not one number ("3, 3" is not "3")
    if _set_versus_tuple(p_key, r_key) or (_EQUATION_RE.search(p_key) is None) != (_EQUATION_RE.search(r_key) is None):
        return False  # a set is not a tuple; an equation is not a value (math-verify compares right sides)
    return _mv_verify(
        _latex_for_math_verify(p_norm),
        _latex_for_math_verify(r_norm),
        tolerance=tolerance,
        timeout_s=timeout_s,
        absolute_tolerance=absolute_tolerance,
    )


def answers_equivalent(
    pred: str | None,
    ref: str,
    tolerance: float = 1e-6,
    timeout_s: float = MATH_VERIFY_TIMEOUT_S,
    *,
    absolute_tolerance: float = 0.0,
    answer_type: str = "math",
    labels: str = "letter",
    ordered: bool = False,
) -> bool:
    """True if ``pred`` is mathematically equal to ``ref`` (rules: module docstring).

    Order: normalised exact string match; if both are plain numbers, the numeric rule
    (integers exactly, else ``|pred - ref| <= tolerance * |ref| + absolute_tolerance``; decides
    either way, so ``0.333`` is not ``1/3`` at the default tolerance); unordered lists element by
    element (in order when ``ordered``); otherwise math-verify's symbolic comparison, limited to
    ``timeout_s`` seconds.  ``labels``: which ``label =`` is dropped (:data:`ANSWER_LABELS`).
    ``pred=None`` -> False.  Never raises: a grader error (including a timeout) is logged and
    gives False.
    """
    try:
        return _equivalent(
            pred, ref, tolerance, timeout_s, absolute_tolerance=absolute_tolerance, answer_type=answer_type,
            labels=labels, ordered=ordered,
        )
    except Exception:  # noqa: BLE001 - documented: never raises
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
    extraction: which extractor found ``extracted`` (``boxed``, ``gsm8k``, ``phrase``,
               ``last_number``; None when nothing was found or the grader has no extraction).
    details:   grader-specific detail (the code grader: per-test outcomes and the sandbox
               status); None for graders that have none.
    """

    correct: bool
    extracted: str | None
    reward: float
    format_ok: bool
    error: str | None = None
    details: dict | None = None
    extraction: str | None = None


class MathReward:
    """Binary correctness reward plus optional format reward.

    ``reward = (correct_reward if correct else incorrect_reward) + format_weight * format_ok``.
    ``answer_type`` and ``absolute_tolerance``: see :func:`answers_equivalent`.  With
    ``truncated_fallback=False`` a response cut at the token limit (``finished=False``) is graded
    only on an explicit answer (``\\boxed{}``, ``####``), never on the "the answer is" / last-number
    fallbacks of ``extraction="auto"`` or on ``extraction="last_number"``.
    Grader errors (including a math-verify timeout after ``verify_timeout_s`` seconds) never
    raise: the completion is graded incorrect, the error text goes to ``Grade.error``,
    ``failures`` is incremented and a warning with the running count is logged.
    Per-benchmark conventions (``docs/evaluation.md``, "Grading conventions"):
    ``last_number_fallback=False`` never reads the last number of a response without an answer
    marker or phrase (style ``auto``); ``answer_labels`` (:data:`ANSWER_LABELS`) says which
    ``label =`` is dropped; ``list_order`` (:data:`LIST_ORDERS`) whether a bare comma list is a
    sequence (``problem``: when the problem text passed to ``__call__`` asks for an order).
    """

    def __init__(
        self,
        correct_reward: float = 1.0,
        incorrect_reward: float = 0.0,
        format_weight: float = 0.0,
        tolerance: float = 1e-6,
        extraction: str = "auto",
        verify_timeout_s: float = MATH_VERIFY_TIMEOUT_S,
        *,
        absolute_tolerance: float = 0.0,
        answer_type: str = "math",
        truncated_fallback: bool = True,
        last_number_fallback: bool = True,
        answer_labels: str = "letter",
        list_order: str = "problem",
    ) -> None:
        if extraction not in EXTRACTION_STYLES:
            raise ValueError(
                f"reward extraction={extraction!r} is unknown; use one of {EXTRACTION_STYLES}"
            )
        if tolerance < 0 or absolute_tolerance < 0:
            raise ValueError(f"reward tolerances must be >= 0, got {tolerance} and {absolute_tolerance}")
        if answer_type not in ANSWER_TYPES:
            raise ValueError(f"answer_type={answer_type!r} is unknown; use one of {ANSWER_TYPES}")
        if answer_labels not in ANSWER_LABELS:
            raise ValueError(f"answer_labels={answer_labels!r} is unknown; use one of {ANSWER_LABELS}")
        if list_order not in LIST_ORDERS:
            raise ValueError(f"list_order={list_order!r} is unknown; use one of {LIST_ORDERS}")
        if verify_timeout_s <= 0:
            raise ValueError(f"reward verify_timeout_s must be > 0, got {verify_timeout_s}")
        self.correct_reward = float(correct_reward)
        self.incorrect_reward = float(incorrect_reward)
        self.format_weight = float(format_weight)
        self.tolerance = float(tolerance)
        self.extraction = extraction
        self.verify_timeout_s = float(verify_timeout_s)
        self.absolute_tolerance = float(absolute_tolerance)
        self.answer_type = answer_type
        self.truncated_fallback = bool(truncated_fallback)
        self.last_number_fallback = bool(last_number_fallback)
        self.answer_labels = answer_labels
        self.list_order = list_order
        self.failures = 0
        self._lock = threading.Lock()

    def __call__(
        self,
        completion: str,
        reference: str,
        response_ids: Sequence[int] = (),
        *,
        finished: bool = True,
        tolerance: float | None = None,
        problem: str | None = None,
    ) -> Grade:
        """Grade ``completion`` against ``reference``; never raises (see ``failures``).
        ``response_ids`` is part of the grader interface; this grader reads the text only.
        ``finished=False``: the response was cut at the token limit; ``tolerance``: the problem's
        own relative tolerance (None: the grader's); ``problem``: its statement (with
        ``list_order="problem"``, a request for an order makes a list a sequence)."""
        extracted: str | None = None
        format_ok = False
        correct = False
        error: str | None = None
        method: str | None = None
        try:
            fallbacks = finished or self.truncated_fallback
            extracted, format_ok, method = _extract(completion, self.extraction, fallbacks, self.last_number_fallback)
            ordered = self.list_order == "ordered" or (self.list_order == "problem" and asks_for_order(problem))
            correct = _equivalent(
                extracted,
                reference,
                self.tolerance if tolerance is None else float(tolerance),
                self.verify_timeout_s,
                absolute_tolerance=self.absolute_tolerance,
                answer_type=self.answer_type,
                labels=self.answer_labels,
                ordered=ordered,
            )
        except Exception as exc:  # noqa: BLE001 - documented: never raises
            correct = False
            error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.failures += 1
                failures = self.failures
            logger.warning(
                "math grader failed (%s); graded as incorrect [failures=%d]", error, failures
            )
        reward = self.correct_reward if correct else self.incorrect_reward
        reward += self.format_weight * float(format_ok)
        return Grade(
            correct=correct, extracted=extracted, reward=reward, format_ok=format_ok, error=error, extraction=method
        )

    def __repr__(self) -> str:
        return (
            f"MathReward(correct_reward={self.correct_reward}, "
            f"incorrect_reward={self.incorrect_reward}, format_weight={self.format_weight}, "
            f"tolerance={self.tolerance}, extraction={self.extraction!r}, "
            f"verify_timeout_s={self.verify_timeout_s}, absolute_tolerance={self.absolute_tolerance}, "
            f"answer_type={self.answer_type!r}, truncated_fallback={self.truncated_fallback}, "
            f"last_number_fallback={self.last_number_fallback}, answer_labels={self.answer_labels!r}, "
            f"list_order={self.list_order!r})"
        )
