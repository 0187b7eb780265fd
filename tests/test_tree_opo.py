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
from rlbench.algorithm.advantages.staged import order_pairs, ordered_means, project_order, sae_advantage, soft_sae_projection
from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError, DataError
from rlbench.model import load_policy
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion
from rlbench.rollout.strategies.mcts_prefix import (
    TREE_FORMAT, backup, mcts_rounds, prefix_value, read_tree, revealed_length, search_nodes, uct_score, uct_select, write_tree,
)
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


# ------------------------------------------------------------------ the heuristic baseline and the soft-SAE program


def test_tree_value_baseline_by_hand():
    """a'_i = r_i - 0.5 V(p_i), mean-centred per prompt, no std. Prompt 0: V = 0.25 at depth 0, 0.75 at depth 1."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    values = stage_tokens([0.25, 0.25, 0.75, 0.75, 0.5, 0.5]).double()
    adv = sae_advantage(rewards, groups, stage_tokens([0, 0, 1, 1, 0, 0]), torch.ones(6, 3), prefix_value=values,
                        baseline="tree_value")[:, 0]
    # prompt 0: a' = 0.875, -0.125, 0.625, 0.625 (mean 0.5); prompt 1: one prefix, V cancels: r - 0.5
    assert adv.tolist() == pytest.approx([0.375, -0.625, 0.125, 0.125, -0.5, 0.5])
    with pytest.raises(ValueError, match="prefix_value"):
        sae_advantage(rewards, groups, stage_tokens([0, 0, 1, 1, 0, 0]), torch.ones(6, 3), baseline="tree_value")


def test_prefix_value_heuristics_by_hand():
    leaves = [([1, 2, 3], 1.0), ([1, 2, 4], 0.0), ([1, 5, 6], 1.0), ([7, 8, 9], 0.0)]
    assert prefix_value((1, 2), leaves, "expectation") == 0.5  # two leaves extend (1, 2): rewards 1, 0
    assert prefix_value((1,), leaves, "expectation") == pytest.approx(2 / 3)
    assert prefix_value((), leaves, "expectation") == 0.5  # the root: every leaf
    assert prefix_value((1, 2), leaves, "optimistic") == 1.0 and prefix_value((1, 2), leaves, "pessimistic") == 0.0
    assert prefix_value((1, 5), leaves, "pessimistic") == 1.0 and prefix_value((3,), leaves, "expectation") == 0.0


def kkt_residual(a, r0, pairs, margin):
    """The largest violation of the soft-SAE program's KKT conditions at a: primal feasibility, and
    (1 + mu) a - r0 + nu 1 + sum_k lambda_k (e_i - e_j) = 0 with mu, lambda >= 0 on the active constraints only."""
    n = len(a)
    active = [(i, j) for i, j in pairs if abs(a[i] + margin - a[j]) < 1e-9]
    ball = abs(float(a @ a) - n) < 1e-9
    columns = [torch.ones(n, dtype=torch.float64)] + ([a] if ball else [])
    for i, j in active:
        e = torch.zeros(n, dtype=torch.float64)
        e[i], e[j] = 1.0, -1.0
        columns.append(e)
    m = torch.stack(columns, 1)
    coef = torch.linalg.lstsq(m, (r0 - a)[:, None]).solution[:, 0]  # nu, mu, lambdas
    stationarity = float((m @ coef - (r0 - a)).abs().max())
    signs = float(-coef[1:].min()) if len(coef) > 1 else 0.0
    feasible = max([abs(float(a.sum())), float(a @ a) - n] + [float(a[i] + margin - a[j]) for i, j in pairs])
    return max(stationarity, signs, feasible)


def test_soft_sae_without_violations_is_the_centred_input_in_the_ball():
    r0 = torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64)  # centred: 2, 0, -1, -1; ||.||^2 = 6 > 4
    a = soft_sae_projection(r0, [(2, 0)], 0.0)  # -1 <= 2: no violation
    assert a.tolist() == pytest.approx([2 * math.sqrt(4 / 6), 0.0, -math.sqrt(4 / 6), -math.sqrt(4 / 6)], abs=1e-12)
    inside = torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64)
    assert torch.allclose(soft_sae_projection(inside + 1.0, [], 0.0), inside, atol=1e-15)  # in the ball: centred only


def test_a_violated_pair_ends_on_its_constraint():
    r0 = torch.tensor([0.6, 0.2, -0.8], dtype=torch.float64)  # the pair (0, 1) wants a_0 + 0.1 <= a_1
    a = soft_sae_projection(r0, [(0, 1)], 0.1)
    # projection onto a_1 - a_0 = 0.1: both move by (0.4 + 0.1) / 2 = 0.25; the sum stays 0, ||a||^2 = 0.79 < 3
    assert a.tolist() == pytest.approx([0.35, 0.45, -0.8], abs=1e-12) and float(a[1] - a[0]) == pytest.approx(0.1, abs=1e-14)
    assert project_order(r0, [(0, 1)], [0.1]).tolist() == pytest.approx([0.35, 0.45, -0.8], abs=1e-12)


@pytest.mark.parametrize("margin", [0.0, 0.2])
def test_soft_sae_meets_its_kkt_conditions(margin):
    generator = torch.Generator().manual_seed(7)
    checked = 0
    for _ in range(40):
        n = int(torch.randint(3, 9, (1,), generator=generator))
        r0 = 3 * torch.randn(n, generator=generator, dtype=torch.float64)
        rewards = (torch.rand(n, generator=generator) > 0.5).float().tolist()
        stages = torch.randint(0, 3, (n,), generator=generator).tolist()
        pairs = order_pairs(rewards, stages)
        a = soft_sae_projection(r0, pairs, margin)
        assert kkt_residual(a, r0, pairs, margin) < 1e-8
        checked += bool(pairs) and float(a @ a) == pytest.approx(n)
    assert checked > 5  # the ball and the order both bind in some draws


def test_order_pairs_are_shallow_failures_before_deep_successes():
    assert order_pairs([0.0, 1.0, 0.0, 1.0], [0, 0, 1, 1]) == [(0, 3)]


def test_soft_projection_of_one_stage_tree_value_is_centred_rewards_in_the_ball():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = sae_advantage(rewards, torch.zeros(4, dtype=torch.long), stage_tokens([0] * 4), torch.ones(4, 3),
                        prefix_value=torch.zeros(4, 3, dtype=torch.float64), baseline="tree_value", projection="soft")[:, 0]
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])  # ||.||^2 = 0.75 <= 4: no pair, unchanged


# ------------------------------------------------------------------ the offline teacher tree on the tiny model


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def _cfg(tree, stage_depths=((2, 0),), search=None, **options):
    block = {"search": {"segment_tokens": 2, "root_branching": 2, "branching": 2, "rounds": 0, **(search or {})}, "stage_depths": [list(s) for s in stage_depths],
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
    # prefix_value: the depth-0 prefix's V is the mean reward of all the prompt's tree leaves (expectation)
    values = batch.extras["prefix_value"][:, 0]
    for p, problem in enumerate(PROBLEMS[:2]):
        leaves = strategy.tree["prompts"][problem.uid]["leaves"]
        assert values[4 * p + 2].item() == pytest.approx(sum(leaf["reward"] for leaf in leaves) / len(leaves))
    assert graded.group_index.tolist() == [0] * 4 + [1] * 4  # the group is the prompt's, all its depths
    graded, metrics = strategy.rollout(PROBLEMS[:2])  # the second stage: the prompt alone
    assert metrics["mcts_prefix_depth"] == 0 and metrics["rollout_outcome_mean"] == pytest.approx(float(graded.outcome.mean()))


# ------------------------------------------------------------------ MCTS selection rounds of the teacher tree


def test_sae_and_value_heuristic_options_refused(tmp_path):
    from rlbench.algorithm.registry import ADVANTAGES

    for bad in ({"baseline": "tree"}, {"projection": "hard"}, {"margin": -0.1}, {"alpha": -1.0}):
        with pytest.raises(ConfigError, match="algorithm.advantage"):
            ADVANTAGES.validate_params("sae", bad)
    ADVANTAGES.validate_params("sae", {"baseline": "tree_value", "projection": "soft", "margin": 0.1})
    with pytest.raises(ConfigError, match="value_heuristic"):
        validate_strategy(_cfg(tmp_path / "t.json", value_heuristic="mean"), "sae")


def test_uct_score_by_hand():
    c = math.sqrt(2)
    assert uct_score(1.0, 2, 4, c) == pytest.approx(0.5 + math.sqrt(2) * math.sqrt(math.log(4) / 2))  # 0.5 + sqrt(ln 4)
    assert uct_score(0.0, 1, 4, 1.0) == pytest.approx(math.sqrt(math.log(4)))
    assert uct_score(3.0, 4, 9, 0.0) == 0.75  # c = 0: the mean value alone
    assert uct_score(0.0, 0, 5, 1.0) == math.inf
    assert uct_select([5.0, 0.0, 0.0], [5, 0, 0], 5, 1.0) == 1  # unvisited children first, the first of them
    assert uct_select([5.0, 0.0], [5, 1], 6, 0.1) == 0  # exploitation: 1.0 + 0.1*sqrt(ln 6 / 5) against 0.1*sqrt(ln 6)
    assert uct_select([5.0, 0.0], [5, 1], 6, 10.0) == 1  # exploration: 1 + 10*0.599 against 10*1.339
    assert uct_select([1.0, 1.0, 1.0], [2, 2, 2], 6, 1.0) == 0  # ties: the first child
    assert uct_select([0.0, 1.0, 1.0], [2, 2, 2], 6, 1.0) == 1


def test_backup_by_hand_on_a_three_node_path():
    visits, sums = [3, 2, 1, 5], [1.0, 1.0, 0.0, 2.0]
    assert backup(visits, sums, [0, 1, 2], 0.5) == ([4, 3, 2, 5], [1.5, 1.5, 0.5, 2.0])
    assert visits == [3, 2, 1, 5] and sums == [1.0, 1.0, 0.0, 2.0]  # pure: the inputs are unchanged


class ScriptedSampler:
    """The k-th sample of a request with prefix P continues P with SCRIPT[P][k] (tokens, EOS sampled); the reward
    of a response is REWARD.get(response, 0). Records each call's (prefix, n, max_new_tokens)."""

    SCRIPT = {
        (1, 1): [([8], False), ([9], True)], (1, 1, 8): [([5], False)],
        (2, 1): [([3], False), ([4], False)], (2, 1, 3): [([6], False)], (2, 1, 4): [([6], False)],
        (1, 2): [([5], True), ([6], True)],
    }
    REWARD = {(1, 1, 7, 7): 1.0, (2, 1, 3, 6): 1.0}

    class tokenizer:
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    def __init__(self):
        self.calls = []

    def generate(self, requests, params, generator=None):
        out = []
        for r in requests:
            self.calls.append((r.prefix_ids, r.n, params.max_new_tokens))
            script = self.SCRIPT[tuple(r.prefix_ids)]
            out.append([Completion(0, r.prompt_ids, list(r.prefix_ids) + script[k][0], [0.0] * (len(r.prefix_ids) + 1), script[k][1])
                        for k in range(r.n)])
        return out

    def grade(self, problems, groups, max_length):
        rewards = torch.tensor([self.REWARD.get(tuple(c.response_ids), 0.0) for group in groups for c in group])
        group_index = torch.tensor([g for g, group in enumerate(groups) for _ in group])
        return type("Graded", (), {"rewards": rewards, "group_index": group_index})()


