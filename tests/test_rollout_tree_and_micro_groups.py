"""Tree rollouts (rlbench/rollout/strategies/tree.py) and their advantages (rlbench/algorithm/advantages/tree.py):
closed forms on hand-built trees, the sampler on the tiny model, and the refusals before loading; and
micro-group sampling (rlbench/rollout/strategies/micro_groups.py): the same groups whatever the micro-group size."""

from __future__ import annotations

import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.algorithm.advantages import grpo_advantage, reinforce_pp_baseline_advantage
from rlbench.algorithm.advantages.tree import leaf_paths, tree_advantage, treerpo_advantage
from rlbench.errors import ConfigError
from rlbench.model import build_tiny_model, load_policy
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, SamplingParams, make_strategy, validate_strategy
from rlbench.rollout.strategies.tree import TreeOptions, split_budget

from conftest import has_vllm_gpu, model_preset

ROOT = Path(__file__).resolve().parents[1]

# One prompt, 4 leaves of 4 tokens: the prompt -> node 1 (2 tokens) -> leaves' own nodes 3, 4 (2 tokens
# each); the prompt -> node 2 -> nodes 5, 6.
TREE = torch.tensor([[1, 1, 3, 3], [1, 1, 4, 4], [2, 2, 5, 5], [2, 2, 6, 6]])
MASK = torch.ones(4, 4)
ONE_GROUP = torch.zeros(4, dtype=torch.long)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])


def _whitened(values: list[float], tokens_per_row: int) -> torch.Tensor:
    """Whitening over all tokens written out: (x - mean) / (unbiased std + 1e-8)."""
    flat = torch.tensor(values, dtype=torch.float64).repeat_interleave(tokens_per_row)
    mean = flat.mean()
    std = math.sqrt(float(((flat - mean) ** 2).sum()) / (flat.numel() - 1))
    return ((torch.tensor(values, dtype=torch.float64) - mean) / (std + 1e-8))[:, None].expand(-1, tokens_per_row)


def test_tree_advantage_by_hand():
    # group mean 0.25; node 1 holds leaves 0, 1 (mean 0.5); node 2 leaves 2, 3 (mean 0); nodes 3-6 hold one leaf
    # leaf 0: (0.75 + 0.5) / 2; leaf 1: (-0.25 - 0.5) / 2; leaves 2, 3: (-0.25 + 0) / 2
    by_hand = [0.625, -0.375, -0.125, -0.125]
    raw = tree_advantage(REWARDS, ONE_GROUP, TREE, MASK, whiten=False)
    assert torch.allclose(raw, torch.tensor(by_hand)[:, None].expand(4, 4))
    # group_size weighting: (4 * 0.75 + 2 * 0.5) / 6, (4 * -0.25 + 2 * -0.5) / 6, (4 * -0.25) / 6
    sized = tree_advantage(REWARDS, ONE_GROUP, TREE, MASK, weighting="group_size", whiten=False)
    assert torch.allclose(sized[:, 0], torch.tensor([4 / 6, -2 / 6, -1 / 6, -1 / 6]))
    whitened = tree_advantage(REWARDS, ONE_GROUP, TREE, MASK)
    assert torch.allclose(whitened.double(), _whitened(by_hand, 4), atol=1e-6)


def test_tree_advantage_of_a_flat_tree_is_reinforce_pp_baseline():
    """Every node holds one leaf: only the prompt's group counts (REINFORCE++-baseline)."""
    nodes = torch.arange(6)[:, None].expand(6, 3).clone()
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    mask = torch.ones(6, 3)
    mask[2, 2] = 0
    nodes[2, 2] = -1
    assert torch.allclose(tree_advantage(rewards, groups, nodes, mask), reinforce_pp_baseline_advantage(rewards, groups, mask))


def test_equal_sibling_rewards_give_no_local_component():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])  # siblings below node 1 agree, and below node 2
    raw = tree_advantage(rewards, ONE_GROUP, TREE, MASK, whiten=False)
    # leaf 0: a_0 = 0.5, a_node1 = 0: mean 0.25
    assert torch.allclose(raw[:, 0], torch.tensor([0.25, 0.25, -0.25, -0.25]))


