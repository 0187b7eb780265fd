"""Tree-OPO (arXiv:2509.09284): Staged Advantage Estimation (rlbench/algorithm/advantages/staged.py) by hand and
against GRPO, and rollout=mcts_prefix's offline teacher tree and depth mixes (rlbench/rollout/strategies/mcts_prefix.py)
on the tiny model."""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from conftest import model_preset, smoke_cli_steps
from rlbench.algorithm.advantages import grpo_advantage
from rlbench.algorithm.advantages.staged import ordered_means, sae_advantage
from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
from rlbench.model import load_policy
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams, make_strategy, validate_strategy
from rlbench.rollout.strategies.mcts_prefix import TREE_FORMAT, read_tree
from rlbench.rollout.strategies.tree import TreeSampling
from rlbench.training.batch import collate


def stage_tokens(stages, length=3):
    """prefix_stage [B,T]: each response's stage on its tokens."""
    return torch.tensor(stages)[:, None].expand(len(stages), length).clone()


# Prompt 0: depth 0 rewards 1, 1, 0, 1 (mean 0.75), depth 1 rewards 0, 1 (mean 0.5): out of the tree's order.
# Prompt 1: depth 0 rewards 0, 1 (mean 0.5), depth 1 rewards 1, 1 (mean 1, no variance: a saturated deep prefix).
REWARDS = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
STAGES = stage_tokens([0, 0, 0, 0, 1, 1, 0, 0, 1, 1])
MASK = torch.ones(10, 3)


def test_ordered_means_is_the_weighted_monotone_projection():
    assert ordered_means([0.75, 0.5], [4, 2]) == pytest.approx([2 / 3, 2 / 3])  # (4 * 0.75 + 2 * 0.5) / 6
    assert ordered_means([0.2, 0.1, 0.9], [1, 1, 1]) == pytest.approx([0.15, 0.15, 0.9])
    assert ordered_means([0.1, 0.3, 0.2, 0.0], [1, 1, 1, 1]) == pytest.approx([0.1, 0.5 / 3, 0.5 / 3, 0.5 / 3])
    assert ordered_means([0.1, 0.5], [3, 1]) == [0.1, 0.5]  # already in order: unchanged


def test_sae_by_hand():
    adv = sae_advantage(REWARDS, GROUPS, STAGES, MASK, epsilon=0.0)[:, 0]
    # prompt 0: baselines (4 * 0.75 + 2 * 0.5) / 6 = 2/3 at both depths; pooled variance
    # (3 * 0.25^2 + 0.75^2 + 2 * 0.5^2) / (6 - 2) = 1.25 / 4 = 0.3125
    s0 = math.sqrt(0.3125)
    # prompt 1: in order, baselines 0.5 and 1; pooled variance (2 * 0.5^2 + 0) / (4 - 2) = 0.25
    expected = [1 / 3 / s0] * 2 + [-2 / 3 / s0, 1 / 3 / s0, -2 / 3 / s0, 1 / 3 / s0] + [-1.0, 1.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected)
    unordered = sae_advantage(REWARDS, GROUPS, STAGES, MASK, ordered=False, epsilon=0.0)[:, 0]
    # baselines are the (prompt, prefix) means: 0.75 and 0.5 for prompt 0
    expected[:6] = [0.25 / s0, 0.25 / s0, -0.75 / s0, 0.25 / s0, -0.5 / s0, 0.5 / s0]
    assert unordered.tolist() == pytest.approx(expected)