def _scripted_record():
    """Four leaves of a segment tree of 1-token segments (root_branching 2, branching 2), max_new_tokens 4."""
    paths = [[1, 1, 7, 7], [1, 2, 7, 7], [2, 1, 7, 7], [2, 2, 7, 7]]
    rewards = [1.0, 0.0, 0.0, 0.0]
    return {"prompt_ids": [0], "leaves": [{"response_ids": p, "reward": r} for p, r in zip(paths, rewards)],
            "nodes": search_nodes(paths, rewards, 1)}


def test_search_nodes_of_a_segment_tree():
    nodes = _scripted_record()["nodes"]
    # 0: prompt; 1: [1] (2 leaves); 2: [1,1] (leaf 0's own, its rollout the rest); 3: [1,2]; 4: [2]; 5: [2,1]; 6: [2,2]
    assert [(n["parent"], n["tokens"], n["N"], n["W"], n["leaf"]) for n in nodes] == [
        (-1, [], 4, 1.0, -1), (0, [1], 2, 1.0, 0), (1, [1], 1, 1.0, 0), (1, [2], 1, 0.0, 1),
        (0, [2], 2, 0.0, 2), (4, [1], 1, 0.0, 2), (4, [2], 1, 0.0, 3),
    ]
    assert not any(n["ended"] for n in nodes)
    ended = search_nodes([[3], [4, 4, 4]], [1.0, 0.0], 2)  # a leaf ending inside its first segment: a terminal node
    assert [(n["tokens"], n["ended"]) for n in ended] == [([], False), ([3], True), ([4, 4], False)]


