"""AEPO's entropy-balanced rollout (rlbench/rollout/strategies/entropy_branch.py, arXiv:2510.14545)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.model import load_policy
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, HFGenerateEngine, RolloutSetup, make_strategy, validate_strategy
from rlbench.rollout.engines.base import Completion, PositionStats, SamplingParams
from rlbench.rollout.strategies.entropy_branch import (
    EntropyBranchOptions,
    EntropyBranchRollout,
    branch_probability,
    global_samples,
    segment_entropies,
)

from conftest import smoke_cli_steps, model_preset

ROOT = Path(__file__).resolve().parents[1]


def test_global_samples_follow_the_entropy_gap():
    # m = clip(floor(n sigmoid(beta (H_root - H_step))) + 1, 1, n)
    assert global_samples(8, 0.5, 0.5, 0.5) == 5  # sigmoid(0) = 1/2: floor(4) + 1
    assert global_samples(8, 0.9, 0.1, 0.5) == int(8 / (1 + math.exp(-0.4))) + 1 == 5
    assert global_samples(8, 4.0, 0.0, 2.0) == 8  # a question more uncertain than the steps: global samples
    assert global_samples(8, 0.0, 4.0, 2.0) == 1  # uncertain steps: one global sample, the rest branches


def test_branch_probability_falls_with_consecutive_branches():
    options = EntropyBranchOptions(entropy_weight=2.0, penalty=0.05)
    assert branch_probability(0.4, 0.1, 0, options) == pytest.approx(0.6)
    assert branch_probability(0.4, 0.1, 4, options) == pytest.approx(0.6 * 0.8)
    probabilities = [branch_probability(0.5, 0.2, l, options) for l in range(25)]
    assert probabilities == sorted(probabilities, reverse=True) and probabilities[-1] == 0.0
    assert branch_probability(0.9, 0.5, 0, options) == 1.0  # clipped


def test_segment_entropies_are_normalised_means():
    stats = PositionStats(torch.zeros(5, 2, dtype=torch.long), torch.zeros(5, 2, dtype=torch.float64),
                          torch.tensor([1.0, 3.0, 2.0, 2.0, 4.0], dtype=torch.float64), 100)
    assert segment_entropies(stats, 2) == pytest.approx([2 / math.log(100), 2 / math.log(100), 4 / math.log(100)])


class ScriptedEngine:
    """Responses are 8 tokens: an unprefixed request gets [1..8]; a prefixed one its prefix then 9s."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, params, generator=None):
        self.calls.append([(r.prefix_ids, r.n, params.max_new_tokens) for r in requests])
        out = []
        for i, r in enumerate(requests):
            ids = list(r.prefix_ids) + ([9] * params.max_new_tokens if r.prefix_ids else list(range(1, 9)))[: params.max_new_tokens]
            out.append([Completion(i, r.prompt_ids, ids, [0.0] * len(ids), False, prefix_len=len(r.prefix_ids)) for _ in range(r.n)])
        return out


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def scripted_setup(n=4):
    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    sampler = Sampler(ScriptedEngine(), EvenTokenReward(), Tokenizer(), {}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))


def entropy_stats(per_token):
    """PositionStats whose normalised entropies are ``per_token`` (vocabulary e^1: log |V| = 1)."""
    e = torch.tensor(per_token, dtype=torch.float64)
    return PositionStats(torch.zeros(len(e), 2, dtype=torch.long), torch.zeros(len(e), 2, dtype=torch.float64), e, math.e)


def test_budget_split_and_branches_from_segment_boundaries(monkeypatch):
    # segments of 2 tokens over 8: H = [0.2, 0.9, 0.9, 0.9] per segment; H_root 0.2 < H_step 0.9
    monkeypatch.setattr(ScriptedEngine, "position_stats", raising=False, value=lambda engine, items, params: [
        entropy_stats([0.2, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]) for _ in items])
    setup = scripted_setup(n=4)
    options = EntropyBranchOptions(segment_tokens=2, beta=0.5, entropy_weight=1.0, branch_threshold=0.5, penalty=0.05)
    groups, metrics = EntropyBranchRollout(setup, options).rollout([Problem("3", "q", "a")])
    m = global_samples(4, 0.2, 0.9, 0.5)
    assert m == int(4 / (1 + math.exp(0.35))) + 1 == 2
    calls = setup.sampler.engine.calls
    assert calls[0] == [((), 1, 8)] and calls[1] == [((), m - 1, 8)]
    # every boundary has u + 0.7 >= 0.5 (with the penalty at most 5% per consecutive boundary): the first
    # boundary (token 2) branches both global samples, which fills the group
    assert calls[2] == [((1, 2), 1, 8), ((1, 2), 1, 8)]
    assert metrics == {"entropy_branch_global": 2.0, "entropy_branch_branches": 2.0, "entropy_branch_filled": 0.0}
    assert [c.response_ids for c in groups.groups[0]] == [list(range(1, 9))] * 2 + [[1, 2] + [9] * 6] * 2
    assert [c.behaviour for c in groups.groups[0]] == ["policy", "policy", "branch", "branch"]


