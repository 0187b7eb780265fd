"""LATR lookahead rollouts (rlbench/rollout/strategies/lookahead.py, arXiv:2510.24302)."""

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
from rlbench.rollout.strategies.lookahead import (
    LookaheadOptions,
    LookaheadRollout,
    branch_points,
    continuations_similar,
    is_math_symbol,
    is_stop_word,
    math_symbol_tokens,
    rouge_l_f1,
    stop_word_tokens,
    suffix_match,
    too_similar,
)

from conftest import smoke_cli_steps, model_preset

ROOT = Path(__file__).resolve().parents[1]


def stats(rows):
    """PositionStats from [(a1, p1, a2, p2), ...]."""
    return PositionStats(torch.tensor([[a1, a2] for a1, _, a2, _ in rows]),
                         torch.tensor([[p1, p2] for _, p1, _, p2 in rows], dtype=torch.float64), torch.zeros(len(rows)), 100)


def test_branch_points_need_a_likely_runner_up_close_to_the_top_token():
    s = stats([(5, 0.5, 6, 0.4), (5, 0.9, 6, 0.05), (7, 0.45, 8, 0.1), (3, 0.35, 4, 0.3), (1, 0.5, 2, 0.16)])
    # p2 > 0.15 and p1 - p2 < 0.25: positions 0 (0.1 apart), 3 (0.05 apart); 4 is 0.34 apart, 2 has p2 = 0.1
    assert branch_points(s, [5, 5, 7, 4, 1], 0.15, 0.25) == [(0, 6), (3, 3)]  # the top-two token not taken
    assert branch_points(s, [5, 5, 7, 4, 1], 1.0, 0.25) == []  # abs threshold 1: never


def test_the_absolute_threshold_applies_to_the_runner_up_not_to_the_top_token():
    """LATR's rule reads p(a2) > abs_threshold: a top token above the threshold with a runner-up below
    it is no branch point, however close the two are. Probabilities are exact in binary, so the strict
    ``>`` is checked at the boundary too."""
    s = stats([(1, 0.25, 2, 0.125), (3, 0.375, 4, 0.25), (5, 0.5, 6, 0.0625)])
    assert branch_points(s, [1, 3, 5], 0.125, 0.5) == [(1, 4)]  # p2 = 0.125 is not above 0.125
    assert branch_points(s, [1, 3, 5], 0.0625, 0.5) == [(0, 2), (1, 4)]
    assert branch_points(s, [2, 4, 6], 0.25, 1.0) == []  # every p1 is above 0.25, no p2 is


def test_rouge_l_f1_and_the_pruning_rule():
    assert rouge_l_f1([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)  # LCS 3: P = R = 3/4
    assert rouge_l_f1([1, 2], [1, 2, 3, 4]) == pytest.approx(2 * 1.0 * 0.5 / 1.5)  # P 1, R 1/2
    assert rouge_l_f1([1, 2], [3, 4]) == 0.0 and rouge_l_f1([], [1]) == 0.0
    trunk = [9, 1, 2, 3, 4, 5]
    assert too_similar([9, 7, 2, 3, 4, 5], trunk, 1, (4,), 0.5)  # only the branch token differs: F1 0.8
    assert not too_similar([9, 7, 8, 6, 0, 10], trunk, 1, (4,), 0.5)
    assert too_similar([9, 7, 2, 3, 0, 10], trunk, 1, (2, 4), 0.5)  # similar at checkpoint 2 (F1 2/3)


def test_the_share_of_each_group_follows_the_schedule():
    options = LookaheadOptions(mix_schedule=((0, 1.0), (100, 0.75), (200, 0.5)))
    assert [options.share(s) for s in (0, 99, 100, 150, 200, 10_000)] == [1.0, 1.0, 0.75, 0.75, 0.5, 0.5]


class ScriptedEngine:
    """generate: a request without prefix gets [10, 11, 12, 13, 14, 15] (budget-cut); a prefixed one
    gets its prefix then the tokens of ``tails[last prefix token]`` (budget-cut); calls are recorded."""

    def __init__(self, tails):
        self.tails, self.calls = tails, []

    def generate(self, requests, params, generator=None):
        self.calls.append([(r.prefix_ids, r.n, params.max_new_tokens) for r in requests])
        out = []
        for i, r in enumerate(requests):
            new = (self.tails[r.prefix_ids[-1]] if r.prefix_ids else [10, 11, 12, 13, 14, 15])[: params.max_new_tokens]
            out.append([Completion(i, r.prompt_ids, [*r.prefix_ids, *new], [0.0] * (len(r.prefix_ids) + len(new)), False,
                                   prefix_len=len(r.prefix_ids)) for _ in range(r.n)])
        return out


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def scripted_setup(tails, n=3, budget=6):
    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    sampler = Sampler(ScriptedEngine(tails), EvenTokenReward(), Tokenizer(), {}, lambda r, _: r)
    return RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, budget), torch.Generator().manual_seed(0))


def test_branches_look_ahead_from_the_trunk_and_similar_ones_are_pruned(monkeypatch):
    # trunk [10..15]; branch points at t=1 (token 21) and t=3 (token 23) and t=4 (token 24)
    monkeypatch.setattr(ScriptedEngine, "position_stats", raising=False, value=lambda engine, items, params: [
        stats([(10, 0.9, 20, 0.05), (11, 0.4, 21, 0.35), (12, 0.9, 22, 0.05), (13, 0.4, 23, 0.3), (14, 0.4, 24, 0.3),
               (15, 0.9, 25, 0.05)])])
    # after 21 the branch rejoins the trunk (12, 13: too similar); after 23 and 24 it differs
    tails = {21: [12, 13, 14, 15], 23: [30, 31, 32], 24: [40, 41]}
    setup = scripted_setup(tails, n=3)
    options = LookaheadOptions(checkpoints=(2,), mode="resample")
    groups, metrics = LookaheadRollout(setup, options).rollout([Problem("7", "q", "a")])
    calls = setup.sampler.engine.calls
    assert calls[0] == [((), 1, 6)]  # the trunk
    # lookahead: min(2, budget - t - 1) tokens after trunk[:t] + [branch token], one call per budget
    assert calls[1:3] == [[((10, 11, 12, 13, 24), 1, 1)], [((10, 21), 1, 2), ((10, 11, 12, 23), 1, 2)]]
    assert metrics == {"lookahead_share": 1.0, "lookahead_prompts": 1.0, "lookahead_candidates": 3.0,
                       "lookahead_pruned": 1.0, "lookahead_branches": 2.0, "lookahead_levels": 1.0, "lookahead_filled": 0.0}
    responses = [c.response_ids for c in groups.groups[0]]
    assert responses[0] == [10, 11, 12, 13, 14, 15]
    # both survivors filled the budget in their lookahead: no completion call
    assert sorted(responses[1:]) == [[10, 11, 12, 13, 24, 40], [10, 11, 12, 23, 30, 31]] and len(calls) == 3
    assert [c.behaviour for c in groups.groups[0]] == ["policy", "branch", "branch"]


