"""Physical units after a numeric answer: the maintained list and the rule that tells a unit from a
variable.

A trailing unit is split off only when what precedes it is a plain number (``5``, ``\\frac{37}{4}``,
``1.5e3``, ``2\\times10^{3}``) and every word of the tail is in :data:`UNIT_WORDS`, joined by ``/``,
``\\cdot``, ``*`` or spaces, each with an optional power (``cm^{-3}``, ``m/s^2``, ``kg \\cdot m``).

**A variable is never mistaken for a unit.** Letters written against the number are a product of
variables (``2mg`` is 2·m·g, ``5r^5``), so a unit must be separated from the value by a space (or be
wrapped in ``\\text{}``). One lower-case letter is a variable in an expression (``\\frac{37}{4} m``,
``2k``), so on its own (``5 m``, ``5 m^2``) it is taken as a unit only when the benchmark's
``answer_type`` is ``number`` (which also accepts a unit written against the value, ``5m``). Elsewhere a tail counts as a unit when it is
unambiguous: it has a word of two or more letters from the list (``cm``, ``kg``, ``eV``), a ``/``
between units (``m/s``), or an upper-case SI symbol of :data:`UPPERCASE_SYMBOLS` (``J``, ``V``,
``W``, ``N``, ...). Units wrapped in one of :data:`TEXT_WRAPPERS` (``\\text{}``, ``\\mathrm{}``,
``\\textnormal{}``, ...) are labels and are removed by the normaliser in any case (``rlbench.reward.math``).
"""

from __future__ import annotations

import re

__all__ = ["TEXT_WRAPPERS", "UNIT_WORDS", "UPPERCASE_SYMBOLS", "split_unit", "unit_key"]

#: LaTeX commands that wrap words (a unit or a label) around an answer: ``5\textnormal{ miles}``
TEXT_WRAPPERS = ("text", "textbf", "textrm", "textnormal", "textit", "textsf", "texttt", "mbox", "mathrm", "rm")
#: regular expression of one wrapper command (``\text``, ``\textnormal``, ...) and the spaces after it
TEXT_WRAPPER_RE = r"\\(?:" + "|".join(sorted(TEXT_WRAPPERS, key=len, reverse=True)) + r")(?![A-Za-z])\s*"

_SI_PREFIXED = {  # symbol: the prefixes in common use
    "m": "k c m \\mu μ u n p f",
    "g": "k m \\mu μ u n",
    "s": "m \\mu μ u n p",
    "L": "m d \\mu μ",
    "l": "m d",
    "J": "k M G m",
    "eV": "k M G T m",
    "W": "k M G m",
    "V": "k M m \\mu μ",
    "A": "k m \\mu μ n",
    "Pa": "k M G h",
    "Hz": "k M G T",
    "N": "k m",
    "F": "\\mu μ n p m",
    "H": "m \\mu",
    "T": "m \\mu",
    "C": "m \\mu μ n",
    "mol": "m \\mu μ k",
    "\\Omega": "k M m",
    "Ω": "k M m",
    "M": "m \\mu μ n",
}
_OTHER_UNITS = """
    K cd rad sr Bq Gy Sv Wb lm lx S atm bar mbar torr Torr mmHg psi cal kcal Cal erg dyn Wh kWh
    ly AU au pc amu Da u min h hr hrs d yr yrs y wk
    in ft yd mi mph kph kmh knot knots lb lbs oz gal qt pt tsp tbsp acre acres ha
    inch inches foot feet yard yards mile miles meter meters metre metres centimeter centimeters
    millimeter millimeters kilometer kilometers gram grams kilogram kilograms liter liters litre
    litres milliliter milliliters second seconds minute minutes hour hours day days week weeks
    month months year years degree degrees dollar dollars cent cents euro euros pound pounds
    unit units square cubic sq cu ohm ohms volt volts watt watts joule joules newton newtons
    kelvin calorie calories
""".split()

#: every word accepted as (part of) a unit
UNIT_WORDS = frozenset(
    [f"{prefix}{symbol}" for symbol, prefixes in _SI_PREFIXED.items() for prefix in ["", *prefixes.split()]]
    + _OTHER_UNITS
)
#: one-letter units that are not taken for variables (upper-case SI symbols)
UPPERCASE_SYMBOLS = frozenset("J V W N K T F C A L Ω".split())

_POWER = r"(?:\^\s*(?:\{\s*-?\d+\s*\}|-?\d))?"
_ATOM = r"(\\mu\s*[A-Za-z]+|\\Omega|[A-Za-zμΩ]+)" + _POWER
_UNIT_TAIL_RE = re.compile(_ATOM.replace("(", "(?:", 1) + r"(?:(?:\s*(?:/|\\cdot|\*|·)\s*|\s+)" + _ATOM.replace("(", "(?:", 1) + r")*")
_ATOM_RE = re.compile(_ATOM)


def _atoms(tail: str) -> list[str]:
    tail = tail.replace("\\cdot", " ")
    return [re.sub(r"\\mu\s*", r"\\mu", m.group(1)) for m in _ATOM_RE.finditer(tail)]


def _is_unit(tail: str, number_answer: bool) -> bool:
    atoms = _atoms(tail)
    if not atoms or any(a not in UNIT_WORDS for a in atoms):
        return False
    if number_answer:
        return True
    return "/" in tail or any(len(a) > 1 for a in atoms) or any(a in UPPERCASE_SYMBOLS for a in atoms)


def split_unit(text: str, is_number, number_answer: bool = False) -> tuple[str, str]:
    """``(value, unit)`` of a normalised answer: the longest trailing run of unit words (module
    docstring) after a value for which ``is_number(value)`` holds; ``unit`` is ``""`` when there is
    none (then ``value`` is ``text``)."""
    separators = " ~}0123456789" if number_answer else " ~"
    for start in range(1, len(text)):
        if text[start - 1] not in separators or not _UNIT_TAIL_RE.fullmatch(text, start):
            continue
        head, tail = text[:start].strip(), text[start:].strip()
        if head and is_number(head) and _is_unit(tail, number_answer):
            return head, tail
    return text, ""


def unit_key(unit: str) -> str:
    """A comparable form of a unit: atoms without spaces or braces, plurals made singular
    (``\\text{ inches}`` and ``inch`` give ``inch``)."""
    unit = re.sub(TEXT_WRAPPER_RE, "", unit)
    unit = re.sub(r"[{}\s]|\\[,;: !]", "", unit).replace("\\mu", "μ")
    singular = {"inches": "inch", "feet": "foot"}
    return "".join(singular.get(w, w[:-1] if len(w) > 3 and w.endswith("s") and w[:-1] in UNIT_WORDS else w)
                   for w in re.split(r"(\W+)", unit))
