"""``env=python_tool``: a math problem with a Python interpreter (the tool-integrated reasoning of
ReTool, Feng et al. 2025, arXiv:2504.11536, section 3.1: the rollout interleaves the policy's text with
the interpreter's output, which is masked out of the loss).

A turn ends when the policy's text holds a closed ```` ```python ... ``` ```` block. The block runs
once, in the project's code sandbox (rlbench.sandbox: the trusted supervisor and the run's
``sandbox`` limits; model code never runs in the trainer's process), each block in a fresh
interpreter (no state carries between blocks); its standard output, or the error, cut to
``max_output_chars`` characters, comes back as the observation ```` ```output ... ``` ````. A turn
without a code block is the final answer: the run's grader (the math grader) grades it and the
episode ends with its reward, so the reward does not depend on the number of tool calls. A turn that
opens a block and never closes it (the turn's budget ran out) ends the episode: ``unclosed_tool_tag``,
graded as an answer like any other last turn. The state key is the sequence of tool outputs so far.
After the last call ``env.max_tool_calls`` allows, the policy sees its output and may answer; a block past
the cap is not run and ends the episode (``tool_call_cap``, no answer: incorrect).

``run_reward`` r > 0 adds GTPO's optional per-turn signal (Ding et al. 2025, arXiv:2511.14846, section 3: a turn
reward for code that runs): a turn whose block ran without error gets reward r (its ``turn_rewards``, which
``advantage=gtpo_turn`` discounts into the turn returns), and the episode's reward is the sum of its turns' (the
final answer's grade plus r per block that ran); the verdict (``correct``, pass@k) is the grader's alone. 0 (the
default) keeps ReTool's rule, a reward independent of the tool calls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.code import TOOL_BLOCK as CLOSED_BLOCK
from rlbench.reward.math import Grade
from rlbench.rollout.env.base import Environment, Reset, StepResult, output_block, register_env
from rlbench.sandbox import run_tests

OPEN_TAG = "```python"
INSTRUCTIONS = ("\n\nYou may run Python: write a ```python code block``` and its output will be shown. "
                "Put the final answer in \\boxed{}.")


def tool_output(stdout: str, status: str, error: str | None, limit: int) -> tuple[str, bool]:
    """(the observation text of one run, whether it failed): its stdout, or the error after it,
    cut to ``limit`` characters (a cut says so)."""
    failed = status != "passed"
    return output_block(stdout + (f"{error or status}\n" if failed else ""), limit), failed


@register_env("python_tool")
class PythonTool(Environment):
    answers_after_last_call = True

    @dataclass(frozen=True)
    class Options:
        """The ``env.python_tool`` block."""

        max_output_chars: int = 256   # a tool output is cut to this many characters
        run_reward: float = 0.0       # the reward of a turn whose block ran without error (GTPO's per-turn signal)

        def __post_init__(self) -> None:
            if self.max_output_chars < 1:
                raise ConfigError(f"env.python_tool.max_output_chars must be >= 1, got {self.max_output_chars}")
            if not math.isfinite(self.run_reward) or self.run_reward < 0:
                raise ConfigError(f"env.python_tool.run_reward must be a finite number >= 0, got {self.run_reward}")

    def reset(self, problem: Problem) -> Reset:
        self.problem, self.outputs, self.last_grade = problem, (), None
        return Reset(problem.prompt + INSTRUCTIONS, self.outputs)

    def turn_end(self, text: str) -> int | None:
        match = CLOSED_BLOCK.search(text)
        return match.end() if match else None

    def step(self, action_text: str) -> StepResult:
        match = CLOSED_BLOCK.search(action_text)
        if match is None:
            self.last_grade = self.context.grade_text(self.problem, action_text)
            ended_by = "unclosed_tool_tag" if OPEN_TAG in action_text else "answer"
            return StepResult("", self.last_grade.reward, True, self.outputs, ended_by=ended_by)
        cap = self.context.max_tool_calls
        if cap is not None and len(self.outputs) >= cap:  # a call past the cap: not run
            return StepResult("", 0.0, True, self.outputs, ended_by="tool_call_cap")
        result = run_tests(match.group(1), [], self.context.sandbox_limits)
        observation, failed = tool_output(result.stdout, result.status, result.error, self.options.max_output_chars)
        self.outputs = (*self.outputs, observation)
        reward = 0.0 if failed else self.options.run_reward
        return StepResult(observation, reward, False, self.outputs, tool_calls=1, tool_errors=int(failed))

    def grade(self, total_reward: float) -> Grade:
        """The grader's verdict on the final answer, with the episode's reward: the sum of its turns' (the answer's
        reward, plus ``run_reward`` per block that ran); an episode that ended before an answer is incorrect."""
        if self.last_grade is not None:
            return dataclasses.replace(self.last_grade, reward=float(total_reward))
        return Grade(correct=False, extracted=None, reward=float(total_reward), format_ok=False)