def test_no_branch_point_gives_plain_sampling(monkeypatch):
    monkeypatch.setattr(ScriptedEngine, "position_stats", raising=False, value=
                        lambda engine, items, params: [stats([(10, 0.99, 20, 0.01)] * 6) for _ in items])
    setup = scripted_setup({}, n=4)
    groups, metrics = LookaheadRollout(setup, LookaheadOptions(mode="resample")).rollout([Problem("1", "q", "a"), Problem("2", "q", "a")])
    assert metrics["lookahead_candidates"] == 0 and metrics["lookahead_filled"] == 6
    assert [len(g) for g in groups.groups] == [4, 4]
    assert all(c.prefix_len == 0 and c.behaviour == "policy" for g in groups.groups for c in g)


def test_the_share_is_of_each_group_and_the_step_count_is_state(monkeypatch):
    """mix_schedule gives the share of each group that LATR's tree holds (the released mix_ratio): with
    n = 4 and share 0.5, a trunk, its tree of 2 (no branch point here: filled i.i.d.) and 2 i.i.d."""
    monkeypatch.setattr(ScriptedEngine, "position_stats", raising=False, value=
                        lambda engine, items, params: [stats([(10, 0.99, 20, 0.01)] * 6) for _ in items])
    setup = scripted_setup({}, n=4)
    strategy = LookaheadRollout(setup, LookaheadOptions(mix_schedule=((0, 1.0), (1, 0.5), (2, 0.25)), mode="resample", fill="iid"))
    strategy.load_state_dict({"steps": 1})
    groups, metrics = strategy.rollout([Problem(str(i), "q", "a") for i in range(2)])
    assert metrics["lookahead_share"] == 0.5 and metrics["lookahead_prompts"] == 2 and metrics["lookahead_filled"] == 2
    assert setup.sampler.engine.calls[0] == [((), 3, 6), ((), 3, 6)]  # the trunk and the 2 i.i.d. responses
    assert setup.sampler.engine.calls[-1] == [((), 1, 6), ((), 1, 6)]  # the fill
    assert [len(g) for g in groups.groups] == [4, 4]
    setup.sampler.engine.calls.clear()
    _, metrics = strategy.rollout([Problem(str(i), "q", "a") for i in range(2)])  # share 0.25: a tree of 1 is no tree
    assert metrics["lookahead_prompts"] == 0 and setup.sampler.engine.calls == [[((), 4, 6), ((), 4, 6)]]
    assert strategy.state_dict() == {"steps": 3}


TRUNK, FIRST, SECOND = (10, 11, 12, 13, 14, 15), (10, 21, 30, 31, 32, 33), (10, 21, 30, 40, 50, 51)


def two_level_stats(engine, items, params):
    """The trunk hesitates at t = 1 (runner-up 21); its branch FIRST hesitates at t = 3 (runner-up 40)."""
    out = []
    for _, response in items:
        rows = [(token, 0.99, 0, 0.01) for token in response]
        if tuple(response) == TRUNK:
            rows[1] = (11, 0.4, 21, 0.35)
        if tuple(response) == FIRST:
            rows[3] = (31, 0.4, 40, 0.35)
        out.append(stats(rows))
    return out


@pytest.mark.parametrize("window", [1024, 3])
def test_branches_branch_again_within_the_branch_window(monkeypatch, window):
    """More than one level: the trunk's branch FIRST is completed, scored, and branches at its own branch
    point after its birth (SECOND); with branch_window 3 that point (t = 3) is past the window and the
    tree is filled with i.i.d. responses instead."""
    monkeypatch.setattr(ScriptedEngine, "position_stats", raising=False, value=two_level_stats)
    setup = scripted_setup({21: [30, 31], 31: [32, 33], 40: [50], 50: [51]}, n=4)
    options = LookaheadOptions(checkpoints=(2,), branch_window=window, mode="resample", fill="iid")
    groups, metrics = LookaheadRollout(setup, options).rollout([Problem("7", "q", "a")])
    responses = [tuple(c.response_ids) for c in groups.groups[0]]
    if window == 1024:
        assert responses == [TRUNK, FIRST, SECOND, TRUNK]  # the fourth: one i.i.d. fill
        assert metrics["lookahead_levels"] == 2 and metrics["lookahead_branches"] == 2 and metrics["lookahead_filled"] == 1
        # SECOND shares FIRST up to its branch token, which is FIRST's runner-up at t = 3
        assert SECOND[:3] == FIRST[:3] and SECOND[3] == 40
    else:
        assert responses == [TRUNK, FIRST, TRUNK, TRUNK]
        assert metrics["lookahead_levels"] == 1 and metrics["lookahead_filled"] == 2
    assert [c.behaviour for c in groups.groups[0]][:2] == ["policy", "branch"]


def test_suffix_match_by_hand_and_as_a_pruning_rule():
    assert suffix_match([1, 2, 3, 4], [9, 3, 4, 8]) == pytest.approx(0.5)  # the suffix [3, 4] occurs in b
    assert suffix_match([9, 3, 4, 8], [1, 2, 3, 4]) == pytest.approx(0.5)  # b's suffix [3, 4] occurs in a: symmetric
    assert suffix_match([1, 2, 3], [4, 5, 6]) == 0.0 and suffix_match([], [1]) == 0.0
    assert suffix_match([7, 2, 3, 4], [1, 2, 3, 4]) == pytest.approx(0.75)  # a branch that rejoins its parent's text
    trunk = [9, 1, 2, 3, 4, 5]
    branch = [9, 7, 2, 3, 4, 5]  # ROUGE-L F1 of t..t+2 = [7, 2, 3] / [1, 2, 3]: 2/3; suffix match 2/3
    assert not too_similar(branch, trunk, 1, (2,), 0.9)
    assert too_similar(branch, trunk, 1, (2,), 0.9, suffix_threshold=0.2)
    assert not too_similar([9, 7, 8, 6, 0, 10], trunk, 1, (2, 4), 0.9, suffix_threshold=0.2)


@pytest.fixture(scope="module")
def tiny():
    return load_policy(model_preset("tiny"), seed=0)


def test_on_the_tiny_model_branches_share_the_trunk_up_to_their_branch_token(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, batch_size=16, progress=False)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"user": "{problem}"}, lambda r, _: r)
    params = SamplingParams(1.0, 1.0, 6)
    setup = RolloutSetup(sampler, 4, params, torch.Generator().manual_seed(0))
    # every position a branch point, and no pruning: 3 branches per trunk
    options = LookaheadOptions(abs_threshold=0.0, rel_threshold=1.0, checkpoints=(2,), rouge_l_threshold=1.0,
                               suffix_match_threshold=1.0, mode="resample")
    groups, metrics = LookaheadRollout(setup, options).rollout([Problem("a", "question a", "0")])
    trunk, *branches = groups.groups[0]
    assert metrics["lookahead_branches"] == 3 and len(branches) == 3
    prompt = trunk.prompt_ids
    top = engine.position_stats([(prompt, tuple(trunk.response_ids))], params)[0].top_tokens
    for t, branch in enumerate(branches):  # the earliest branch points: t = 0, 1, 2
        assert branch.response_ids[:t] == trunk.response_ids[:t]
        expected = int(top[t, 1]) if trunk.response_ids[t] == int(top[t, 0]) else int(top[t, 0])
        assert branch.response_ids[t] == expected != trunk.response_ids[t]
        assert len(branch.response_ids) <= 6 and branch.behaviour == "branch"
    cost = sampler.cost.take()
    assert cost["reused_tokens"] > 0


