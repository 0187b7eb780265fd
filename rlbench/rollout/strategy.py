"""The rollout-strategy seam: how a training step turns prompts into graded groups.

A strategy is selected by ``conf/rollout/<strategy>.yaml`` (``rollout.strategy``); the engine that
generates (``rollout.engine``: hf | vllm) is a sub-choice every strategy shares. The step calls

    groups, metrics = strategy.rollout(problems, draw_prompts)

and trains on ``groups`` (:class:`rlbench.rollout.groups.GradedGroups`: responses grouped per
prompt, graded, reward-shaped, each group with an explicit id). ``draw_prompts(k)`` gives k more
training problems for strategies that sample beyond the step's own prompts.

Adding a strategy is one module and one YAML: a class registered with :func:`register_strategy`,
with ``from_config(rollout_cfg, setup)`` (build from the ``rollout`` node and the shared
:class:`RolloutSetup`), ``validate(rollout_cfg, advantage)`` (refuse impossible settings before the
model loads; ``advantage`` is the estimator's name) and ``rollout(problems, draw_prompts)``; and
``conf/rollout/<name>.yaml`` with ``defaults: [iid, _self_]``, ``strategy: <name>`` and the
strategy's own block. Import the module in rlbench/rollout/__init__.py so that it registers.

State across steps: a strategy that keeps anything between steps (a replay buffer, stored drafts,
per-prompt statistics) implements ``state_dict() -> dict`` and ``load_state_dict(state)`` (plain
Python values and tensors), so checkpoints save it and a resumed run continues exactly.

Off-policy responses: a strategy that returns tokens the current policy did not sample (a trace, a
replayed or stale response, a draft, a hint) labels them on the Completion (``behaviour``,
``off_policy``, ``behaviour_logprobs``, ``loss_mask``, ``policy_version``; rlbench/rollout/base.py);
the trainer then takes pi_old from the stored behaviour log-probs on those tokens, never ratio 1
(rlbench.training.step.behaviour_old_logp), and the loss pieces read the ``off_policy`` mask.

Shaped for what comes next (not implemented yet):

* tree / segment strategies (TreeRL, segment rollouts) branch from shared prefixes: they send the
  engine requests with ``prefix_ids`` (the prefix is returned and scored as part of the response) and
  a per-request ``n``; the responses sharing a root prompt form one group, whatever request produced
  them, which is why groups carry ids rather than being positions in a request list;
* multi-turn tool use (code-interpreter turns): a strategy alternates generation and tool calls and
  returns the tool's output tokens inside the response; they must not be trained on, so such a
  group carries a per-token loss mask (1 for policy tokens, 0 for tool output) that the batch
  multiplies into its response mask (as DAPO's overlong filter does per response);
* pairwise / preference objectives over the responses of a group read the group as it is: its
  responses, rewards and id, from which the loss forms pairs inside each group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from rlbench.algorithm.registry import ADVANTAGES
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.base import SamplingParams
from rlbench.rollout.groups import GradedGroups, GroupSampler

DEFAULT_STRATEGY = "iid"


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

    def sample(self, problems: list[Problem]) -> GradedGroups:
        """``n`` graded responses for each of ``problems``."""
        return self.sampler(problems, self.n, self.params, self.generator)


class RolloutStrategy(Protocol):
    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None
    ) -> tuple[GradedGroups, dict[str, float]]:
        """The step's graded groups (one per prompt of ``problems`` unless the strategy says otherwise)
        and the strategy's metrics."""
        ...


STRATEGIES: dict[str, type] = {}


def register_strategy(name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        if name in STRATEGIES:
            raise ValueError(f"rollout strategy {name!r} is registered twice")
        STRATEGIES[name] = cls
        return cls

    return register


def options_block(rollout_cfg: Any, name: str, keys: set[str]) -> dict:
    """The strategy's own block ``rollout.<name>`` as a dict (empty when absent); ConfigError naming
    the keys it takes when it holds others."""
    node = dict(rollout_cfg.get(name) or {})
    unknown = set(node) - set(keys)
    if unknown:
        raise ConfigError(f"rollout.{name} has no key(s) {sorted(unknown)}; it takes {sorted(keys)}")
    return node


def needs_groups(strategy: str, rollout_cfg: Any, reason: str) -> None:
    """ConfigError unless ``rollout.n >= 2``; ``reason``: what the strategy does within a group."""
    n = int(rollout_cfg.n)
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


def strategy_class(rollout_cfg: Any) -> type:
    """The class of ``rollout.strategy``; ConfigError naming the registered strategies if unknown."""
    name = rollout_cfg.get("strategy", DEFAULT_STRATEGY)
    if name not in STRATEGIES:
        raise ConfigError(f"rollout.strategy={name!r} is unknown; choose one of {sorted(STRATEGIES)} (conf/rollout/)")
    return STRATEGIES[name]


def strategy_options(rollout_cfg: Any, name: str, options_class: type) -> Any:
    """The ``rollout.<name>`` block as an instance of the dataclass ``options_class`` (its fields are
    the keys, with their defaults); an unknown key is a ConfigError naming the keys it takes."""
    return options_class(**options_block(rollout_cfg, name, {f.name for f in dataclasses.fields(options_class)}))


def validate_strategy(rollout_cfg: Any, advantage: str) -> None:
    """Refuse an unknown strategy or impossible strategy settings (before anything is loaded)."""
    strategy_class(rollout_cfg).validate(rollout_cfg, advantage)


def make_strategy(rollout_cfg: Any, setup: RolloutSetup) -> RolloutStrategy:
    return strategy_class(rollout_cfg).from_config(rollout_cfg, setup)


class OptionStrategy:
    """Base of a strategy whose ``options(rollout_cfg)`` returns its constructor's keyword arguments
    (checked there): ``from_config`` builds it from them, ``validate`` checks them before loading."""

    @classmethod
    def options(cls, rollout_cfg: Any) -> dict:
        raise NotImplementedError

    @classmethod
    def from_config(cls, rollout_cfg: Any, setup: RolloutSetup) -> Any:
        return cls(setup, **cls.options(rollout_cfg))

    @classmethod
    def validate(cls, rollout_cfg: Any, advantage: str) -> None:
        cls.options(rollout_cfg)
