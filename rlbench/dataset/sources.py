"""Locate and load the datasets and benchmarks described by ``conf/dataset`` / ``conf/benchmark``.

A spec (one YAML file, as a plain dict or an OmegaConf DictConfig) looks like::

    name: gsm8k
    loader: jsonl                 # jsonl | arith | toy_repos | flaw_steps
    hub_id: openai/gsm8k          # Hugging Face Hub id, for users with network access
    hub_config: main              # optional datasets.load_dataset config name (or a list, concatenated)
    hub_splits: {test: train}     # optional: local split name -> Hub split name
    files: {train: gsm8k/train.jsonl, test: gsm8k/test.jsonl}   # relative to the data dir
    split: train
    fields: {problem: question, answer: answer}   # each a name, a path (answer[0], meta.answer)
                                  # or a list of candidates; optional tolerance: <field>
    answer_type: math             # math | number | expression | set | text (reference answers,
                                  # rlbench.reward.math) | code (tests; see rlbench.dataset.code)
    answer_format: gsm8k          # raw | gsm8k | boxed
    tolerance: null               # relative tolerance of numeric answers (null: reward.tolerance)
    absolute_tolerance: 0         # added to it: |pred - ref| <= tolerance * |ref| + absolute_tolerance
    truncated_fallback: true      # a response cut at the token limit may be graded by the
                                  # "the answer is" / last-number fallbacks (false: \boxed / #### only)
    last_number_fallback: true    # a response without an answer marker or phrase is graded on its
                                  # last number (false: it has no answer)
    answer_labels: letter         # letter (x = 3 -> 3) | any (also AB = 4, f(x) = 1, (p,q) = (3,2))
    list_order: problem           # problem (ordered if it asks: "in increasing order") | ordered | unordered
    allow_empty: false            # zero usable problems: an error (true: a row marked empty)
    id_field: id                  # optional, default "id"
    meta_fields: [level]          # optional record fields copied into Problem.meta
    skip_bad_answers: false       # optional: skip (with a warning) records without an answer
    limit: null
    reward_extraction: auto       # hint for the grader (passed through, not used here)
    prompt: {system: null, user: "{problem} ..."}   # may name other record fields: {unit}

The arith loader takes ``arith: {level, train_size, test_size, seed}`` instead of files; the toy_repos loader
(env=code_repair's repositories, rlbench/dataset/toy_repos.py) ``toy_repos: {train_size, test_size, seed}``, the
flaw_steps loader (FAPO's GenRM problems, rlbench/dataset/flaw_steps.py) ``flaw_steps: {train_size, test_size, seed}``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlbench.config.schema import DatasetConfig
from rlbench.config.walk import nearest
from rlbench.dataset.arith import LEVELS as ARITH_LEVELS
from rlbench.dataset.arith import SPLITS as ARITH_SPLITS
from rlbench.dataset.arith import generate_arith_levels
from rlbench.dataset.base import Problem, ProblemList, spec_value
from rlbench.dataset.code import records_to_code_problems, validate_code_spec
from rlbench.dataset.flaw_steps import generate_flaw_steps
from rlbench.dataset.jsonl import ANSWER_FORMATS, iter_jsonl, records_to_problems
from rlbench.dataset.prompts import check_template, template_fields
from rlbench.dataset.toy_repos import generate_toy_repos
from rlbench.errors import ConfigError, DataError
from rlbench.reward.math import ANSWER_LABELS, LIST_ORDERS
from rlbench.reward.math import ANSWER_TYPES as MATH_ANSWER_TYPES

DATA_DIR_ENV = "RLBENCH_DATA_DIR"
LOADERS = ("jsonl", "arith", "toy_repos", "flaw_steps")
GENERATED = {"toy_repos": generate_toy_repos, "flaw_steps": generate_flaw_steps}  # size, seed, split -> problems
# graded by rlbench.reward.MathReward (the reference read as math, number, ...) / rlbench.reward.code.CodeReward
ANSWER_TYPES = (*MATH_ANSWER_TYPES, "code")
# the keys of ``fields`` of an answer benchmark; solution: the worked solution, kept as meta["solution"]
# (a guidance source for training on the dataset's own solutions, rlbench.guidance)
MATH_FIELDS = ("problem", "answer", "tolerance", "solution")
SOURCES = ("auto", "local", "hub")

_HUB_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def repo_root() -> Path:
    """Return the repository root: the parent of the ``rlbench`` package directory."""
    return Path(__file__).resolve().parent.parent.parent


def resolve_data_dir(configured: str | None = None) -> Path:
    """Return the data directory.

    Order: the ``RLBENCH_DATA_DIR`` environment variable; else ``configured`` when given; else
    ``<repo root>/../shared/data`` when it exists; else raise DataError saying how to set it.
    """
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    given = (f"{DATA_DIR_ENV}={env}", Path(env).expanduser()) if env else (
        (f"data_dir={configured}", Path(str(configured)).expanduser()) if configured is not None and str(configured).strip()
        else None)
    if given:
        setting, folder = given
        if not folder.is_dir():
            raise DataError(f"{setting} is not a folder; point it at the folder that holds the benchmark files "
                            f"(e.g. gsm8k/train.jsonl inside)")
        return folder
    default = repo_root().parent / "shared" / "data"
    if default.is_dir():
        return default
    raise DataError(
        f"No data directory found: set the environment variable {DATA_DIR_ENV} to the folder "
        f"that holds the benchmark files (e.g. export {DATA_DIR_ENV}=/path/to/data, with "
        f"gsm8k/train.jsonl inside), or place them at {default}"
    )


def _to_plain(spec: Any) -> dict[str, Any]:
    """Return a plain, resolved dict copy of a spec (dict or OmegaConf DictConfig)."""
    if spec is None:
        raise ConfigError("dataset spec is missing (expected a mapping such as conf/dataset/gsm8k.yaml)")
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        DictConfig = None  # type: ignore[assignment]
    if DictConfig is not None and isinstance(spec, DictConfig):
        missing = sorted(OmegaConf.missing_keys(spec))
        if missing:
            raise ConfigError(
                f"dataset {spec.get('name')!r}: {', '.join(missing)} must be set (??? in the config); "
                f"give it on the command line, e.g. {missing[0]}=<value>"
            )
        return OmegaConf.to_container(spec, resolve=True)  # type: ignore[return-value]
    if not isinstance(spec, Mapping):
        raise ConfigError(f"dataset spec must be a mapping, got {type(spec).__name__}")
    return dict(spec)


def _spec_name(spec: Mapping[str, Any]) -> str:
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("dataset spec needs a non-empty 'name' (e.g. name: gsm8k)")
    return name


def _spec_split(spec: Mapping[str, Any], split: str | None) -> str:
    split = split if split is not None else spec.get("split")
    if not isinstance(split, str) or not split:
        raise ConfigError(f"dataset {spec.get('name')!r}: set 'split' (e.g. split: train)")
    return split


def _check_limit(spec: Mapping[str, Any]) -> int | None:
    limit = spec.get("limit")
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(
            f"dataset {spec.get('name')!r}: limit must be null or a non-negative integer, got {limit!r}"
        )
    return limit


def _hub_hint(spec: Mapping[str, Any]) -> str:
    hub_id = spec.get("hub_id")
    if not hub_id:
        return "this dataset has no hub_id, so it can only be read from local files"
    config = spec.get("hub_config")
    suffix = f" (config {config!r})" if config else ""
    return f"with network access it can be loaded from the Hugging Face Hub as {hub_id!r}{suffix} (source=hub)"


def _missing_file_message(spec: Mapping[str, Any], path: Path, split: str) -> str:
    return (
        f"Data file for {spec.get('name')!r} split {split!r} not found: {path}. "
        f"Set the environment variable {DATA_DIR_ENV} to the folder that holds "
        f"{spec['files'][split]} (or fix files.{split} in the config); "
        f"{_hub_hint(spec)}."
    )


def _local_path(spec: Mapping[str, Any], split: str, data_dir: str | None) -> Path:
    """Return the local file of ``split``; relative paths are joined to the data directory."""
    rel = Path(str(spec["files"][split])).expanduser()
    if rel.is_absolute():
        return rel
    return resolve_data_dir(data_dir) / rel


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes") for v in _HUB_OFFLINE_ENVS)


HUB_PROBE_SECONDS = 3.0  # one connection attempt; unanswered, the Hub counts as unreachable


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face Hub (``HF_ENDPOINT``, default https://huggingface.co) accepts a TCP
    connection within :data:`HUB_PROBE_SECONDS`, checked once per process. Validation asks it before
    accepting a missing local file for ``source=auto``, so a machine without network is told at once
    instead of after the datasets library's retries (~24 s)."""
    endpoint = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=HUB_PROBE_SECONDS):
            return True
    except OSError:
        return False


