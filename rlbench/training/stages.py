"""Stages (``trainer.stages``): ``[{at: 10, rollout.n: 16, rollout.max_new_tokens: 32}, ...]``: from
step ``at`` on, the listed settings change (DRIVE's and CAMPO's schedules of group size and length).
``trainer.prompt_sampler: {name: hard_focus, hard_focus: {...}}`` switches the prompt sampler: a whole
``trainer.prompt_sampler`` node, its settings block beside its name (DRIVE's uniform stage 1, then its
hard-focus stage 2, conf/prompt_sampler/drive.yaml).
Steps must be strictly increasing (an unordered or repeated step is refused before the model loads).

This module parses and checks them (validation reads every stage's settings, :func:`stage_settings`);
the curriculum (rlbench.training.curricula) enters them during the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlbench.config.schema import PromptSamplerConfig, RunConfig
from rlbench.config.typed import typed_node
from rlbench.errors import ConfigError

SAMPLER_KEY = "trainer.prompt_sampler"  # a whole sampler node (its name checked by rlbench.validation)
STAGE_KEYS = ("rollout.n", "rollout.max_new_tokens", "rollout.temperature", "trainer.prompts_per_step", SAMPLER_KEY)


@dataclass(frozen=True)
class Stage:
    at: int
    changes: dict[str, Any]


def parse_stages(stages_cfg: list | None, steps: int) -> list[Stage]:
    """``trainer.stages`` as Stages, refused unless each has ``at`` (2 <= at <= trainer.steps) and
    only keys of STAGE_KEYS, and the steps strictly increase (no two stages at one step)."""
    stages = []
    for i, raw in enumerate(list(stages_cfg or [])):
        entry = _flatten(dict(raw))
        if "at" not in entry:
            raise ConfigError(f"trainer.stages[{i}] has no 'at' (the step it starts at): {entry}")
        at = entry.pop("at")
        if isinstance(at, bool) or not isinstance(at, int) or not 2 <= at <= max(steps, 2):
            raise ConfigError(f"trainer.stages[{i}].at={at!r} must be a step in 2..trainer.steps={steps}")
        unknown = set(entry) - set(STAGE_KEYS)
        if unknown or not entry:
            raise ConfigError(f"trainer.stages[{i}] may change {list(STAGE_KEYS)}; got {sorted(entry) or 'nothing'}")
        for key, value in entry.items():
            if key == SAMPLER_KEY:
                if not hasattr(value, "items") or not isinstance(value.get("name"), str):
                    raise ConfigError(f"trainer.stages[{i}].{key}={value!r} must be a prompt sampler node "
                                      "{name: <sampler>, <sampler>: {<its settings>}}")
                entry[key] = typed_node(dict(value), PromptSamplerConfig)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"trainer.stages[{i}].{key}={value!r} must be a positive number")
        if stages and at <= stages[-1].at:
            what = "overlaps" if at == stages[-1].at else "comes before"
            raise ConfigError(f"trainer.stages[{i}].at={at} {what} the previous stage's at={stages[-1].at}: "
                              "stages must start at strictly increasing steps")
        stages.append(Stage(at, entry))
    return stages


def _flatten(entry: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{rollout: {n: 16}} and {"rollout.n": 16} alike -> {"rollout.n": 16}; a prompt sampler node stays whole."""
    flat: dict[str, Any] = {}
    for key, value in entry.items():
        if hasattr(value, "items") and f"{prefix}{key}" != SAMPLER_KEY:
            flat.update(_flatten(dict(value), f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def stage_settings(config: RunConfig, stages: list[Stage]) -> list[dict[str, Any]]:
    """The value of every stage key in force at each stage (the run's config, then each stage's
    changes on top of the previous ones): what validation checks (batch arithmetic) for every stage."""
    current = {key: _select(config, key) for key in STAGE_KEYS}
    out = []
    for stage in stages:
        current = {**current, **stage.changes}
        out.append(dict(current))
    return out


def _select(config: RunConfig, dotted: str) -> Any:
    """The value at ``dotted`` (``rollout.n``): the attribute path through the typed config."""
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