def test_rounds_expand_the_uct_child_by_hand():
    """c = sqrt(2). Round 1: root N=4: [1] (W=1, N=2) 0.5 + sqrt(ln 4) beats [2] (W=0, N=2) sqrt(ln 4); under [1],
    [1,1] (W=1) beats [1,2] (W=0): [1,1] is expanded: [1,1,8] (rollout [1,1,8,5], reward 0) and [1,1,9] (EOS: its own
    rollout, reward 0). Round 2: root N=6: [1] (W=1, N=4) 0.25 + 1.414*sqrt(ln 6 / 4) = 1.197 against [2] (W=0, N=2)
    1.414*sqrt(ln 6 / 2) = 1.339: [2]; its children tie (W=0, N=1): the first, [2,1], is expanded: [2,1,3] (rollout
    [2,1,3,6], reward 1), [2,1,4] (reward 0). Round 3: root N=8: [1] and [2] tie (W=1, N=4): [1]; under it (N=4)
    [1,1] (W=1, N=3) 0.333 + 1.414*sqrt(ln 4 / 3) = 1.295 against [1,2] (W=0, N=1) 1.414*sqrt(ln 4) = 1.665: [1,2]."""
    sampler = ScriptedSampler()
    setup = type("Setup", (), {"sampler": sampler, "params": SamplingParams(temperature=1.0, max_new_tokens=4), "generator": None})()
    record = _scripted_record()
    mcts_rounds(setup, [PROBLEMS[0]], [record], 3, math.sqrt(2), segment_tokens=1, branching=2)
    expansions = [call[0] for call in sampler.calls if call[1] == 2]
    assert expansions == [(1, 1), (2, 1), (1, 2)]
    assert all(call[2] == 1 for call in sampler.calls if call[1] == 2)  # one segment of 1 token
    assert [(c[0], c[2]) for c in sampler.calls if c[1] == 1] == [((1, 1, 8), 1), ((2, 1, 3), 1), ((2, 1, 4), 1)]  # rollouts
    nodes = record["nodes"]
    new = [(n["parent"], n["tokens"], n["N"], n["W"], n["ended"]) for n in nodes[7:]]
    assert new == [(2, [8], 1, 0.0, False), (2, [9], 1, 0.0, True), (5, [3], 1, 1.0, False), (5, [4], 1, 0.0, False),
                   (3, [5], 1, 0.0, True), (3, [6], 1, 0.0, True)]
    assert [(n["N"], n["W"]) for n in nodes[:7]] == [(10, 2.0), (6, 1.0), (3, 1.0), (3, 0.0), (4, 1.0), (3, 1.0), (1, 0.0)]
    assert [leaf["response_ids"] for leaf in record["leaves"][4:]] == [[1, 1, 8, 5], [1, 1, 9], [2, 1, 3, 6], [2, 1, 4, 6], [1, 2, 5], [1, 2, 6]]
    assert [leaf["reward"] for leaf in record["leaves"][4:]] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_a_selected_terminal_node_backs_up_its_reward_without_sampling():
    sampler = ScriptedSampler()
    setup = type("Setup", (), {"sampler": sampler, "params": SamplingParams(temperature=1.0, max_new_tokens=4), "generator": None})()
    record = {"prompt_ids": [0], "leaves": [{"response_ids": [3], "reward": 1.0}], "nodes": search_nodes([[3]], [1.0], 2)}
    mcts_rounds(setup, [PROBLEMS[0]], [record], 2, 1.0, segment_tokens=2, branching=2)
    assert sampler.calls == [] and [(n["N"], n["W"]) for n in record["nodes"]] == [(3, 3.0), (3, 3.0)]


