"""EDGE-GRPO's Guided Error Correction (``rollout=edge_gec``; Zhang et al. 2025, "EDGE-GRPO: Entropy-Driven
GRPO with Guided Error Correction for Advantage Diversity", arXiv:2507.21848, section 3.3; the authors'
``grpo_aha_trainer.py``): every response scoring below the maximum accuracy + format score of 2 is reflected
on, or given the reference answer or solution.

After the policy's ``rollout.n`` responses per prompt are graded, every response whose score
``accuracy (0/1) + format (0/1)`` is below 2 (:func:`needs_correction`: wrong, or right without the answer
format) is corrected before the group is graded again, so that an all-wrong group gains diversity:

- with probability 1/2, **reflection**: the phrase ``reflection`` (" Wait! Something is wrong here.") is
  appended and the policy continues for at most ``reflection_tokens`` (256) new tokens;
- otherwise, with probability 1/2 each, **answer**: ``answer_template`` with the reference answer
  ("\\nWait! Something is wrong here. After verification, the correct answer is \\\\boxed{...}.") is
  appended, or **solution**: the response is replaced by the problem's guidance trace (the dataset's
  solution, ``guidance=dataset``; a problem without a trace gets the answer branch).

Accuracy is the grader's ``correct``, format its ``format_ok`` (rlbench.reward.math.Grade): for the math
grader a ``\\boxed{}`` answer was found (extraction auto or boxed), as the authors' ``box_format_reward``.

Token bookkeeping: the corrected completion is trained in every token with pi_old recomputed, as in the
authors' code: its tokens are declared the policy's own (``off_policy`` None, label ``gec_<branch>``), so the
training step takes pi_old from its forward pass of the policy before the update (the path of the policy's own
tokens, and of ``rollout.replay.behaviour=recomputed``), and the first update's ratio is 1 on the injected
text too, never pi_theta / 1. The injected tokens' ``logprobs`` are 0 placeholders: no sampler scored them, so
the run refuses ``algorithm.sampling_correction`` and stale (asynchronous) training with this rollout
(rlbench/validation.py), the two readers that would take them for a behaviour probability.
A trailing EOS is dropped before text is appended; the answer branch ends with the EOS token (the
authors re-tokenise the text and stop there), so it counts as finished. The injected text is tokenised
on its own and joined to the response's ids (the authors re-tokenise the joined text).
The branch draws come from the rollout's random stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlbench.config.schema import RolloutConfig
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.guidance.traces import Trace
from rlbench.reward.math import Grade
from rlbench.rollout.continuation import continue_with_budgets
from rlbench.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from rlbench.rollout.groups import GradedGroups
from rlbench.rollout.strategy import (
    RolloutSetup,
    RolloutStrategy,
    register_strategy,
    strategy_options,
)

REFLECTION = " Wait! Something is wrong here."
ANSWER_TEMPLATE = "\nWait! Something is wrong here. After verification, the correct answer is \\boxed{" + "{answer}" + "}."
#: The corrections, in the order of the draws: a first uniform u < 1/2 reflects; otherwise a second < 1/2
#: injects the answer sentence, else the solution.
BRANCHES = ("reflection", "answer", "solution")


@dataclass(frozen=True)
class EdgeGecOptions:
    """The ``rollout.edge_gec`` block."""

    reflection_tokens: int = 256  # new tokens after the reflection phrase (the authors' 256)
    reflection: str = REFLECTION
    answer_template: str = ANSWER_TEMPLATE  # must contain {answer}


def needs_correction(grade: Grade) -> bool:
    """The paper's trigger (arXiv:2507.21848 sec. 3.3; the authors' box_accuracy_reward + box_format_reward):
    accuracy (0/1) + format (0/1) below the maximum 2, i.e. a wrong or a badly formatted response."""
    return float(grade.correct) + float(grade.format_ok) < 2


def correction_branch(generator: torch.Generator | None) -> str:
    """One wrong response's correction: reflection, answer or solution with probabilities 1/2, 1/4, 1/4
    (the authors' two ``random.choice`` draws)."""
    first, second = torch.rand(2, generator=generator).tolist()
    if first < 0.5:
        return "reflection"
    return "answer" if second < 0.5 else "solution"


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _own_tokens(completion: Completion, tokenizer: Any) -> tuple[list[int], list[float]]:
    """The response's tokens and sampling log-probs without a trailing EOS."""
    ids, logprobs = list(completion.response_ids), list(completion.logprobs)
    if ids and ids[-1] == getattr(tokenizer, "eos_token_id", None):
        ids, logprobs = ids[:-1], logprobs[:-1]
    return ids, logprobs


def corrected(
    completion: Completion, own: tuple[list[int], list[float]], injected: list[int], tail: tuple[list[int], list[float]],
    finished: bool, branch: str, tokenizer: Any,
) -> Completion:
    """own tokens + injected tokens + tail, labelled ``gec_<branch>``, all the policy's: pi_old is recomputed on
    every token by the training step (the injected tokens' ``logprobs`` are 0 placeholders, never read as mu)."""
    (ids, logprobs), (tail_ids, tail_logprobs) = own, tail
    response = ids + injected + tail_ids
    return replace(
        completion, response_ids=response, logprobs=logprobs + [0.0] * len(injected) + tail_logprobs, finished=finished,
        text=tokenizer.decode(response), prefix_len=0, behaviour=f"gec_{branch}", off_policy=None, behaviour_logprobs=None,
    )


@register_strategy("edge_gec")
class EdgeGuidedErrorCorrection(RolloutStrategy):
    """EDGE-GRPO's GEC: every response scoring below 2 (wrong or badly formatted) reflected on (then continued), or given the answer or the solution."""

    def __init__(self, setup: RolloutSetup, options: EdgeGecOptions):
        self.setup, self.options = setup, options

    @classmethod
    def config_options(cls, rollout: RolloutConfig) -> dict[str, Any]:
        options = strategy_options(rollout, "edge_gec", EdgeGecOptions)
        if options.reflection_tokens < 1:
            raise ConfigError(f"rollout.edge_gec.reflection_tokens must be >= 1, got {options.reflection_tokens}")
        if "{answer}" not in options.answer_template:
            raise ConfigError("rollout.edge_gec.answer_template must contain {answer}")
        return {"options": options}

    def _solution(self, problem: Problem) -> Trace | None:
        """The problem's first guidance trace (its solution), None without one."""
        traces = self.setup.guidance.for_problem(problem) if self.setup.guidance is not None else []
        return traces[0] if traces else None

    def rollout(
        self, problems: list[Problem], draw_prompts: Callable[[int], list[Problem]] | None = None
    ) -> tuple[GradedGroups, dict[str, float]]:
        setup, sampler, options = self.setup, self.setup.sampler, self.options
        tokenizer = sampler.tokenizer
        graded = setup.sample(problems)
        metrics = {"rollout_outcome_mean": float(graded.outcome.mean().item())}  # the policy's own, before GEC
        groups = [list(group) for group in graded.groups]
        counts = dict.fromkeys(BRANCHES, 0)
        reflections: list[tuple[int, int, tuple[list[int], list[float]], list[int]]] = []
        row = 0
        for g, (problem, group) in enumerate(zip(problems, graded.groups)):
            for k, completion in enumerate(group):
                if needs_correction(graded.grades[row]):
                    branch = correction_branch(setup.generator)
                    solution = self._solution(problem) if branch == "solution" else None
                    branch = "answer" if branch == "solution" and solution is None else branch
                    counts[branch] += 1
                    own = _own_tokens(completion, tokenizer)
                    if branch == "reflection":
                        reflections.append((g, k, own, _text_ids(tokenizer, options.reflection)))
                    elif branch == "answer":
                        sentence = _text_ids(tokenizer, options.answer_template.replace("{answer}", problem.answer))
                        eos = getattr(tokenizer, "eos_token_id", None)
                        groups[g][k] = corrected(completion, own, sentence + ([eos] if eos is not None else []),
                                                 ([], []), True, branch, tokenizer)
                    else:
                        groups[g][k] = corrected(completion, ([], []), list(solution.token_ids), ([], []), solution.finished,
                                                 branch, tokenizer)
                row += 1
        if reflections:
            requests = [(GenerationRequest(prompt_ids=groups[g][k].prompt_ids, prefix_ids=tuple(own[0] + phrase)),
                         options.reflection_tokens) for g, k, own, phrase in reflections]
            params = SamplingParams(setup.params.temperature, setup.params.top_p, options.reflection_tokens)
            for (g, k, own, phrase), (continuation,) in zip(reflections, continue_with_budgets(sampler, requests, params, setup.generator)):
                start = len(own[0]) + len(phrase)
                tail = (list(continuation.response_ids[start:]), list(continuation.logprobs[start:]))
                groups[g][k] = corrected(groups[g][k], own, phrase, tail, continuation.finished, "reflection", tokenizer)
        if any(counts.values()):
            graded = sampler.grade(problems, groups, setup.params.max_new_tokens)
        flat = [c for group in graded.groups for c in group]
        metrics.update({f"gec_{branch}": float(count) for branch, count in counts.items()})
        metrics["gec_correct"] = float(sum(bool(grade.correct) for grade, c in zip(graded.grades, flat) if c.behaviour.startswith("gec_")))
        return graded, metrics
