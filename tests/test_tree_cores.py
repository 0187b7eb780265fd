"""The cores of the tree and scheduling rollouts on scripted engines and in closed form: TreePO's divergence
schedule, early stops and fallback (rollout=tree, rlbench/rollout/strategies/tree.py, arXiv:2508.17445), and
Infinite Sampling's length-aware micro-group scheduler (rollout=micro_groups, arXiv:2506.22950)."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.config.typed import rollout_config
from rlbench.dataset.base import Problem
from rlbench.errors import ConfigError
from rlbench.reward.toy import EvenTokenReward
from rlbench.rollout import GroupSampler, RolloutSetup, make_strategy
from rlbench.rollout.engines.base import Completion, SamplingParams
from rlbench.rollout.strategies.micro_groups import pack_by_length
from rlbench.rollout.strategies.tree import (
    TreePOOptions,
    TreePOSampling,
    _Node,
    DIVERGENCES,
    allocate_divergence,
    divergence_budget,
    divergence_counts,
    has_repetition,
)

EOS = 2


class ScriptedTokenizer:
    """Token ids decode to ``words[id]`` (default ``"t<id> "``); EOS is dropped with skip_special_tokens."""

    eos_token_id = EOS

    def __init__(self, words=None):
        self.words = words or {}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words.get(i, f"t{i} ") for i in ids if not (skip_special_tokens and i == EOS))


class ScriptedEngine:
    """Every child of every request gets fresh token ids (100, 101, ...), ``max_new_tokens`` of them, each
    with log-prob ``logprob(token)``; ``script(call, request, child, prefix)`` may return the new tokens
    instead (a list ending in EOS ends the path). Calls are recorded as (prefix, n, max_new_tokens)."""

    def __init__(self, script=None, logprob=lambda token: -1.0):
        self.script, self.logprob, self.calls, self.next_token = script, logprob, [], 100

    def generate(self, requests, params, generator=None):
        call = len(self.calls)
        self.calls.append([(r.prefix_ids, r.n, params.max_new_tokens) for r in requests])
        out = []
        for i, r in enumerate(requests):
            group = []
            for k in range(r.n):
                new = self.script(call, i, k, r.prefix_ids) if self.script else None
                if new is None:
                    new = list(range(self.next_token, self.next_token + params.max_new_tokens))
                    self.next_token += params.max_new_tokens
                new = new[: params.max_new_tokens]
                ids = [*r.prefix_ids, *new]
                group.append(Completion(i, r.prompt_ids, ids, [self.logprob(t) for t in ids],
                                        bool(new) and new[-1] == EOS, prefix_len=len(r.prefix_ids)))
            out.append(group)
        return out


def tree_setup(n=8, max_new_tokens=8, script=None, logprob=lambda token: -1.0, words=None, seed=0, **tree):
    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    sampler = Sampler(ScriptedEngine(script, logprob), EvenTokenReward(), ScriptedTokenizer(words), {}, lambda r, _: r)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, max_new_tokens), torch.Generator().manual_seed(seed))
    cfg = rollout_config({"strategy": "tree", "n": n, "tree": {"segment_tokens": 2, "root_branching": 2, "branching": 2, **tree}})
    strategy = make_strategy(cfg, setup)
    assert isinstance(strategy, TreePOSampling)
    return strategy, sampler.engine


def grow(strategy, prompts=1):
    return strategy.rollout([Problem(str(p), "q", "a") for p in range(prompts)])


def check_tree(groups, n):
    """n leaves per group; a node's tokens are the same in every leaf that passes through it."""
    for group in groups:
        assert len(group) == n
        seen: dict[int, list[int]] = {}
        for leaf in group:
            assert len(leaf.extras["tree_nodes"]) == len(leaf.response_ids) == len(leaf.logprobs)
            for node in dict.fromkeys(leaf.extras["tree_nodes"]):
                tokens = [t for t, k in zip(leaf.response_ids, leaf.extras["tree_nodes"]) if k == node]
                assert seen.setdefault(node, tokens) == tokens