def test_settings_are_checked_before_the_model_loads(make_cfg):
    cfg = rollout_config(make_cfg("rollout=lookahead").rollout)
    validate_strategy(cfg, "grpo")
    assert isinstance(make_strategy(rollout_config(make_cfg("rollout=lookahead", "rollout.lookahead.mode=resample").rollout),
                                    scripted_setup({})), LookaheadRollout)
    base = {"strategy": "lookahead", "n": 4, "max_new_tokens": 8}
    with pytest.raises(ConfigError, match=r"checkpoints reach 8 tokens, not shorter than rollout.max_new_tokens=8"):
        validate_strategy(rollout_config({**base, "lookahead": {"checkpoints": [2, 8]}}), "grpo")
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        validate_strategy(rollout_config({**base, "n": 1}), "grpo")
    with pytest.raises(ConfigError, match="rollout.engine=vllm cannot: use rollout.engine=hf or rollout.lookahead.mode=resample"):
        validate_strategy(rollout_config({**base, "engine": "vllm"}), "grpo")
    validate_strategy(rollout_config({**base, "engine": "vllm", "lookahead": {"mode": "resample"}}), "grpo")  # both engines
    with pytest.raises(ConfigError, match="mode must be one of decode, resample"):
        validate_strategy(rollout_config({**base, "lookahead": {"mode": "tokens"}}), "grpo")
    with pytest.raises(ConfigError, match="needs an engine that branches while decoding"):
        LookaheadRollout(scripted_setup({}), LookaheadOptions())
    with pytest.raises(ConfigError, match="mix_schedule must be"):
        validate_strategy(rollout_config({**base, "lookahead": {"mix_schedule": [[5, 1.0]]}}), "grpo")
    with pytest.raises(ConfigError, match="suffix_match_threshold must be in"):
        validate_strategy(rollout_config({**base, "lookahead": {"suffix_match_threshold": 2}}), "grpo")
    with pytest.raises(ConfigError, match="branch_window must be >= 1"):
        validate_strategy(rollout_config({**base, "lookahead": {"branch_window": 0}}), "grpo")
    with pytest.raises(ConfigError, match="abs_threshold must be in"):
        validate_strategy(rollout_config({**base, "lookahead": {"abs_threshold": 1.5}}), "grpo")
    with pytest.raises(ConfigError, match="parent_token must be one of top1, sampled"):
        validate_strategy(rollout_config({**base, "lookahead": {"parent_token": "top2"}}), "grpo")
    with pytest.raises(ConfigError, match="fill must be one of repeat, iid"):
        validate_strategy(rollout_config({**base, "lookahead": {"fill": "first"}}), "grpo")
    with pytest.raises(ConfigError, match="return_threshold_decay must be in"):
        validate_strategy(rollout_config({**base, "lookahead": {"return_threshold_decay": -0.1}}), "grpo")
    # the released defaults (starreeze/latr model/utils.py, scripts/grpo-kt-math.sh)
    options = LookaheadOptions.from_config(cfg)
    assert (options.parent_token, options.fill, options.stop_word_filter, options.return_threshold,
            options.return_threshold_decay) == ("top1", "repeat", False, 0.98, 0.05)
    assert (options.rule().return_threshold, options.rule().return_decay) == (0.98, 0.05)
    with pytest.raises(ConfigError, match=r"no key\(s\) \['depth'\]"):
        validate_strategy(rollout_config({**base, "lookahead": {"depth": 2}}), "grpo")


@pytest.mark.slow
def test_cli_run_branches_and_logs_what_it_did(tmp_path):
    """`rlbench experiment=smoke rollout=lookahead` with thresholds that make every position a branch
    point and prune nothing, one branch per token (n = 3: a trunk and branches at its tokens 0 and 1, the
    second sharing its first token)."""
    steps = smoke_cli_steps(
        tmp_path / "run", "rollout=lookahead", "rollout.n=3", "rollout.lookahead.abs_threshold=0",
        "rollout.lookahead.rel_threshold=1", "rollout.lookahead.checkpoints=[2]",
        "rollout.lookahead.rouge_l_threshold=1", "rollout.lookahead.suffix_match_threshold=1",
        "rollout.lookahead.max_branches_per_token=1",
    )
    for step in steps:  # 2 prompts, 2 branches each
        assert step["lookahead_share"] == 1.0 and step["lookahead_branches"] == 4 and step["responses_branch"] == 4
        assert step["reused_tokens"] > 0 and step["generated_responses"] >= 6


# ---------------------------------------------------------------- mode decode: branching while decoding

from rlbench.rollout.engines.base import GenerationRequest  # noqa: E402
from rlbench.rollout.engines.branching import BranchRule, spawn_tokens  # noqa: E402

def NEVER_PRUNE(a, b):
    return False


def test_spawn_tokens_by_hand():
    """A non-sampled top-m token v branches iff p(v) > abs and p(a1) - p(v) < rel, at most max_per_token."""
    rule = BranchRule(0.15, 0.25, (4,), NEVER_PRUNE)
    assert spawn_tokens([5, 6], [0.5, 0.4], 5, rule) == [6]  # 0.4 > 0.15, 0.5 - 0.4 = 0.1 < 0.25
    assert spawn_tokens([5, 6], [0.5, 0.4], 6, rule) == [5]  # sampled the runner-up: the top token branches
    assert spawn_tokens([5, 6], [0.5, 0.2], 5, rule) == []  # 0.3 apart
    assert spawn_tokens([5, 6], [0.3, 0.125], 5, rule) == []  # p(a2) = 0.125 is not above 0.15
    assert spawn_tokens([5, 6], [0.3, 0.25], 9, rule) == [5, 6]  # sampled neither: both branch
    assert spawn_tokens([5, 6], [0.3, 0.25], 9, BranchRule(0.15, 0.25, (4,), NEVER_PRUNE, max_per_token=1)) == [5]
    assert spawn_tokens([5, 6], [0.5, 0.5], 5, BranchRule(1.0, 0.25, (4,), NEVER_PRUNE)) == []  # abs 1: never


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    model, tokenizer = tiny
    prompts = [tuple(tokenizer.encode("question a")), tuple(tokenizer.encode("a longer question b here"))]
    return HFGenerateEngine(model, tokenizer, batch_size=16, progress=False), prompts


