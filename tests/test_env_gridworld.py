"""env=gridworld (rlbench/rollout/env/gridworld.py): a scripted policy's episodes give the expected
observations, rewards, states and masks, alone and through rollout=multi_turn into GiGPO's advantage."""

from __future__ import annotations

import pytest
import torch
from test_env_multi_turn import Tokens, run

from rlbench.algorithm.advantages.gigpo import gigpo_advantage
from rlbench.config.schema import EnvConfig
from rlbench.dataset.base import Problem
from rlbench.rollout.env import EnvContext, EnvFactory
from rlbench.rollout.env.base import state_id
from rlbench.rollout.env.gridworld import first_move
from rlbench.training.batch import collate

PROBLEM = Problem("a", "ignored", "0")  # its layout: A at (2, 2), G at (1, 1) on the 3 x 3 grid
INTRO = "Move A to G. Answer with one move per line: up, down, left or right.\n"


def factory(max_turns=4, **options):
    return EnvFactory(EnvConfig(name="gridworld", max_turns=max_turns, turn_tokens=8, max_observation_tokens=16,
                                settings={"gridworld": options}), EnvContext())


def test_a_scripted_policy_reaches_the_goal():
    env = factory()()
    start = env.reset(PROBLEM)
    assert start.observation == INTRO + "...\n.G.\n..A\n" and start.state_key == (2, 2)
    bumped = env.step("down\n")  # into the border: nothing moves, the state recurs
    assert (bumped.observation, bumped.reward, bumped.done, bumped.state_key) == ("...\n.G.\n..A\n", 0.0, False, (2, 2))
    idle = env.step("jump\n")  # no move named: the same
    assert idle.state_key == (2, 2) and not idle.done
    up = env.step("Up!\n")
    assert (up.observation, up.reward, up.done, up.state_key) == ("...\n.GA\n...\n", 0.0, False, (1, 2))
    goal = env.step("I go left, then up\n")  # the first move named counts
    assert (goal.reward, goal.done, goal.state_key, goal.ended_by) == (1.0, True, (1, 1), "goal")


def test_moves_by_initials():
    assert first_move("x dz", initials=True) == "down" and first_move("ubu", initials=True) == "up"
    assert first_move("down", initials=False) == "down" and first_move("dz", initials=False) is None
    env = factory(moves="initials", goal_reward=2.0)()
    env.reset(PROBLEM)
    assert env.step("ul\n").state_key == (1, 2) and env.step("la\n").reward == 2.0


def test_layout_comes_from_the_uid():
    env = factory(size=5)()
    env.reset(Problem("seed-1", "", "0"))
    first = (env.agent, env.goal)
    env.reset(Problem("seed-1", "other text", "1"))
    assert (env.agent, env.goal) == first and env.agent != env.goal
    assert all(0 <= v < 5 for cell in first for v in cell)


def test_episodes_through_multi_turn_and_gigpo():
    # two episodes of one layout: the first goes up then left (goal at turn 2), the second bumps into the
    # border (state (2, 2) again), then up, then right-bump: three turns, no goal within max_turns=3
    script = [["up\n", "down\n"], ["left\n", "up\n"], ["right\n"]]
    groups, metrics, _ = run(script, n=2, factory=factory(max_turns=3), problems=(PROBLEM,))
    won, lost = groups.groups[0]
    assert groups.outcome.tolist() == [1.0, 0.0]
    assert won.text == "up\n...\n.GA\n...\nleft\n"
    assert lost.text == "down\n...\n.G.\n..A\nup\n...\n.GA\n...\nright\n"
    assert metrics["multi_turn_ended_goal"] == 1 and metrics["multi_turn_ended_turn_cap"] == 1
    obs = len("...\n.GA\n...\n")
    assert won.loss_mask == [1] * 3 + [0] * obs + [1] * 5
    # anchor states: both start in (2, 2); the lost episode is in (2, 2) again at turn 1 and in (1, 2) at turn 2,
    # where the won episode took its winning turn 1
    s22, s12 = state_id((2, 2)), state_id((1, 2))
    turn_states = [won.extras["turn_states"][i] for i in (0, -1)] + [lost.extras["turn_states"][i] for i in (0, 5 + obs, -1)]
    assert turn_states == [s22, s12, s22, s22, s12]
    batch = collate(groups.groups, pad_token_id=0)
    extras = {name: batch.extras[name] for name in ("step_index", "turn_states", "turn_rewards")}
    adv = gigpo_advantage(groups.rewards, batch.group_index, batch.response_mask, omega=1.0, gamma=0.5, epsilon=0.0, **extras)
    grpo = 2 ** -0.5  # two episodes, rewards 1 and 0: +-1/sqrt(2)
    # anchor (2, 2): won turn 0 (return 0.5), lost turns 0 and 1 (returns 0): mean 1/6, std sqrt(1/12)
    a22 = torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)
    a22 = ((a22 - a22.mean()) / a22.std()).tolist()
    # anchor (1, 2): won turn 1 (return 1) and lost turn 2 (return 0): +-1/sqrt(2)
    assert adv[0, 0].item() == pytest.approx(grpo + a22[0], rel=1e-5)
    assert adv[0, len(won.response_ids) - 1].item() == pytest.approx(grpo + 2 ** -0.5, rel=1e-5)
    assert adv[1, 0].item() == pytest.approx(-grpo + a22[1], rel=1e-5)
    assert adv[1, len(lost.response_ids) - 1].item() == pytest.approx(-grpo - 2 ** -0.5, rel=1e-5)
    assert (adv[batch.response_mask == 0] == 0).all()
    assert Tokens().decode(won.response_ids) == won.text
