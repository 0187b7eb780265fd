"""The ``<reasoning>…</reasoning><answer>…</answer>`` response format and its rewards, as MOTIF
(Mitra & Ulukus 2025, arXiv:2507.02851; its released training code, motif.py) adds them to its
multi-round reward; they are the format rewards of the common GRPO recipe for GSM8K. The prompt that
asks for the format is conf/dataset/prompt/motif.yaml; the terms are ``xml_count``, ``soft_format`` and
``strict_format`` of rlbench.reward.terms (reward=xml_format weighs them 1, 0.5 and 0.5, as the code does).

As in the released code the format patterns are matched from the response's start. Unlike it, a block's
text may span lines (holding no tag) and the strict format's last newline is optional: the code's patterns
(``.`` stops at a line break) never match the layout its own prompt asks for in the soft format (tags on lines
of their own), and in the strict format only a one-line reasoning and answer followed by a newline, which a
response ending at end-of-sequence right after ``</answer>`` lacks. The xml count is the code's.
"""

from __future__ import annotations

import re

#: a block's text: any lines holding none of the four tags
_TAG_FREE = r"(?:(?!</?(?:reasoning|answer)>).)*?"
#: the soft format: a reasoning block, then an answer block, from the response's start (anything may follow)
SOFT_FORMAT_RE = re.compile(rf"<reasoning>{_TAG_FREE}</reasoning>\s*<answer>{_TAG_FREE}</answer>", re.DOTALL)
#: the strict format: the whole response is the two blocks, each tag on its own line (a final newline or none)
STRICT_FORMAT_RE = re.compile(rf"^<reasoning>\n{_TAG_FREE}\n</reasoning>\n<answer>\n{_TAG_FREE}\n</answer>\n?$", re.DOTALL)
#: each correctly placed tag's credit, and the penalty per character after the closing answer tag
TAG_CREDIT, TAIL_PENALTY = 0.125, 0.001


def answer_tag_content(text: str) -> str:
    """The answer part of a response: after its last ``<answer>``, up to the next ``</answer>`` (to the
    end when unclosed), stripped; a response without ``<answer>`` is its own answer part (MOTIF's reading)."""
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def outside_answer_part(text: str) -> str:
    """The response less its answer part (:func:`answer_tag_content`, with its tags): the text before its last
    ``<answer>`` and after the ``</answer>`` that closes it; empty for a response without ``<answer>``."""
    if "<answer>" not in text:
        return ""
    before, _, rest = text.rpartition("<answer>")
    _, closed, after = rest.partition("</answer>")
    return before + after if closed else before


def xml_count(text: str) -> float:
    """Partial credit per correctly placed tag (MOTIF, arXiv:2507.02851: the code's xml-count reward)::

        x(y) = 1/8 [#"<reasoning>\\n" = 1] + 1/8 [#"\\n</reasoning>\\n" = 1]
             + [#"\\n<answer>\\n" = 1] (1/8 - |tail(y, "\\n</answer>\\n")| / 1000)
             + [#"\\n</answer>" = 1] (1/8 - (|tail(y, "\\n</answer>")| - 1) / 1000)

    with #s the occurrences of s in y and tail(y, s) the text after the last s (all of y when s is
    absent): 0.5 for a perfect response ending in ``</answer>\\n``, less 0.002 per character after it."""
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += TAG_CREDIT
    if text.count("\n</reasoning>\n") == 1:
        count += TAG_CREDIT
    if text.count("\n<answer>\n") == 1:
        count += TAG_CREDIT - len(text.split("\n</answer>\n")[-1]) * TAIL_PENALTY
    if text.count("\n</answer>") == 1:
        count += TAG_CREDIT - (len(text.split("\n</answer>")[-1]) - 1) * TAIL_PENALTY
    return count


def soft_format(text: str) -> float:
    """1 when the response starts with a reasoning block followed by an answer block, each on any number
    of lines (MOTIF, arXiv:2507.02851: the code's soft format reward, 0.5 × this): ``re.match(SOFT_FORMAT_RE, y)``."""
    return float(SOFT_FORMAT_RE.match(text) is not None)


def strict_format(text: str) -> float:
    """1 when the whole response is ``<reasoning>\\n…\\n</reasoning>\\n<answer>\\n…\\n</answer>``, the layout
    MOTIF's prompt shows, with a final newline or none (MOTIF, arXiv:2507.02851: the code's strict format
    reward, 0.5 × this): ``re.match(STRICT_FORMAT_RE, y)`` (``$`` also matches before one more final newline)."""
    return float(STRICT_FORMAT_RE.match(text) is not None)