def test_treerpo_advantage_by_hand():
    adv = treerpo_advantage(REWARDS, ONE_GROUP, TREE, MASK)
    top = 0.25 / math.sqrt(2 * 0.25**2)  # V(1) = 0.5, V(2) = 0 around their mean 0.25, unbiased std
    below = 0.5 / math.sqrt(0.5)  # leaves 0, 1 below node 1: 1 and 0
    expected = torch.tensor(
        [[top, top, below, below], [top, top, -below, -below], [-top, -top, 0, 0], [-top, -top, 0, 0]]  # node 2's leaves agree
    )
    assert torch.allclose(adv.double(), expected.double(), atol=1e-5)


def test_treerpo_of_a_flat_tree_is_grpo():
    nodes = torch.arange(8)[:, None].expand(8, 2).clone()
    groups = torch.tensor([0] * 4 + [1] * 4)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    mask = torch.ones(8, 2)
    assert torch.allclose(treerpo_advantage(rewards, groups, nodes, mask), grpo_advantage(rewards, groups, mask), atol=1e-6)


def test_leaf_paths_and_bad_paths():
    assert leaf_paths(TREE, MASK) == [[1, 3], [1, 4], [2, 5], [2, 6]]
    with pytest.raises(ValueError, match="twice"):
        leaf_paths(torch.tensor([[1, 2, 1]]), torch.ones(1, 3))


def test_split_budget():
    assert split_budget(8, 2) == [4, 4]
    assert split_budget(5, 2) == [3, 2]
    assert split_budget(3, 3) == [1, 1, 1]


def _rollout_cfg(**tree):
    return rollout_config({"strategy": "tree", "n": 8, "tree": {"segment_tokens": 2, "root_branching": 2, "branching": 2, **tree}})


def test_options_refused_before_loading():
    with pytest.raises(ConfigError, match="power of branching"):
        TreeOptions.from_config(rollout_config({"strategy": "tree", "n": 12, "tree": {"root_branching": 2, "branching": 2}}))
    with pytest.raises(ConfigError, match="no key"):
        TreeOptions.from_config(_rollout_cfg(depth=3))
    with pytest.raises(ConfigError, match="branching must be >= 2"):
        TreeOptions.from_config(_rollout_cfg(branching=1))
    assert TreeOptions.from_config(rollout_config({"strategy": "tree", "n": 6, "tree": {"root_branching": 2, "branching": 3}})).branching == 3
    with pytest.raises(ConfigError, match="algorithm/advantage="):
        validate_strategy(_rollout_cfg(), "grpo")
    validate_strategy(_rollout_cfg(), "tree")


