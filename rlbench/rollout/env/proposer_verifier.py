"""``env=proposer_verifier``: two roles take turns on a math problem (one shared policy, or with
``model.lora.per_role`` an adapter per role on one frozen base: rlbench/model/lora.py), the two-agent
math workflow of AT-GRPO (Zhao et al. 2025, arXiv:2510.11062, section 3: agents act in a fixed order, each
with its own role reward).

Turn 0 (and every even turn) is the proposer's: it writes a solution with the final answer in
``\\boxed{}``; its turn ends at the closed box (or its token budget). The run's grader (the math grader)
grades the proposal: the proposer's reward is ``correct_reward`` when it is right, else 0. Then the
environment inserts the verifier's prompt as an observation (loss mask 0) with the proposal's answer, and
the verifier (every odd turn) answers ``ACCEPT`` or ``REJECT``; its turn ends at the first of the two. The
verifier's reward is ``correct_reward`` when its verdict is right about the proposal (ACCEPT of a correct
proposal, REJECT of a wrong one), else 0 (no verdict: 0). ACCEPT ends the episode; REJECT hands the turn
back to the proposer for a corrected answer, until ``env.max_turns`` turns (max_turns / 2 proposer-verifier
rounds; the cap reaches the environment as ``EnvContext.max_turns``, one setting for both). Roles follow the turn index, role = turn mod 2, which is what
algorithm=at_grpo's (group, turn, role) key reads with ``num_roles: 2``.

The episode is correct when its last proposal is correct (the team's answer). The state key is (turn,
the last proposal's extracted answer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade
from rlbench.rollout.env.base import Environment, Reset, StepResult, register_env

BOXED = re.compile(r"\\boxed\{[^{}]*\}")
VERDICT = re.compile(r"ACCEPT|REJECT")
PROPOSER = "\n\nYou are the proposer: solve the problem and put the final answer in \\boxed{}."
VERIFIER = "\nVerifier: the proposed answer is {answer}. Is it correct? Reply ACCEPT or REJECT.\n"
RETRY = "\nProposer: the verifier rejected it; give a corrected final answer in \\boxed{}.\n"


@register_env("proposer_verifier")
class ProposerVerifier(Environment):
    @dataclass(frozen=True)
    class Options:
        """The ``env.proposer_verifier`` block."""

        correct_reward: float = 1.0   # a role's turn reward when its proposal / verdict is right

        def __post_init__(self) -> None:
            if not self.correct_reward > 0:
                raise ConfigError(f"env.proposer_verifier.correct_reward must be > 0, got {self.correct_reward}")

    roles = ("proposer", "verifier")

    def reset(self, problem: Problem) -> Reset:
        self.problem, self.turn, self.proposal = problem, 0, None
        return Reset(problem.prompt + PROPOSER, (0, None))

    def role(self) -> str:
        return self.roles[self.turn % len(self.roles)]

    def turn_end(self, text: str) -> int | None:
        match = (BOXED if self.role() == "proposer" else VERDICT).search(text)
        return match.end() if match else None

    def step(self, action_text: str) -> StepResult:
        assert self.problem is not None
        reward_if = float(self.options.correct_reward)
        if self.role() == "proposer":
            self.proposal = self.context.grade_text(self.problem, action_text)
            self.turn += 1
            state = (self.turn, self.proposal.extracted)
            return StepResult(VERIFIER.format(answer=self.proposal.extracted), reward_if * self.proposal.correct,
                              False, state)
        verdicts = VERDICT.findall(action_text)
        verdict = verdicts[0] if verdicts else None
        right = verdict == ("ACCEPT" if self.proposal.correct else "REJECT")
        reward = reward_if if right else 0.0
        self.turn += 1
        state = (self.turn, self.proposal.extracted)
        if verdict == "ACCEPT":
            return StepResult("", reward, True, state, ended_by="accepted")
        if verdict is None:
            return StepResult("", reward, True, state, ended_by="no_verdict")
        if self.context.max_turns is not None and self.turn >= self.context.max_turns:
            return StepResult("", reward, True, state, ended_by="rejected")
        return StepResult(RETRY, reward, False, state)

    def grade(self, total_reward: float) -> Grade:
        """The team's answer: the grader's verdict on the last proposal (none: incorrect)."""
        if self.proposal is not None:
            return Grade(correct=self.proposal.correct, extracted=self.proposal.extracted,
                         reward=float(total_reward), format_ok=self.proposal.format_ok)
        return Grade(correct=False, extracted=None, reward=float(total_reward), format_ok=False)
