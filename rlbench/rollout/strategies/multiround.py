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
answer.``; one sample per round. Each trajectory j of y_1 is scored on its last round's response y_j as the
released code scores it,

    s_j = 2   when the grader finds the reference in y_j (in its answer part under reward=xml_format),
          1   else when the last \\boxed{} answer of y_j outside its answer part is the reference
              (rlbench.reward.xml_format.outside_answer_part: a boxed answer outside the answer tags),
          0   otherwise,

and the reward of y_1 is their mean, the expected final-round score

    R(y_1) = mean over y_1's trajectories of s_j.

This score takes the place of the grader's term in the reward composition
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
from rlbench.reward.xml_format import answer_tag_content, outside_answer_part
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


def motif_reward(final_correct: torch.Tensor, boxed_outside: torch.Tensor, continuations: int) -> torch.Tensor:
    """R(y_1) = the mean of s_j = 2 [final answer right] or else 1 [boxed answer outside the answer part right]
    over y_1's ``continuations`` trajectories (consecutive)."""
    scores = torch.where(final_correct.bool(), 2.0, boxed_outside.float())
    return scores.view(-1, continuations).mean(-1)


def boxed_outside_correct(grader: Any, problems: list[Problem], last: list[Completion], final_correct: torch.Tensor) -> torch.Tensor:
    """1 for each last-round response graded wrong whose text outside its answer part holds the reference as its
    last ``\\boxed{}`` answer (read by ``grader``: a Grade whose extraction is ``boxed``), else 0."""
    outside = [outside_answer_part(c.text) for c in last]
    todo = [i for i, (text, right) in enumerate(zip(outside, final_correct.tolist())) if not right and "\\boxed" in text]
    grades = grade_completions(grader, [problems[i] for i in todo], [dataclasses.replace(last[i], text=outside[i]) for i in todo]) if todo else []
    credit = torch.zeros(len(last))
    for i, g in zip(todo, grades):
        credit[i] = float(g.correct and g.extraction == "boxed")
    return credit


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
        last_problems = [p for p, _ in trajectories]
        final_correct = torch.tensor([float(g.correct) for g in grade_completions(sampler.grader, last_problems, last)])
        boxed_outside = boxed_outside_correct(sampler.grader, last_problems, last, final_correct)
        # the composed terms of y_1 less the grader's (a weighted sum; exactly 0 with the default {grader: 1})
        grader_weight = sampler.compose.weights.get("grader", 0.0)
        own_terms = first.outcome - grader_weight * torch.tensor([g.reward for g in first.grades], dtype=torch.float32)
        reward = motif_reward(final_correct, boxed_outside, options.continuations) + own_terms
        inputs = shaping_inputs(first.problems, first.groups, first.grades, setup.params.max_new_tokens, sampler.tokenizer)
        first.rewards = sampler.shape_rewards(reward, inputs).to(torch.float32)
        return first, {
            "multiround_final_accuracy": float(final_correct.mean()),
            "multiround_boxed_outside": float(boxed_outside.mean()),  # the last rounds given the 1.0 credit
            "multiround_first_accuracy": float(first.correct.mean()),
        }