def test_rounds_0_is_the_segment_tree_exactly(tiny, tmp_path):
    """rounds=0 writes the leaves of the segment tree, graded (and does not depend on the exploration constant)."""
    trees = [_strategy(tiny, _cfg(tmp_path / "t.json", search=search)).grow_teacher_tree(PROBLEMS) for search in ({"exploration": 0.5}, {"rounds": 0})]
    reference = _strategy(tiny, _cfg(tmp_path / "r.json"))
    sampler = reference.setup.sampler
    leaves, _ = TreeSampling(reference.setup, reference.search).grow(sampler.encode(PROBLEMS))
    graded = sampler.grade(PROBLEMS, leaves, 8)
    for tree in trees:
        for p, problem in enumerate(PROBLEMS):
            rewards = graded.rewards[graded.group_index == p].tolist()
            assert tree["prompts"][problem.uid]["leaves"] == [
                {"response_ids": list(leaf.response_ids), "reward": float(r)} for leaf, r in zip(leaves[p], rewards)
            ]
    assert trees[0] == trees[1]


def test_rounds_grow_the_teacher_tree_and_the_file_keeps_n_and_w(tiny, tmp_path):
    path = tmp_path / "tree.json"
    strategy = _strategy(tiny, _cfg(path, search={"rounds": 3, "exploration": 1.0}))
    strategy.training_problems(PROBLEMS)
    strategy.rollout(PROBLEMS[:2])
    assert sum(len(node["leaves"]) for node in strategy.tree["prompts"].values()) > 3 * 4  # the rounds added leaves
    for node in strategy.tree["prompts"].values():
        nodes, leaves = node["nodes"], node["leaves"]
        assert 4 <= len(leaves) <= 4 + 3 * 2  # each round adds branching=2 leaves unless it selected a terminal node
        assert nodes[0]["N"] == 4 + 3 * 2 - (10 - len(leaves)) // 2  # one visit per evaluation, a reselection one
        for k, parent in enumerate(nodes):
            assert parent["N"] >= sum(n["N"] for n in nodes if n["parent"] == k)
    again = read_tree(path, strategy.tree["tokenizer"], 2)
    assert again == strategy.tree and all("N" in n and "W" in n for p in again["prompts"].values() for n in p["nodes"])
    write_tree(tmp_path / "copy.json", again)
    assert read_tree(tmp_path / "copy.json", again["tokenizer"], 2) == again