def _hub_usable(spec: Mapping[str, Any], source: str) -> bool:
    """``source=auto`` may fall back to the Hub: the spec has a hub_id, the Hub is not switched off
    (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``) and answers."""
    return source == "auto" and bool(spec.get("hub_id")) and not _hub_offline() and hub_reachable()


def validate_spec(
    spec: Any, split: str | None = None, *, data_dir: str | None = None, source: str = "auto"
) -> None:
    """Cheap checks of a dataset/benchmark spec before any model is loaded.

    Checks the loader, answer_format, split (in ``files`` for jsonl, train/test for arith), the
    fields, limit, the prompt template (must contain ``{problem}``), the arith settings, and for
    jsonl that the local file exists. A missing local file is accepted only when it can come from
    the Hub instead: ``source="hub"``, or ``source="auto"`` with a ``hub_id`` and the Hub not
    switched off (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``). Raises ConfigError or DataError.
    """
    spec = _to_plain(spec)
    if source not in SOURCES:
        raise ConfigError(f"source must be one of {list(SOURCES)}, got {source!r}")
    name, split = _validate_static(spec, split)
    if spec_value(spec, "loader") != "jsonl":
        return
    if source == "hub":
        if not spec.get("hub_id"):
            raise ConfigError(f"dataset {name!r}: source=hub needs a hub_id in the config")
        return
    explicit = os.environ.get(DATA_DIR_ENV, "").strip() or (data_dir is not None and str(data_dir).strip())
    try:
        path = _local_path(spec, split, data_dir)
    except DataError:
        if not explicit and _hub_usable(spec, source):  # no data folder at all: the Hub may serve it
            return
        raise
    if path.is_file() or _hub_usable(spec, source):
        return
    unreachable = source == "auto" and spec.get("hub_id") and not _hub_offline()
    raise DataError(_missing_file_message(spec, path, split)
                    + (" The Hub does not answer from here, so the file must be local." if unreachable else ""))


