"""Datasets and benchmarks: load problems from a config, build chat prompts.

Public API:

- :func:`resolve_data_dir` -- where local data files live (``RLBENCH_DATA_DIR`` first).
- :func:`load_problems` -- one split of a ``conf/dataset`` or ``conf/benchmark`` spec as Problems.
- :func:`validate_spec` -- cheap config checks before any model is loaded.
- :func:`build_messages` -- chat messages for one problem from the spec's ``prompt`` section.
- :func:`generate_arith` -- the procedural arithmetic task.
"""

from rlbench.dataset.arith import generate_arith
from rlbench.dataset.base import Problem
from rlbench.dataset.jsonl import ANSWER_FORMATS, extract_answer, extract_last_boxed
from rlbench.dataset.prompts import DEFAULT_USER_TEMPLATE, build_messages, render_user_prompt
from rlbench.dataset.sources import (
    DATA_DIR_ENV,
    LOADERS,
    SOURCES,
    load_problems,
    resolve_data_dir,
    validate_spec,
)

__all__ = [
    "ANSWER_FORMATS",
    "DATA_DIR_ENV",
    "DEFAULT_USER_TEMPLATE",
    "LOADERS",
    "SOURCES",
    "Problem",
    "build_messages",
    "extract_answer",
    "extract_last_boxed",
    "generate_arith",
    "load_problems",
    "render_user_prompt",
    "resolve_data_dir",
    "validate_spec",
]
