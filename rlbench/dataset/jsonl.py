"""Read JSON Lines records and turn them into :class:`Problem` objects.

The helpers here know nothing about where a file lives (see :mod:`rlbench.dataset.sources`);
they parse records, pick the problem/answer fields named by a dataset config and extract the
reference answer in one of the supported ``answer_format`` styles:

``raw``
    the answer field as it is, converted to a string (``27.0`` -> ``"27.0"``).
``gsm8k``
    the text after the last ``####`` of a GSM8K answer, commas dropped (``"1,000"`` -> ``"1000"``).
``boxed``
    the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in a worked solution, with
    nested braces matched (``\\boxed{\\frac{1}{2}}`` -> ``"\\frac{1}{2}"``).

A field name may be a path into the record (:func:`field_value`): ``answer[0]`` (the first
element of a list), ``meta.answer`` (a key of a nested object), ``answers[0].text``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import re

from rlbench.dataset.base import Problem, ProblemList
from rlbench.reward.math import extract_answer as extract_reward_answer
from rlbench.errors import DataError

ANSWER_FORMATS = ("raw", "gsm8k", "boxed")

log = logging.getLogger(__name__)



def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for each non-empty line of a JSONL file (1-based numbers).

    Raises DataError naming the file and line when a line is not valid JSON or not an object,
    and when the file cannot be read.
    """
    path = Path(path)
    try:
        handle = path.open("r", encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"Data file not found: {path}") from None
    except OSError as exc:
        raise DataError(f"Cannot read data file {path}: {exc}") from exc
    with handle:
        try:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno}); "
                        "each line must hold one JSON object"
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
                    )
                yield lineno, record
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: file is not valid UTF-8 ({exc.reason})") from None


def extract_last_boxed(text: str) -> str | None:
    """Return the content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    Nested braces are matched (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); the braceless
    form ``\\boxed 5`` gives ``5``. Returns None when there is no complete box. The grader's
    extraction is the single implementation (``rlbench.reward.math``).
    """
    return extract_reward_answer(text, style="boxed")


def extract_gsm8k_answer(text: str) -> str | None:
    """Return the final answer of a GSM8K solution: text after the last ``####``, commas dropped."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def extract_answer(value: Any, answer_format: str) -> str | None:
    """Extract the reference answer string from a record's answer field.

    Returns None when the value holds no answer in the requested format (the caller turns that
    into a DataError with the file and line). Raises ValueError for an unknown ``answer_format``.
    """
    if value is None or isinstance(value, (dict, list)):
        return None
    if answer_format == "raw":
        text = value if isinstance(value, str) else _scalar_to_str(value)
        text = text.strip()
        return text or None
    if not isinstance(value, str):
        value = _scalar_to_str(value)
    if answer_format == "gsm8k":
        return extract_gsm8k_answer(value)
    if answer_format == "boxed":
        return extract_last_boxed(value) or None
    raise ValueError(f"unknown answer_format {answer_format!r}; choose one of {list(ANSWER_FORMATS)}")


def _scalar_to_str(value: Any) -> str:
    """Render a JSON scalar as a string: ints and floats as Python prints them, bools lower-case."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def as_name_list(names: str | Sequence[str]) -> list[str]:
    """Normalise a field spec (one name or a list of candidate names) to a list of names."""
    if isinstance(names, str):
        return [names]
    return [str(n) for n in names]


_PATH_STEP_RE = re.compile(r"\.?([^.\[\]]+)|\[(-?\d+)\]")


def field_value(record: Mapping[str, Any], path: str) -> Any:
    """The value at ``path`` in ``record`` (None when absent): a key of the record (also one that
    contains dots or brackets), else a path of keys and list indices, ``answer[0]``,
    ``meta.answer``, ``answers[-1].text``."""
    if path in record:
        return record[path]
    value: Any = record
    position = 0
    while position < len(path):
        step = _PATH_STEP_RE.match(path, position)
        if step is None or step.end() == position:
            return None
        key, index = step.groups()
        if key is not None:
            value = value.get(key) if isinstance(value, Mapping) else None
        else:
            value = value[int(index)] if isinstance(value, list) and -len(value) <= int(index) < len(value) else None
        if value is None:
            return None
        position = step.end()
    return value


def pick_field(record: Mapping[str, Any], names: str | Sequence[str]) -> tuple[str | None, Any]:
    """Return ``(name, value)`` for the first candidate field (or path, :func:`field_value`)
    present and not None in ``record``."""
    for name in as_name_list(names):
        value = field_value(record, name)
        if value is not None:
            return name, value
    return None, None


