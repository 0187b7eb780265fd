"""The multi-turn environment seam: what an episode of rollout=multi_turn talks to.

An episode starts from a problem; each turn the policy writes until the environment's turn end (a
stop marker, a closed tool block) or the turn's token budget; the environment answers with a
:class:`StepResult`: an observation (text, inserted into the response as context, never trained
on), a reward (0 until the end, for most environments), a done flag and a hashable state (GiGPO's
anchor groups compare the states in which actions were taken). docs/agents.md describes the seam.

Adding an environment is one module and one YAML: ``rlbench/rollout/env/<name>.py`` with a subclass
of :class:`Environment` registered by :func:`register_env` (its settings block, the ``env.<name>``
keys, is the dataclass ``Options`` of the class), and ``conf/env/<name>.yaml`` with ``name: <name>``,
the episode caps and the block. Every module of this package is imported, so nothing else is edited.

This package sits in the rollout layer: it may use the sandbox and the graders (data layer), never
the trainer.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

from rlbench.config.schema import EnvConfig
from rlbench.config.typed import settings_block
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward import grade_completions
from rlbench.reward.math import Grade
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.strategy import class_registrar
from rlbench.sandbox import SandboxLimits


@dataclass(frozen=True)
class Reset:
    """The start of an episode: the first observation (the text the policy is asked, inside the
    dataset's chat template) and the key of the start state."""

    observation: str
    state_key: Hashable


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one turn of the policy.

    observation  text appended to the response as context (loss mask 0); ignored when ``done``
    reward       the reward of this turn (the episode's return is the sum over its turns)
    done         the episode is over
    state_key    a hashable key of the state after the turn (equal keys: the same state)
    ended_by     when done: why, in a word (``goal``, ``answer``, ``unclosed_tool_tag``, ...)
    tool_calls, tool_errors  tools run in this turn, and how many of them failed
    """

    observation: str
    reward: float
    done: bool
    state_key: Hashable
    ended_by: str = ""
    tool_calls: int = 0
    tool_errors: int = 0


class Environment:
    """Base class of every environment: one instance per episode.

    A subclass sets ``Options`` (the dataclass of its ``env.<name>`` block; its fields' defaults are
    the defaults) and implements :meth:`reset` and :meth:`step`; it may override :meth:`turn_end`
    (by default: the end of the first of ``stop_markers``) and :meth:`grade` (by default: correct
    when the return is positive)."""

    @dataclass(frozen=True)
    class Options:
        pass

    #: a turn ends just after the first of these in the policy's text (turn_end's default)
    stop_markers: ClassVar[tuple[str, ...]] = ()
    #: the policy's EOS ends the episode (model_stopped); False: it ends the turn only (a dialogue's chat turn)
    eos_ends_episode: ClassVar[bool] = True
    #: the roles that take turns, in order (turn t is role t mod their number; model.lora.per_role gives each
    #: an adapter named after it); (): one role
    roles: ClassVar[tuple[str, ...]] = ()
    #: after the last allowed tool call (``env.max_tool_calls``) the episode goes on, so that the policy sees the
    #: call's output and answers; the environment refuses a further call itself (the episode ends with
    #: ``ended_by="tool_call_cap"``, the call not run). False: the episode ends right after the last allowed call
    #: (an environment whose every turn is a tool call, as code_repair's)
    answers_after_last_call: ClassVar[bool] = False

    def __init__(self, options: Any, context: EnvContext):
        self.options, self.context = options, context
        self.problem: Problem | None = None

    def reset(self, problem: Problem) -> Reset:
        raise NotImplementedError

    def step(self, action_text: str) -> StepResult:
        raise NotImplementedError

    def fork(self) -> Environment:
        """An independent copy in the same state (a branch of the episode: REFUEL's turn-h pair); the
        context (grader, limits) is shared, everything else copied."""
        return copy.deepcopy(self, {id(self.context): self.context})

    def turn_end(self, text: str) -> int | None:
        """The length of the turn within ``text`` (the policy's text so far in this turn): the
        position just after the first stop marker; None: the turn goes on."""
        ends = [text.index(m) + len(m) for m in self.stop_markers if m in text]
        return min(ends) if ends else None

    def grade(self, total_reward: float) -> Grade:
        """The verdict on the finished episode whose turns' rewards sum to ``total_reward``."""
        return Grade(correct=total_reward > 0, extracted=None, reward=float(total_reward), format_ok=True)


@dataclass(frozen=True)
class EnvContext:
    """What an environment may use besides its options: the run's grader (rlbench.reward), the
    sandbox limits for model-written code (rlbench.sandbox.SandboxLimits) and the episode's turn cap
    (``env.max_turns``, set by :class:`EnvFactory` from the run's ``env`` node: an environment whose length
    is a number of turns, as user_sim's dialogue, reads it here instead of a setting of its own) and its
    tool-call cap (``env.max_tool_calls``, likewise: an environment that ``answers_after_last_call`` refuses
    the calls past it)."""

    grader: Any = None
    sandbox_limits: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)
    max_turns: int | None = None
    max_tool_calls: int | None = None

    def grade_text(self, problem: Problem, text: str, finished: bool = True) -> Grade:
        """The run's grader on ``text`` as an answer to ``problem``."""
        if self.grader is None:
            raise ValueError("this environment grades answers but was built without a grader")
        completion = Completion(request_index=0, prompt_ids=(), response_ids=[], logprobs=[], finished=finished, text=text)
        return grade_completions(self.grader, [problem], [completion])[0]


def output_block(text: str, limit: int) -> str:
    """A tool's output as an observation: ``text`` cut to ``limit`` characters (a cut says so) in an
    ```` ```output ```` block (python_tool's runs, code_repair's test reports)."""
    if len(text) > limit:
        text = text[:limit] + "...[truncated]\n"
    return f"```output\n{text}```\n"


ENVIRONMENTS: dict[str, type[Environment]] = {}


register_env = class_registrar(ENVIRONMENTS, "environment")


def env_class(config: EnvConfig) -> type[Environment]:
    if config.name not in ENVIRONMENTS:
        raise ConfigError(f"env.name={config.name!r} is unknown; choose one of {sorted(ENVIRONMENTS)} (conf/env/)")
    return ENVIRONMENTS[config.name]


def env_roles(config: EnvConfig | None) -> tuple[str, ...]:
    """The roles of the run's environment (``Environment.roles``; no environment: none)."""
    return env_class(config).roles if config is not None else ()


def env_options(config: EnvConfig) -> Any:
    """The ``env.<name>`` block as the environment's ``Options`` (unknown keys refused)."""
    cls = env_class(config)
    return settings_block(config.settings.get(config.name), cls.Options, f"env.{config.name}")


def validate_env(config: EnvConfig | None, strategy: str, mode: str = "train") -> None:
    """Refuse a multi-turn strategy without an environment, an unknown environment or bad options,
    before the model loads; an environment that would be ignored is refused too: a training run whose
    strategy is single-turn (its evaluations would run episodes its training never does), and
    mode=generate (its traces are single-turn answers). mode=eval runs each sample as an episode through
    the environment (rlbench.eval.evaluate), whatever the rollout strategy (it samples nothing for training)."""
    if config is None:
        if strategy == "multi_turn" and mode == "train":
            raise ConfigError("rollout=multi_turn needs an environment: add env=<name> (conf/env/)")
        return
    if mode == "generate":
        raise ConfigError(f"env={config.name}: mode=generate writes single-turn traces and does not run episodes "
                          "through an environment; drop env= (mode=eval env=<name> evaluates through one)")
    if mode == "train" and strategy != "multi_turn":
        raise ConfigError(f"env={config.name} is only used by rollout=multi_turn (this run has rollout={strategy}); "
                          f"to evaluate through it without training: mode=eval env={config.name}")
    env_options(config)


@dataclass(frozen=True)
class EnvFactory:
    """Builds one environment per episode from the run's ``env`` node."""

    config: EnvConfig
    context: EnvContext

    def __post_init__(self) -> None:
        object.__setattr__(self, "_options", env_options(self.config))
        object.__setattr__(self, "context", dataclasses.replace(self.context, max_turns=self.config.max_turns,
                                                                        max_tool_calls=self.config.max_tool_calls))

    def __call__(self) -> Environment:
        return env_class(self.config)(self._options, self.context)

    def with_context(self, **changes: Any) -> EnvFactory:
        return EnvFactory(self.config, dataclasses.replace(self.context, **changes))


def state_id(key: Hashable) -> int:
    """A stable 62-bit integer of a state key (its repr's BLAKE2 digest): equal keys, equal ids."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 2


class EnvTimeout(Exception):
    """An environment call ran past its time limit."""


def call_all_with_timeout(functions: list[Callable[[], Any]], timeout_s: float, workers: int) -> list[tuple[Any, BaseException | None]]:
    """Each of ``functions`` called in a daemon thread, at most ``workers`` at once: per call ``(value, None)``,
    ``(None, its exception)``, or ``(None, EnvTimeout)`` when it ran ``timeout_s`` seconds from its own start
    (it is left running and its slot freed: an environment is trusted code, model code runs in the sandbox)."""
    results: list[tuple[Any, BaseException | None]] = [(None, None)] * len(functions)
    pending = list(range(len(functions)))
    running: dict[int, tuple[threading.Thread, dict[str, Any], float]] = {}

    def target(function: Callable[[], Any], box: dict[str, Any]) -> None:
        try:
            box["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            box["error"] = error

    while pending or running:
        while pending and len(running) < max(int(workers), 1):
            index = pending.pop(0)
            box: dict[str, Any] = {}
            thread = threading.Thread(target=target, args=(functions[index], box), daemon=True, name="env-step")
            thread.start()
            running[index] = (thread, box, time.monotonic())
        first = next(iter(running.values()))[0]
        first.join(0.005)
        for index, (thread, box, started) in list(running.items()):
            if not thread.is_alive():
                results[index] = (box.get("value"), box.get("error"))
            elif time.monotonic() - started > timeout_s:
                results[index] = (None, EnvTimeout(f"no answer within {timeout_s} s"))
            else:
                continue
            del running[index]
    return results
