"""``env=gridworld``: a small text grid. The policy moves an agent (``A``) towards a goal (``G``)
one word a turn (``up``, ``down``, ``left``, ``right``; the first of them in the turn's text; with
``moves: initials`` the first of the letters u, d, l, r, which a tiny model's random text holds);
reward ``goal_reward`` when it reaches the goal, 0 otherwise. A turn that names no move, or walks
into the border, leaves the agent where it is, so states recur within and across the episodes of a
group: the anchor states GiGPO (arXiv:2505.10978, section 3.2) groups steps by.

The layout comes from the problem: the start and the goal are drawn from a generator seeded with
the CRC-32 of the problem's uid, so any dataset serves as a list of layouts (dataset=arith by
default); the problem's text is not used. The state key is the agent's cell. Each turn ends at a
newline (``stop_markers``). Observations draw the grid, one row a line, ``.`` for a free cell.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.rollout.env.base import Environment, Reset, StepResult, register_env

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def first_move(text: str, initials: bool = False) -> str | None:
    """The first move word in ``text`` (case-insensitive), None when it names none; ``initials``: the
    first of the letters u, d, l, r instead (for a tiny model that cannot spell the words)."""
    lowered = text.lower()
    found = [(lowered.index(word[0] if initials else word), word) for word in MOVES if (word[0] if initials else word) in lowered]
    return min(found)[1] if found else None


@register_env("gridworld")
class GridWorld(Environment):
    @dataclass(frozen=True)
    class Options:
        """The ``env.gridworld`` block."""

        size: int = 3               # the grid is size x size cells
        goal_reward: float = 1.0    # the reward of the move that reaches the goal
        moves: str = "words"        # words: up/down/left/right | initials: the first of the letters u/d/l/r


        def __post_init__(self) -> None:
            if self.size < 2:
                raise ConfigError(f"env.gridworld.size must be >= 2, got {self.size}")
            if self.moves not in ("words", "initials"):
                raise ConfigError(f"env.gridworld.moves must be words or initials, got {self.moves!r}")

    stop_markers = ("\n",)

    def layout(self, problem: Problem) -> tuple[tuple[int, int], tuple[int, int]]:
        """(start, goal): two distinct cells drawn from the problem's uid."""
        size = self.options.size
        rng = random.Random(zlib.crc32(problem.uid.encode()))
        start, goal = rng.sample(range(size * size), 2)
        return divmod(start, size), divmod(goal, size)

    def draw(self) -> str:
        size = self.options.size
        rows = []
        for r in range(size):
            rows.append("".join("A" if (r, c) == self.agent else "G" if (r, c) == self.goal else "." for c in range(size)))
        return "\n".join(rows) + "\n"

    def reset(self, problem: Problem) -> Reset:
        self.problem = problem
        self.agent, self.goal = self.layout(problem)
        intro = "Move A to G. Answer with one move per line: up, down, left or right.\n"
        return Reset(intro + self.draw(), self.agent)

    def step(self, action_text: str) -> StepResult:
        move = first_move(action_text, self.options.moves == "initials")
        if move is not None:
            dr, dc = MOVES[move]
            r, c = self.agent[0] + dr, self.agent[1] + dc
            if 0 <= r < self.options.size and 0 <= c < self.options.size:
                self.agent = (r, c)
        if self.agent == self.goal:
            return StepResult("", float(self.options.goal_reward), True, self.agent, ended_by="goal")
        return StepResult(self.draw(), 0.0, False, self.agent)