def records_to_problems(
    records: Iterable[tuple[str, dict[str, Any]]],
    *,
    name: str,
    split: str,
    problem_field: str | Sequence[str],
    answer_field: str | Sequence[str],
    answer_format: str,
    id_field: str | None = "id",
    meta_fields: Sequence[str] = (),
    limit: int | None = None,
    skip_bad_answers: bool = False,
    tolerance_field: str | None = None,
    prompt_fields: Sequence[str] = (),
    solution_field: str | None = None,
) -> ProblemList:
    """Convert ``(where, record)`` pairs into Problems.

    ``where`` locates the record for error messages (``"path/to/file.jsonl:12"``). ``uid`` is
    ``"{name}/{split}/{id}"`` when every loaded record has a distinct ``id_field`` value, else
    ``"{name}/{split}/{index}"`` (0-based position of the record in the source). ``meta`` holds
    ``index``, ``id`` (when present) and the listed ``meta_fields`` that the record has. At most
    ``limit`` problems are returned. With ``skip_bad_answers`` a record whose answer cannot be
    extracted (e.g. the two MATH solutions with an empty ``\\boxed{}``) is skipped with a warning
    instead of raising DataError; the count is the result's ``skipped``. ``tolerance_field``: the
    record field (or path) with the problem's own relative tolerance (a number >= 0, or absent /
    null: the benchmark's), kept as ``meta["tolerance"]``. ``prompt_fields``: record fields the
    prompt template names (``{unit}``), kept in ``meta["prompt_fields"]``; a record without one is
    a DataError. ``solution_field``: the record field with the worked solution (GSM8K's answer, MATH's
    solution), kept as ``meta["solution"]`` when the record has it (a guidance trace, rlbench.guidance).
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer_format {answer_format!r}; choose one of {list(ANSWER_FORMATS)}")
    rows: list[tuple[int, str, dict[str, Any], Any]] = []
    skipped: list[str] = []
    for position, (where, record) in enumerate(records):
        if limit is not None and len(rows) >= limit:
            break
        _, problem = pick_field(record, problem_field)
        if problem is None:
            raise DataError(
                f"{where}: record has no problem field {as_name_list(problem_field)} "
                f"(fields present: {sorted(record)}); set fields.problem in the dataset config"
            )
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"{where}: problem field must be a non-empty string, got {problem!r:.80}")
        _, raw_answer = pick_field(record, answer_field)
        if raw_answer is None:
            raise DataError(
                f"{where}: record has no answer field {as_name_list(answer_field)} "
                f"(fields present: {sorted(record)}); set fields.answer in the dataset config"
            )
        answer = extract_answer(raw_answer, answer_format)
        if answer is None and skip_bad_answers:
            skipped.append(where)
            continue
        if answer is None:
            hint = {
                "gsm8k": "no '####' followed by an answer",
                "boxed": "no complete \\boxed{...} in the text",
                "raw": "empty or non-scalar value",
            }[answer_format]
            raise DataError(
                f"{where}: cannot extract the answer with answer_format={answer_format!r} "
                f"({hint}); value starts {str(raw_answer)[:80]!r}"
            )
        _check_record_extras(where, record, tolerance_field, prompt_fields)
        rows.append((position, problem, record, answer))
    if skipped:
        log.warning(
            "skipped %d record(s) whose answer could not be extracted (answer_format=%s): %s",
            len(skipped), answer_format, ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""),
        )

    ids: list[Any] = [rec.get(id_field) if id_field else None for _, _, rec, _ in rows]
    use_ids = bool(rows) and all(
        isinstance(i, (str, int)) and not isinstance(i, bool) for i in ids
    ) and len({str(i) for i in ids}) == len(ids)

    problems = []
    for (index, problem, record, answer), rid in zip(rows, ids):
        meta: dict[str, Any] = {"index": index}
        if rid is not None:
            meta["id"] = rid
        for key in meta_fields:
            if key in record:
                meta[key] = record[key]
        if tolerance_field and field_value(record, tolerance_field) is not None:
            meta["tolerance"] = float(field_value(record, tolerance_field))
        if solution_field and isinstance(field_value(record, solution_field), str):
            meta["solution"] = field_value(record, solution_field)
        if prompt_fields:
            meta["prompt_fields"] = {key: field_value(record, key) for key in prompt_fields}
        uid = f"{name}/{split}/{rid if use_ids else index}"
        problems.append(Problem(uid=uid, prompt=problem, answer=answer, meta=meta))
    return ProblemList(problems, skipped=len(skipped))


def _check_record_extras(
    where: str, record: Mapping[str, Any], tolerance_field: str | None, prompt_fields: Sequence[str]
) -> None:
    """DataError unless the record's tolerance (when given) is a number >= 0 and it has every field
    the prompt template names."""
    if tolerance_field:
        tol = field_value(record, tolerance_field)
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0):
            raise DataError(f"{where}: tolerance field {tolerance_field!r} must be a number >= 0, got {tol!r}")
    for key in prompt_fields:
        if field_value(record, key) is None:
            raise DataError(
                f"{where}: the prompt template names {{{key}}}, but the record has no field {key!r} "
                f"(fields present: {sorted(record)})"
            )