def test_sae_groups_are_keyed_by_prompt_and_prefix():
    """The same depth in two prompts is two baselines; the same prompt at two depths is two baselines."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 0, 0])
    stages = stage_tokens([1, 1, 1, 1, 2, 2])
    adv = sae_advantage(rewards, groups, stages, torch.ones(6, 3), ordered=False, epsilon=0.0)[:, 0]
    # prompt 0: depth 1 mean 0.5, depth 2 mean 1; pooled variance (0.5 + 0) / (4 - 2); prompt 1: no variance
    s = math.sqrt(0.25)
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0, 0.0, 0.0])


def test_a_saturated_stage_keeps_the_advantage_finite():
    """Every reward of prompt 1's depth 1 is 1 and epsilon is 0: the per-stage std would divide 0 by 0; the pooled
    std of the prompt is 0.5. A prompt whose every stage has no variance gets 0."""
    adv = sae_advantage(REWARDS, GROUPS, STAGES, MASK, epsilon=0.0)
    assert torch.isfinite(adv).all() and adv[6:8, 0].abs().tolist() == [1.0, 1.0]
    flat = sae_advantage(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), stage_tokens([1, 1, 0, 0]),
                         torch.ones(4, 3), ordered=False, epsilon=0.0)
    assert torch.equal(flat, torch.zeros(4, 3))


@pytest.mark.parametrize("depth", [0, 2])
def test_one_stage_is_grpo_exactly(depth):
    generator = torch.Generator().manual_seed(depth)
    rewards = torch.rand(12, generator=generator).round(decimals=1)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 3])
    mask = (torch.rand(12, 5, generator=generator) > 0.2).float()
    stages = torch.full((12, 5), depth)
    assert torch.equal(sae_advantage(rewards, groups, stages, mask), grpo_advantage(rewards, groups, mask))


def test_a_stage_must_be_constant_along_a_response():
    with pytest.raises(ValueError, match="varies along a response"):
        sae_advantage(REWARDS[:2], GROUPS[:2], torch.tensor([[0, 0, 1], [0, 0, -1]]), MASK[:2])


# ------------------------------------------------------------------ the offline teacher tree on the tiny model


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def _cfg(tree, stage_depths=((2, 0),), **options):
    block = {"search": {"segment_tokens": 2, "root_branching": 2, "branching": 2}, "stage_depths": [list(s) for s in stage_depths],
             "steps_per_stage": 1, "teacher_tree": str(tree), **options}
    return rollout_config({"strategy": "mcts_prefix", "n": 4, "max_new_tokens": 8, "mcts_prefix": block})


def _strategy(tiny, cfg, seed=0):
    model, tokenizer = tiny
    sampler = GroupSampler(HFGenerateEngine(model, tokenizer, progress=False), EvenTokenReward(), tokenizer,
                           {"system": None, "user": "{problem}"}, lambda rewards, inputs: rewards)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    return make_strategy(cfg, RolloutSetup(sampler, 4, params, torch.Generator().manual_seed(seed)))


PROBLEMS = [Problem(uid=f"p{i}", prompt=q, answer="0") for i, q in enumerate(["1 + 2", "3 + 4", "5 + 6"])]


@pytest.fixture
def grown(monkeypatch):
    """Counts the search trees grown (TreeSampling.grow calls)."""
    calls = []
    original = TreeSampling.grow

    def grow(self, prompt_ids):
        calls.append(len(prompt_ids))
        return original(self, prompt_ids)

    monkeypatch.setattr(TreeSampling, "grow", grow)
    return calls


def test_the_teacher_tree_is_grown_once_written_and_read_back(tiny, tmp_path, grown):
    path = tmp_path / "teacher" / "tree.json"
    strategy = _strategy(tiny, _cfg(path))
    strategy.training_problems(PROBLEMS)
    graded, metrics = strategy.rollout(PROBLEMS[:2])
    assert grown == [3] and metrics["mcts_teacher_tree_prompts"] == 3  # every training prompt, once, before training
    tree = json.loads(path.read_text())
    assert tree["format"] == TREE_FORMAT and tree["segment_tokens"] == 2 and sorted(tree["prompts"]) == ["p0", "p1", "p2"]
    assert all(len(node["leaves"]) == 4 for node in tree["prompts"].values())
    for problem, group in zip(PROBLEMS, graded.groups):  # mixed depths: 2 completions of a 4-token prefix, 2 of the prompt
        leaves = tree["prompts"][problem.uid]["leaves"]
        best = max(leaf["reward"] for leaf in leaves)
        assert [c.extras["prefix_stage"][0] for c in group] == [2, 2, 0, 0]
        assert all(c.extras["prefix_stage"] == [c.extras["prefix_stage"][0]] * len(c.response_ids) for c in group)
        assert [c.loss_mask[:4] if c.loss_mask else None for c in group] == [[0] * 4, [0] * 4, None, None]
        prefix = group[0].response_ids[:4]
        assert group[1].response_ids[:4] == prefix
        assert any(leaf["response_ids"][:4] == prefix and leaf["reward"] == best for leaf in leaves)
    assert metrics["mcts_prefix_tokens_mean"] == 2.0  # (4 + 0) / 2
    strategy.rollout(PROBLEMS[1:])
    assert grown == [3]  # no online growth once the tree exists
    # a new run reads the file; a resumed one takes the tree from its checkpoint
    again = _strategy(tiny, _cfg(path), seed=1)
    again.rollout(PROBLEMS[:1])
    assert grown == [3] and again.tree == tree
    resumed = _strategy(tiny, _cfg(tmp_path / "absent.json"))
    resumed.load_state_dict(json.loads(json.dumps(strategy.state_dict())))
    resumed.rollout(PROBLEMS[:1])
    assert grown == [3] and not (tmp_path / "absent.json").exists() and resumed.step == 3


def test_a_tree_of_other_settings_is_refused(tiny, tmp_path):
    path = tmp_path / "tree.json"
    strategy = _strategy(tiny, _cfg(path))
    strategy.rollout(PROBLEMS[:1])
    with pytest.raises(DataError, match="segments of 2 tokens"):
        read_tree(path, json.loads(path.read_text())["tokenizer"], 4)
    with pytest.raises(DataError, match="has no tree for problem 'p2'"):
        strategy.rollout(PROBLEMS[2:])


def test_teacher_prompts_are_the_trained_prompts(tiny, tmp_path):
    strategy = _strategy(tiny, _cfg(tmp_path / "tree.json", teacher_prompts=2))
    assert strategy.training_problems(PROBLEMS) == PROBLEMS[:2]
    with pytest.raises(ConfigError, match="only with rollout.mcts_prefix.teacher_tree"):
        validate_strategy(_cfg("", teacher_prompts=2), "sae")
    with pytest.raises(ConfigError, match="teacher_prompts=-1 must be >= 0"):
        validate_strategy(_cfg(tmp_path / "tree.json", teacher_prompts=-1), "sae")


def test_a_mixed_step_collates_its_stages(tiny, tmp_path):
    strategy = _strategy(tiny, _cfg(tmp_path / "tree.json", stage_depths=((1, 0), (0,))))
    graded, _ = strategy.rollout(PROBLEMS[:2])
    batch = collate(graded.groups, 0)
    stages = batch.extras["prefix_stage"]
    assert stages.max(dim=1).values.tolist() == [1, 1, 0, 0] * 2
    assert graded.group_index.tolist() == [0] * 4 + [1] * 4  # the group is the prompt's, all its depths
    graded, metrics = strategy.rollout(PROBLEMS[:2])  # the second stage: the prompt alone
    assert metrics["mcts_prefix_depth"] == 0 and metrics["rollout_outcome_mean"] == pytest.approx(float(graded.outcome.mean()))


@pytest.mark.slow
def test_cli_tree_opo_with_sae(tmp_path):
    tree = tmp_path / "tree.json"
    steps = smoke_cli_steps(
        tmp_path / "run", "rollout=mcts_prefix", "algorithm/advantage=sae", "rollout.mcts_prefix.search.segment_tokens=2",
        "rollout.mcts_prefix.stage_depths=[[1,0]]", f"rollout.mcts_prefix.teacher_tree={tree}",
    )
    assert steps[0]["mcts_teacher_tree_prompts"] > 0 and "mcts_teacher_tree_prompts" not in steps[1]
    assert all(step["mcts_prefix_depths"] == 2 for step in steps) and tree.exists()
