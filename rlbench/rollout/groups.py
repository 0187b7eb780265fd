"""Graded groups: what a rollout strategy returns. A group is the responses of one prompt, graded
against the prompt's problem and rewarded with the algorithm's reward shaping; each group carries an
explicit id.

:class:`GroupSampler` is the one way to produce them: encode the prompts, ask the engine for ``n``
responses each, grade them, shape the rewards. Strategies (rlbench.rollout.strategy) decide which
prompts to sample and which groups to keep; advantage inputs that need extra rollouts (ReMax's
greedy baseline, PVPO's reference anchor) call the same sampler.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from rlbench.dataset.base import Problem
from rlbench.prompting import encode_prompts
from rlbench.reward import grade_completions
from rlbench.reward.code import tool_blocks
from rlbench.reward.math import Grade
from rlbench.reward.terms import RewardComposer
from rlbench.rollout.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams


@dataclass
class GradedGroups:
    """Graded responses, grouped per prompt. Per-group fields have one entry per group; per-response
    fields are flat, group after group.

    group_ids [G] the id of each group: unique within a training step, assigned by the strategy in
                  the order the groups were generated (a group keeps its id through selection, so
                  a strategy that drops or regroups responses still names where each came from)
    rewards   [B] the reward after the algorithm's reward shaping (what the advantage sees)
    outcome   [B] the composed reward (``reward.terms``: the grader's alone by default), before shaping
    finished  [B] bool, True when the response ended with EOS
    """

    problems: list[Problem]
    groups: list[list[Completion]]
    grades: list[Grade]
    rewards: torch.Tensor
    outcome: torch.Tensor
    finished: torch.Tensor
    group_ids: list[int]

    @property
    def group_index(self) -> torch.Tensor:
        """[B] long: the position (0..G-1) in this batch of each response's group."""
        sizes = torch.tensor([len(group) for group in self.groups], dtype=torch.long)
        return torch.arange(len(self.groups)).repeat_interleave(sizes)

    @property
    def response_group_ids(self) -> torch.Tensor:
        """[B] long: the group id of each response."""
        return torch.tensor([gid for gid, group in zip(self.group_ids, self.groups) for _ in group], dtype=torch.long)

    @property
    def correct(self) -> torch.Tensor:
        return torch.tensor([float(grade.correct) for grade in self.grades])

    @property
    def uids(self) -> list[str]:
        """The problem uid of every response."""
        return [problem.uid for problem, group in zip(self.problems, self.groups) for _ in group]

    def with_group_ids(self, first_id: int) -> "GradedGroups":
        """The same groups numbered first_id, first_id + 1, ... in order."""
        ids = list(range(first_id, first_id + len(self.groups)))
        return GradedGroups(self.problems, self.groups, self.grades, self.rewards, self.outcome, self.finished, ids)

    def select(self, positions: Sequence[int]) -> "GradedGroups":
        """The groups at ``positions`` (0..G-1), in that order, keeping their ids."""
        index = self.group_index
        rows = [row for g in positions for row in (index == g).nonzero(as_tuple=True)[0].tolist()]
        take = torch.tensor(rows, dtype=torch.long)
        return GradedGroups(
            problems=[self.problems[g] for g in positions],
            groups=[self.groups[g] for g in positions],
            grades=[self.grades[row] for row in rows],
            rewards=self.rewards[take],
            outcome=self.outcome[take],
            finished=self.finished[take],
            group_ids=[self.group_ids[g] for g in positions],
        )

    @staticmethod
    def concat(parts: Sequence["GradedGroups"]) -> "GradedGroups":
        return GradedGroups(
            problems=[p for part in parts for p in part.problems],
            groups=[g for part in parts for g in part.groups],
            grades=[g for part in parts for g in part.grades],
            rewards=torch.cat([part.rewards for part in parts]),
            outcome=torch.cat([part.outcome for part in parts]),
            finished=torch.cat([part.finished for part in parts]),
            group_ids=[i for part in parts for i in part.group_ids],
        )


def instructed(problem: Problem, instruction: str | None) -> Problem:
    """``problem`` with ``instruction`` on a line after its text (itself when there is none)."""
    return problem if not instruction else dataclasses.replace(problem, prompt=f"{problem.prompt}\n{instruction}")


def policy_code(text: str) -> str:
    """The closed ```python blocks of ``text`` joined by newlines (the shaping input ``policy_code``)."""
    return "\n".join(tool_blocks(text))


def shaping_inputs(problems: Sequence[Problem], groups: Sequence[Sequence[Completion]], grades: Sequence[Grade],
                   max_length: int, tokenizer: Any) -> dict[str, Any]:
    """What reward-shaping functions may read (the ``shaping`` entries of rlbench.algorithm.step_inputs);
    ``groups[i]`` answers ``problems[i]``."""
    flat = [c for group in groups for c in group]
    sizes = torch.tensor([len(group) for group in groups], dtype=torch.long)
    return {
        "response_lengths": torch.tensor([len(c.response_ids) for c in flat], dtype=torch.long),
        "finished": torch.tensor([c.finished for c in flat], dtype=torch.bool),
        "max_length": max_length,
        "correct": torch.tensor([bool(g.correct) for g in grades], dtype=torch.bool),
        "group_index": torch.arange(len(groups)).repeat_interleave(sizes),
        "response_texts": [c.text for c in flat],
        "response_token_ids": [list(c.response_ids) for c in flat],
        "policy_code": [policy_code(c.text) for c in flat],  # rollout=multi_turn: the policy turns' code only
        "first_tokens": [tokenizer.decode(c.response_ids[:1]) if c.response_ids else "" for c in flat],
        "problem_uids": [problem.uid for problem, group in zip(problems, groups) for _ in group],
    }


@dataclass
class GenerationCost:
    """What generation cost since the last :meth:`take`: tokens the engine generated (sampled, EOS
    included), tokens it was given as response prefixes and only scored (``reused``: a shared tree
    prefix, an accepted draft, a hint), responses and seconds inside the engine. Every engine call
    of a run goes through :class:`GroupSampler`, so the step's cost includes the extra rollouts of
    dynamic sampling, ReMax's greedy baseline and PVPO's anchors."""

    generated_tokens: int = 0
    reused_tokens: int = 0
    responses: int = 0
    seconds: float = 0.0
    reward_metrics: Callable[[], dict[str, float]] | None = None  # the reward composition's (GroupSampler sets it)

    def add(self, groups: Sequence[Sequence[Completion]], seconds: float, shared: int = 0) -> None:
        """Count ``groups``; ``shared``: tokens of their responses decoded once for another response (a
        branch's prefix, its parent's tokens), counted as reused."""
        for group in groups:
            for c in group:
                self.generated_tokens += len(c.response_ids) - c.prefix_len
                self.reused_tokens += c.prefix_len
                self.responses += 1
        self.generated_tokens -= shared
        self.reused_tokens += shared
        self.seconds += seconds

    def take(self) -> dict[str, float]:
        """The counts as step metrics, reset to zero."""
        out = {
            "generated_tokens": float(self.generated_tokens),
            "reused_tokens": float(self.reused_tokens),
            "generated_responses": float(self.responses),
            "engine_s": self.seconds,
            **(self.reward_metrics() if self.reward_metrics is not None else {}),
        }
        self.generated_tokens = self.reused_tokens = self.responses = 0
        self.seconds = 0.0
        return out


@dataclass
class GroupSampler:
    """Prompts -> graded groups: encode each problem's prompt, sample ``n`` responses per prompt, grade
    each against its problem (one batch call for graders that run programs in parallel) and apply the
    reward shaping (``shape_rewards(rewards, inputs)``, i.e. ``Algorithm.shape_rewards``, with
    :func:`shaping_inputs`). Groups are numbered 0..G-1. ``compose``: the reward terms
    (rlbench.reward.terms; ``reward.terms``), by default the grader's reward alone; their metrics and the
    judge's are taken with :attr:`cost`."""

    engine: RolloutEngine
    grader: Any
    tokenizer: Any
    prompt_spec: Mapping[str, Any]
    shape_rewards: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
    cost: GenerationCost = field(default_factory=GenerationCost)
    compose: RewardComposer = field(default_factory=RewardComposer)
    #: a sentence written after each problem's text in its prompt (None: nothing), e.g. INTELLECT-2's length
    #: target (Algorithm.prompt_instruction)
    prompt_instruction: Callable[[Problem], str | None] | None = None

    def __post_init__(self) -> None:
        self.cost.reward_metrics = self.compose.take

    def generate(
        self, requests: Sequence[GenerationRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> list[list[Completion]]:
        """The engine's completions for ``requests``, counted in :attr:`cost` (strategies that build
        their own requests, e.g. with ``prefix_ids``, call this rather than the engine)."""
        start = time.perf_counter()
        groups = self.engine.generate(requests, params, generator=generator)
        self.cost.add(groups, time.perf_counter() - start)
        return groups

    def encode(self, problems: Sequence[Problem]) -> list[tuple[int, ...]]:
        """The prompt token ids of ``problems`` (the dataset's chat template), each problem's text followed
        by its ``prompt_instruction`` when there is one."""
        if self.prompt_instruction is not None:
            problems = [instructed(problem, self.prompt_instruction(problem)) for problem in problems]
        return encode_prompts(self.tokenizer, problems, self.prompt_spec)

    def __call__(
        self,
        problems: Sequence[Problem],
        n: int | Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        prompt_ids: Sequence[tuple[int, ...]] | None = None,
    ) -> GradedGroups:
        """``n`` graded responses per prompt (:meth:`sample`, then :meth:`grade`)."""
        return self.grade(problems, self.sample(problems, n, params, generator, prompt_ids), params.max_new_tokens)

    def sample(
        self,
        problems: Sequence[Problem],
        n: int | Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        prompt_ids: Sequence[tuple[int, ...]] | None = None,
    ) -> list[list[Completion]]:
        """``n`` responses per prompt (one count for all, or one per problem), ungraded; ``prompt_ids``:
        the encoded prompts when the caller has them (else they are encoded here)."""
        if prompt_ids is None:
            prompt_ids = self.encode(problems)
        counts = [n] * len(problems) if isinstance(n, int) else list(n)
        requests = [GenerationRequest(prompt_ids=ids, n=count) for ids, count in zip(prompt_ids, counts)]
        return self.generate(requests, params, generator)

    def grade(self, problems: Sequence[Problem], groups: list[list[Completion]], max_length: int) -> GradedGroups:
        """Grade ``groups`` (``groups[i]`` answers ``problems[i]``, however they were produced: sampled
        now, built by a strategy, replayed from a buffer) and shape their rewards; ``max_length`` is the
        response budget; groups numbered 0..G-1."""
        flat = [c for group in groups for c in group]
        grades = grade_completions(self.grader, [p for p, group in zip(problems, groups) for _ in group], flat)
        return self.shaped(problems, groups, grades, max_length)

    def shaped(self, problems: Sequence[Problem], groups: list[list[Completion]], grades: Sequence[Grade], max_length: int) -> GradedGroups:
        """``groups`` with their ``grades`` given (the grader's, or a file's labels: rollout=offline), the
        reward terms composed (reward.terms: the default is the grade's reward) and shaped; groups numbered 0..G-1."""
        grades = list(grades)
        outcome = self.compose(problems, [[c.text for c in group] for group in groups], grades).to(torch.float32)
        inputs = shaping_inputs(problems, groups, grades, max_length, self.tokenizer)
        rewards = self.shape_rewards(outcome, inputs).to(torch.float32)
        return GradedGroups(list(problems), groups, grades, rewards, outcome, inputs["finished"], list(range(len(groups))))
