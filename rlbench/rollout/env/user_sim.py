"""``env=user_sim``: a scripted user holding a multi-turn arithmetic dialogue, the verifiable stand-in for
REFUEL's simulated user (Gao et al. 2024, arXiv:2410.04612, section 5, where Llama-3.1-70B-it plays the
user). No second model: the user's lines are a script drawn from the problem.

Turn 1 asks ``What is a + b?``; each later turn says ``Now add c.`` or ``Now subtract c.``, applied to the
previous turn's TRUE result (the running total of the script, not the policy's answer). The reward of a
turn is ``turn_reward`` when the math grader (rlbench.reward.math.MathReward with its defaults: a boxed
answer, an answer phrase or the last number; whatever ``reward=`` the run trains with, since the dialogue is
arithmetic) finds that turn's true result in the turn's text, else 0. By default the user does not say
the true result back (``reveal: false``), so a wrong answer leaves the policy without the number the next
turn builds on: an early mistake costs later turns too, which is what makes REFUEL's future return
``Q = sum_{k >= h} r_k`` differ from the turn's own reward. With ``reveal: true`` the user's next line
starts with the true result, and the turns are independent problems.

The dialogue lasts ``env.max_turns`` turns (H; read from the context, so the episode's turn cap and the
dialogue's length are one setting, and REFUEL's branch turn drawn from 1..env.max_turns is always a turn of
the dialogue). The numbers come from a generator seeded with the CRC-32 of the problem's uid, so any
dataset serves as a list of dialogues (dataset=arith by default; the problem's text is not used) and the
same problem gives the same dialogue in every run. A turn ends at a newline or at the policy's EOS (the
end of a chat turn; ``eos_ends_episode`` is false). The state key is (turn, true result so far).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.math import Grade, MathReward
from rlbench.rollout.env.base import (
    EnvContext,
    Environment,
    Reset,
    StepResult,
    register_env,
)

INTRO = "Answer each question with the number only.\n"
#: the user's grader of every turn: the math grader with its defaults (module docstring)
MATH = EnvContext(grader=MathReward())


@register_env("user_sim")
class UserSim(Environment):
    @dataclass(frozen=True)
    class Options:
        """The ``env.user_sim`` block."""

        max_operand: int = 9        # a, b and each later c are drawn from 0..max_operand
        turn_reward: float = 1.0    # the reward of a turn whose answer is the true result
        reveal: bool = False        # the user's next line starts with the true result of the turn before

        def __post_init__(self) -> None:
            if self.max_operand < 1:
                raise ConfigError(f"env.user_sim.max_operand must be >= 1, got {self.max_operand}")
            if not self.turn_reward > 0:
                raise ConfigError(f"env.user_sim.turn_reward must be > 0, got {self.turn_reward}")

    stop_markers = ("\n",)
    eos_ends_episode = False

    @property
    def turns(self) -> int:
        """The dialogue's length H: the episode's turn cap, env.max_turns."""
        if self.context.max_turns is None:
            raise ValueError("user_sim's dialogue length is env.max_turns; build it through EnvFactory")
        return self.context.max_turns

    def script(self, problem: Problem) -> list[tuple[str, int]]:
        """The dialogue of ``problem``: per turn, the user's question and its true result."""
        rng = random.Random(zlib.crc32(problem.uid.encode()))
        top = self.options.max_operand
        a, b = rng.randint(0, top), rng.randint(0, top)
        lines, total = [(f"What is {a} + {b}?", a + b)], a + b
        for _ in range(self.turns - 1):
            c = rng.randint(0, top)
            if rng.random() < 0.5:
                total += c
                lines.append((f"Now add {c}.", total))
            else:
                total -= c
                lines.append((f"Now subtract {c}.", total))
        return lines

    def reset(self, problem: Problem) -> Reset:
        self.problem, self.lines, self.turn = problem, self.script(problem), 0
        return Reset(INTRO + self.lines[0][0], (0, None))

    def step(self, action_text: str) -> StepResult:
        question, truth = self.lines[self.turn]
        assert self.problem is not None
        verdict = MATH.grade_text(Problem(self.problem.uid, question, str(truth)), action_text)
        reward = float(self.options.turn_reward) if verdict.correct else 0.0
        self.turn += 1
        state = (self.turn, truth)
        if self.turn >= len(self.lines):
            return StepResult("", reward, True, state, ended_by="dialogue_end")
        said = f"It is {truth}. " if self.options.reveal else ""
        return StepResult(f"\n{said}{self.lines[self.turn][0]}\n", reward, False, state)

    def grade(self, total_reward: float) -> Grade:
        """Correct when every turn of the dialogue was answered right."""
        full = self.turns * float(self.options.turn_reward)
        return Grade(correct=total_reward >= full, extracted=None, reward=float(total_reward), format_ok=True)
