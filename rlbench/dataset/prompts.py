"""Turn a :class:`Problem` into chat messages using a dataset's ``prompt`` config.

A prompt config is ``{"system": str | None, "user": str}``; ``user`` is a ``str.format``
template that contains ``{problem}`` and, for records read from files, may name any other field
of the record (``{unit}``: the loader copies those values into ``Problem.meta["prompt_fields"]``);
literal braces are doubled (``\\boxed{{}}``).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError

DEFAULT_USER_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def template_fields(template: Any) -> list[str]:
    """The placeholders of a user template other than ``{problem}`` (record fields), in order."""
    if not isinstance(template, str):
        return []
    names = [field for _, field, _, _ in string.Formatter().parse(template) if field]
    return list(dict.fromkeys(n for n in names if n != "problem"))


def check_template(template: Any, key: str = "prompt.user", record_fields: bool = False) -> None:
    """Raise ConfigError unless ``template`` is a format string containing ``{problem}``; other
    placeholders are allowed only with ``record_fields`` (each must be a plain field name: the
    loader checks that every record has it)."""
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"{key} must be a non-empty string template containing {{problem}}")
    try:
        names = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as exc:
        raise ConfigError(
            f"{key} is not a valid format template ({exc}); write literal braces doubled, "
            "e.g. \\boxed{{}}"
        ) from None
    if "problem" not in names:
        raise ConfigError(f"{key} must contain the placeholder {{problem}}; got {template!r}")
    unknown = sorted({n for n in names if n != "problem"})
    if unknown and not record_fields:
        raise ConfigError(
            f"{key} uses unknown placeholder(s) {unknown}; only {{problem}} is filled in "
            "(write literal braces doubled, e.g. \\boxed{{}})"
        )
    odd = [n for n in unknown if not n.isidentifier()]
    if odd:
        raise ConfigError(
            f"{key}: placeholder(s) {odd} are not record field names (write {{field}}; literal braces "
            "doubled, e.g. \\boxed{{}})"
        )


def _prompt_section(prompt_spec: Any) -> Mapping[str, Any]:
    """Accept a prompt section, a whole dataset spec (with a ``prompt`` key) or None."""
    if prompt_spec is None:
        return {}
    if hasattr(prompt_spec, "keys") and "prompt" in prompt_spec and "user" not in prompt_spec:
        prompt_spec = prompt_spec["prompt"]
        if prompt_spec is None:
            return {}
    if not hasattr(prompt_spec, "get"):
        raise ConfigError(f"prompt must be a mapping with 'system' and 'user', got {prompt_spec!r}")
    return prompt_spec


def render_user_prompt(problem: Problem | str, prompt_spec: Any = None) -> str:
    """Fill the user template of ``prompt_spec`` with the problem text (default template if none)."""
    section = _prompt_section(prompt_spec)
    template = section.get("user") or DEFAULT_USER_TEMPLATE
    fields = dict(problem.meta.get("prompt_fields") or {}) if isinstance(problem, Problem) else {}
    check_template(template, record_fields=bool(fields))
    missing = [n for n in template_fields(template) if n not in fields]
    if missing:
        raise ConfigError(f"prompt.user names record field(s) {missing} that this problem does not carry")
    text = problem.prompt if isinstance(problem, Problem) else problem
    return str(template).format(problem=text, **{k: v for k, v in fields.items() if k != "problem"})


def build_messages(problem: Problem, prompt_spec: Any = None) -> list[dict[str, str]]:
    """Return chat messages for ``problem``: an optional system message, then the user message.

    ``prompt_spec`` is the dataset's ``prompt`` section (``system``, ``user``) or the whole
    dataset spec; a missing/empty ``system`` gives no system message, a missing ``user`` uses
    :data:`DEFAULT_USER_TEMPLATE`.
    """
    section = _prompt_section(prompt_spec)
    messages: list[dict[str, str]] = []
    system = section.get("system")
    if system is not None and str(system).strip():
        messages.append({"role": "system", "content": str(system)})
    messages.append({"role": "user", "content": render_user_prompt(problem, section)})
    return messages