# ------------------------------------------------------------------ the divergence schedule, closed form


def test_the_budget_passes_ended_paths_branching_to_the_survivors():
    # B = max(N, min(R, w * (E + N)))
    assert divergence_budget(remaining=8, paths=3, ended_now=1, branching=2) == 8  # min(8, 2 * 4)
    assert divergence_budget(remaining=7, paths=3, ended_now=0, branching=2) == 6  # min(7, 2 * 3)
    assert divergence_budget(remaining=4, paths=3, ended_now=0, branching=2) == 4  # the leaves still missing cap it
    assert divergence_budget(remaining=2, paths=2, ended_now=5, branching=2) == 2
    assert divergence_budget(remaining=1, paths=3, ended_now=0, branching=2) == 3  # every path goes on (floor N)
    assert divergence_budget(remaining=16, paths=1, ended_now=1, branching=3) == 6


def test_fixed_divergence_splits_the_budget_evenly_the_remainder_to_the_last_path():
    options = TreePOOptions(branching=2)
    assert divergence_counts(options, [[-1.0]] * 3, remaining=8, ended_now=1) == [2, 2, 4]  # 8 // 3, 8 % 3 to the last
    assert divergence_counts(options, [[-1.0]] * 3, remaining=7, ended_now=0) == [2, 2, 2]
    assert divergence_counts(options, [[-1.0]] * 3, remaining=4, ended_now=0) == [1, 1, 2]
    assert divergence_counts(options, [[-1.0]] * 2, remaining=2, ended_now=5) == [1, 1]
    assert divergence_counts(TreePOOptions(branching=3), [[-1.0]], remaining=16, ended_now=1) == [6]


# Two paths: A's tokens at -5, -5, -1, -1 (sum -12, mean -3, last 2-token segment's mean -1), B's at -2 x 4
# (sum -8, mean -2, last segment -2); 6 children: one each, 4 by weight (raw r = 4 w, floors, largest remainder).
#   sum  -12 / -8: softmax(-(S - min)) = softmax(0, -4) = [.982, .018]: r = [3.93, .07] -> [5, 1]; + sign -> [1, 5]
#   mean  -3 / -2: softmax(0, -1) = [.731, .269]: r = [2.92, 1.08] -> [4, 2]; + sign -> [2, 4]
#   last  -1 / -2: softmax(-1, 0) = [.269, .731] -> [2, 4]; + sign -> [4, 2]
TWO_PATHS = [[-5.0, -5.0, -1.0, -1.0], [-2.0] * 4]


@pytest.mark.parametrize("divergence, counts", [
    ("fixed", [3, 3]),
    ("low_probability", [5, 1]), ("high_probability", [1, 5]),
    ("low_probability_per_token", [4, 2]), ("high_probability_per_token", [2, 4]),
    ("low_last_segment_probability", [2, 4]), ("high_last_segment_probability", [4, 2]),
])
def test_each_released_divergence_rule_by_hand(divergence, counts):
    assert set(DIVERGENCES) == {"fixed", "low_probability", "high_probability", "low_probability_per_token",
                                "high_probability_per_token", "low_last_segment_probability", "high_last_segment_probability"}
    options = TreePOOptions(divergence=divergence, segment_tokens=2)
    assert divergence_counts(options, TWO_PATHS, remaining=6, ended_now=1) == counts  # B = min(6, 2 * 3) = 6


def test_the_temperature_flattens_the_weights():
    # low_probability at T = 8: softmax(0, -0.5) = [.622, .378]: r = [2.49, 1.51], floors [3, 2], the remainder .51 wins
    assert divergence_counts(TreePOOptions(divergence="low_probability", divergence_temperature=8.0), TWO_PATHS, 6, 1) == [3, 3]
    assert divergence_counts(TreePOOptions(divergence="low_probability", divergence_temperature=2.0), TWO_PATHS, 6, 1) == [5, 1]
    # softmax(0, -2) = [.881, .119]: r = [3.52, .48] -> [4, 1] + 1 to path 0


