"""Tests for rlbench.eval.metrics: pass@k, maj@k, bootstrap CI and summarize."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import numpy as np
import pytest

from rlbench.eval import ProblemResult, bootstrap_ci, maj_at_k, pass_at_k, summarize


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (first c correct) containing a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def brute_maj_at_k(keys, correct, k: int) -> float:
    """Majority vote over every k-subset, written as plainly as possible."""
    total = 0.0
    subsets = list(itertools.combinations(range(len(keys)), k))
    for s in subsets:
        votes = Counter(keys[i] for i in s if keys[i] is not None)
        if not votes:
            continue
        best = max(votes.values())
        winner_idx = min(i for i in s if keys[i] is not None and votes[keys[i]] == best)
        first_with_key = keys.index(keys[winner_idx])
        total += bool(correct[first_with_key])
    return total / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_matches_binomial_formula():
    for n, c, k in [(16, 3, 4), (64, 10, 8), (50, 0, 5), (50, 50, 1)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (3, 1, 0), (3, 4, 1), (3, -1, 1), (0, 0, 1)])
def test_pass_at_k_invalid(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_large_n():
    value = pass_at_k(200, 3, 100)
    assert math.isfinite(value) and 0.0 <= value <= 1.0
    expected = 1 - math.comb(197, 100) / math.comb(200, 100)
    assert value == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(200, 150, 100) == 1.0  # n - c < k


MAJ_CASES = [
    (["a", "b", "a", "c"], [True, False, True, False]),
    (["a", "b", "b", "a"], [True, False, False, True]),  # ties everywhere
    (["a", "b", "b", "a"], [False, True, True, False]),
    ([None, "x", None, "y", "y"], [False, False, False, True, True]),
    ([None, None, None], [False, False, False]),
    ([None, "a", None], [False, True, False]),
    (["a", "a", "a"], [True, True, True]),
    (["1", "2", "3", "2", "1", None, "3"], [False, True, False, True, False, False, False]),
]


@pytest.mark.parametrize(("keys", "correct"), MAJ_CASES)
def test_maj_at_k_matches_brute_force(keys, correct):
    for k in range(1, len(keys) + 1):
        assert maj_at_k(keys, correct, k) == pytest.approx(brute_maj_at_k(keys, correct, k), abs=1e-12)


def test_maj_at_k_random_cases_match_brute_force():
    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(1, 7)
        keys = [rng.choice(["p", "q", "r", None]) for _ in range(n)]
        good = rng.choice(["p", "q", "r"])
        correct = [key == good for key in keys]
        k = rng.randint(1, n)
        assert maj_at_k(keys, correct, k) == pytest.approx(brute_maj_at_k(keys, correct, k), abs=1e-12)


def test_maj_at_k_tie_goes_to_earliest_sample():
    assert maj_at_k(["right", "wrong"], [True, False], 2) == 1.0
    assert maj_at_k(["wrong", "right"], [False, True], 2) == 0.0


def test_maj_at_k_sampled_subsets():
    rng = random.Random(0)
    keys = [rng.choice("abc") for _ in range(30)]
    correct = [key == "a" for key in keys]
    exact = brute_maj_at_k(keys, correct, 3)  # C(30, 3) = 4060 > 2000 -> sampling
    approx = maj_at_k(keys, correct, 3, max_subsets=2000, seed=0)
    assert approx == maj_at_k(keys, correct, 3, max_subsets=2000, seed=0)
    assert abs(approx - exact) < 0.05
    assert maj_at_k(keys, correct, 3, max_subsets=5000) == pytest.approx(exact, abs=1e-12)


def test_maj_at_k_invalid():
    with pytest.raises(ValueError):
        maj_at_k(["a"], [True], 2)
    with pytest.raises(ValueError):
        maj_at_k(["a", "b"], [True], 1)


def test_bootstrap_ci_basic_and_deterministic():
    values = np.random.default_rng(3).random(50)
    state = np.random.get_state()
    low, high = bootstrap_ci(values, seed=7)
    assert low <= float(np.mean(values)) <= high
    assert low < high
    assert (low, high) == bootstrap_ci(values, seed=7)
    assert (low, high) != bootstrap_ci(values, seed=8)
    after = np.random.get_state()
    assert after[0] == state[0] and np.array_equal(after[1], state[1]) and after[2:] == state[2:]


def test_bootstrap_ci_edge_cases():
    assert bootstrap_ci([0.3]) == (0.3, 0.3)
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)
    with pytest.raises(ValueError):
        bootstrap_ci([])
    low, high = bootstrap_ci([0.0, 1.0] * 20, alpha=0.5)
    low_wide, high_wide = bootstrap_ci([0.0, 1.0] * 20, alpha=0.01)
    assert low_wide <= low <= 0.5 <= high <= high_wide


def _example():
    return [
        ProblemResult("A", "a1", [True, False, False, False], ["1", "2", "2", "3"]),
        ProblemResult("B", "b1", [False, False], [None, "7"]),
        ProblemResult("A", "a2", [True, True, True, True], ["5", "5", "5", "5"]),
    ]


def test_summarize_hand_computed():
    rows = summarize(_example(), ks=[2, 1])
    assert [(r["benchmark"], r["k"]) for r in rows] == [
        ("A", 1), ("A", 2), ("B", 1), ("B", 2), ("macro_avg", 1), ("macro_avg", 2)
    ]
    a1, a2, b1, b2, m1, m2 = rows
    # A, k=1: pass@1 = (1/4 + 1) / 2; maj@1 = same; accuracy = same
    assert a1["pass_at_k"] == pytest.approx(0.625)
    assert a1["maj_at_k"] == pytest.approx(0.625)
    assert a1["mean_accuracy"] == pytest.approx(0.625)
    # A, k=2: pass@2(a1) = 1 - C(3,2)/C(4,2) = 0.5; maj@2(a1) = 3/6 (ties -> sample 0 wins
    # in the three pairs containing it); a2 is always 1
    assert a2["pass_at_k"] == pytest.approx(0.75)
    assert a2["maj_at_k"] == pytest.approx(0.75)
    assert a2["mean_accuracy"] == pytest.approx(0.625)
    assert a1["n"] == a2["n"] == 4 and a1["problems"] == 2
    assert 0.25 <= a1["ci_low"] <= a1["pass_at_k"] <= a1["ci_high"] <= 1.0
    for row in (b1, b2):
        assert row["pass_at_k"] == 0.0 and row["maj_at_k"] == 0.0 and row["mean_accuracy"] == 0.0
        assert (row["ci_low"], row["ci_high"]) == (0.0, 0.0)
        assert row["n"] == 2 and row["problems"] == 1
    assert set(a1) == {
        "benchmark", "k", "pass_at_k", "ci_low", "ci_high", "maj_at_k", "mean_accuracy", "n",
        "problems", "maj_ci_low", "maj_ci_high", "accuracy_ci_low", "accuracy_ci_high",
    }
    assert a1["accuracy_ci_low"] <= a1["mean_accuracy"] <= a1["accuracy_ci_high"]
    assert a2["maj_ci_low"] <= a2["maj_at_k"] <= a2["maj_ci_high"]
    # macro average: each benchmark weighs 1/2 whatever its size; B (one problem, all wrong)
    # contributes 0 to every resample, so the interval is A's halved
    assert m1["pass_at_k"] == pytest.approx((0.625 + 0.0) / 2) and m2["pass_at_k"] == pytest.approx(0.75 / 2)
    assert m1["maj_at_k"] == pytest.approx(0.625 / 2) and m1["problems"] == 3 and m1["n"] == 2
    assert (m1["ci_low"], m1["ci_high"]) == pytest.approx((a1["ci_low"] / 2, a1["ci_high"] / 2))


def test_macro_bootstrap_interval_keeps_each_benchmark_weight():
    from rlbench.eval.metrics import macro_bootstrap_ci

    big = [1.0] * 50  # a large benchmark of all-correct problems
    small = [0.0, 1.0]  # a small benchmark
    low, high = macro_bootstrap_ci([big, small], n_resamples=2000, seed=1)
    # resamples of `small` have mean 0, 0.5 or 1 -> macro 0.5, 0.75 or 1.0
    assert (low, high) == (0.5, 1.0)
    assert macro_bootstrap_ci([[0.3]]) == (0.3, 0.3)
    with pytest.raises(ValueError):
        macro_bootstrap_ci([[1.0], []])


def test_summarize_k_too_large():
    with pytest.raises(ValueError, match=r"k=4.*n=2"):
        summarize(_example(), ks=[4])


def test_summarize_uneven_n_reports_min():
    results = [
        ProblemResult("A", "a1", [True, False, False], ["1", "2", "2"]),
        ProblemResult("A", "a2", [True, False], ["1", "2"]),
    ]
    (row,) = summarize(results, ks=[2])
    assert row["n"] == 2
    assert row["pass_at_k"] == pytest.approx((pass_at_k(3, 1, 2) + pass_at_k(2, 1, 2)) / 2)


def test_summarize_mismatched_lengths():
    with pytest.raises(ValueError, match="answer keys"):
        summarize([ProblemResult("A", "a1", [True, False], ["1"])], ks=[1])