def test_config_refusals(make_cfg):
    from rlbench.validation import validate_config

    with pytest.raises(ConfigError, match="Select rollout=multi_turn or rollout=tree"):
        validate_config(make_cfg("experiment=toy_learning/grpo", "algorithm/advantage=tree"))
    with pytest.raises(ConfigError, match="does not read the tree"):
        validate_config(make_cfg("experiment=toy_learning/grpo", "rollout=tree"))
    with pytest.raises(ConfigError, match="power of branching"):
        validate_config(make_cfg("experiment=toy_learning/grpo", "rollout=treerpo", "algorithm/advantage=treerpo", "rollout.n=6"))
    validate_config(make_cfg("experiment=toy_learning/grpo", "rollout=treerpo", "algorithm/advantage=treerpo"))


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def _strategy(model, tokenizer, n=8, max_new_tokens=8, seed=0, cfg=None, prefix_cache_mb=0, **tree):
    from rlbench.dataset.base import Problem
    from rlbench.reward.toy import EvenTokenReward

    sampler = GroupSampler(
        HFGenerateEngine(model, tokenizer, progress=False, prefix_cache_mb=prefix_cache_mb), EvenTokenReward(), tokenizer,
        {"system": None, "user": "{problem}"}, lambda rewards, inputs: rewards,
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    cfg = cfg if cfg is not None else _rollout_cfg(**tree)
    cfg.n = n
    strategy = make_strategy(cfg, RolloutSetup(sampler, n, params, torch.Generator().manual_seed(seed)))
    problems = [Problem(uid=f"p{i}", prompt=q, answer="0") for i, q in enumerate(["1 + 2", "3 + 4"])]
    return strategy, sampler, problems


def _check_tree(groups, n, max_new_tokens, eos):
    for group in groups:
        assert len(group) == n
        seen: dict[int, list[int]] = {}
        for leaf in group:
            assert len(leaf.extras['tree_nodes']) == len(leaf.response_ids) == len(leaf.logprobs) <= max_new_tokens
            assert (leaf.response_ids[-1] == eos) == leaf.finished  # finished = ended with EOS
            for node in dict.fromkeys(leaf.extras['tree_nodes']):  # a node's tokens are the same in every leaf that has it
                tokens = [t for t, k in zip(leaf.response_ids, leaf.extras['tree_nodes']) if k == node]
                assert seen.setdefault(node, tokens) == tokens


def test_tree_rollout_shares_prefixes(tiny):
    model, tokenizer = tiny
    strategy, sampler, problems = _strategy(model, tokenizer)
    graded, metrics = strategy.rollout(problems)
    groups = graded.groups
    _check_tree(groups, 8, 8, tokenizer.eos_token_id)
    cost = sampler.cost.take()
    # the tiny model never samples EOS in 8 tokens: a full binary tree 2 -> 4 -> 8 over 2-token
    # segments, then one 2-token segment per leaf: (2 + 4 + 8 + 8) x 2 tokens per prompt
    assert cost["generated_tokens"] == 2 * (2 + 4 + 8 + 8) * 2
    assert sum(len(c.response_ids) for g in groups for c in g) == 2 * 8 * 8  # what iid would have generated
    assert cost["reused_tokens"] > 0
    assert metrics["tree_fallback_leaves"] == 0
    first = groups[0]
    assert len({c.extras['tree_nodes'][0] for c in first}) == 2  # root_branching
    assert graded.rewards.shape == (16,)


def test_tree_logprobs_are_the_policys(tiny):
    model, tokenizer = tiny
    strategy, _, problems = _strategy(model, tokenizer, n=4, max_new_tokens=6)
    graded, _ = strategy.rollout(problems)
    for leaf in graded.groups[0]:
        ids = torch.tensor([list(leaf.prompt_ids) + leaf.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(leaf.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(leaf.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(leaf.logprobs), ref, atol=1e-4)


def test_groups_are_full_when_branches_end_early(tiny):
    """Responses that end at EOS early pass their branching to the survivors, or a fallback restarts paths
    (rollout=tree: TreePO's schedule; the scripted cases are in tests/test_tree_cores.py): every prompt
    still gets n leaves."""
    _, tokenizer = tiny
    model = build_tiny_model(tokenizer, None, seed=1)
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 9.0
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    strategy, _, problems = _strategy(model, tokenizer, n=8, max_new_tokens=12, seed=3)
    graded, metrics = strategy.rollout(problems)
    _check_tree(graded.groups, 8, 12, tokenizer.eos_token_id)
    assert metrics["tree_stop_eos"] == sum(c.finished for g in graded.groups for c in g) > 0


@pytest.mark.parametrize("eos_bias", [0.0, 9.0])
def test_tree_with_kept_kv_grows_the_same_tree(tiny, eos_bias):
    """rollout.prefix_cache_mb > 0: each round extends the KV of the last round's rows instead of
    prefilling the path again; the same leaves (tokens, nodes, ends) and log-probs up to float rounding,
    with and without early ends and fallbacks."""
    _, tokenizer = tiny
    model = build_tiny_model(tokenizer, None, seed=1)
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = eos_bias
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    runs = []
    for budget in (0, 8):
        strategy, sampler, problems = _strategy(model, tokenizer, n=8, max_new_tokens=12, seed=3, prefix_cache_mb=budget)
        graded, metrics = strategy.rollout(problems)
        runs.append(([[(c.response_ids, c.extras['tree_nodes'], c.finished) for c in g] for g in graded.groups],
                     torch.tensor([lp for g in graded.groups for c in g for lp in c.logprobs]), metrics, sampler.engine))
    (leaves, logprobs, metrics, _), (cached_leaves, cached_logprobs, cached_metrics, engine) = runs
    assert cached_leaves == leaves and cached_metrics == metrics
    assert torch.allclose(cached_logprobs, logprobs, rtol=0, atol=1e-5)
    assert engine.prefix_cache.stats.hits >= metrics["tree_rounds"] - 1  # every round after the first reused KV


def test_micro_groups_give_the_full_groups_statistics(tiny):
    """Decoding each group in rounds of 2 responses per prompt gives exactly the responses, rewards and
    group-relative advantages of decoding it whole (size = n)."""
    model, tokenizer = tiny

    def run(size):
        cfg = rollout_config({"strategy": "micro_groups", "micro_groups": {"size": size}})
        strategy, sampler, problems = _strategy(model, tokenizer, n=8, seed=5, cfg=cfg)
        graded, metrics = strategy.rollout(problems)
        return graded, metrics, sampler.cost.take()

    micro, micro_metrics, micro_cost = run(2)
    whole, whole_metrics, _ = run(8)
    assert micro_metrics["micro_group_rounds"] == 4 and whole_metrics["micro_group_rounds"] == 1
    assert [[(c.response_ids, c.logprobs) for c in g] for g in micro.groups] == [[(c.response_ids, c.logprobs) for c in g] for g in whole.groups]
    assert torch.equal(micro.rewards, whole.rewards)
    mask = torch.ones(16, 1)
    assert torch.equal(grpo_advantage(micro.rewards, micro.group_index, mask), grpo_advantage(whole.rewards, whole.group_index, mask))
    assert len({tuple(c.response_ids) for c in micro.groups[0]}) > 1  # the responses of a group differ
    assert micro_cost["generated_responses"] == 16


def test_micro_group_size_must_divide_n():
    with pytest.raises(ConfigError, match=r"must divide rollout.n=8.*\[1, 2, 4, 8\]"):
        validate_strategy(rollout_config({"strategy": "micro_groups", "n": 8, "micro_groups": {"size": 3}}), "grpo")
    validate_strategy(rollout_config({"strategy": "micro_groups", "n": 8, "micro_groups": {"size": 4}}), "grpo")


@pytest.mark.gpu
@pytest.mark.skipif(not has_vllm_gpu(), reason="needs CUDA and vLLM")
@pytest.mark.parametrize("strategy", ["tree", "treerpo", "micro_groups"])
def test_strategy_on_the_vllm_engine_gpu(strategy):
    """Each strategy of this module through the vLLM engine (prefix caching serves the tree's paths):
    every group has its n responses, tree leaves share their nodes' tokens."""
    from rlbench.dataset.base import Problem
    from rlbench.reward.toy import EvenTokenReward
    from rlbench.rollout.engines.vllm import VLLMEngine

    model, tokenizer = load_policy(model_preset("smollm2_135m"), device="cuda")
    engine = VLLMEngine(model, tokenizer, gpu_memory_utilization=0.2, enforce_eager=True)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"system": None, "user": "{problem}"}, lambda r, i: r)
    block = {"micro_groups": {"size": 2}} if strategy == "micro_groups" else {strategy: {"segment_tokens": 4}}
    cfg = rollout_config({"strategy": strategy, "n": 8, **block})
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    graded, _ = make_strategy(cfg, RolloutSetup(sampler, 8, params, torch.Generator().manual_seed(0))).rollout(
        [Problem(uid="p0", prompt="1 + 2", answer="3"), Problem(uid="p1", prompt="3 + 4", answer="7")]
    )
    assert [len(g) for g in graded.groups] == [8, 8]
    if strategy != "micro_groups":
        _check_tree(graded.groups, 8, 16, tokenizer.eos_token_id)