def test_never_branching_gives_the_plain_samples(tiny_engine):
    """abs_threshold 1: no branch, and each tree's one member (the trunk) is the plain loop's sample of the
    same prompt with n = 1 and the same generator state, token for token and log-prob for log-prob (the
    same prefill, draws and decoding steps; two prompts of different lengths in one batch)."""
    engine, prompts = tiny_engine
    params = SamplingParams(1.0, 1.0, 12)
    rule = BranchRule(1.0, 0.25, (4,), NEVER_PRUNE, parent_top1=False)
    trees = engine.generate_branching([GenerationRequest(p, 4) for p in prompts], params, rule, torch.Generator().manual_seed(3))
    plain = engine.generate([GenerationRequest(p, 1) for p in prompts], params, torch.Generator().manual_seed(3))
    for tree, (sample,) in zip(trees, plain):
        assert len(tree.members) == 1 and tree.spawned == 0 and tree.parents == [-1]
        (trunk,) = tree.members
        assert trunk.response_ids == sample.response_ids and trunk.logprobs == sample.logprobs
        assert trunk.finished == sample.finished and trunk.behaviour == "policy"


def test_branches_spawn_exactly_at_eligible_positions_and_share_their_parents_prefix(tiny_engine):
    """Temperature 0.1 makes the tiny model's distribution peaked with some close top-two positions. No
    pruning and room for 64: the branches born of each member are exactly the tokens spawn_tokens gives at
    each position of it (its distribution recomputed by position_stats) after its own branch point; a
    branch equals its parent before its branch point and differs there; every log-prob, the branch
    token's included, is the engine's score_prefixes of the sequence."""
    engine, prompts = tiny_engine
    params = SamplingParams(0.1, 1.0, 10)
    rule = BranchRule(0.1, 0.3, (3,), NEVER_PRUNE, parent_top1=False)
    trees = engine.generate_branching([GenerationRequest(prompts[0], 64)], params, rule, torch.Generator().manual_seed(0))
    assert sum(t.spawned for t in trees) >= 10
    for tree in trees:
        members = tree.members
        assert len(members) < 64 and tree.pruned == 0  # the tree never filled: every eligible position branched
        stats = engine.position_stats([(c.prompt_ids, tuple(c.response_ids)) for c in members], params)
        expected, found = [], []
        for k, (member, s) in enumerate(zip(members, stats)):
            for t in range(tree.births[k] + 1, len(member.response_ids)):
                top, probs = [int(x) for x in s.top_tokens[t]], [float(x) for x in s.top_probs[t]]
                expected += [(k, t, v) for v in spawn_tokens(top, probs, member.response_ids[t], rule)]
        for k, (parent, t) in enumerate(zip(tree.parents, tree.births)):
            if parent < 0:
                continue
            branch, source = members[k].response_ids, members[parent].response_ids
            assert branch[:t] == source[:t] and branch[t] != source[t] and members[k].behaviour == "branch"
            found.append((parent, t, branch[t]))
        assert sorted(found) == sorted(expected)
        scores = engine.score_prefixes([(c.prompt_ids, tuple(c.response_ids)) for c in members], params)
        for member, score in zip(members, scores):
            assert member.logprobs == pytest.approx(score, abs=1e-5)


class ForcedNextToken(torch.nn.Module):
    """The tiny model with its next-token distribution forced: a function of the current token alone,
    ``chain[token]`` (token -> {next: probability}; any other token -> 10). The model still runs (its KV
    cache is what the engine copies and drops); only its logits are replaced."""

    def __init__(self, model, chain):
        super().__init__()
        self.inner, self.chain = model, chain
        self.generation_config = model.generation_config

    def forward(self, input_ids=None, cache=None, logits_to_keep=1, **kw):
        from rlbench.rollout.engines.hf import _cache_argument

        out = self.inner(input_ids=input_ids, logits_to_keep=logits_to_keep, **{_cache_argument(self.inner): cache}, **kw)
        tokens = input_ids[:, -out.logits.shape[1]:]
        logits = torch.full_like(out.logits, -30.0)
        for (b, t), token in zip(torch.cartesian_prod(torch.arange(tokens.shape[0]), torch.arange(tokens.shape[1])).tolist(),
                                 tokens.flatten().tolist()):
            for nxt, p in self.chain.get(token, {10: 1.0}).items():
                logits[b, t, nxt] = float(torch.tensor(p).log())
        out.logits = logits
        return out


# the trunk opens with 10, then hesitates between 11 (0.5) and 12 (0.45): the only branch point; both
# continue with 13 forever (REJOIN: the branch's continuation is the trunk's) or 13 and 14 (DIVERGE)
REJOIN = {10: {11: 0.5, 12: 0.45, 15: 0.05}, 11: {13: 1.0}, 12: {13: 1.0}, 13: {13: 1.0}}
DIVERGE = {**REJOIN, 12: {14: 1.0}, 14: {14: 1.0}}


@pytest.mark.parametrize("chain", ["rejoin", "diverge"])
def test_a_forced_branch_point_branches_once_and_identical_continuations_are_pruned(tiny, chain):
    """Position 1 is the only eligible position (p(a2) = 0.45 > 0.15, 0.5 - 0.45 < 0.25; elsewhere the
    next token is certain): exactly one branch, born there, with the trunk's token 0 and the other of 11 and
    12 at position 1, its log-prob log 0.5 or log 0.45. The rule (ROUGE-L 0.5) is asked once, on the c = 3
    tokens from the branch point of each (the released RolloutFilter's lookahead length): a branch that
    continues as the trunk does (x 13 13: F1 2/3) is pruned and the tree keeps the trunk alone, one that
    continues differently (x 14 14: F1 0) stays."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, REJOIN if chain == "rejoin" else DIVERGE), tokenizer, batch_size=16,
                              progress=False, lean_decode=False)
    asked = []

    def similar(a, b):
        asked.append((list(a), list(b)))
        return continuations_similar(a, b, 0.5)

    rule = BranchRule(0.15, 0.25, (3,), similar)
    (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), 4)],
                                        SamplingParams(1.0, 1.0, 8), rule, torch.Generator().manual_seed(0))
    trunk = tree.members[0].response_ids
    after = {11: 13, 12: 13 if chain == "rejoin" else 14}  # the token repeated after 11 and after 12
    assert tree.spawned == 1 and trunk[0] == 10 and trunk[1] in (11, 12) and trunk[2:] == [after[trunk[1]]] * 6
    ((branch, parent),) = asked
    assert parent == trunk[1:4] and {branch[0], parent[0]} == {11, 12}
    if chain == "rejoin":
        assert branch[1:] == parent[1:] == [13, 13]
        assert tree.pruned == 1 and len(tree.members) == 1
    else:
        assert tree.pruned == 0 and tree.parents == [-1, 0] and tree.births == [-1, 1]
        kept, other = tree.members[1], 23 - trunk[1]
        assert kept.response_ids == [10, other, *[after[other]] * 6] and kept.behaviour == "branch"
        assert kept.logprobs[1] == pytest.approx(math.log(REJOIN[10][other]), abs=1e-5)
        assert kept.logprobs[2:] == pytest.approx([0.0] * 6, abs=1e-5)


@pytest.mark.parametrize("share,abs_threshold", [(1.0, 0.05), (0.5, 0.05), (1.0, 1.0)])
def test_decoded_groups_have_exactly_n_members(tiny, share, abs_threshold):
    """Mode decode through the strategy: every group holds n = 4 responses (the tree, filled with plain
    samples when short, as with abs_threshold 1, then the i.i.d. share); the tree's members come first,
    branches labelled."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, batch_size=16, progress=False)
    sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"user": "{problem}"}, lambda r, _: r)
    setup = RolloutSetup(sampler, 4, SamplingParams(0.1, 1.0, 8), torch.Generator().manual_seed(0))
    options = LookaheadOptions(abs_threshold=abs_threshold, rel_threshold=0.5, checkpoints=(3,), mix_schedule=((0, share),), fill="iid",
                               parent_token="sampled")
    groups, metrics = LookaheadRollout(setup, options).rollout([Problem(str(i), f"question {i}", "0") for i in range(3)])
    assert [len(g) for g in groups.groups] == [4, 4, 4]
    tree = round(4 * share)
    assert metrics["lookahead_branches"] + metrics["lookahead_filled"] == 3 * (tree - 1)
    assert metrics["lookahead_branches"] == sum(c.behaviour == "branch" for g in groups.groups for c in g)
    assert all(c.request_index == i for i, g in enumerate(groups.groups) for c in g)
    cost = sampler.cost.take()
    assert cost["generated_responses"] == 12
    if abs_threshold == 1.0:
        assert metrics["lookahead_branches"] == 0 and metrics["lookahead_filled"] == 3 * 3 and cost["reused_tokens"] == 0
    else:
        assert metrics["lookahead_branches"] > 0 and cost["reused_tokens"] > 0


