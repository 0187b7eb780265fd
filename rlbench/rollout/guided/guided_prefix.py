"""Rollouts that continue a prefix of the guidance trace: G²RPO-A's guided responses (here) and DR-PO's
dataset reset (``rollout=dataset_reset``, rlbench/rollout/guided/dataset_reset.py, which reuses
:func:`prefixed_response` and :func:`trace_body`).

A ground-truth reasoning prefix whose length adapts to the accuracy (``rollout=guided_prefix``;
"G²RPO-A: Guided Group Relative Policy Optimization with Adaptive Guidance",
arXiv:2508.13023): in each group of a prompt that has a guidance trace (``guidance=<source>``), the
first ``guided_per_group`` of the ``rollout.n`` responses start with the first ``length`` tokens of the
trace (the engine continues from ``prefix_ids``; rlbench/rollout/engines/base.py), the others are sampled
freely; the advantage is computed over the whole group.

The prefix tokens are not the policy's samples. ``train_prefix: false`` (the default) makes them
context (``loss_mask`` 0, never trained: the continuation is the policy's own sample given the prompt
and the prefix, so it is on-policy); ``train_prefix: true`` trains them as the authors' code does
(T-Lab-CUHKSZ/G2RPO-A, the guidance ids are part of the completion), labelled off-policy with the
sampling policy's own scores of them as behaviour log-probs (what that code's ratio uses), so the loss
pieces see them as off-policy tokens.

The length schedule (:class:`GuidanceLength`, the authors' rule, read in their trainer's
``_compute_new_guidance_length``): in cycles of three steps, the accuracies of the first two are kept and
at the third the step's accuracy a is compared with their mean m: a < m multiplies the length by m / a
(capped at ``max_length``), a > m by m / a (at least 1 token); a or m equal to 0 leaves it unchanged.
The accuracy is the share of the step's responses graded correct, guided ones included (as in the code).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclass(frozen=True)
class GuidedPrefixOptions:
    """The ``rollout.guided_prefix`` block."""

    guided_per_group: int = 2  # responses per group that start with a prefix of the trace (the authors' code: 2)
    initial_length: int = 64  # tokens of the trace at the start
    max_length: int = 64  # the cap of the adaptive length
    train_prefix: bool = False  # false: the prefix is context (loss_mask 0); true: trained as off-policy tokens


@dataclass
class GuidanceLength:
    """G²RPO-A's guidance length, updated once per step from the step's accuracy (module docstring)."""

    length: int
    max_length: int
    step: int = 0
    history: list[float] = field(default_factory=list)

    def update(self, accuracy: float) -> int:
        """Record the step's accuracy; returns the length for the next step."""
        self.step += 1
        position = (self.step - 1) % 3
        if position == 0:
            self.history = [accuracy]
        elif position == 1:
            self.history.append(accuracy)
        else:
            if len(self.history) == 2:
                mean = sum(self.history) / 2.0
                if accuracy > 0 and mean > 0 and accuracy != mean:
                    scaled = self.length * mean / accuracy
                    self.length = int(min(scaled, self.max_length)) if accuracy < mean else max(int(scaled), 1)
            self.history = [accuracy]
        return self.length

    def state_dict(self) -> dict:
        return {"length": self.length, "step": self.step, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.length, self.step, self.history = int(state["length"]), int(state["step"]), list(state["history"])


def options(rollout: RolloutConfig) -> dict:
    settings = dataclasses.asdict(strategy_options(rollout, "guided_prefix", GuidedPrefixOptions))
    n = int(rollout.n)
    if not 1 <= settings["guided_per_group"] < n:
        raise ConfigError(
            f"rollout.guided_prefix.guided_per_group={settings['guided_per_group']} must be at least 1 and below "
            f"rollout.n={n}: the group needs unguided responses"
        )
    if not 1 <= settings["initial_length"] <= settings["max_length"]:
        raise ConfigError("rollout.guided_prefix needs 1 <= initial_length <= max_length (tokens of the trace)")
    return settings


@register_strategy("guided_prefix")
class GuidedPrefix(RolloutStrategy):
    def __init__(self, setup: RolloutSetup, guided_per_group: int, initial_length: int, max_length: int, train_prefix: bool):
        self.setup, self.guided, self.train_prefix = setup, guided_per_group, train_prefix
        self.schedule = GuidanceLength(initial_length, max_length)

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        return options(rollout)

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)

    def prefix(self, problem: Problem) -> tuple[int, ...]:
        """The first ``length`` tokens of the problem's trace (its EOS excluded), () without one."""
        return trace_body(self.setup, problem)[: self.schedule.length]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        prompt_ids = sampler.encode(problems)
        prefixes = [self.prefix(p) for p in problems]
        requests = []
        for ids, prefix in zip(prompt_ids, prefixes):
            if prefix:
                requests += [GenerationRequest(ids, n=self.guided, prefix_ids=prefix), GenerationRequest(ids, n=setup.n - self.guided)]
            else:
                requests.append(GenerationRequest(ids, n=setup.n))
        generated = iter(sampler.generate(requests, setup.params, setup.generator))
        groups = []
        for prefix in prefixes:
            if prefix:
                guided, free = next(generated), next(generated)
                groups.append([self.label(c, len(prefix)) for c in guided] + list(free))
            else:
                groups.append(list(next(generated)))
        graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        length = self.schedule.length
        own = [c.behaviour == "policy" for group in groups for c in group]
        metrics = {
            "guidance_length": float(length),
            "groups_guided": float(sum(1 for p in prefixes if p)),
            "rollout_outcome_mean": float(graded.outcome[own].mean().item()),  # the unguided responses
        }
        self.schedule.update(float(graded.correct.mean().item()))
        return graded, metrics

    def label(self, completion: Any, prefix_len: int) -> Any:
        return prefixed_response(completion, prefix_len, trained=self.train_prefix)


def prefixed_response(completion: Any, prefix_len: int, trained: bool = False, behaviour: str = "prefix") -> Any:
    """A response that continues a given prefix: the prefix is context (loss_mask 0), or, ``trained``,
    off-policy tokens whose behaviour log-probs are the sampling policy's own scores of them."""
    r = len(completion.response_ids)
    if trained:
        return replace(
            completion, behaviour=behaviour, off_policy=[1] * prefix_len + [0] * (r - prefix_len),
            behaviour_logprobs=list(completion.logprobs),
        )
    return replace(completion, behaviour=behaviour, loss_mask=[0] * prefix_len + [1] * (r - prefix_len))


def trace_body(setup: RolloutSetup, problem: Problem) -> tuple[int, ...]:
    """The token ids of the problem's first trace without its EOS, () without a trace."""
    library = setup.guidance
    traces = library.for_problem(problem) if library is not None else []
    if not traces:
        return ()
    ids = traces[0].token_ids
    return tuple(ids[:-1] if traces[0].finished else ids)
