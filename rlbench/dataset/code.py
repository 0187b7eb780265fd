"""Code benchmarks (HumanEval, MBPP, or any JSONL with tests) as :class:`Problem` objects.

A code spec has ``answer_type: code`` and names its fields::

    fields:
      problem: prompt            # the task text shown to the model
      tests: test_list           # assert_list: a list of assert statements, each one test
                                 # check_function: a program defining check(candidate)
      test_setup: test_imports   # optional: code (or list of lines) run before the tests
      entry_point: entry_point   # optional: the function under test
      solution: code             # optional: reference solution, kept as Problem.answer
    test_format: assert_list     # assert_list | check_function
    example_test_in_prompt: true # append the first assert to the task (MBPP's convention)
    id_range: {test: [11, 510], validation: [511, 600], train: [601, 974]}   # optional, inclusive

The resulting Problem carries what the code grader needs in ``meta``: ``tests`` (list of code
strings, one per test), ``test_setup`` (code), ``entry_point`` (or None) and ``code_prefix``
(for HumanEval the signature and docstring, prepended when a completion holds only a body).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlbench.dataset.base import Problem, spec_value
from rlbench.dataset.jsonl import as_name_list, pick_field
from rlbench.errors import ConfigError, DataError

TEST_FORMATS = ("assert_list", "check_function")
CODE_FIELDS_REQUIRED = ("problem", "tests")
CODE_FIELDS_OPTIONAL = ("test_setup", "entry_point", "solution")


def validate_code_spec(spec: Mapping[str, Any], name: str, split: str) -> None:
    """Static checks of a code spec: fields, test_format, id_range. Raises ConfigError."""
    fields = spec.get("fields")
    if not isinstance(fields, Mapping):
        raise ConfigError(f"benchmark {name!r}: set fields: {{problem: <field>, tests: <field>}}")
    for key in CODE_FIELDS_REQUIRED:
        if not fields.get(key):
            raise ConfigError(f"benchmark {name!r} (answer_type code): fields.{key} must name a record field")
    unknown = sorted(set(fields) - set(CODE_FIELDS_REQUIRED) - set(CODE_FIELDS_OPTIONAL))
    if unknown:
        raise ConfigError(
            f"benchmark {name!r}: unknown code field(s) {unknown}; "
            f"known: {list(CODE_FIELDS_REQUIRED + CODE_FIELDS_OPTIONAL)}"
        )
    test_format = spec_value(spec, "test_format")
    if test_format not in TEST_FORMATS:
        raise ConfigError(f"benchmark {name!r}: test_format {test_format!r} is unknown; choose one of {list(TEST_FORMATS)}")
    if test_format == "check_function" and not fields.get("entry_point"):
        raise ConfigError(f"benchmark {name!r}: test_format check_function needs fields.entry_point (check(<entry_point>))")
    id_range = spec.get("id_range")
    if id_range is not None:
        bounds = id_range.get(split) if isinstance(id_range, Mapping) else None
        if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and all(isinstance(b, int) for b in bounds)):
            raise ConfigError(
                f"benchmark {name!r}: id_range.{split} must be [first_id, last_id] (inclusive integers); "
                f"id_range has {dict(id_range) if isinstance(id_range, Mapping) else id_range!r}"
            )


def _as_code(value: Any, where: str, key: str) -> str:
    """A code field given as text or as a list of lines."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise DataError(f"{where}: field {key} must be a string or a list of strings, got {type(value).__name__}")


def _tests(value: Any, test_format: str, entry_point: str | None, where: str) -> tuple[list[str], str]:
    """Return (tests, extra setup code) for one record."""
    if test_format == "check_function":
        if not isinstance(value, str) or "def check" not in value:
            raise DataError(f"{where}: test_format check_function needs a test program defining check(candidate)")
        return [f"check({entry_point})"], value
    if isinstance(value, str):
        value = [line for line in value.splitlines() if line.strip()]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(t, str) and t.strip() for t in value):
        raise DataError(f"{where}: tests must be a non-empty list of assert statements, got {str(value)[:80]!r}")
    return list(value), ""


def _in_range(record_id: Any, bounds: Sequence[int] | None) -> bool:
    if bounds is None:
        return True
    try:
        value = int(record_id)
    except (TypeError, ValueError):
        return False
    return bounds[0] <= value <= bounds[1]


def records_to_code_problems(
    records: Iterable[tuple[str, dict[str, Any]]],
    spec: Mapping[str, Any],
    *,
    name: str,
    split: str,
    limit: int | None = None,
) -> list[Problem]:
    """Convert ``(where, record)`` pairs of a code benchmark into Problems (see the module doc).

    Records outside ``id_range[split]`` (by ``id_field``) are left out; a malformed record raises
    DataError naming the file and line. ``uid`` is ``"{name}/{split}/{id}"`` when every record has
    a distinct id, else ``"{name}/{split}/{position}"`` for all (so uids are always unique).
    """
    fields = spec["fields"]
    test_format = spec_value(spec, "test_format")
    id_field = spec.get("id_field") or "id"
    bounds = (spec.get("id_range") or {}).get(split)
    problems: list[Problem] = []
    for position, (where, record) in enumerate(records):
        if limit is not None and len(problems) >= limit:
            break
        record_id = record.get(id_field)
        if not _in_range(record_id, bounds):
            continue
        _, text = pick_field(record, fields["problem"])
        if not isinstance(text, str) or not text.strip():
            raise DataError(
                f"{where}: record has no problem text in {as_name_list(fields['problem'])} "
                f"(fields present: {sorted(record)})"
            )
        entry_point = None
        if fields.get("entry_point"):
            _, entry_point = pick_field(record, fields["entry_point"])
            if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
                raise DataError(f"{where}: entry_point must be a Python identifier, got {entry_point!r}")
        _, raw_tests = pick_field(record, fields["tests"])
        if raw_tests is None:
            raise DataError(f"{where}: record has no tests field {as_name_list(fields['tests'])} (fields present: {sorted(record)})")
        tests, check_program = _tests(raw_tests, test_format, entry_point, where)
        setup = _as_code(pick_field(record, fields["test_setup"])[1], where, "test_setup") if fields.get("test_setup") else ""
        solution = _as_code(pick_field(record, fields["solution"])[1], where, "solution") if fields.get("solution") else ""
        shown, tests_in_prompt = text, []
        if spec.get("example_test_in_prompt") and test_format == "assert_list":
            shown, tests_in_prompt = f"{text.rstrip()}\nYour code should pass this test:\n{tests[0]}", [0]
        meta = {
            "tests_in_prompt": tests_in_prompt,  # indices into tests: the code reward's pass_rate skips them
            "index": position,
            "tests": tests,
            "test_setup": "\n".join(part for part in (setup, check_program) if part),
            "entry_point": entry_point,
            "code_prefix": text if test_format == "check_function" else "",
        }
        if record_id is not None:
            meta["id"] = record_id
        problems.append(Problem(uid="", prompt=shown, answer=solution, meta=meta))
    if not problems:
        raise DataError(f"benchmark {name!r} split {split!r}: no records (check id_range and the data file)")
    # uids from the id field when every record has a distinct one, else from record positions
    ids = [p.meta.get("id") for p in problems]
    use_ids = all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in ids) and len({str(i) for i in ids}) == len(ids)
    return [
        Problem(uid=f"{name}/{split}/{p.meta['id'] if use_ids else p.meta['index']}", prompt=p.prompt, answer=p.answer, meta=p.meta)
        for p in problems
    ]