def _validate_static(spec: Mapping[str, Any], split: str | None) -> tuple[str, str]:
    """All checks of :func:`validate_spec` except file existence; returns ``(name, split)``."""
    name = _spec_name(spec)
    _check_keys(spec, name)
    loader = spec_value(spec, "loader")
    if loader not in LOADERS:
        raise ConfigError(f"dataset {name!r}: unknown loader {loader!r}; choose one of {list(LOADERS)}")
    split = _spec_split(spec, split)
    _check_limit(spec)

    prompt = spec.get("prompt")
    if prompt is not None and not isinstance(prompt, Mapping):
        raise ConfigError(f"dataset {name!r}: prompt must be a mapping with 'system' and 'user'")
    if prompt and prompt.get("user") is not None:
        check_template(prompt["user"], key=f"dataset {name!r} prompt.user", record_fields=loader == "jsonl" and spec.get("answer_type") != "code")
    system = (prompt or {}).get("system")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"dataset {name!r}: prompt.system must be a string or null")

    if loader == "arith":
        _validate_arith(spec, name, split)
        return name, split
    if loader in GENERATED:
        _validate_generated_loader(spec, loader, name, split)
        return name, split

    answer_type = spec_value(spec, "answer_type")
    if answer_type not in ANSWER_TYPES:
        raise ConfigError(f"dataset {name!r}: answer_type {answer_type!r} is unknown; choose one of {list(ANSWER_TYPES)}")
    if answer_type == "code":
        validate_code_spec(spec, name, split)
        _check_files(spec, name, split)
        return name, split
    _check_grading_keys(spec, name)
    answer_format = spec_value(spec, "answer_format")
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError(
            f"dataset {name!r}: unknown answer_format {answer_format!r}; choose one of "
            f"{list(ANSWER_FORMATS)}"
        )
    fields = spec.get("fields")
    if not isinstance(fields, Mapping):
        raise ConfigError(f"dataset {name!r}: set fields: {{problem: <field>, answer: <field>}}")
    unknown = sorted(set(fields) - set(MATH_FIELDS))
    if unknown:
        hints = [f"{key!r} (did you mean {nearest(key, MATH_FIELDS)!r}?)" if nearest(key, MATH_FIELDS) else repr(key) for key in unknown]
        raise ConfigError(f"dataset {name!r}: unknown fields key(s) {', '.join(hints)}; fields maps {list(MATH_FIELDS)}")
    tolerance_field = fields.get("tolerance")
    if tolerance_field is not None and not (isinstance(tolerance_field, str) and tolerance_field):
        raise ConfigError(f"dataset {name!r}: fields.tolerance must name a record field, got {tolerance_field!r}")
    for key in ("problem", "answer"):
        value = fields.get(key)
        one_name = isinstance(value, str) and bool(value)
        name_list = (
            isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)
        )
        if not (one_name or name_list):
            raise ConfigError(
                f"dataset {name!r}: fields.{key} must be a field name or a list of candidate names"
            )
    _check_files(spec, name, split)
    return name, split