def test_weighted_rules_give_every_path_a_child_and_break_ties_towards_the_earlier_path():
    paths = [[-1.0, -1.0], [-1.0, -1.0], [-9.0, -9.0]]  # A and B tie; C is 16 nats less likely in sum
    high = TreePOOptions(divergence="high_probability")
    # weights ~ [.5, .5, 6e-8] (just under .5 each): 2 more children, raw [1 - 1e-7, 1 - 1e-7, 2e-7]: floors all 0,
    # the two largest remainders are A and B; C keeps its one child
    assert divergence_counts(high, paths, remaining=5, ended_now=0) == [2, 2, 1]
    assert divergence_counts(high, paths, remaining=4, ended_now=0) == [2, 1, 1]  # one more: the tie goes to A
    for rule in DIVERGENCES:
        for remaining in range(3, 9):
            counts = divergence_counts(TreePOOptions(divergence=rule), paths, remaining, ended_now=1)
            assert min(counts) >= 1 and sum(counts) == min(remaining, 8), (rule, remaining, counts)


def test_allocation_gives_each_path_one_and_the_rest_by_largest_remainder():
    assert allocate_divergence([1.0, 1.0, 1.0], 4) == [2, 1, 1]  # a tie goes to the earlier path
    assert allocate_divergence([0.5, 0.25, 0.25], 7) == [3, 2, 2]  # 4 more: raw 2, 1, 1
    assert allocate_divergence([0.7, 0.2, 0.1], 3) == [1, 1, 1]
    assert allocate_divergence([0.6, 0.3, 0.1], 8) == [4, 3, 1]  # raw 3, 1.5, 0.5: remainders tie, the earlier wins


def test_repetition_detector():
    assert has_repetition("x" * 39, 32, 8)  # 8 windows of 32 x's
    assert not has_repetition("x" * 38, 32, 8)
    assert has_repetition("ab" * 6, 2, 6) and not has_repetition("ab" * 5, 2, 6)
    assert not has_repetition("x" * 100, 0, 8)  # window 0: off
    assert not has_repetition("the answer is 42", 32, 8)


def test_options_refused_before_loading():
    def options(n=8, **tree):
        return TreePOOptions.from_config(rollout_config({"strategy": "tree", "n": n, "tree": tree}))

    assert options(n=12).root_branching == 2  # any group size: the budget caps the tree
    for bad, message in [({"divergence": "quality"}, "divergence must be one of"),
                         ({"divergence_temperature": 0.0}, "divergence_temperature must be > 0"),
                         ({"root_branching": 16}, "exceeds rollout.n=8"),
                         ({"root_branching": 4, "root_branching_max": 3}, "below root_branching"),
                         ({"repetition_count": 1}, "repetition_count >= 2")]:
        with pytest.raises(ConfigError, match=message):
            options(**bad)


# ------------------------------------------------------------------ growth on a scripted engine


def test_without_early_ends_the_tree_doubles_until_the_group_is_covered():
    strategy, engine = tree_setup(n=8, max_new_tokens=8)
    graded, metrics = grow(strategy)
    calls = engine.calls
    assert [len(call) for call in calls] == [1, 2, 4, 8]
    assert calls[0] == [((), 2, 2)]
    assert [r[1:] for r in calls[1]] == [(2, 2)] * 2 and [r[1:] for r in calls[2]] == [(2, 2)] * 4
    assert [r[1:] for r in calls[3]] == [(1, 2)] * 8  # covered: every path goes on alone
    check_tree(graded.groups, 8)
    assert metrics["tree_rounds"] == 4 and metrics["tree_stop_length"] == 8 and metrics["tree_fallback_leaves"] == 0
    assert metrics["tree_node_count"] == 2 + 4 + 8  # the last segment extends each leaf's own node
    assert all(len(c.response_ids) == 8 for c in graded.groups[0])