def test_no_branch_leaves_global_samples_only(monkeypatch):
    monkeypatch.setattr(ScriptedEngine, "position_stats", raising=False, value=lambda engine, items, params: [
        entropy_stats([0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]) for _ in items])
    setup = scripted_setup(n=4)
    options = EntropyBranchOptions(segment_tokens=2, entropy_weight=10.0)  # entropy falls: u - 8 < 0.5 always
    groups, metrics = EntropyBranchRollout(setup, options).rollout([Problem("3", "q", "a")])
    assert metrics["entropy_branch_branches"] == 0 and len(groups.groups[0]) == 4
    assert all(c.prefix_len == 0 for c in groups.groups[0])
    assert metrics["entropy_branch_global"] + metrics["entropy_branch_filled"] == 4


def test_on_the_tiny_model_branches_continue_a_global_sample_from_a_boundary():
    model, tokenizer = load_policy(model_preset("tiny"), seed=0)
    engine = HFGenerateEngine(model, tokenizer, batch_size=16, progress=False)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 4, SamplingParams(1.0, 1.0, 6), torch.Generator().manual_seed(0))
    options = EntropyBranchOptions(segment_tokens=2, beta=0.0, branch_threshold=0.0)  # m = floor(4 / 2) + 1 = 3
    groups, metrics = EntropyBranchRollout(setup, options).rollout([Problem("a", "question a", "0")])
    *globals_, branch = groups.groups[0]
    assert metrics["entropy_branch_global"] == 3 and metrics["entropy_branch_branches"] == 1 and len(globals_) == 3
    # the first boundary (token 2) of the first global sample takes the one branch slot
    assert branch.prefix_len == 2 and branch.response_ids[:2] == globals_[0].response_ids[:2]
    assert len(branch.response_ids) <= 6 and branch.behaviour == "branch"
    assert all(c.prefix_len == 0 and c.behaviour == "policy" for c in globals_)


def test_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=entropy_branch").rollout)
    validate_strategy(cfg, "grpo")
    assert isinstance(make_strategy(cfg, scripted_setup()), EntropyBranchRollout)
    base = {"strategy": "entropy_branch", "n": 4, "max_new_tokens": 8}
    with pytest.raises(ConfigError, match=r"segment_tokens=8 is not shorter than rollout.max_new_tokens=8"):
        validate_strategy(rollout_config({**base, "entropy_branch": {"segment_tokens": 8}}), "grpo")
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        validate_strategy(rollout_config({**base, "n": 1}), "grpo")
    validate_strategy(rollout_config({**base, "engine": "vllm"}), "grpo")  # the engine interface serves both
    with pytest.raises(ConfigError, match=r"no key\(s\) \['alpha'\]"):
        validate_strategy(rollout_config({**base, "entropy_branch": {"alpha": 1}}), "grpo")


@pytest.mark.slow
def test_cli_run_with_the_aepo_loss(tmp_path):
    """`rlbench experiment=smoke algorithm=aepo rollout=entropy_branch`: both halves of AEPO."""
    steps = smoke_cli_steps(
        tmp_path / "run", "algorithm=aepo", "rollout=entropy_branch", "rollout.n=4", "rollout.entropy_branch.beta=0",
        "rollout.entropy_branch.branch_threshold=0"
    )
    for step in steps:  # 2 prompts: beta 0 gives 3 global samples each (floor(4 / 2) + 1), then 1 branch each
        assert step["entropy_branch_global"] == 6 and step["entropy_branch_branches"] == 2 and step["responses_branch"] == 2
        assert step["reused_tokens"] > 0