def _check_keys(spec: Mapping[str, Any], name: str) -> None:
    """A key the spec schema does not know (``answer_fromat``) is refused, naming the nearest one:
    the same rule as the config walk, for specs passed to the loaders directly."""
    valid = [f.name for f in dataclasses.fields(DatasetConfig)]
    for key in spec:
        if key not in valid:
            guess = nearest(str(key), valid)
            hint = f"did you mean {guess!r}? " if guess else ""
            raise ConfigError(f"dataset {name!r}: unknown key {key!r}; {hint}valid keys: {', '.join(sorted(valid))}")


def _check_grading_keys(spec: Mapping[str, Any], name: str) -> None:
    """The per-benchmark tolerances are numbers >= 0 (or null); the switches are booleans; the grading
    conventions name one of their choices (``rlbench.reward.math``)."""
    for key in ("tolerance", "absolute_tolerance"):
        value = spec.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf")):
            raise ConfigError(f"dataset {name!r}: {key} must be a finite number >= 0 or null, got {value!r}")
    for key in ("truncated_fallback", "last_number_fallback", "allow_empty"):
        if key in spec and not isinstance(spec[key], bool):
            raise ConfigError(f"dataset {name!r}: {key} must be true or false, got {spec[key]!r}")
    for key, choices in (("answer_labels", ANSWER_LABELS), ("list_order", LIST_ORDERS)):
        if spec.get(key) is not None and spec[key] not in choices:
            raise ConfigError(f"dataset {name!r}: {key} {spec[key]!r} is unknown; choose one of {list(choices)}")


def _check_files(spec: Mapping[str, Any], name: str, split: str) -> None:
    files = spec.get("files")
    if not isinstance(files, Mapping) or not files:
        raise ConfigError(f"dataset {name!r}: set files: {{<split>: <path relative to the data dir>}}")
    if split not in files:
        raise ConfigError(
            f"dataset {name!r}: split {split!r} is not in files (available: {sorted(files)}); "
            "change 'split' or add the file"
        )


def _validate_arith(spec: Mapping[str, Any], name: str, split: str) -> None:
    arith = spec.get("arith")
    if not isinstance(arith, Mapping):
        raise ConfigError(f"dataset {name!r}: loader arith needs arith: {{level, train_size, test_size}}")
    if split not in ARITH_SPLITS:
        raise ConfigError(f"dataset {name!r}: arith split must be one of {list(ARITH_SPLITS)}, got {split!r}")
    level = arith.get("level")
    levels = list(level) if isinstance(level, (list, tuple)) else [level]
    if (
        not levels
        or len(set(map(str, levels))) != len(levels)
        or any(isinstance(x, bool) or x not in ARITH_LEVELS for x in levels)
    ):
        raise ConfigError(
            f"dataset {name!r}: arith.level must be one of {list(ARITH_LEVELS)} or a list of distinct levels "
            f"(e.g. [1, 2]: mixed difficulty), got {level!r}"
        )
    _validate_generated(arith, "arith", name, split)


def _validate_generated(block: Mapping[str, Any], key: str, name: str, split: str) -> None:
    """The size and seed of a generated dataset's block (``arith``, ``toy_repos``, ``flaw_steps``)."""
    size = block.get(f"{split}_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"dataset {name!r}: {key}.{split}_size must be a non-negative integer, got {size!r}")
    seed = block.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"dataset {name!r}: {key}.seed must be null or an integer, got {seed!r}")


def _validate_generated_loader(spec: Mapping[str, Any], loader: str, name: str, split: str) -> None:
    """A generated loader of :data:`GENERATED` (toy_repos, flaw_steps): its block, a train or test split."""
    block = spec.get(loader)
    if not isinstance(block, Mapping):
        raise ConfigError(f"dataset {name!r}: loader {loader} needs {loader}: {{train_size, test_size}}")
    if split not in ARITH_SPLITS:
        raise ConfigError(f"dataset {name!r}: {loader} split must be one of {list(ARITH_SPLITS)}, got {split!r}")
    _validate_generated(block, loader, name, split)


