"""GTPO multi-turn (Ding et al. 2025, arXiv:2511.14846, section 3; conf/algorithm/gtpo_turn.yaml): the turn
advantage (discounted returns normalised within the group) and the code-similarity reward shaping, by hand,
against GRPO, and through rollout=multi_turn on env=python_tool with a scripted policy."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_config
from test_env_multi_turn import ScriptedEngine, Tokens
from test_env_python_tool import CODE, PROBLEM, factory, sandbox_runs  # noqa: F401  (sandbox_runs: a fixture)

from rlbench.algorithm.advantages.group_relative import grpo_advantage
from rlbench.algorithm.advantages.gtpo_turn import gtpo_turn_advantage
from rlbench.algorithm.shaping import apply_shaping, check_shapers, gtpo_code_similarity
from rlbench.errors import ConfigError
from rlbench.reward.math import MathReward
from rlbench.rollout import GroupSampler, RolloutSetup
from rlbench.rollout.engines.base import SamplingParams
from rlbench.rollout.groups import policy_code
from rlbench.rollout.strategies.multi_turn import MultiTurnRollout
from rlbench.training.batch import collate
from rlbench.validation import validate_config


def turns_batch(turn_rewards: list[list[float]], obs: int = 1):
    """One row per episode: each turn one token, then ``obs`` observation tokens (step_index -1, mask 0)
    between turns; padding to the longest row."""
    rows = []
    for rewards in turn_rewards:
        steps, values = [], []
        for k, r in enumerate(rewards):
            if k:
                steps += [-1] * obs
                values += [0.0] * obs
            steps.append(k)
            values.append(r)
        rows.append((steps, values))
    width = max(len(s) for s, _ in rows)
    step_index = torch.tensor([s + [-1] * (width - len(s)) for s, _ in rows])
    values = torch.tensor([v + [0.0] * (width - len(v)) for _, v in rows], dtype=torch.float64)
    return step_index, values, (step_index >= 0).to(torch.float64)


def test_returns_of_a_three_turn_toy_by_hand():
    # episode 0: a per-turn signal 0.5, a tool turn, the right answer; episode 1: nothing. gamma 0.5:
    # G_0 = (0.5 + 0.5 * 0 + 0.25 * 1, 0 + 0.5 * 1, 1) = (0.75, 0.5, 1), G_1 = (0, 0, 0)
    step_index, turn_rewards, mask = turns_batch([[0.5, 0.0, 1.0], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([1.5, 0.0])  # the episode rewards: the sums of the turns' (no shaping)
    got = gtpo_turn_advantage(rewards, torch.tensor([0, 0]), mask, step_index, turn_rewards, gamma=0.5, scale_by_std=False)
    mean = (0.75 + 0.5 + 1.0) / 6
    want = [[0.75 - mean, 0.0, 0.5 - mean, 0.0, 1.0 - mean], [-mean, 0.0, -mean, 0.0, -mean]]
    assert torch.allclose(got.to(torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-12)


def test_group_normalisation_by_hand_pooled_and_per_turn():
    # group 0: two 2-turn episodes, final rewards 1 and 0, gamma 1: returns (1, 1) and (0, 0);
    # group 1: one 2-turn episode (1, 1) and a 1-turn one (0)
    step_index, turn_rewards, mask = turns_batch([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0]])
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    pooled = gtpo_turn_advantage(rewards, groups, mask, step_index, turn_rewards, gamma=1.0, epsilon=0.0)
    half = 0.5 / math.sqrt(1 / 3)  # group 0: returns 1, 1, 0, 0 -> mean 1/2, unbiased std sqrt(1/3)
    b = torch.tensor([1.0, 1.0, 0.0])  # group 1 pooled: returns 1, 1, 0
    b = ((b - b.mean()) / b.std()).tolist()
    want = [[half, 0, half], [-half, 0, -half], [b[0], 0, b[1]], [b[2], 0, 0]]
    assert torch.allclose(pooled.to(torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-9)
    per_turn = gtpo_turn_advantage(rewards, groups, mask, step_index, turn_rewards, gamma=1.0, epsilon=0.0, normalize="turn")
    # per turn index: group 0 turn 0 (1, 0) and turn 1 (1, 0): +-1/sqrt(2); group 1 turn 0 (1, 0): +-1/sqrt(2),
    # its turn 1 alone: 0
    c = 1 / math.sqrt(2)
    want = [[c, 0, c], [-c, 0, -c], [c, 0, 0.0], [-c, 0, 0]]
    assert torch.allclose(per_turn.to(torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-9)


def test_one_turn_with_gamma_one_is_grpo_exactly():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 1.0, 0.3])
    group_index = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    mask = torch.tensor([[1, 1, 1, 0]] * 7, dtype=torch.float32)
    step_index = torch.where(mask > 0, 0, -1).long()
    grpo = grpo_advantage(rewards, group_index, mask)
    for turn_rewards in (rewards[:, None].expand(7, 4).to(torch.float64), torch.zeros(7, 4, dtype=torch.float64)):
        # the turn reward or none at all: the episode reward (after shaping) lands on the last turn either way
        got = gtpo_turn_advantage(rewards, group_index, mask, step_index, turn_rewards, gamma=1.0)
        assert torch.equal(got, grpo.to(got.dtype))


def test_the_shaping_part_of_the_reward_lands_on_the_last_turn():
    # two 2-turn episodes, turn rewards all 0; the shaping gave the second 0.5: with gamma 1 every turn's return
    # is the shaped episode reward, so turn by turn the advantage is GRPO's on (1, 0.5)
    step_index, turn_rewards, mask = turns_batch([[0.0, 1.0], [0.0, 0.0]])
    rewards = torch.tensor([1.0, 0.5])
    got = gtpo_turn_advantage(rewards, torch.tensor([0, 0]), mask, step_index, turn_rewards, gamma=1.0, scale_by_std=False)
    assert torch.allclose(got, torch.tensor([[0.25, 0, 0.25], [-0.25, 0, -0.25]], dtype=got.dtype))


def test_observation_tokens_get_zero():
    step_index, turn_rewards, mask = turns_batch([[0.0, 0.0, 1.0], [0.0, 1.0]], obs=3)
    got = gtpo_turn_advantage(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask, step_index, turn_rewards)
    assert (got[step_index < 0] == 0).all() and (got[step_index >= 0] != 0).any()


def test_code_similarity_shaping():
    block = "```python\nprint(6*7)\n```"
    texts = [f"Let me compute. {block} so \\boxed{{42}}",   # right
             f"{block}\n\\boxed{{41}}",                    # wrong, the same code as the right one
             "\\boxed{40}",                                # wrong, no code
             "```python\nprint(6*8)\n```",                 # wrong, close code
             f"{block} \\boxed{{1}}",                     # wrong, the same code, but its group has no success
             "```python\nx = 42\n```\n\\boxed{42}"]       # right, other code: the max over successes counts
    correct, groups = torch.tensor([True, False, False, False, False, True]), torch.tensor([0, 0, 0, 0, 1, 0])
    codes = [policy_code(t) for t in texts]
    term = gtpo_code_similarity(codes, correct, groups, weight=0.4)
    assert term[:3].tolist() == [0.0, pytest.approx(0.4), 0.0] and term[4] == 0.0 and term[5] == 0.0
    assert 0.0 < term[3] < 0.4 and term[3] == pytest.approx(0.4 * 2 * 10 / 22)  # "print(6*" + ")\n": 10 of 11 chars each
    rewards = apply_shaping(correct.float(), [("gtpo_code_similarity", {"weight": 0.4})],
                            {"policy_code": codes, "correct": correct, "group_index": groups})
    assert rewards[0] == rewards[5] == 1.0 and rewards[1] == pytest.approx(0.4) and rewards[2] == 0.0  # successes keep 1


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        check_shapers([("gtpo_code_similarity", {"weight": 1.0})])
    step_index, turn_rewards, mask = turns_batch([[1.0]])
    for bad in ({"gamma": 1.5}, {"normalize": "episode"}):
        with pytest.raises(ConfigError):
            gtpo_turn_advantage(torch.ones(1), torch.zeros(1, dtype=torch.long), mask, step_index, turn_rewards, **bad)


def test_the_preset_composes_tool_episodes_with_the_shaping(tmp_path):
    cfg = compose_config(["algorithm=gtpo_turn"], tmp_path)
    assert cfg.rollout.strategy == "multi_turn" and cfg.env.name == "python_tool"
    assert cfg.algorithm.advantage.name == "gtpo_turn" and cfg.algorithm.reward_shaping[0].name == "gtpo_code_similarity"
    assert cfg.algorithm.fidelity.status == "partial"
    validate_config(cfg)


@pytest.mark.slow  # runs the sandbox
def test_a_scripted_tool_group_through_rollout_shaping_and_advantage(sandbox_runs):  # noqa: F811
    # three episodes: the right answer after a block; the same block, then a wrong answer; a wrong answer, no code
    seen = {}

    def shape(outcome, inputs):
        seen.update(inputs)
        return apply_shaping(outcome, [("gtpo_code_similarity", {"weight": 0.5})], inputs)

    script = [[CODE, CODE, "\\boxed{40}$"], ["\\boxed{42}$", "\\boxed{41}$"]]
    sampler = GroupSampler(ScriptedEngine(script), MathReward(), Tokens(), {"user": "{problem}"}, shape)
    setup = RolloutSetup(sampler, 3, SamplingParams(1.0, 1.0, 64), None, env=factory())
    groups, _ = MultiTurnRollout(setup).rollout([PROBLEM])
    right, copied, no_code = groups.groups[0]
    observation = "```output\n42\n```\n"
    assert right.text == CODE + observation + "\\boxed{42}"
    assert seen["policy_code"] == [policy_code(CODE)] * 2 + [""]  # the policy's blocks, not the tool output's
    assert groups.outcome.tolist() == [1.0, 0.0, 0.0] and groups.rewards.tolist() == [1.0, 0.5, 0.0]
    batch = collate(groups.groups, pad_token_id=0)
    adv = gtpo_turn_advantage(groups.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                              batch.extras["turn_rewards"], gamma=0.5, scale_by_std=False)
    # returns: right (0.5, 1), copied (0.25, 0.5: its shaped 0.5 on its last turn), no code (0): mean 0.45
    mean = (0.5 + 1.0 + 0.25 + 0.5 + 0.0) / 5
    assert adv[0, 0].item() == pytest.approx(0.5 - mean) and adv[0, len(right.response_ids) - 1].item() == pytest.approx(1 - mean)
    assert adv[1, 0].item() == pytest.approx(0.25 - mean) and adv[1, len(copied.response_ids) - 1].item() == pytest.approx(0.5 - mean)
    assert adv[2, 0].item() == pytest.approx(-mean)
    tool = slice(len(CODE), len(CODE) + len(observation))
    assert (batch.response_mask[0, tool] == 0).all() and (adv[0, tool] == 0).all()  # tool output: mask 0, advantage 0
    assert (adv[batch.response_mask == 0] == 0).all()


def test_the_per_turn_signal_rewards_a_block_that_runs_and_enters_the_turn_returns(sandbox_runs):  # noqa: F811
    from test_env_python_tool import EnvConfig, EnvContext, EnvFactory, SandboxLimits

    def signalled(run_reward):
        config = EnvConfig(name="python_tool", max_turns=4, turn_tokens=64, max_tokens=400, max_tool_calls=3,
                           max_observation_tokens=100, settings={"python_tool": {"run_reward": run_reward}})
        return EnvFactory(config, EnvContext(grader=MathReward(), sandbox_limits=SandboxLimits(timeout_s=10.0)))

    broken = "```python\nprint(1/0)\n```"
    script = [[CODE, broken], ["\\boxed{42}$", "\\boxed{42}$"]]  # both answer right: one after a block that ran
    sampler = GroupSampler(ScriptedEngine(script), MathReward(), Tokens(), {"user": "{problem}"}, lambda r, _: r)
    groups, _ = MultiTurnRollout(RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 64), None, env=signalled(0.1))).rollout([PROBLEM])
    assert [g.correct for g in groups.grades] == [True, True]  # the verdict is the grader's; the reward sums the turns'
    assert groups.outcome.tolist() == pytest.approx([1.1, 1.0]) and groups.rewards.tolist() == pytest.approx([1.1, 1.0])
    batch = collate(groups.groups, pad_token_id=0)
    first = batch.extras["turn_rewards"][:, 0].tolist()
    assert first == pytest.approx([0.1, 0.0])  # the turn of the block that ran, not of the one that raised
    adv = gtpo_turn_advantage(groups.rewards, batch.group_index, batch.response_mask, batch.extras["step_index"],
                              batch.extras["turn_rewards"], gamma=0.5, scale_by_std=False)
    # returns: ran (0.1 + 0.5 * 1 = 0.6, 1), raised (0.5, 1): mean 0.775
    assert adv[0, 0].item() == pytest.approx(0.6 - 0.775) and adv[1, 0].item() == pytest.approx(0.5 - 0.775)
    # 0 (the default): ReTool's rule, no turn reward whatever the blocks did
    sampler = GroupSampler(ScriptedEngine(script), MathReward(), Tokens(), {"user": "{problem}"}, lambda r, _: r)
    plain, _ = MultiTurnRollout(RolloutSetup(sampler, 2, SamplingParams(1.0, 1.0, 64), None, env=signalled(0.0))).rollout([PROBLEM])
    assert collate(plain.groups, pad_token_id=0).extras["turn_rewards"][:, 0].tolist() == [0.0, 0.0]
    assert plain.rewards.tolist() == [1.0, 1.0]
    with pytest.raises(ConfigError, match="run_reward"):
        signalled(-0.1)()