# --- the released code's choices (starreeze/latr): the stop-word filter, the parent's top-1 token, the repeat fill


class WordTokenizer:
    """Decodes each id to a fixed text (the released StopWordFilter decodes one candidate at a time)."""

    TEXT = {5: "x", 6: " The", 7: " ,", 8: "  ", 9: "\u2581and", 11: " eleven", 12: " the", 13: "##s", 14: "?!", 15: " 2"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.TEXT.get(i, f" w{i}") for i in ids)


def test_stop_words_punctuation_and_space_never_branch():
    """is_stop_word by hand (NLTK English list, lower-cased; `.,;:!?"'` only; empty or space; a leading ▁ or
    ## removed), and spawn_tokens / branch_points drop such a candidate that the thresholds would branch."""
    assert [is_stop_word(t) for t in ("the", " The", "\u2581and", " ,", "?!", "  ", "", "x", " 2", "##s", "Paris", "+")] == [
        True, True, True, True, True, True, True, False, False, True, False, False]  # "s" is in NLTK's list
    can_branch = stop_word_tokens(WordTokenizer())
    assert [can_branch(v) for v in (5, 6, 7, 8, 9, 11, 12, 13, 14, 15)] == [True, False, False, False, False, True, False, False,
                                                                          False, True]
    rule = BranchRule(0.15, 0.25, (4,), NEVER_PRUNE, can_branch=can_branch)
    assert spawn_tokens([5, 6], [0.5, 0.4], 5, rule) == []  # " The" is a stop word
    assert spawn_tokens([5, 15], [0.5, 0.4], 5, rule) == [15]  # " 2" is not
    assert spawn_tokens([7, 11], [0.3, 0.25], 9, rule) == [11]  # "," never, " eleven" does
    rows = stats([(10, 0.5, 12, 0.4), (10, 0.5, 11, 0.4)])
    assert branch_points(rows, [10, 10], 0.15, 0.25) == [(0, 12), (1, 11)]
    assert branch_points(rows, [10, 10], 0.15, 0.25, can_branch) == [(1, 11)]


@pytest.mark.parametrize("stop_word", [False, True])
def test_a_stop_word_candidate_never_branches_while_decoding(tiny, stop_word):
    """The forced chain's only branch point offers 12 (p 0.45) beside the top token 11 (p 0.5): it branches
    once, unless 12 decodes to a stop word (" the") and the filter is on: then the tree is the trunk alone."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, DIVERGE), tokenizer, batch_size=16, progress=False, lean_decode=False)
    rule = BranchRule(0.15, 0.25, (3,), NEVER_PRUNE, can_branch=stop_word_tokens(WordTokenizer()) if stop_word else None)
    (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), 4)],
                                        SamplingParams(1.0, 1.0, 8), rule, torch.Generator().manual_seed(0))
    assert tree.spawned == (0 if stop_word else 1) and len(tree.members) == (1 if stop_word else 2)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_at_a_branch_point_the_parent_takes_the_top_token_and_the_branch_the_runner_up(tiny, seed):
    """parent_top1 (the released sample_nk="none"): whatever the draws, the trunk takes 11 (p 0.5) at the
    branch point and the branch 12 (p 0.45), each with its warped log-prob (log 0.5, log 0.45); sampling
    instead, the trunk takes 12 for some seed."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, DIVERGE), tokenizer, batch_size=16, progress=False, lean_decode=False)
    prompt = tuple(tokenizer.encode("question a"))
    (tree,) = engine.generate_branching([GenerationRequest(prompt, 4)], SamplingParams(1.0, 1.0, 8),
                                        BranchRule(0.15, 0.25, (3,), NEVER_PRUNE), torch.Generator().manual_seed(seed))
    trunk, branch = tree.members
    assert trunk.response_ids[:3] == [10, 11, 13] and branch.response_ids[:3] == [10, 12, 14] and tree.births == [-1, 1]
    assert trunk.logprobs[1] == pytest.approx(math.log(0.5), abs=1e-5)
    assert branch.logprobs[1] == pytest.approx(math.log(0.45), abs=1e-5)
    sampled = [engine.generate_branching([GenerationRequest(prompt, 4)], SamplingParams(1.0, 1.0, 8),
                                         BranchRule(0.15, 0.25, (3,), NEVER_PRUNE, parent_top1=False),
                                         torch.Generator().manual_seed(s))[0].members[0].response_ids[1] for s in range(8)]
    assert 12 in sampled


# two branch points on the trunk (t = 1: 11 or 12; t = 2 after 11: 13 or 17)
BRANCHY = {10: {11: 0.5, 12: 0.45, 15: 0.05}, 11: {13: 0.55, 17: 0.4, 15: 0.05}, 12: {14: 1.0}, 13: {13: 1.0},
           14: {14: 1.0}, 17: {17: 1.0}}


