"""VinePPO's rollouts (``rollout=vine``; Kazemnejad et al. 2024, arXiv:2410.01679, section 4): each
response is cut into steps and the value of the state before every step is a Monte-Carlo estimate,
the mean reward of K continuations sampled by the current policy from that state (a language
environment can be reset to any prefix). The values feed the ``vine`` advantage piece
(rlbench/algorithm/advantages/vine.py): A_t = r_t + gamma V^(s_{t+1}) - V^(s_t).

Configuration (``rollout.vine``; conf/rollout/vine.yaml):

    k: 9                # continuations per state (the paper: K = 9)
    boundary: newline   # newline: a step ends after every token whose text holds a newline;
                        # tokens: a step every ``step_tokens`` tokens
    step_tokens: 4      # tokens per step (boundary=tokens)
    max_steps: 8        # at most this many steps per response: more boundaries are thinned to
                        # max_steps - 1 spread evenly over the response (the cost is K per boundary)
    root_value: rollouts  # V^(s_0) of the prompt: K continuations from the prompt (rollouts, the
                          # paper), or the mean reward of the prompt's own rollout.n responses (group)

One step: ``rollout.n`` responses per prompt (one engine call), then one request of K continuations
per distinct state (prompt + response prefix; identical prefixes of one prompt share their
estimate) through ``GroupSampler.generate`` via rlbench.rollout.continuation (the prefix is counted as
reused tokens, only the continuation as generated). Continuations are graded and reward-shaped as the
responses are; they are never trained on. Each response gets the step inputs ``step_index`` and
``step_values`` in ``Completion.extras`` (:func:`token_steps`; rlbench/algorithm/step_inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.continuation import continue_with_budgets
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    needs_groups,
    register_strategy,
    require_advantage_input,
    strategy_options,
)

BOUNDARIES = ("newline", "tokens")
ROOT_VALUES = ("rollouts", "group")
STEP_INPUT = "step_values"


@dataclass(frozen=True)
class VineOptions:
    """The ``rollout.vine`` block (module docstring)."""

    k: int = 9
    boundary: str = "newline"
    step_tokens: int = 4
    max_steps: int = 8
    root_value: str = "rollouts"

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "VineOptions":
        options = strategy_options(rollout, "vine", cls).checked("rollout.vine")
        if options.root_value == "group":
            needs_groups("vine", rollout, "with root_value=group estimates the prompt's value from its group")
        return options

    def checked(self, where: str) -> "VineOptions":
        """The options, or a ConfigError naming the block ``where`` they were read from."""
        for key in ("k", "step_tokens", "max_steps"):
            if isinstance(getattr(self, key), bool) or int(getattr(self, key)) < 1:
                raise ConfigError(
                    f"{where}.{key} must be >= 1, got {getattr(self, key)}"
                    + (" (K Monte-Carlo continuations per state; VinePPO uses 9)" if key == "k" else "")
                )
        if self.boundary not in BOUNDARIES:
            raise ConfigError(f"{where}.boundary must be one of {BOUNDARIES}, got {self.boundary!r}")
        if self.root_value not in ROOT_VALUES:
            raise ConfigError(f"{where}.root_value must be one of {ROOT_VALUES}, got {self.root_value!r}")
        return self


def step_starts(response_ids: list[int], options: VineOptions, tokenizer: Any) -> list[int]:
    """The first token of every step of a response: 0, then each boundary before the response's end,
    thinned to ``max_steps`` steps (0 and max_steps - 1 boundaries spread evenly) when there are more."""
    length = len(response_ids)
    if options.boundary == "tokens":
        inner = list(range(options.step_tokens, length, options.step_tokens))
    else:
        inner = [t + 1 for t in range(length - 1) if "\n" in tokenizer.decode([response_ids[t]])]
    wanted = options.max_steps - 1
    if len(inner) > wanted:
        inner = [inner[(k * len(inner)) // wanted] for k in range(wanted)]
    return [0] + inner


def token_steps(starts_and_values: list[tuple[int, float]], length: int) -> tuple[list[int], list[float]]:
    """(the step 0, 1, ... of each of a response's ``length`` tokens, V^ of the state where the token's step
    starts) from each step's (first token, V^ of the state before it); the first step starts at token 0."""
    index: list[int] = []
    values: list[float] = []
    ends = [start for start, _ in starts_and_values[1:]] + [length]
    for step, ((start, value), end) in enumerate(zip(starts_and_values, ends)):
        index += [step] * (end - start)
        values += [value] * (end - start)
    return index, values


