"""Statistics of a comparison: pure functions on per-problem score matrices (seeds x problems).

A two-way bootstrap over seeds and problems for intervals (Owen 2007), a paired bootstrap for the
difference of two groups, and a paired sign-flip permutation test (Fisher 1935) for its p-value.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def resampling_weights(rng: np.random.Generator, size: int, n_resamples: int) -> np.ndarray:
    """(n_resamples, size) bootstrap weights: multinomial counts of ``size`` draws with replacement,
    divided by ``size``, so that ``weights @ x`` is the mean of a resample of ``x``."""
    return rng.multinomial(size, np.full(size, 1.0 / size), size=n_resamples) / size


def weighted_macro_means(
    matrices: Sequence[np.ndarray], seed_weights: np.ndarray, problem_weights: Sequence[np.ndarray]
) -> np.ndarray:
    """Per resample r: mean over benchmarks b of  sum_s sum_i w[r, s] X_b[s, i] v_b[r, i]."""
    per_benchmark = [
        np.einsum("rs,sp,rp->r", seed_weights, matrix, weights)
        for matrix, weights in zip(matrices, problem_weights)
    ]
    return np.mean(per_benchmark, axis=0)


def _check_matrices(matrices: Sequence[np.ndarray]) -> list[np.ndarray]:
    arrays = [np.asarray(m, dtype=np.float64) for m in matrices]
    if not arrays:
        raise ValueError("the bootstrap needs at least one benchmark matrix")
    seeds = {a.shape[0] for a in arrays}
    if any(a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0 for a in arrays) or len(seeds) != 1:
        raise ValueError(
            "each benchmark needs a non-empty (seeds x problems) matrix with the same seeds (rows): "
            f"got shapes {[a.shape for a in arrays]}"
        )
    return arrays


def hierarchical_bootstrap(
    matrices: Sequence[np.ndarray], *, n_resamples: int = 1000, seed: int = 0
) -> np.ndarray:
    """Bootstrap replicates of the macro mean of per-problem scores over seeds and problems.

    ``matrices[b]`` is the (S, P_b) matrix X_b[s, i] of benchmark b: row s is one run (seed), column
    i one problem, the same problems in every row. The statistic is

        theta = mean_b ( 1/(S P_b) sum_s sum_i X_b[s, i] )

    Each replicate draws S seeds with replacement (seed weights w_s, shared by all benchmarks, since
    a seed is one run scored on every benchmark) and, for each benchmark, P_b problems with
    replacement (problem weights v_i), and evaluates theta on the resampled grid:
    theta* = mean_b sum_s sum_i w_s X_b[s, i] v_i.

    Seeds and problems are resampled as *crossed* factors -- one problem resample serves every
    drawn seed -- because every run is scored on the same problems. This is the two-way
    ("pigeonhole") bootstrap of Owen (2007), "The pigeonhole bootstrap", Ann. Appl. Stat. 1(2). For
    X[s, i] = a_s + b_i + e_si its variance is var(a)/S + var(b)/P + 3 var(e)/(S P), slightly
    conservative against the true var(a)/S + var(b)/P + var(e)/(S P). Resampling problems
    independently within each seed (the nested bootstrap) would shrink the problem term to
    var(b)/(S P) and understate the interval, since the same problems recur in every seed.

    Randomness: a local ``numpy.random.default_rng(seed)``. Returns the ``n_resamples`` replicates;
    :func:`percentile_interval` turns them into an interval.
    """
    arrays = _check_matrices(matrices)
    rng = np.random.default_rng(seed)
    seed_weights = resampling_weights(rng, arrays[0].shape[0], n_resamples)
    problem_weights = [resampling_weights(rng, a.shape[1], n_resamples) for a in arrays]
    return weighted_macro_means(arrays, seed_weights, problem_weights)


def paired_bootstrap_difference(
    matrices: Sequence[np.ndarray],
    baseline_matrices: Sequence[np.ndarray],
    *,
    n_resamples: int = 1000,
    seed: int = 0,
) -> np.ndarray:
    """Bootstrap replicates of theta(group) - theta(baseline), paired on problems.

    theta is the statistic of :func:`hierarchical_bootstrap`. Each replicate draws one problem
    resample per benchmark and applies it to both groups (the pairing: both were scored on the same
    problems), and draws the seeds of each group independently (their runs are different runs):

        delta* = theta*(X, w, v) - theta*(Y, w', v)

    The two groups may have different numbers of seeds but need the same problems per benchmark.
    Randomness: a local ``numpy.random.default_rng(seed)``.
    """
    group = _check_matrices(matrices)
    baseline = _check_matrices(baseline_matrices)
    if [a.shape[1] for a in group] != [a.shape[1] for a in baseline]:
        raise ValueError("paired bootstrap: the two groups need the same problems in every benchmark")
    rng = np.random.default_rng(seed)
    problem_weights = [resampling_weights(rng, a.shape[1], n_resamples) for a in group]
    group_seeds = resampling_weights(rng, group[0].shape[0], n_resamples)
    baseline_seeds = resampling_weights(rng, baseline[0].shape[0], n_resamples)
    return weighted_macro_means(group, group_seeds, problem_weights) - weighted_macro_means(
        baseline, baseline_seeds, problem_weights
    )


def percentile_interval(replicates: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """The alpha/2 and 1 - alpha/2 quantiles of bootstrap replicates (the percentile interval;
    Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"percentile_interval needs 0 < alpha < 1, got {alpha}")
    low, high = np.quantile(np.asarray(replicates, dtype=np.float64), [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(low), float(high)


def paired_problem_differences(
    matrices: Sequence[np.ndarray], baseline_matrices: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Per-problem differences d_i and weights u_i with  sum_i u_i d_i = theta(group) - theta(baseline).

    d_i = mean_s X_b[s, i] - mean_s Y_b[s, i] (the seed-averaged per-problem score difference);
    u_i = 1 / (B P_b) for a problem of benchmark b (the macro average over B benchmarks).
    """
    group = _check_matrices(matrices)
    baseline = _check_matrices(baseline_matrices)
    if [a.shape[1] for a in group] != [a.shape[1] for a in baseline]:
        raise ValueError("paired differences need the same problems in every benchmark")
    n_benchmarks = len(group)
    differences = np.concatenate([g.mean(axis=0) - b.mean(axis=0) for g, b in zip(group, baseline)])
    weights = np.concatenate([np.full(g.shape[1], 1.0 / (n_benchmarks * g.shape[1])) for g in group])
    return differences, weights


def sign_flip_test(
    differences: Sequence[float],
    weights: Sequence[float] | None = None,
    *,
    n_resamples: int = 1000,
    seed: int = 0,
) -> float:
    """Two-sided paired permutation (sign-flip) test of "no difference" on per-problem differences.

    Under H0 the two groups are exchangeable on every problem, so each difference d_i is as likely
    to carry either sign. The statistic is T = sum_i u_i d_i (u_i = 1/P by default, i.e. the mean
    difference) and

        p = #{ sign vectors e : |sum_i u_i e_i d_i| >= |T| } / #{ sign vectors }

    Fisher (1935), "The Design of Experiments", sec. 21; as "approximate randomization" for NLP
    systems, Noreen (1989) and Dror et al. (2018), "The Hitchhiker's Guide to Testing Statistical
    Significance in Natural Language Processing", ACL. All 2^P sign vectors are enumerated when
    2^P <= ``n_resamples`` (exact p); otherwise ``n_resamples`` random sign vectors from
    ``numpy.random.default_rng(seed)`` give p = (1 + #{|T*| >= |T|}) / (1 + n_resamples), which
    never reports 0. Identical groups (all d_i = 0) give p = 1.
    """
    d = np.asarray(differences, dtype=np.float64).ravel()
    if d.size == 0:
        raise ValueError("sign_flip_test needs at least one difference")
    u = np.full(d.size, 1.0 / d.size) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if u.shape != d.shape:
        raise ValueError(f"sign_flip_test: {d.size} differences but {u.size} weights")
    if n_resamples < 1:
        raise ValueError(f"sign_flip_test needs n_resamples >= 1, got {n_resamples}")
    contributions = u * d
    observed = abs(contributions.sum())
    tolerance = 1e-12 * max(1.0, float(np.abs(contributions).sum()))
    if d.size < 63 and 2**d.size <= n_resamples:
        bits = (np.arange(2**d.size)[:, None] >> np.arange(d.size)) & 1
        statistics = np.abs((1 - 2 * bits) @ contributions)
        return float(np.mean(statistics >= observed - tolerance))
    rng = np.random.default_rng(seed)
    exceed = 0
    chunk = max(1, min(n_resamples, 4_000_000 // d.size))
    for start in range(0, n_resamples, chunk):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(chunk, n_resamples - start), d.size))
        exceed += int(np.sum(np.abs(signs @ contributions) >= observed - tolerance))
    return (1 + exceed) / (1 + n_resamples)