def test_the_parents_token_is_the_top_one_and_log_probs_are_the_warped_ones(tiny):
    """parent_top1 at temperature 0.9 (the warped distribution differs from the chain's): the trunk takes
    the top token of its warped distribution at each position (position_stats), each branch the runner-up
    at its branch point, and every log-prob, the parent's and the branch's token at a branch point
    included, equals score_prefixes within 1e-5."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, BRANCHY), tokenizer, batch_size=16, progress=False, lean_decode=False)
    params = SamplingParams(0.9, 1.0, 6)
    (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), 8)], params,
                                        BranchRule(0.15, 0.25, (3,), NEVER_PRUNE), torch.Generator().manual_seed(0))
    members = tree.members
    assert [m.response_ids[:3] for m in members] == [[10, 11, 13], [10, 12, 14], [10, 11, 17]] and tree.births == [-1, 1, 2]
    stats_ = engine.position_stats([(c.prompt_ids, tuple(c.response_ids)) for c in members], params)
    assert all(members[0].response_ids[t] == int(stats_[0].top_tokens[t][0]) for t in range(6))
    for k in (1, 2):
        t = tree.births[k]
        assert members[k].response_ids[t] == int(stats_[0].top_tokens[t][1]) and tree.parents[k] == 0
    scores = engine.score_prefixes([(c.prompt_ids, tuple(c.response_ids)) for c in members], params)
    for member, score in zip(members, scores):
        assert member.logprobs == pytest.approx(score, abs=1e-5)
    assert members[0].logprobs[1] != pytest.approx(math.log(0.5), abs=1e-3)  # warped, not the chain's


# after the branch point both rows continue with 13 or 14, whose runner-up 16 (p 0.3) is too far to branch
RETURN = {10: {11: 0.5, 12: 0.45, 15: 0.05}, 11: {13: 1.0}, 12: {14: 1.0}, 13: {13: 0.7, 16: 0.3}, 14: {14: 0.7, 16: 0.3},
          16: {16: 0.7, 13: 0.3}}


@pytest.mark.parametrize("size", [2, 3])
def test_rows_sample_once_the_trees_are_full_and_past_their_checkpoints(tiny, size):
    """The released return_on_full: a tree of 2 is full after the branch at t = 1, which is past its
    checkpoint 3 at the end of step 5: tokens 2..5 are the top ones (13 or 14), then rows sample (some 16
    within 24 tokens, seeds 0-2). A tree of 3 never fills: its rows stay greedy to the end."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, RETURN), tokenizer, batch_size=16, progress=False, lean_decode=False)
    seen16 = []
    for seed in range(3):
        (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), size)],
                                            SamplingParams(1.0, 1.0, 30), BranchRule(0.15, 0.25, (3,), NEVER_PRUNE),
                                            torch.Generator().manual_seed(seed))
        assert len(tree.members) == 2
        for member in tree.members:
            assert member.response_ids[2:6] == [member.response_ids[2]] * 4
            seen16.append(16 in member.response_ids[6:])
    assert all(seen16) if size == 2 else not any(seen16)


def test_repeat_fill_copies_the_first_member_and_continues_it_past_the_window(monkeypatch):
    """fill repeat (the released fill_return_sequences): no branch point, n = 4, share 1: the tree (the
    trunk) gets 3 copies of the trunk, with its log-probs, and no engine call but the trunk's. With
    branch_window 3 the copies are the trunk's first 3 tokens sampled on from there (one call, n = 3)."""
    monkeypatch.setattr(ScriptedEngine, "position_stats", raising=False, value=
                        lambda engine, items, params: [stats([(10, 0.99, 20, 0.01)] * 6) for _ in items])
    setup = scripted_setup({12: [40, 41, 42]}, n=4)
    groups, metrics = LookaheadRollout(setup, LookaheadOptions(mode="resample")).rollout([Problem("1", "q", "a")])
    (group,) = groups.groups
    trunk = group[0]
    assert len(group) == 4 and metrics["lookahead_filled"] == 3 and setup.sampler.engine.calls == [[((), 1, 6)]]
    assert all(c.response_ids == trunk.response_ids and c.logprobs == trunk.logprobs and c is not trunk for c in group[1:])
    setup = scripted_setup({12: [40, 41, 42]}, n=4)
    groups, _ = LookaheadRollout(setup, LookaheadOptions(mode="resample", branch_window=3)).rollout([Problem("1", "q", "a")])
    ((prefix, m, _),) = setup.sampler.engine.calls[-1]
    assert prefix == (10, 11, 12) and m == 3
    assert [c.response_ids for c in groups.groups[0][1:]] == [[10, 11, 12, 40, 41, 42]] * 3


def test_repeat_fill_while_decoding_gives_n_members_whose_extra_ones_equal_the_first(tiny):
    """Mode decode, abs_threshold 1 (no branch), share 1, n = 4: each group is its trunk and 3 copies of it
    (token for token, log-prob for log-prob); fill iid gives i.i.d. responses instead (not all equal)."""
    model, tokenizer = tiny
    for fill in ("repeat", "iid"):
        engine = HFGenerateEngine(model, tokenizer, batch_size=16, progress=False)
        sampler = GroupSampler(engine, EvenTokenReward(), tokenizer, {"user": "{problem}"}, lambda r, _: r)
        setup = RolloutSetup(sampler, 4, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))
        options = LookaheadOptions(abs_threshold=1.0, checkpoints=(3,), fill=fill)
        groups, metrics = LookaheadRollout(setup, options).rollout([Problem(str(i), f"question {i}", "0") for i in range(2)])
        assert [len(g) for g in groups.groups] == [4, 4] and metrics["lookahead_filled"] == 6
        same = [c.response_ids == g[0].response_ids and c.logprobs == g[0].logprobs for g in groups.groups for c in g[1:]]
        assert all(same) if fill == "repeat" else not all(same)


# --- the released early return (return_on_full with return_nb_thres_init / return_nb_thres_decay) and its fill


def test_nearly_full_by_hand():
    """Four trees of 8 (N = 32): at step 0 with threshold 0.98 the count must reach round(31.36) = 31, so one
    missing row is allowed, two are not; a tree with no running row counts 8. The threshold decays by
    0.05 * step / budget (budget 100): 32 * (0.98 - 0.0005 s) drops below 30.5 between s = 53 (30.512 -> 31)
    and s = 54 (30.496 -> 30). Threshold 1 without decay: only all full (or done) returns."""
    from rlbench.rollout.engines.branching import nearly_full

    rule = BranchRule(0.15, 0.25, (4,), NEVER_PRUNE, return_threshold=0.98, return_decay=0.05)
    sizes, running = [8] * 4, [False] * 4
    assert nearly_full([8, 8, 8, 7], sizes, running, 0, 100, rule)
    assert not nearly_full([8, 8, 7, 7], sizes, running, 0, 100, rule)
    assert nearly_full([8, 8, 6, 7], sizes, [False, False, True, False], 0, 100, rule)  # tree 2 done: counted 8
    assert not nearly_full([8, 8, 7, 7], sizes, running, 53, 100, rule)
    assert nearly_full([8, 8, 7, 7], sizes, running, 54, 100, rule)
    strict = BranchRule(0.15, 0.25, (4,), NEVER_PRUNE)  # the defaults: 1.0, no decay
    assert not nearly_full([8, 8, 8, 7], sizes, running, 99, 100, strict)
    assert nearly_full([8, 8, 8, 1], sizes, [False, False, False, True], 99, 100, strict)