def test_a_path_that_ends_hands_its_branching_to_the_survivors():
    # the first child of the root ends at EOS after one token; its sibling then spawns min(7, 2 * 2) = 4
    strategy, engine = tree_setup(n=8, max_new_tokens=8, script=lambda call, i, k, prefix: [5, EOS] if (call, k) == (0, 0) else None)
    graded, metrics = grow(strategy)
    assert engine.calls[1] == [((100, 101), 4, 2)]
    assert [n for _, n, _ in engine.calls[2]] == [1, 1, 1, 4]  # min(7, 2 * 4) = 7 split evenly, the remainder to the last
    check_tree(graded.groups, 8)
    assert metrics["tree_stop_eos"] == 1 and metrics["tree_stop_length"] == 7


def test_boxed_answer_and_repetition_stop_a_path():
    words = {7: "so \\boxed{4", 8: "} done", 9: "again " * 10}

    def script(call, i, k, prefix):
        if call == 0:
            return [7, 8] if k == 0 else [9, 9]  # child 0 closes a box, child 1 repeats itself
        return None

    for stop_at_boxed in (True, False):
        strategy, _ = tree_setup(n=4, max_new_tokens=6, script=script, words=words, stop_at_boxed=stop_at_boxed,
                                 repetition_window=6, repetition_count=8)
        graded, metrics = grow(strategy)
        check_tree(graded.groups, 4)
        leaves = {tuple(c.response_ids) for c in graded.groups[0]}
        assert (9, 9) in leaves and metrics["tree_stop_repetition"] == 1  # "again " x 20: 8 x a 6-char run
        assert ((7, 8) in leaves) == stop_at_boxed and metrics["tree_stop_boxed"] == float(stop_at_boxed)
        assert not any(c.finished for c in graded.groups[0])  # neither stop is an EOS


def test_fallback_restarts_from_a_segment_boundary_of_a_finished_leaf():
    # round 0 grows 2 paths of one segment; round 1 branches each in 2 (min(6, 2 * 2) = 4) and all 4 end at EOS
    def script(call, i, k, prefix):
        return [50 + 10 * call + 2 * i + k, EOS] if call == 1 else None

    strategy, engine = tree_setup(n=6, max_new_tokens=8, script=script)
    graded, metrics = grow(strategy)
    # round 1 ended 4 leaves of 4 tokens (2 segments); 2 missing: one leaf, cut back to 0 or 2 tokens, restarts 2 paths
    fallback = engine.calls[2]
    assert len(fallback) == 1 and fallback[0][1] == 2 and len(fallback[0][0]) in (0, 2)
    assert metrics["tree_fallback_leaves"] == 2 and metrics["tree_stop_eos"] == 4
    check_tree(graded.groups, 6)


def test_fallback_from_the_prompt_when_no_leaf_finished():
    # every path stops on repetition in round 0 (not a complete answer): the fallback starts from the prompt
    words = {9: "again " * 10}
    strategy, engine = tree_setup(n=4, max_new_tokens=6, script=lambda call, i, k, prefix: [9, 9] if call == 0 else None,
                                  words=words, repetition_window=6)
    graded, metrics = grow(strategy)
    assert engine.calls[1] == [((), 2, 2)]
    assert metrics["tree_fallback_leaves"] == 2 and metrics["tree_stop_repetition"] == 2
    check_tree(graded.groups, 4)


