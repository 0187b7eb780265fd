"""The rollout-strategy seam: how a training step turns prompts into graded groups.

A strategy is selected by ``conf/rollout/<strategy>.yaml`` (``rollout.strategy``); the engine that
generates (``rollout.engine``: hf | vllm) is a sub-choice every strategy shares. The step calls

    groups, metrics = strategy.rollout(problems, draw_prompts)

and trains on ``groups`` (:class:`rlbench.rollout.groups.GradedGroups`: responses grouped per
prompt, graded, reward-shaped, each group with an explicit id). ``draw_prompts(k)`` gives k more
training problems for strategies that sample beyond the step's own prompts.

Adding a strategy is one module and one YAML: ``rlbench/rollout/strategies/<name>.py`` (or ``guided/``
when its groups hold responses the policy did not sample for the prompt as it stands), a subclass of
:class:`RolloutStrategy` registered with :func:`register_strategy` under the module's name, and
``conf/rollout/<name>.yaml`` with ``defaults: [iid, _self_]``, ``strategy: <name>`` and the strategy's
own block. Every module of those packages is imported, so nothing else is edited. The base class
declares every hook the run calls, with its default; a strategy overrides what it needs.

Off-policy responses: a strategy that returns tokens the current policy did not sample (a trace, a
replayed or stale response, a draft, a hint) labels them on the Completion (``behaviour``,
``off_policy``, ``behaviour_logprobs``, ``loss_mask``, ``policy_version``; rlbench/rollout/engines/base.py);
the trainer then takes pi_old from the stored behaviour log-probs on those tokens, never ratio 1
(rlbench.training.step.behaviour_old_logp), and the loss pieces read the ``off_policy`` mask.

A strategy whose completions carry what an advantage reads (a tree's nodes, Monte-Carlo step values)
names those step inputs in ``provides``; the validation refuses an advantage that reads such an input
under a strategy that does not provide it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from rlbench.algorithm.registry import ADVANTAGES
from rlbench.config.schema import RolloutConfig
from rlbench.config.typed import settings_block
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.groups import GradedGroups, GroupSampler


@dataclass(frozen=True)
class RolloutSetup:
    """What every strategy samples with: the sampler (engine, grader, reward shaping), the group size
    ``n`` (rollout.n), the sampling parameters, the rollout's random stream and the guidance traces;
    ``seed`` (the run's) derives a strategy's own streams (rlbench.utils STREAM_*)."""

    sampler: GroupSampler
    n: int
    params: SamplingParams
    generator: torch.Generator | None
    seed: int = 0
    guidance: Any = None  # rlbench.guidance.GuidanceLibrary: the run's checked traces (guidance=<source>), or None
    prompt_stats: Any = None  # rlbench.training.curricula.PromptStatsStore: the run's per-prompt statistics, or None
    env: Any = None  # rlbench.rollout.env.EnvFactory: one environment per episode (env=<name>), or None

    def sample(self, problems: list[Problem]) -> GradedGroups:
        """``n`` graded responses for each of ``problems``."""
        return self.sampler(problems, self.n, self.params, self.generator)


class RolloutStrategy:
    """Base class of every rollout strategy: each hook the run calls, with its default.

    Built by :meth:`from_config` from the ``rollout`` node: :meth:`options` reads and checks the
    strategy's own block (``rollout.<name>``) into the constructor's keyword arguments, and
    :meth:`validate` runs the same checks before the model loads. A strategy keeps its
    :class:`RolloutSetup` as ``setup`` (``trainer.stages`` changes its group size and length there).
    """

    #: Step inputs this strategy fills in Completion.extras (STEP_INPUTS entries of producer "strategy",
    #: rlbench/algorithm/step_inputs.py), e.g. a tree's nodes.
    provides: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, setup: RolloutSetup):
        self.setup = setup

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        """The constructor's keyword arguments besides ``setup``, read from ``rollout`` and checked
        (ConfigError); a strategy without options takes none."""
        return {}

    @classmethod
    def from_config(cls, rollout: RolloutConfig, setup: RolloutSetup) -> "RolloutStrategy":
        return cls(setup, **cls.config_options(rollout))

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """Refuse impossible settings before the model loads (ConfigError); ``advantage`` is the
        estimator's name. By default: the checks of :meth:`options`."""
        cls.config_options(rollout)

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        """The step's graded groups (one per prompt of ``problems`` unless the strategy says otherwise)
        and the strategy's metrics."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any] | None:
        """What the strategy keeps between steps (a replay buffer, drafts, per-prompt statistics) as plain
        values and tensors, so that a resumed run continues exactly; None: nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s value."""

    def training_logits_transform(self) -> Callable[[torch.Tensor, Any], torch.Tensor] | None:
        """The change a strategy makes to the sampling distribution (rollout=masked's top-p mask), applied
        to the step's forwards alike; None: the plain distribution."""
        return None

    def stop_replay(self) -> None:
        """From now on replay nothing (ReMix's reincarnation); a strategy that replays nothing ignores it."""

    def training_problems(self, problems: list[Problem]) -> list[Problem]:
        """The problems the run trains on, given the dataset's (called once, before training): a strategy
        that brings its own prompts (rollout=offline with a file of prompts) returns them; by default the
        dataset's problems."""
        return problems

    def in_context(self, problem: Problem) -> Problem:
        """The problem as the trained policy is asked it, here and at evaluation (Training-Free GRPO puts
        its experience library in every prompt); by default the problem itself."""
        return problem


STRATEGIES: dict[str, type] = {}


def class_registrar(table: dict[str, type], kind: str) -> Callable[[str], Callable[[type], type]]:
    """A decorator factory that registers a class in ``table`` under a name, refusing a name taken twice
    (``kind`` names what is registered in the error)."""

    def register_as(name: str) -> Callable[[type], type]:
        def register(cls: type) -> type:
            if name in table:
                raise ValueError(f"{kind} {name!r} is registered twice")
            table[name] = cls
            return cls

        return register

    return register_as


register_strategy = class_registrar(STRATEGIES, "rollout strategy")


def needs_groups(strategy: str, rollout: RolloutConfig, reason: str) -> None:
    """ConfigError unless ``rollout.n >= 2``; ``reason``: what the strategy does within a group."""
    n = int(rollout.n)
    if n < 2:
        raise ConfigError(f"rollout={strategy} {reason}, which needs rollout.n >= 2 (got {n}); use rollout=iid")


def require_advantage_input(advantage: str, input_name: str, refusal: str) -> None:
    """ConfigError unless advantage ``advantage`` reads ``input_name`` (an input only the strategy
    provides); ``refusal`` is the message, formatted with ``advantage`` and ``readers`` (the registered
    advantages that read the input)."""
    if input_name in ADVANTAGES.accepted_inputs(advantage):
        return
    readers = sorted(name for name in ADVANTAGES.names() if input_name in ADVANTAGES.accepted_inputs(name))
    raise ConfigError(refusal.format(advantage=advantage, readers=readers))


def strategy_class(rollout: RolloutConfig) -> type:
    """The class of ``rollout.strategy``; ConfigError naming the registered strategies if unknown."""
    name = rollout.strategy
    if name not in STRATEGIES:
        raise ConfigError(f"rollout.strategy={name!r} is unknown; choose one of {sorted(STRATEGIES)} (conf/rollout/)")
    return STRATEGIES[name]


def strategy_options(rollout: RolloutConfig, name: str, options_class: type) -> Any:
    """The ``rollout.<name>`` block as an instance of the dataclass ``options_class`` (its fields are the
    keys, their defaults declared there only; rlbench.config.typed.settings_block)."""
    return settings_block(rollout.settings.get(name), options_class, f"rollout.{name}")


def validate_strategy(rollout: RolloutConfig, advantage: str) -> None:
    """Refuse an unknown strategy or impossible strategy settings (before anything is loaded)."""
    strategy_class(rollout).validate(rollout, advantage)


def make_strategy(rollout: RolloutConfig, setup: RolloutSetup) -> RolloutStrategy:
    return strategy_class(rollout).from_config(rollout, setup)