# tree A (prompt "question a", last token -> 10) branches at t = 1 and is full at 2 (the RETURN chain); tree B
# ("question b", last token 278 -> 20) never branches (21's runner-up 16 is 0.4 behind): 3 of the N = 4 places
EARLY = {**RETURN, 278: {20: 1.0}, 20: {21: 1.0}, 21: {21: 0.7, 16: 0.3}}


def early_trees(tiny, seed, **rule):
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, EARLY), tokenizer, batch_size=16, progress=False, lean_decode=False)
    requests = [GenerationRequest(tuple(tokenizer.encode(f"question {x}")), 2) for x in "ab"]
    return engine.generate_branching(requests, SamplingParams(1.0, 1.0, 30), BranchRule(0.15, 0.25, (3,), NEVER_PRUNE, **rule),
                                     torch.Generator().manual_seed(seed))


def greedy_until(tree):
    """The first position (after 2) where a member leaves its greedy run: each row repeats its token from t = 2
    on while it takes its top token (13, 14 or 21; the runner-up 16 is p 0.3); the smallest such position."""
    return min(next((t for t in range(2, len(m.response_ids)) if m.response_ids[t] != m.response_ids[2]), 99)
               for m in tree.members)


@pytest.mark.parametrize("threshold,returns", [(0.8, True), (0.9, False)])
def test_the_early_return_fires_at_the_threshold_and_not_below(tiny, threshold, returns):
    """3 of 4 places held: round(4 * 0.8) = 3 is reached, round(4 * 0.9) = 4 is not. At 0.8 the batch returns
    once every row is past its checkpoint 3 (the branch born at 1, the trunks counted as born at 0: after step
    5, 6 tokens): tokens 2..5 are the top ones and the rows sample from 6 on (some 16 within 30 tokens, seeds
    0-2); tree B stays the trunk alone and records the return (6 tokens). At 0.9 nothing returns: greedy to
    the end, returned -1."""
    for seed in range(3):
        a, b = early_trees(tiny, seed, return_threshold=threshold)
        assert len(a.members) == 2 and len(b.members) == 1 and b.members[0].response_ids[:2] == [20, 21]
        assert a.returned == b.returned == (6 if returns else -1)
        assert all(m.response_ids[2:6] == [m.response_ids[2]] * 4 for m in (*a.members, *b.members))
        if returns:
            assert all(16 in m.response_ids[6:] for m in (*a.members, *b.members))
        else:
            assert greedy_until(a) == greedy_until(b) == 99


def test_the_threshold_decays_over_the_decoding_steps_of_each_call(tiny):
    """Threshold 0.9 decaying by 0.1 over the 30-token budget: 4 * (0.9 - 0.1 s / 30) is 3.507 (-> 4) at step
    7 and 3.493 (-> 3) at step 8: the batch returns after step 8 (9 tokens), not before; and afresh in the
    next call (the decay restarts with each call's decoding steps)."""
    for seed in (0, 1):
        for call in range(2):
            a, b = early_trees(tiny, seed, return_threshold=0.9, return_decay=0.1)
            assert a.returned == b.returned == 9, (seed, call)
            assert greedy_until(a) >= 9 and greedy_until(b) >= 9


def test_a_short_tree_at_the_early_return_is_filled_from_its_trunk_as_it_stood(monkeypatch):
    """fill repeat in mode decode: a tree that returned short (returned = 3 tokens) gets copies of its trunk's
    first 3 tokens, each sampled on from there (one call: prefix 10 11 12, n = 2); a trunk that had
    ended before the return (2 tokens) is copied as it is."""
    from rlbench.rollout.engines.branching import BranchTree

    def generate_branching(engine, requests, params, rule, generator=None):
        assert (rule.return_threshold, rule.return_decay) == (0.98, 0.05)  # the options' defaults reach the rule
        trunks = {1: [10, 11, 12, 13, 14, 15], 2: [10, 11]}
        return [BranchTree(members=[Completion(0, r.prompt_ids, trunks[r.prompt_ids[0]], [0.0] * len(trunks[r.prompt_ids[0]]),
                                               r.prompt_ids[0] == 2)], parents=[-1], births=[-1], returned=3) for r in requests]

    monkeypatch.setattr(ScriptedEngine, "generate_branching", generate_branching, raising=False)
    setup = scripted_setup({12: [40, 41, 42]}, n=3)
    groups, metrics = LookaheadRollout(setup, LookaheadOptions()).rollout([Problem("1", "q", "a"), Problem("2", "q", "a")])
    assert metrics["lookahead_filled"] == 4
    ((prefix, m, _),) = setup.sampler.engine.calls[-1]  # the budget is bucketed, the copies cut to 3 tokens
    assert prefix == (10, 11, 12) and m == 2
    assert [c.response_ids for c in groups.groups[0]] == [[10, 11, 12, 13, 14, 15]] + [[10, 11, 12, 40, 41, 42]] * 2
    assert [c.response_ids for c in groups.groups[1]] == [[10, 11]] * 3


# the branch 12 (born at 1) hesitates at 2 between 13 (0.5) and 18 (0.45): a child born at 2; the branch then
# rejoins the trunk (13 13 13: pruned at its checkpoint 3), the child diverges (18 18 18)
NESTED = {10: {11: 0.5, 12: 0.45, 15: 0.05}, 11: {13: 1.0}, 12: {13: 0.5, 18: 0.45, 15: 0.05}, 13: {13: 1.0}, 18: {18: 1.0}}