@register_strategy("vine")
class VineSampling(RolloutStrategy):
    """``rollout=vine`` (module docstring)."""

    provides = frozenset({"step_index", "step_values"})

    def __init__(self, setup: RolloutSetup, options: VineOptions):
        self.setup, self.options = setup, options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": VineOptions.from_config(rollout)}

    @classmethod
    def validate(cls, rollout: RolloutConfig, advantage: str) -> None:
        """The options, and an advantage that reads the step values."""
        VineOptions.from_config(rollout)
        require_advantage_input(
            advantage, STEP_INPUT,
            "rollout=vine estimates Monte-Carlo values at step boundaries, and advantage '{advantage}' does not read "
            "them (the continuations would be generated for nothing). Add algorithm/advantage=<one of {readers}>, "
            "or use rollout=iid",
        )

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        prompt_ids = sampler.encode(problems)
        graded = sampler(problems, setup.n, setup.params, setup.generator, prompt_ids)
        metrics = monte_carlo_step_values(sampler, graded, prompt_ids, self.options, setup.params, setup.generator)
        return graded, metrics


def monte_carlo_step_values(
    sampler: Any, graded: GradedGroups, prompt_ids: list[list[int]], options: VineOptions, params: Any,
    generator: torch.Generator | None,
) -> dict[str, float]:
    """VinePPO's Monte-Carlo values of the graded responses' steps (module docstring): the responses are cut
    into steps (:func:`step_starts`), each distinct state (prompt + response prefix; identical prefixes of one
    prompt share their estimate) gets ``options.k`` continuations from ``sampler`` (graded by it), and every
    response gets ``step_index`` and ``step_values`` in ``Completion.extras`` (:func:`token_steps`). Returns the
    metrics vine_states, vine_continuations and vine_steps_mean. Also the data of Direct Advantage PO's critic
    (rlbench/training/step_critic.py)."""
    problems = graded.problems
    max_new = params.max_new_tokens
    # the distinct states to estimate: (prompt, response prefix) -> position in the request list
    states: dict[tuple[int, tuple[int, ...]], int] = {}
    starts_of: list[list[int]] = []
    for p, group in enumerate(graded.groups):
        for completion in group:
            starts = step_starts(completion.response_ids, options, sampler.tokenizer)
            starts_of.append(starts)
            for start in starts:
                if start or options.root_value == "rollouts":
                    states.setdefault((p, tuple(completion.response_ids[:start])), len(states))
    requests = [
        (GenerationRequest(prompt_ids[p], n=options.k, prefix_ids=prefix, score_prefix=False), max_new - len(prefix))
        for p, prefix in states
    ]
    continuations = continue_with_budgets(sampler, requests, params, generator)
    owners = [problems[p] for p, _ in states]
    values = torch.zeros(len(states), dtype=torch.float64)
    if states:
        scored = sampler.grade(owners, continuations, max_new)
        values = torch.zeros(len(states), dtype=torch.float64).index_add_(
            0, scored.group_index, scored.rewards.to(torch.float64)
        ) / options.k
    group_means = [float(graded.rewards[graded.group_index == p].to(torch.float64).mean()) for p in range(len(problems))]
    row = 0
    for p, group in enumerate(graded.groups):
        for completion in group:
            steps = [
                (start, group_means[p] if not start and options.root_value == "group"
                 else float(values[states[(p, tuple(completion.response_ids[:start]))]]))
                for start in starts_of[row]
            ]
            index, step_values = token_steps(steps, len(completion.response_ids))
            completion.extras.update(step_index=index, step_values=step_values)
            row += 1
    return {
        "vine_states": float(len(states)),
        "vine_continuations": float(len(states) * options.k),
        "vine_steps_mean": float(sum(len(s) for s in starts_of) / max(len(starts_of), 1)),
    }
