"""``rollout=icl_expert`` (ICPO; Huang et al. 2025, "Think Outside the Policy: In-Context Steered Policy
Optimization", arXiv:2510.26519): one response per prompt sampled with a solved demonstration in the
prompt and trained for the bare prompt (see :class:`InContextExpert`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.engines.base import GenerationRequest
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.guided.hints import first_trace_text
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


def with_demonstration(problem: Problem, demo: Problem, solution: str) -> Problem:
    """The problem preceded by a solved demonstration (another problem and its solution)."""
    return replace(problem, prompt=f"Example problem: {demo.prompt}\nExample solution: {solution}\n\nProblem: {problem.prompt}")


def expert_bonus(step: int, beta: float, horizon: int) -> float:
    """ICPO's annealed bonus of a correct expert response: beta * max(0, 1 - step / horizon)."""
    return beta * max(0.0, 1.0 - step / horizon)


@dataclass(frozen=True)
class ICLExpertOptions:
    """The ``rollout.icl_expert`` block."""

    beta: float = 1.0  # bonus of a correct expert response at step 0 (the authors' code)
    horizon: int = 400  # steps over which the bonus decays linearly to 0 (the authors' code: T = 400)


@register_strategy("icl_expert")
class InContextExpert(RolloutStrategy):
    """ICPO's implicit expert forcing (Huang et al. 2025, "Think Outside the Policy: In-Context Steered
    Policy Optimization", arXiv:2510.26519): per prompt, ``rollout.n - 1`` responses of the policy and
    one "expert" response sampled with a solved demonstration in the prompt (another problem of the
    step with a guidance trace, drawn from the rollout stream) and trained for the bare prompt. The
    expert response is off-policy in every token with behaviour log-prob 0 (mu = 1: ICPO's loss shapes
    pi_theta itself, as LUFFY's; loss ``policy_shaping``). Expert rejection: a wrong expert response is
    dropped and one more response of the policy takes its place, so the group statistics exclude it.
    A correct expert response's reward gets the bonus ``beta * max(0, 1 - t / horizon)`` (t: the
    step, from 0). A prompt with no demonstration available gets ``rollout.n`` policy responses."""

    def __init__(self, setup: RolloutSetup, beta: float, horizon: int):
        self.setup, self.beta, self.horizon = setup, beta, horizon
        self.steps = 0

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict:
        options = strategy_options(rollout, "icl_expert", ICLExpertOptions)
        beta, horizon = options.beta, options.horizon
        if beta < 0 or horizon < 1:
            raise ConfigError(f"rollout.icl_expert needs beta >= 0 and horizon >= 1, got {beta}, {horizon}")
        if int(rollout.n) < 2:
            raise ConfigError("rollout=icl_expert needs rollout.n >= 2: one expert response beside the policy's")
        return {"beta": beta, "horizon": horizon}

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def demonstration(self, position: int, problems: list[Problem]) -> Problem | None:
        """Another problem of the step with a trace, drawn uniformly from the rollout stream."""
        others = [i for i, p in enumerate(problems) if i != position and first_trace_text(self.setup, p)]
        if not others:
            return None
        return problems[others[int(torch.randint(len(others), (), generator=self.setup.generator).item())]]

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler = self.setup, self.setup.sampler
        prompt_ids = sampler.encode(problems)
        demos = [self.demonstration(i, problems) for i in range(len(problems))]
        with_expert = [i for i, demo in enumerate(demos) if demo is not None]
        requests = [GenerationRequest(ids, n=setup.n - (demo is not None)) for ids, demo in zip(prompt_ids, demos)]
        groups = [list(group) for group in sampler.generate(requests, setup.params, setup.generator)]
        if with_expert:
            forced = [with_demonstration(problems[i], demos[i], first_trace_text(setup, demos[i])) for i in with_expert]
            expert_requests = [GenerationRequest(ids, n=1) for ids in sampler.encode(forced)]
            experts = sampler.generate(expert_requests, setup.params, setup.generator)
            expert_grades = sampler.grade([problems[i] for i in with_expert], experts, setup.params.max_new_tokens)
            rejected = []
            for i, (group, grade) in zip(with_expert, zip(experts, expert_grades.grades)):
                c = group[0]
                if grade.correct:
                    r = len(c.response_ids)
                    groups[i].append(replace(c, prompt_ids=prompt_ids[i], behaviour="expert", off_policy=[1] * r,
                                             behaviour_logprobs=[0.0] * r))
                else:
                    rejected.append(i)
            if rejected:  # expert rejection: one more response of the policy instead
                extra = sampler.generate([GenerationRequest(prompt_ids[i], n=1) for i in rejected], setup.params, setup.generator)
                for i, group in zip(rejected, extra):
                    groups[i].extend(group)
        graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        expert = torch.tensor([c.behaviour == "expert" for group in groups for c in group])
        bonus = expert_bonus(self.steps, self.beta, self.horizon)
        graded.rewards = graded.rewards + bonus * expert.to(graded.rewards.dtype)
        self.steps += 1
        metrics = {
            "expert_responses": float(expert.sum().item()),
            "experts_rejected": float(len(with_expert) - int(expert.sum().item())),
            "expert_bonus": bonus,
            "rollout_outcome_mean": float(graded.outcome[~expert].mean().item()),  # the policy's own responses
        }
        return graded, metrics
