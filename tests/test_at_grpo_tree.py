"""AT-GRPO's greedy tree rollout (arXiv:2510.11062, section 3; rollout.multi_turn.branch=greedy_tree) with a scripted
environment and a scripted engine: every turn K candidates fork from the tree's current episode, the best (highest turn
reward, ties to the first) advances all copies; each turn's candidates are a group (the key (prompt, turn, role))."""

from __future__ import annotations

import math

import pytest
import torch
from test_env_multi_turn import Factory, Scripted, ScriptedEngine, Tokens

from rlbench.algorithm.advantages.at_grpo import at_grpo_advantage
from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.dataset.base import Problem
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.env import StepResult
from rlbench.rollout.env.base import state_id
from rlbench.rollout.strategies.multi_turn import MultiTurnOptions, MultiTurnRollout, greedy_best
from rlbench.training.batch import collate


class Scored(Scripted):
    """A turn "<word>=<reward>" pays <reward> and moves to state <word>; "win" ends the episode with reward 1."""

    def step(self, action_text):
        word = action_text.strip()
        if word == "win":
            return StepResult("", 1.0, True, "goal", ended_by="goal")
        name, _, reward = word.partition("=")
        return StepResult("ok\n", float(reward or 0.0), False, name)


def tree(script, n, branch="greedy_tree", max_turns=3, problems=("x",)):
    sampler = GroupSampler(ScriptedEngine(script), None, Tokens(), {"user": "{problem}"}, lambda rewards, inputs: rewards)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 16), None, env=Factory(Scored, max_turns=max_turns))
    groups, metrics = MultiTurnRollout(setup, MultiTurnOptions(branch=branch)).rollout(
        [Problem(str(i), p, "0") for i, p in enumerate(problems)])
    return groups, metrics, sampler.engine


def trained(c):
    return "".join(chr(t) for t, m in zip(c.response_ids, c.loss_mask) if m)


SCRIPT = [["a=0\n", "b=1\n", "c=1\n"],   # turn 0: b and c tie at 1 -> b (the first) advances
          ["d=0\n", "e=0\n", "f=2\n"],   # turn 1: f advances
          ["g=1\n", "h=3\n", "i=0\n"]]   # turn 2: the cap (max_turns 3) ends every candidate


def test_the_best_candidate_is_every_next_candidates_prefix_and_ties_go_to_the_first():
    groups, metrics, engine = tree(SCRIPT, 3)
    assert [len(g) for g in groups.groups] == [3, 3, 3]  # K x turns
    turn0, turn1, turn2 = groups.groups
    b, f = turn0[1], turn1[2]
    assert b.response_ids == [ord(ch) for ch in "b=1\nok\n"]
    for c in turn1:  # every turn-1 candidate continues from b exactly: its tokens, then its own turn
        assert c.response_ids[:len(b.response_ids)] == b.response_ids
        assert c.logprobs[:len(b.response_ids)] == b.logprobs
    for c in turn2:
        assert c.response_ids[:len(f.response_ids)] == f.response_ids
    assert [trained(c) for c in turn2] == ["g=1\n", "h=3\n", "i=0\n"]  # the history is context (loss mask 0)
    assert turn2[0].text == "b=1\nok\nf=2\nok\ng=1\n"
    # one engine call a turn, all candidates continuing the same prefix
    assert [len(call) for call in engine.calls] == [3, 3, 3]
    assert {prefix for _, prefix, _ in engine.calls[2]} == {tuple(f.response_ids)}
    # each turn's candidates share a state id: the state their turn acted in
    for turn, state in zip(groups.groups, ("start", "b", "f")):
        for c in turn:
            assert {s for s, m in zip(c.extras["turn_states"], c.loss_mask) if m} == {state_id(state)}
    # a candidate's reward is its turn's
    assert groups.outcome.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 2.0, 1.0, 3.0, 0.0]
    assert [p.uid for p in groups.problems] == ["0", "0", "0"]
    assert metrics["multi_turn_tree_turns"] == 3 and metrics["multi_turn_tree_ties"] == 1
    assert metrics["multi_turn_ended_turn_cap"] == 3 and metrics["multi_turn_ended_tree_turn"] == 6


def test_greedy_best_ties():
    assert greedy_best([0.0, 1.0, 1.0]) == 1 and greedy_best([2.0, 2.0]) == 0 and greedy_best([-1.0, 0.5]) == 1


def test_advantages_are_each_keys_normalisation():
    groups, _, _ = tree(SCRIPT, 3)
    batch = collate(groups.groups, pad_token_id=0)
    adv = at_grpo_advantage(groups.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                            batch.extras["turn_rewards"], num_roles=1, epsilon=0.0)
    by_hand = []
    for rewards in ([0.0, 1.0, 1.0], [0.0, 0.0, 2.0], [1.0, 3.0, 0.0]):  # mean, unbiased std, per key
        mean = sum(rewards) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 2)
        by_hand += [(r - mean) / std for r in rewards]
    for row, c in enumerate(c for g in groups.groups for c in g):
        mask = batch.response_mask[row] > 0
        assert int(mask.sum()) == len(trained(c))
        assert torch.allclose(adv[row][mask], torch.full((int(mask.sum()),), by_hand[row], dtype=adv.dtype))
        assert torch.all(adv[row][~mask] == 0)