def load_problems(
    spec: Any,
    split: str | None = None,
    *,
    seed: int = 0,
    data_dir: str | None = None,
    source: str = "auto",
) -> list[Problem]:
    """Load the problems of one split of a dataset/benchmark spec.

    ``split`` defaults to ``spec["split"]``. ``source``: ``"local"`` reads the JSONL file under
    the data directory (see :func:`resolve_data_dir`); ``"hub"`` calls
    ``datasets.load_dataset(hub_id, hub_config, split=...)``; ``"auto"`` reads the local file
    when it exists and falls back to the Hub. ``seed`` only matters for the arith loader (unless
    its config pins ``arith.seed``). ``limit`` keeps the first N problems. Raises ConfigError for a
    bad spec and DataError for missing or malformed data (with file path and line number).
    """
    plain = _to_plain(spec)
    if source not in SOURCES:
        raise ConfigError(f"source must be one of {list(SOURCES)}, got {source!r}")
    name, split = _validate_static(plain, split)
    limit = _check_limit(plain)

    loader = spec_value(plain, "loader")
    if loader == "arith" or loader in GENERATED:
        block = plain[loader]
        block_seed = seed if block.get("seed") is None else block["seed"]
        if loader == "arith":
            problems = generate_arith_levels(block["level"], block[f"{split}_size"], block_seed, split)
        else:
            problems = GENERATED[loader](block[f"{split}_size"], block_seed, split)
        if limit is not None:
            problems = problems[:limit]
        return ProblemList(
            Problem(uid=f"{name}/{split}/{i}", prompt=p.prompt, answer=p.answer, meta=dict(p.meta))
            for i, p in enumerate(problems)
        )

    if source == "local":
        return _load_local(plain, name, split, _local_path(plain, split, data_dir), limit)
    if source == "hub":
        return _load_hub(plain, name, split, limit)

    # auto: local file when it exists, else the Hub.
    try:
        path: Path | None = _local_path(plain, split, data_dir)
    except DataError:
        path = None
    if path is not None and path.is_file():
        return _load_local(plain, name, split, path, limit)
    shown = path if path is not None else Path(str(plain["files"][split]))
    if not plain.get("hub_id"):
        raise DataError(_missing_file_message(plain, shown, split))
    try:
        return _load_hub(plain, name, split, limit)
    except DataError as exc:
        raise DataError(
            f"{_missing_file_message(plain, shown, split)} Loading from the Hub failed too: {exc}"
        ) from exc


def _load_local(
    spec: Mapping[str, Any], name: str, split: str, path: Path, limit: int | None
) -> list[Problem]:
    if not path.is_file():
        raise DataError(_missing_file_message(spec, path, split))

    def records() -> Iterator[tuple[str, dict[str, Any]]]:
        for lineno, record in iter_jsonl(path):
            yield f"{path}:{lineno}", record

    return _convert(spec, name, split, records(), limit)


def _convert(
    spec: Mapping[str, Any],
    name: str,
    split: str,
    records: Iterator[tuple[str, dict[str, Any]]],
    limit: int | None,
) -> list[Problem]:
    if spec_value(spec, "answer_type") == "code":
        return records_to_code_problems(records, spec, name=name, split=split, limit=limit)
    fields = spec["fields"]
    return records_to_problems(
        records,
        name=name,
        split=split,
        problem_field=fields["problem"],
        answer_field=fields["answer"],
        answer_format=spec_value(spec, "answer_format"),
        id_field=spec_value(spec, "id_field"),
        meta_fields=list(spec.get("meta_fields") or ()),
        limit=limit,
        skip_bad_answers=bool(spec_value(spec, "skip_bad_answers")),
        tolerance_field=fields.get("tolerance"),
        solution_field=fields.get("solution"),
        prompt_fields=template_fields((spec.get("prompt") or {}).get("user")),
    )


def _load_hub(spec: Mapping[str, Any], name: str, split: str, limit: int | None) -> list[Problem]:
    """Load a split from the Hugging Face Hub with ``datasets`` (imported lazily)."""
    hub_id = spec.get("hub_id")
    if not hub_id:
        raise DataError(f"dataset {name!r} has no hub_id; it can only be read from local files")
    try:
        import datasets  # noqa: PLC0415 - optional, heavy import
    except ImportError as exc:
        raise DataError(f"the 'datasets' package is needed to load {hub_id!r} from the Hub: {exc}") from exc
    hub_split = (spec.get("hub_splits") or {}).get(split, split)
    configs = spec.get("hub_config")
    config_list = configs if isinstance(configs, (list, tuple)) else [configs]

    def records() -> Iterator[tuple[str, dict[str, Any]]]:
        for config in config_list:
            try:
                ds = datasets.load_dataset(hub_id, config, split=hub_split)
            except Exception as exc:  # network, auth, unknown id/config/split
                raise DataError(
                    f"could not load {hub_id!r} (config {config!r}, split {hub_split!r}) from the "
                    f"Hugging Face Hub: {type(exc).__name__}: {exc}"
                ) from exc
            for row_index, row in enumerate(ds):
                yield f"{hub_id}[{config or 'default'}/{hub_split}] row {row_index + 1}", dict(row)

    return _convert(spec, name, split, records(), limit)