def test_online_rounds_are_the_teacher_trees_rounds_by_hand(monkeypatch):
    """The online search (teacher_tree "") runs search.rounds UCT rounds on the segment tree it grew, as the teacher's
    tree does: the scripted tree's 3 rounds give the hand counts of test_rounds_expand_the_uct_child_by_hand."""
    record = _scripted_record()
    leaves = [[Completion(0, (0,), leaf["response_ids"], [0.0] * 4, False) for leaf in record["leaves"]]]
    monkeypatch.setattr(TreeSampling, "grow", lambda self, prompt_ids: (leaves, {}))
    cfg = rollout_config({"strategy": "mcts_prefix", "n": 4, "max_new_tokens": 4, "mcts_prefix": {
        "search": {"segment_tokens": 1, "root_branching": 2, "branching": 2, "rounds": 3}, "stage_depths": [1], "teacher_tree": ""}})
    sampler = ScriptedSampler()
    strategy = make_strategy(cfg, RolloutSetup(sampler, 4, SamplingParams(temperature=1.0, max_new_tokens=4), None))
    (online,), _, _ = strategy.search_records([PROBLEMS[0]], [(0,)])
    mcts_rounds(type("Setup", (), {"sampler": ScriptedSampler(), "params": strategy.setup.params, "generator": None})(),
                [PROBLEMS[0]], [record], 3, math.sqrt(2), segment_tokens=1, branching=2)
    assert online == record and len(online["nodes"]) == 7 + 3 * 2  # 3 expansions of branching 2
    assert [(n["N"], n["W"]) for n in online["nodes"][:7]] == [(10, 2.0), (6, 1.0), (3, 1.0), (3, 0.0), (4, 1.0), (3, 1.0), (1, 0.0)]
    assert [call[0] for call in sampler.calls if call[1] == 2] == [(1, 1), (2, 1), (1, 2)]


