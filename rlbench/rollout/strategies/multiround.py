"""MOTIF multi-round thinking (``rollout=multiround``; Mitra & Ulukus 2025, "MOTIF: Modular Thinking via
Reinforcement Fine-tuning in LLMs", arXiv:2507.02851): the model reasons over several rounds, each
round's prompt carrying the previous round's progress; the reward of a first-round response is the
expected outcome of the rounds that follow it, and only first-round tokens are trained.

Per prompt, the group is n first-round responses y_1 (the dataset's prompt). For each y_1,
``continuations`` trajectories run the remaining ``rounds - 1`` rounds: round k's prompt is the problem
followed by ``Progress in round k-1: <previous round's progress>`` (inside the dataset's template, where
the problem text goes; the progress is the answer part of a ``<reasoning>``/``<answer>`` response, as the
released code hands it on, and a response without ``<answer>`` whole, stripped:
rlbench.reward.xml_format.answer_tag_content), and the last round's adds ``Current round is the final round. Provide a final
answer.``; one sample per round. With c(.) the grader's verdict on the last round (correct: 1, else 0),
the reward of y_1 is

    R(y_1) = 2 * mean over its trajectories of c(y_final)

the expected final-round accuracy (the released code's 2.0 for a correct boxed final answer; its 1.0
for a final response that holds the answer outside its answer tags is a format credit rlbench's graders
do not separate). This score takes the place of the grader's term in the reward composition
(``reward.terms``): the first round gets no credit for its own answer, only for the progress it hands on,
and the other terms of y_1 are added with their weights,

    r(y_1) = R(y_1) + sum over the terms t other than the grader of w_t * t(y_1)

(MOTIF's format rewards: reward=xml_format, rlbench.reward.xml_format). The algorithm's reward shaping then
applies; the composed reward of y_1 itself stays the step's ``outcome``. The later rounds' responses are
generated (counted in ``generated_tokens``) but never trained.

No state between steps. Configuration (conf/rollout/multiround.yaml):

    strategy: multiround
    multiround:
      rounds: 3            # rounds per trajectory (the first is the trained one)
      continuations: 4     # trajectories per first-round response (MOTIF's traj_num)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward import grade_completions
from rlbench.reward.xml_format import answer_tag_content
from rlbench.rollout.engines.base import Completion, GenerationRequest
from rlbench.rollout.groups import GradedGroups, shaping_inputs
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)


@dataclasses.dataclass(frozen=True)
class MultiroundOptions:
    """The ``rollout.multiround`` block."""

    rounds: int = 3
    continuations: int = 4

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> "MultiroundOptions":
        options = strategy_options(rollout, "multiround", cls)
        if options.rounds < 2:
            raise ConfigError(f"rollout.multiround.rounds must be >= 2 (the first round is trained, later ones score it), "
                              f"got {options.rounds}; use rollout=iid for one round")
        if options.continuations < 1:
            raise ConfigError(f"rollout.multiround.continuations must be >= 1, got {options.continuations}")
        return options


FINAL_ROUND_NOTE = " Current round is the final round. Provide a final answer."


def round_problem(problem: Problem, round_number: int, response: str, final: bool) -> Problem:
    """The problem of round ``round_number + 1``: its text followed by the progress of ``round_number``,
    the answer part of that round's ``response`` (and, in the last round, the note that it is the last)."""
    note = FINAL_ROUND_NOTE if final else ""
    progress = answer_tag_content(response)
    return dataclasses.replace(problem, prompt=f"{problem.prompt}\n\nProgress in round {round_number}: {progress}{note}")


def motif_reward(final_correct: torch.Tensor, continuations: int) -> torch.Tensor:
    """R(y_1) = 2 * the mean final-round verdict of y_1's ``continuations`` trajectories (consecutive)."""
    return 2.0 * final_correct.float().view(-1, continuations).mean(-1)


@register_strategy("multiround")
class MultiroundRollout(RolloutStrategy):
    """MOTIF (arXiv:2507.02851): first-round responses rewarded by the expected outcome of the later
    rounds that continue from their progress; only first-round tokens are trained."""

    def __init__(self, setup: RolloutSetup, options: MultiroundOptions):
        self.setup, self.options = setup, options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        return {"options": MultiroundOptions.from_config(rollout)}

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler, options = self.setup, self.setup.sampler, self.options
        first = setup.sample(problems)  # round 1: the trained group, graded and shaped
        # trajectories: (problem of the group, the round's response), `continuations` per first-round response
        trajectories = [(problem, c) for problem, group in zip(first.problems, first.groups) for c in group
                        for _ in range(options.continuations)]
        for round_number in range(1, options.rounds):
            final = round_number == options.rounds - 1
            round_problems = [round_problem(p, round_number, c.text, final) for p, c in trajectories]
            requests = [GenerationRequest(ids) for ids in sampler.encode(round_problems)]
            responses = sampler.generate(requests, setup.params, setup.generator)
            trajectories = [(p, r[0]) for (p, _), r in zip(trajectories, responses)]
        last: list[Completion] = [c for _, c in trajectories]
        final_correct = torch.tensor([float(g.correct) for g in grade_completions(sampler.grader, [p for p, _ in trajectories], last)])
        # the composed terms of y_1 less the grader's (a weighted sum; exactly 0 with the default {grader: 1})
        grader_weight = sampler.compose.weights.get("grader", 0.0)
        own_terms = first.outcome - grader_weight * torch.tensor([g.reward for g in first.grades], dtype=torch.float32)
        reward = motif_reward(final_correct, options.continuations) + own_terms
        inputs = shaping_inputs(first.problems, first.groups, first.grades, setup.params.max_new_tokens, sampler.tokenizer)
        first.rewards = sampler.shape_rewards(reward, inputs).to(torch.float32)
        return first, {
            "multiround_final_accuracy": float(final_correct.mean()),
            "multiround_first_accuracy": float(first.correct.mean()),
        }