def test_an_episode_that_ends_stops_its_tree():
    # turn 1: the best candidate wins (done): no turn 2 for this prompt; the other prompt goes on to its cap
    script = [["a=0\n", "b=1\n", "p=0\n", "q=0\n"],
              ["c=0\n", "win\n", "r=1\n", "s=0\n"],
              ["t=0\n", "u=0\n"]]
    groups, metrics, engine = tree(script, 2, problems=("x", "y"))
    assert [p.uid for p in groups.problems] == ["0", "0", "1", "1", "1"]
    assert [len(call) for call in engine.calls] == [4, 4, 2] and not engine.script
    assert groups.groups[1][1].text == "b=1\nok\nwin\n" and groups.groups[1][1].finished
    assert metrics["multi_turn_tree_turns"] == 2.5 and metrics["multi_turn_ended_goal"] == 1


def test_one_agent_one_turn_is_plain_multi_turn_and_grpo_exactly():
    script = [["a=0\n", "b=1\n", "c=0.5\n", "win\n"]]
    plain, _, _ = tree([list(s) for s in script], 4, branch="none", max_turns=1)
    greedy, _, _ = tree([list(s) for s in script], 4, max_turns=1)
    assert [c.response_ids for c in greedy.groups[0]] == [c.response_ids for c in plain.groups[0]]
    assert [c.loss_mask for c in greedy.groups[0]] == [c.loss_mask for c in plain.groups[0]]
    assert [c.extras for c in greedy.groups[0]] == [c.extras for c in plain.groups[0]]
    assert torch.equal(greedy.rewards, plain.rewards)
    batch = collate(greedy.groups, pad_token_id=0)
    got = at_grpo_advantage(greedy.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                            batch.extras["turn_rewards"], num_roles=1)
    plain_batch = collate(plain.groups, pad_token_id=0)
    want = grpo_advantage(plain.rewards, plain_batch.group_index, plain_batch.response_mask)
    assert torch.equal(got, want.to(got.dtype))


def test_one_candidate_is_refused():
    from rlbench.config.schema import RolloutConfig
    from rlbench.errors import ConfigError
    with pytest.raises(ConfigError, match="greedy_tree"):
        MultiTurnOptions.from_config(RolloutConfig(strategy="multi_turn", n=1, settings={"multi_turn": {"branch": "greedy_tree"}}))


def test_two_roles_on_proposer_verifier():
    # turn 0 (proposer): 41, 42, 42 -> the first right proposal advances; turn 1 (verifier): ACCEPT of it ends the tree
    from test_env_proposer_verifier import PROBLEM, factory

    from rlbench.reward.math import MathReward
    script = [["\\boxed{41}", "\\boxed{42}", "\\boxed{42}"], ["ACCEPT", "REJECT", "ACCEPT"]]
    sampler = GroupSampler(ScriptedEngine(script), MathReward(), Tokens(), {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 64), None, env=factory(2))
    groups, metrics = MultiTurnRollout(setup, MultiTurnOptions(branch="greedy_tree")).rollout([PROBLEM])
    proposals, verdicts = groups.groups
    best = proposals[1]
    assert all(c.response_ids[:len(best.response_ids)] == best.response_ids for c in verdicts)
    assert [trained(c) for c in verdicts] == ["ACCEPT", "REJECT", "ACCEPT"]
    assert groups.outcome.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert metrics["multi_turn_tree_turns"] == 2 and metrics["multi_turn_ended_accepted"] == 2
    batch = collate(groups.groups, pad_token_id=0)
    adv = at_grpo_advantage(groups.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                            batch.extras["turn_rewards"], num_roles=2, epsilon=0.0)
    third, std = 1 / 3, math.sqrt(1 / 3)  # both keys: rewards {0, 1, 1} in some order: mean 2/3, unbiased std sqrt(1/3)
    want = [-2 * third / std, third / std, third / std, third / std, -2 * third / std, third / std]
    for row, a in enumerate(want):
        mask = batch.response_mask[row] > 0
        assert torch.allclose(adv[row][mask], torch.full((int(mask.sum()),), a, dtype=adv.dtype))
    # the team reward (the last proposal right) on the tree: a proposer candidate's is its own proposal's verdict
    # (its local reward again), a verifier candidate's the shared proposal's (one value in the key), so with
    # epsilon 0 the mixing r_local + alpha r_team leaves every key's normalisation as it was
    assert groups.correct.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    mixed = at_grpo_advantage(groups.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                              batch.extras["turn_rewards"], correct=groups.correct, num_roles=2, alpha=1.0, epsilon=0.0)
    assert torch.allclose(mixed, adv, atol=1e-12)