def test_online_rounds_on_the_tiny_model(tiny, grown):
    """rounds=2 online: each step's search adds the rounds' rollouts to the segment tree's 4 leaves, one visit of the
    root per evaluation (a reselected terminal node: one), and a step draws its prefix from a best leaf of them all."""
    strategy = _strategy(tiny, _cfg("", stage_depths=((2,),), search={"rounds": 2, "exploration": 1.0}))
    records = []
    original = strategy.search_records
    strategy.search_records = lambda *args: _keep(records, original(*args))
    graded, metrics = strategy.rollout(PROBLEMS[:2])
    assert grown == [2] and len(records) == 1 and strategy.tree is None  # online: one search per step, no file
    for record, group in zip(records[0], graded.groups):
        nodes, leaves = record["nodes"], record["leaves"]
        expansions = (len(leaves) - 4) // 2
        first = search_nodes([leaf["response_ids"] for leaf in leaves[:4]], [leaf["reward"] for leaf in leaves[:4]], 2)
        assert len(nodes) == len(first) + 2 * expansions and len(leaves) == 4 + 2 * expansions
        assert nodes[0]["N"] == 4 + 2 * expansions + (2 - expansions)
        for k, node in enumerate(nodes):  # N: the node's own evaluations plus its children's visits
            assert node["N"] >= sum(n["N"] for n in nodes if n["parent"] == k)
        best = max(leaf["reward"] for leaf in leaves)
        solution = next(leaf for leaf in leaves if leaf["reward"] == best)["response_ids"]
        shown = revealed_length(len(solution), 2, 2)
        assert all(c.response_ids[:shown] == solution[:shown] for c in group)
    strategy.rollout(PROBLEMS[:2])
    assert grown == [2, 2]  # the online search runs again each step


def _keep(records, result):
    records.append(result[0])
    return result


def test_rounds_options_refused(tmp_path):
    validate_strategy(_cfg("", search={"rounds": 2}), "sae")  # the online search runs rounds too
    with pytest.raises(ConfigError, match="rounds=-1"):
        validate_strategy(_cfg(tmp_path / "t.json", search={"rounds": -1}), "sae")
    with pytest.raises(ConfigError, match="no key"):
        validate_strategy(_cfg(tmp_path / "t.json", search={"round": 2}), "sae")
    validate_strategy(_cfg(tmp_path / "t.json", search={"rounds": 2, "exploration": 0.5}), "sae")


@pytest.mark.slow
def test_cli_tree_opo_with_sae(tmp_path):
    tree = tmp_path / "tree.json"
    steps = smoke_cli_steps(
        tmp_path / "run", "rollout=mcts_prefix", "algorithm/advantage=sae", "rollout.mcts_prefix.search.segment_tokens=2",
        "rollout.mcts_prefix.stage_depths=[[1,0]]", f"rollout.mcts_prefix.teacher_tree={tree}",
    )
    assert steps[0]["mcts_teacher_tree_prompts"] > 0 and "mcts_teacher_tree_prompts" not in steps[1]
    assert all(step["mcts_prefix_depths"] == 2 for step in steps) and tree.exists()