def test_a_cut_inside_a_node_splits_it():
    root = _Node(0, 0, None)
    trunk = _Node(1, 0, root, [10, 11], [-1.0, -1.0], children=2)
    leaf = _Node(2, 0, trunk, [12, 13, 14, 15], [-2.0] * 4)
    strategy, _ = tree_setup(n=4)
    assert strategy._cut(leaf, 0, 9) == (root, 9)
    assert strategy._cut(leaf, 2, 9) == (trunk, 9)  # at a node boundary: no split
    head, next_id = strategy._cut(leaf, 4, 9)
    assert next_id == 10 and head.id == 9 and head.tokens == [12, 13] and head.parent is trunk and head.children == 1
    assert leaf.parent is head and leaf.tokens == [14, 15] and leaf.path_tokens() == [10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("divergence, counts", [
    ("low_probability", [3, 1]), ("high_probability", [1, 3]), ("fixed", [2, 2]),
    ("low_probability_per_token", [3, 1]), ("high_probability_per_token", [1, 3]),
    ("low_last_segment_probability", [3, 1]), ("high_last_segment_probability", [1, 3]),
])
def test_probability_driven_divergence_on_the_engine(divergence, counts):
    # the path of tokens (100, 101) was sampled at log-prob -5 per token, (102, 103) at -0.1: with 4 children
    # to give, the less likely path gets 3 under low_probability (weights ~ [1, e^-9.8])
    strategy, engine = tree_setup(n=8, max_new_tokens=8, logprob=lambda token: -5.0 if token in (100, 101) else -0.1,
                                  divergence=divergence)
    graded, _ = grow(strategy)
    assert engine.calls[0] == [((), 2, 2)]
    assert engine.calls[1] == [((100, 101), counts[0], 2), ((102, 103), counts[1], 2)]
    check_tree(graded.groups, 8)


def test_random_root_divergence_stays_in_its_range():
    strategy, engine = tree_setup(n=8, max_new_tokens=4, root_branching=2, root_branching_max=4)
    graded, _ = grow(strategy, prompts=24)
    first = [n for _, n, _ in engine.calls[0]]
    assert set(first) == {2, 3, 4}
    check_tree(graded.groups, 8)
    strategy, engine = tree_setup(n=3, max_new_tokens=4, root_branching=2, root_branching_max=8)  # capped at n
    grow(strategy, prompts=24)
    assert {n for _, n, _ in engine.calls[0]} == {2, 3}


# ------------------------------------------------------------------ micro-groups: the length-aware scheduler


class SeededEngine:
    """Each response is a function of its request's seed: as many tokens as the prompt's single id (its
    length, capped by the budget), token j = (seed + j) % 50 + 3. Calls are recorded as row counts."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, params, generator=None):
        assert all(r.seed is not None and r.n == 1 for r in requests)
        self.calls.append(len(requests))
        out = []
        for i, r in enumerate(requests):
            ids = [(r.seed + j) % 50 + 3 for j in range(min(r.prompt_ids[0], params.max_new_tokens))]
            out.append([Completion(i, r.prompt_ids, ids, [-1.0] * len(ids), False)])
        return out


def micro_setup(n=4, seed=0, **micro):
    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    sampler = Sampler(SeededEngine(), EvenTokenReward(), ScriptedTokenizer(), {}, lambda r, _: r)
    setup = RolloutSetup(sampler, n, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(seed))
    return make_strategy(rollout_config({"strategy": "micro_groups", "n": n, "micro_groups": micro}), setup), sampler.engine


def test_packing_by_length_by_hand_and_against_every_order():
    import itertools

    predicted = [5.0, 1.0, 9.0, 3.0, 7.0]
    rounds = pack_by_length(predicted, 2)
    assert rounds == [[1], [0, 3], [2, 4]]  # longest together; the rounds shortest first
    cost = sum(max(predicted[j] for j in r) for r in rounds)
    best = min(sum(max(predicted[j] for j in order[k : k + 2]) for k in range(0, 5, 2))
               for order in itertools.permutations(range(5)))
    assert cost == best == 15.0
    assert pack_by_length([2.0, 2.0, 2.0], 2) == [[2], [0, 1]]  # ties by index


def test_length_aware_schedule_is_a_permutation_within_the_budget():
    strategy, _ = micro_setup(n=6, size=2, max_sequences=4, length_aware=True)
    problems = [Problem(str(u), "q", "a") for u in (8, 1, 5)]
    strategy.lengths = {"8": 8.0, "1": 1.0, "5": 5.0}
    rounds = strategy.schedule(problems)
    jobs = [job for r in rounds for job in r]
    assert sorted(jobs) == [(p, start) for p in range(3) for start in (0, 2, 4)]  # each micro-group once
    assert all(len(r) * 2 <= 4 for r in rounds)  # max_sequences rows per call
    # 9 jobs longest first: 8 8 8 5 5 5 1 1 1 in rounds of 2, the partial round (a 1) first, then shortest first
    assert [[p for p, _ in r] for r in rounds] == [[1], [1, 1], [2, 2], [0, 2], [0, 0]]
    with pytest.raises(ConfigError, match="cannot hold one micro-group"):
        micro_setup(n=4, size=4, max_sequences=2)


def test_scheduled_micro_groups_give_the_unscheduled_responses_and_less_padding():
    """Same seeds -> the same responses in every group, whatever the schedule; once the prompts' lengths
    are known, the length-aware rounds pair long with long and leave no slot unused."""
    problems = [Problem(str(u), "q", "a") for u in (8, 1, 8, 1)]
    plain, plain_engine = micro_setup(n=4, size=2, max_sequences=4)
    aware, aware_engine = micro_setup(n=4, size=2, max_sequences=4, length_aware=True)
    whole, _ = micro_setup(n=4, size=4)
    for step in range(2):
        (a, a_metrics), (p, p_metrics), (w, _) = (s.rollout(problems) for s in (aware, plain, whole))
        responses = [[c.response_ids for c in g] for g in w.groups]
        assert [[c.response_ids for c in g] for g in a.groups] == responses == [[c.response_ids for c in g] for g in p.groups]
        assert torch.equal(a.rewards, w.rewards) and torch.equal(p.rewards, w.rewards)
        assert all(len(set(map(tuple, g))) == 4 for g in responses)  # a group's responses differ
        assert a_metrics["micro_group_rounds"] == p_metrics["micro_group_rounds"] == 4
        assert p_metrics["micro_group_padding"] == pytest.approx(1 - 18 / 32)  # every round: 8, 8, 1, 1 tokens
        assert a_metrics["micro_group_padding"] == (pytest.approx(1 - 18 / 32) if step == 0 else 0.0)
    assert aware.state_dict() == {"lengths": {"8": 8.0, "1": 1.0}} and plain.state_dict() is None
    assert all(rows <= 4 for rows in aware_engine.calls + plain_engine.calls)


# ------------------------------------------------------------------ SPO: prioritised prompts, offline tracker


def spo_sampler(problems, init_samples=0, exploration=0.05, tracker=None, seed=0):
    from types import SimpleNamespace

    from rlbench.algorithm.advantages import SPOTracker
    from rlbench.training.curricula import TrackerPriorityOptions, TrackerPriorityPrompts

    class Sampler(GroupSampler):
        def encode(self, problems):
            return [(int(p.uid),) for p in problems]

    engine = ScriptedEngine()  # fresh token ids per response, in call order
    group_sampler = Sampler(engine, EvenTokenReward(), ScriptedTokenizer(), {}, lambda r, _: r)
    tracker = tracker if tracker is not None else SPOTracker(rho_min=0.875)
    source = SimpleNamespace(tracker=tracker)
    ctx = SimpleNamespace(sampler=group_sampler, params=SamplingParams(1.0, 1.0, 8), inputs=SimpleNamespace(sources=[source]))
    sampler = TrackerPriorityPrompts(problems, seed, TrackerPriorityOptions(exploration=exploration, init_samples=init_samples, init_batch=2))
    sampler.bind(ctx)
    return sampler, tracker, engine


def test_spo_draws_prompts_by_the_trackers_uncertainty():
    from rlbench.algorithm.advantages import spo_tracker_init

    problems = [Problem(str(u), "q", "a") for u in (3, 5, 7)]
    tracker_values = {"3": (0.5, 1.0), "5": spo_tracker_init(8, 8, 0.875), "7": spo_tracker_init(1, 8, 0.875)}
    sampler, tracker, _ = spo_sampler(problems)
    for uid, (successes, n) in {"5": (8, 8), "7": (1, 8)}.items():
        tracker.initialise(uid, successes, n)
    p = [tracker_values[u][0] for u in ("3", "5", "7")]  # 0.5, 8.5 / 9, 1.5 / 9
    weights = [math.sqrt(v * (1 - v)) + 0.05 for v in p]
    expected = [w / sum(weights) for w in weights]
    assert sampler.probabilities().tolist() == pytest.approx(expected)
    assert expected[0] > expected[2] > expected[1]  # the uncertain prompt most, the near-certain one least
    draws = sampler.next(20_000)  # with replacement
    frequency = [sum(d.uid == u for d in draws) / 20_000 for u in ("3", "5", "7")]
    assert frequency == pytest.approx(expected, abs=0.015)


def test_spo_tracker_is_seeded_from_the_initial_policy_before_the_first_draw():
    from rlbench.algorithm.advantages import spo_tracker_init

    problems = [Problem(str(u), "q", "a") for u in (3, 5, 7)]
    sampler, tracker, engine = spo_sampler(problems, init_samples=4)
    assert len(tracker) == 0
    sampler.next(2)
    assert engine.calls == [[((), 4, 8)] * 2, [((), 4, 8)]]  # init_batch 2 prompts x 4 responses, then the last prompt
    assert len(tracker) == 3 and sampler.initialised
    for problem in problems:
        value, weight = tracker.state_of(problem.uid)
        assert weight == pytest.approx(1 / (1 - 0.875))  # N_init
        assert 0 < value < 1
    # the successes are the graded outcomes: the first prompt's 4 responses again from a fresh engine
    again, _, _ = spo_sampler(problems, init_samples=4)
    groups = again.ctx.sampler.sample(problems[:1], 4, again.ctx.params, make_generator_for_test())
    outcome = again.ctx.sampler.grade(problems[:1], groups, 8).outcome.sum().item()
    assert tracker.state_of("3")[0] == pytest.approx(spo_tracker_init(outcome, 4, 0.875)[0])
    # resumed: the initialisation is not repeated
    state = sampler.state_dict()
    resumed, _, resumed_engine = spo_sampler(problems, init_samples=4, tracker=tracker)
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.next(5)] == [p.uid for p in sampler.next(5)] and resumed_engine.calls == []


def make_generator_for_test():
    from rlbench.utils import STREAM_CURRICULUM, make_generator

    return make_generator(0, STREAM_CURRICULUM)


def test_spo_sampling_needs_the_spo_tracker(make_cfg):
    from types import SimpleNamespace

    from rlbench.training.curricula import TrackerPriorityOptions, TrackerPriorityPrompts
    from rlbench.validation import validate_config

    sampler = TrackerPriorityPrompts([Problem("1", "q", "a")], 0, TrackerPriorityOptions())
    with pytest.raises(ConfigError, match="needs algorithm=spo"):
        sampler.bind(SimpleNamespace(inputs=SimpleNamespace(sources=[])))
    with pytest.raises(ConfigError, match="keeps no tracker"):
        validate_config(make_cfg("experiment=toy_learning/grpo", "prompt_sampler=spo"))
    with pytest.raises(ConfigError, match="init_samples >= 0"):
        validate_config(make_cfg("experiment=toy_learning/spo", "prompt_sampler=spo", "trainer.prompt_sampler.spo.init_samples=-1"))
    validate_config(make_cfg("experiment=toy_learning/spo", "prompt_sampler=spo", "trainer.prompt_sampler.spo.init_samples=4"))
