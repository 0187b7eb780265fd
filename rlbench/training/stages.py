"""Stages (``trainer.stages``): ``[{at: 10, rollout.n: 16, rollout.max_new_tokens: 32}, ...]``: from
step ``at`` on, the listed settings change (DRIVE's and CAMPO's schedules of group size and length).
``trainer.prompt_sampler: {name: hard_focus, hard_focus: {...}}`` switches the prompt sampler: a whole
``trainer.prompt_sampler`` node, its settings block beside its name (DRIVE's uniform stage 1, then its
hard-focus stage 2, conf/prompt_sampler/drive.yaml).
Steps must be strictly increasing (an unordered or repeated step is refused before the model loads).

A stage may start on a training signal instead of at a fixed step: ``{when: {metric: truncated_rate, above: 0.5,
for_steps: 2}, rollout.max_new_tokens: 64}`` starts at the step after the one where the step metric had been above
0.5 for 2 steps in a row (``below`` for the other side). Stages start in list order, so a ``when`` stage is only
watched once the stages before it have started, and may be followed only by other ``when`` stages. The metrics it
may read are :data:`STAGE_METRICS`: those every training step logs (CAMPO's switch when the response length
levels off: the truncation rate at the budget rises, arXiv:2507.14683), and ``entropy_change``, computed from the
logged policy entropy by :func:`entropy_change` (DRIVE's switch when the entropy plateaus, arXiv:2511.06307);
:class:`MetricHistory` keeps the recent values it reads (checkpointed with the stages).

This module parses and checks them (validation reads every stage's settings, :func:`stage_settings`);
the curriculum (rlbench.training.curricula) enters them during the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlbench.config.schema import PromptSamplerConfig, RunConfig
from rlbench.config.typed import typed_node
from rlbench.errors import ConfigError

SAMPLER_KEY = "trainer.prompt_sampler"  # a whole sampler node (its name checked by rlbench.validation)
STAGE_KEYS = ("rollout.n", "rollout.max_new_tokens", "rollout.temperature", "trainer.prompts_per_step", SAMPLER_KEY)
PLATEAU_WINDOW = 5  # steps per moving average of entropy_change


def entropy_change(entropies: Sequence[float], window: int = PLATEAU_WINDOW) -> float:
    """How far the policy entropy still moves (DRIVE's stage 1 runs "until entropy plateaus", arXiv:2511.06307;
    the measure is rlbench's): the absolute change between the moving averages of the last two windows of
    ``window`` steps, relative to the earlier one,

        d_t = |mean(H_{t-w+1..t}) - mean(H_{t-2w+1..t-w})| / max(mean(H_{t-2w+1..t-w}), 1e-8),

    H_s the mean per-token entropy logged at step s (``entropy``). Infinite until 2w steps are logged (no
    plateau yet); ``below: x`` watches for the plateau."""
    if len(entropies) < 2 * window:
        return math.inf
    recent = sum(entropies[-window:]) / window
    earlier = sum(entropies[-2 * window:-window]) / window
    return abs(recent - earlier) / max(abs(earlier), 1e-8)


@dataclass(frozen=True)
class DerivedMetric:
    """A stage metric computed from the recent values of a logged one: ``compute(values)``, the last ``keep``."""

    source: str
    keep: int
    compute: Callable[[Sequence[float]], float]


#: the metrics a ``when`` stage may watch: None, a step metric every training step logs (rlbench.training.step);
#: a DerivedMetric, computed from the recent values of a logged one
STAGE_METRICS: dict[str, DerivedMetric | None] = {
    "accuracy": None, "reward_mean": None, "response_length": None, "truncated_rate": None,
    "entropy_change": DerivedMetric("entropy", 2 * PLATEAU_WINDOW, entropy_change),
}


class MetricHistory:
    """The recent values of the logged metrics that the stages' derived metrics read (:data:`STAGE_METRICS`),
    recorded every step from step 1 (a step without the value, e.g. NaN entropy with no token, is skipped)."""

    def __init__(self, stages: list[Stage]):
        self.derived = {stage.when.metric: STAGE_METRICS[stage.when.metric] for stage in stages
                        if stage.when is not None and STAGE_METRICS[stage.when.metric] is not None}
        self.values: dict[str, list[float]] = {d.source: [] for d in self.derived.values()}

    def record(self, metrics: dict[str, float]) -> None:
        for derived in self.derived.values():
            value = metrics.get(derived.source)
            if value is not None and math.isfinite(float(value)):
                self.values[derived.source] = (self.values[derived.source] + [float(value)])[-derived.keep:]

    def value(self, metric: str, metrics: dict[str, float]) -> float:
        """``metric`` at this step: the logged value, or the derived one from the recorded history."""
        derived = self.derived.get(metric)
        return float(metrics[metric]) if derived is None else derived.compute(self.values[derived.source])

    def metrics(self) -> dict[str, float]:
        """The derived metrics' values, once finite (logged with the step)."""
        values = {name: derived.compute(self.values[derived.source]) for name, derived in self.derived.items()}
        return {name: value for name, value in values.items() if math.isfinite(value)}

    def state_dict(self) -> dict[str, list[float]]:
        return {name: list(values) for name, values in self.values.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.values.update({name: list(values) for name, values in state.items() if name in self.values})


@dataclass(frozen=True)
class StageTrigger:
    """``when``: the stage starts after ``metric`` has been above (or below) ``threshold`` for ``for_steps``
    consecutive steps."""

    metric: str
    threshold: float
    above: bool
    for_steps: int = 1

    def holds(self, value: float) -> bool:
        return value > self.threshold if self.above else value < self.threshold

    def __str__(self) -> str:
        side = "above" if self.above else "below"
        return f"when {self.metric} {side} {self.threshold} for {self.for_steps} step(s)"


@dataclass(frozen=True)
class Stage:
    at: int | None  # the step it starts at; None: it starts on its trigger
    changes: dict[str, Any]
    when: StageTrigger | None = None

    @property
    def label(self) -> str:
        """How the stage is named in messages: "at step 10" or "when truncated_rate above 0.5 for 2 step(s)"."""
        return f"at step {self.at}" if self.when is None else str(self.when)


def parse_stages(stages_cfg: list | None, steps: int) -> list[Stage]:
    """``trainer.stages`` as Stages, refused unless each has either ``at`` (2 <= at <= trainer.steps) or
    ``when`` (:func:`parse_trigger`), only keys of STAGE_KEYS, the steps strictly increase (no two stages at
    one step), and no ``at`` stage follows a ``when`` stage (stages start in list order)."""
    stages = []
    for i, raw in enumerate(list(stages_cfg or [])):
        when = dict(raw).get("when")
        entry = _flatten({key: value for key, value in dict(raw).items() if key != "when"})
        if ("at" in entry) == (when is not None):
            raise ConfigError(f"trainer.stages[{i}] needs exactly one of 'at' (the step it starts at) or 'when' "
                              f"(the metric that starts it): {dict(raw)}")
        if when is not None:
            trigger = parse_trigger(when, f"trainer.stages[{i}].when")
            stages.append(Stage(None, _checked_values(entry, i), trigger))
            continue
        at = entry.pop("at")
        if isinstance(at, bool) or not isinstance(at, int) or not 2 <= at <= max(steps, 2):
            raise ConfigError(f"trainer.stages[{i}].at={at!r} must be a step in 2..trainer.steps={steps}")
        if stages and stages[-1].when is not None:
            raise ConfigError(f"trainer.stages[{i}] starts at step {at} after a stage that starts on a metric "
                              f"({stages[-1].label}); stages start in list order: put the 'at' stages first")
        changes = _checked_values(entry, i)
        if stages and at <= stages[-1].at:
            what = "overlaps" if at == stages[-1].at else "comes before"
            raise ConfigError(f"trainer.stages[{i}].at={at} {what} the previous stage's at={stages[-1].at}: "
                              "stages must start at strictly increasing steps")
        stages.append(Stage(at, changes))
    return stages


def _checked_values(entry: dict[str, Any], i: int) -> dict[str, Any]:
    """A stage's changes: only keys of STAGE_KEYS, at least one; a prompt sampler node typed, every other value a
    positive number."""
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
    return entry


def parse_trigger(when: Any, where: str) -> StageTrigger:
    """``{metric: <one of STAGE_METRICS>, above: x | below: x, for_steps: k >= 1 (default 1)}``."""
    if not hasattr(when, "items"):
        raise ConfigError(f"{where}={when!r} must be {{metric: <name>, above: <x> or below: <x>, for_steps: <k>}}")
    when = dict(when)
    unknown = set(when) - {"metric", "above", "below", "for_steps"}
    if unknown:
        raise ConfigError(f"{where} has unknown keys {sorted(unknown)}; it takes metric, above or below, for_steps")
    metric = when.get("metric")
    if metric not in STAGE_METRICS:
        raise ConfigError(f"{where}.metric={metric!r} must be one of {list(STAGE_METRICS)} (logged every step)")
    if ("above" in when) == ("below" in when):
        raise ConfigError(f"{where} needs exactly one of 'above' or 'below' (the threshold), got {when}")
    threshold = when["above"] if "above" in when else when["below"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ConfigError(f"{where}: the threshold must be a finite number, got {threshold!r}")
    count = when.get("for_steps", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{where}.for_steps={count!r} must be an integer >= 1")
    return StageTrigger(metric, float(threshold), "above" in when, count)


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