def test_a_pruned_branch_takes_its_descendants_with_it(tiny):
    """The released BranchInfo.remove removes a pruned branch with its children: the child 18, unlike its
    parent, is not similar to anything, yet goes when its parent is pruned at step 3; the tree is the trunk."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, NESTED), tokenizer, batch_size=16, progress=False, lean_decode=False)

    def similar(a, b):
        return continuations_similar(a, b, 0.5)

    (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), 4)],
                                        SamplingParams(1.0, 1.0, 8), BranchRule(0.15, 0.25, (3,), similar), torch.Generator().manual_seed(0))
    assert tree.spawned == 2 and tree.pruned == 2 and [m.response_ids for m in tree.members] == [[10, 11] + [13] * 6]


# --- the released RolloutFilter's rule (starreeze/latr/model/sample_filter.py at 2adb0ed): c tokens at checkpoint c,
# a checkpoint with EOS skipped, a branch off a math symbol never pruned


def test_continuations_similar_and_math_symbols_by_hand():
    """The per-checkpoint test (ROUGE-L F1 > 0.5 or suffix match > 0.2) on c tokens, and the released
    keep_math_symbols text test: stripped, a substring of "+-*/\\<>=()[]{}_^&%$0123456789" (so "12" and "()"
    are, "10" and "<=" are not, and an empty or white-space token is)."""
    assert continuations_similar([12, 13, 13], [11, 13, 13], 0.5)  # F1 2/3
    assert not continuations_similar([12, 13], [11, 13], 0.5)  # F1 1/2 is not above 1/2 ...
    assert continuations_similar([12, 13], [11, 13], 0.5, suffix_threshold=0.2)  # ... the suffix [13] is: 1/2 > 0.2
    assert [is_math_symbol(t) for t in ("+", " 2", "12", " ()", "$0", "", " ", "\n", "10", "<=", "x", " two", "2x")] == [
        True, True, True, True, True, True, True, True, False, False, False, False, False]
    can_prune = math_symbol_tokens(WordTokenizer())  # 15: " 2", 8: "  ", 5: "x", 7: " ,"
    assert [can_prune(t) for t in (15, 8, 5, 7, 15)] == [False, False, True, True, False]


# the trunk takes 11 then 13 forever; the branch 12 (born at 1) continues 17, then hesitates at 3 between 18 and 19
TIMING = {10: {11: 0.5, 12: 0.45, 15: 0.05}, 11: {13: 1.0}, 13: {13: 1.0}, 12: {17: 1.0}, 17: {18: 0.5, 19: 0.45, 15: 0.05},
          18: {18: 1.0}, 19: {19: 1.0}}


def test_checkpoint_c_compares_c_tokens_at_the_step_they_are_reached(tiny):
    """The release compares, at checkpoint c, the c tokens from the branch point (the branch token included),
    at the step they are complete (t + c - 1; its current_step - birth_step = c). With checkpoint 2 and a
    rule that prunes whatever it is asked, the branch born at 1 is asked once, on [12, 17] against [11, 13],
    at step 2, and goes before its own branch point at 3: one branch spawned. Comparing c + 1 tokens a step
    later (rlbench before) would have spawned its child at 3 first (spawned 2)."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, TIMING), tokenizer, batch_size=16, progress=False, lean_decode=False)
    asked = []
    rule = BranchRule(0.15, 0.25, (2,), lambda a, b: asked.append((list(a), list(b))) or True)
    (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), 4)],
                                        SamplingParams(1.0, 1.0, 8), rule, torch.Generator().manual_seed(0))
    assert asked == [([12, 17], [11, 13])]
    assert tree.spawned == 1 and tree.pruned == 1 and [m.response_ids for m in tree.members] == [[10, 11] + [13] * 6]


@pytest.mark.parametrize("checkpoints,skip_eos,pruned", [((3,), True, False), ((3,), False, True), ((5,), True, False),
                                                         ((5,), False, True), ((2,), True, True)])
def test_a_checkpoint_where_a_continuation_holds_eos_is_skipped(tiny, checkpoints, skip_eos, pruned):
    """Trunk 10 11 13 EOS, branch 10 12 13 EOS (born at 1), ROUGE-L threshold 0.4. With skip_eos (the release:
    it skips a comparison whose continuations hold its EOS, and pads a finished row with EOS) checkpoint 3
    ([12, 13, EOS]) and checkpoint 5 (past the end) are skipped and the branch stays; checkpoint 2 ([12, 13]
    against [11, 13], F1 1/2 > 0.4) prunes it. Without, checkpoint 3 compares [12, 13, EOS] with [11, 13, EOS]
    (F1 2/3), and 5 the same, on what the rows have at their end: pruned."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, {}), tokenizer, batch_size=16, progress=False, lean_decode=False)
    eos = engine.eos_ids[0]
    engine.model.chain = {10: {11: 0.5, 12: 0.45, 15: 0.05}, 11: {13: 1.0}, 12: {13: 1.0}, 13: {eos: 1.0}}
    rule = BranchRule(0.15, 0.25, checkpoints, lambda a, b: continuations_similar(a, b, 0.4), skip_eos=skip_eos)
    (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), 4)],
                                        SamplingParams(1.0, 1.0, 8), rule, torch.Generator().manual_seed(0))
    assert tree.spawned == 1 and tree.pruned == int(pruned)
    assert [m.response_ids for m in tree.members] == [[10, 11, 13, eos]] + ([] if pruned else [[10, 12, 13, eos]])


@pytest.mark.parametrize("exempt,pruned", [(None, True), (11, False), (12, True)])
def test_a_branch_off_a_math_symbol_is_never_pruned(tiny, exempt, pruned):
    """keep_math_symbols, the intended rule: a branch whose parent's token at the branch point (b[0]; here
    the trunk's 11, the branch taking 12) ``can_prune`` refuses is never compared, so never pruned; the
    branch's own token does not count (exempting 12 prunes as without the rule).

    The release's RolloutFilter (starreeze/latr/model/sample_filter.py at 2adb0ed) drops such a comparison
    from its batch but not from the branch ids and lengths it then zips the batch with, so once one is
    dropped the k-th verdict left is applied to the k-th branch id: a branch off a math symbol can be pruned
    for another's similarity, and the last ones are never judged. Its comment ("we should only consider
    those that are not math core symbols") says the intent; rlbench builds that (the exemption) and does not
    reproduce the pairing, an index slip that makes which branch goes depend on the order of the comparisons."""
    model, tokenizer = tiny
    engine = HFGenerateEngine(ForcedNextToken(model, REJOIN), tokenizer, batch_size=16, progress=False, lean_decode=False)
    seen = []

    def can_prune(token):
        seen.append(token)
        return token != exempt

    rule = BranchRule(0.15, 0.25, (3,), lambda a, b: continuations_similar(a, b, 0.5), can_prune=can_prune)
    (tree,) = engine.generate_branching([GenerationRequest(tuple(tokenizer.encode("question a")), 4)],
                                        SamplingParams(1.0, 1.0, 8), rule, torch.Generator().manual_seed(0))
    assert seen == [11] and tree.spawned == 1 and tree.pruned == int(pruned)
    assert [m.response_ids[1] for m in tree.members] == ([11] if pruned else [11, 12])


@pytest.mark.parametrize("keep", [True, False])
def test_the_released_pruning_options_reach_the_decoding_rule(monkeypatch, keep):
    """skip_eos and keep_math_symbols (both on: the release's) reach the engine's rule; keep_math_symbols
    tests the tokenizer's text of the parent's token ("2" is a math symbol, "10" is not: not a substring)."""
    from rlbench.rollout.engines.branching import BranchTree

    rules = []

    def generate_branching(engine, requests, params, rule, generator=None):
        rules.append(rule)
        return [BranchTree(members=[Completion(0, r.prompt_ids, [10, 11], [0.0, 0.0], True)], parents=[-1], births=[-1])
                for r in requests]

    monkeypatch.setattr(ScriptedEngine, "generate_branching", generate_branching, raising=False)
    setup = scripted_setup({}, n=2)
    assert (LookaheadOptions().skip_eos, LookaheadOptions().keep_math_symbols) == (True, True)
    LookaheadRollout(setup, LookaheadOptions(keep_math_symbols=keep, skip_eos=keep)).rollout([Problem("1", "q", "a")])
    (rule,) = rules
    assert rule.skip_eos is keep and rule.similar([1, 2, 3], [4, 2, 3]) and not rule.similar([1, 2], [4, 5])
    if keep:
        assert [rule.can_prune(t) for t in (2, 10, 77)] == [False, True, True]
    else:
        assert rule.can_prune is None
