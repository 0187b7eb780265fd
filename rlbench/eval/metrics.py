"""Evaluation metrics over sampled answers: unbiased pass@k, maj@k, bootstrap CIs.

All randomness uses local ``numpy.random.Generator`` objects seeded explicitly; the global
NumPy / Python RNG state is never read or changed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ProblemResult", "bootstrap_ci", "maj_at_k", "pass_at_k", "summarize"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct.

    Chen et al. (2021), "Evaluating Large Language Models Trained on Code":

        pass@k = 1 - C(n - c, k) / C(n, k)
               = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

    The product form avoids huge binomials. Returns 1.0 when ``n - c < k`` (every
    k-subset contains a correct sample). Raises ValueError unless
    ``1 <= k <= n`` and ``0 <= c <= n``.
    """
    n, c, k = int(n), int(c), int(k)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(f"pass@k needs k <= n, got k={k} with only n={n} samples")
    if c < 0 or c > n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    return 1.0 - prob_all_wrong


def _subsets(n: int, k: int, max_subsets: int, seed: int) -> np.ndarray:
    """k-subsets of range(n) as a sorted (S, k) index array.

    All C(n, k) subsets if that is <= ``max_subsets``; otherwise ``max_subsets`` uniform
    random subsets: for each, the k smallest of n uniform keys drawn from
    ``numpy.random.default_rng(seed)`` (a uniformly random k-subset).
    """
    if math.comb(n, k) <= max_subsets:
        return np.array(list(itertools.combinations(range(n), k)), dtype=np.int64).reshape(-1, k)
    rng = np.random.default_rng(seed)
    keys = rng.random((max_subsets, n))
    idx = np.argpartition(keys, k - 1, axis=1)[:, :k] if k < n else np.argsort(keys, axis=1)
    return np.sort(idx, axis=1)


def maj_at_k(
    answer_keys: Sequence[str | None],
    correct: Sequence[bool],
    k: int,
    *,
    max_subsets: int = 2000,
    seed: int = 0,
) -> float:
    """Expected majority-vote accuracy over k-subsets of the n samples.

        maj@k = mean over k-subsets S of 1[correct(winner(S))]

    where ``winner(S)`` is the most frequent non-None answer key in S, ties broken by the
    earliest sample index (the key whose first sample in S comes first). A key's correctness
    is that of the first sample (lowest index) carrying it -- samples with the same key are
    assumed to share correctness. A subset with no non-None key scores 0. All C(n, k)
    subsets are enumerated when C(n, k) <= ``max_subsets``; otherwise ``max_subsets``
    random subsets from ``numpy.random.default_rng(seed)`` are averaged.
    """
    n = len(answer_keys)
    if len(correct) != n:
        raise ValueError(f"maj@k: {n} answer keys but {len(correct)} correctness flags")
    k = int(k)
    if k < 1 or k > n:
        raise ValueError(f"maj@k needs 1 <= k <= n, got k={k} with n={n} samples")
    if max_subsets < 1:
        raise ValueError(f"maj@k needs max_subsets >= 1, got {max_subsets}")

    # integer id per distinct key, in order of first appearance; None -> -1
    key_ids: dict[str, int] = {}
    ids = np.empty(n, dtype=np.int64)
    key_correct: list[bool] = []
    for i, key in enumerate(answer_keys):
        if key is None:
            ids[i] = -1
            continue
        if key not in key_ids:
            key_ids[key] = len(key_ids)
            key_correct.append(bool(correct[i]))
        ids[i] = key_ids[key]
    m = len(key_ids)
    if m == 0:
        return 0.0
    if not any(key_correct):
        return 0.0

    subsets = _subsets(n, k, max_subsets, seed)  # (S, k), each row sorted ascending
    sub_ids = ids[subsets]  # (S, k)
    n_sub = sub_ids.shape[0]
    rows = np.broadcast_to(np.arange(n_sub)[:, None], sub_ids.shape)
    valid = sub_ids >= 0

    counts = np.zeros((n_sub, m), dtype=np.int64)
    np.add.at(counts, (rows[valid], sub_ids[valid]), 1)
    # position of each key's first sample inside the (sorted) subset; k if absent
    first = np.full((n_sub, m), k, dtype=np.int64)
    for pos in range(k - 1, -1, -1):
        col_ok = valid[:, pos]
        first[np.nonzero(col_ok)[0], sub_ids[col_ok, pos]] = pos
    # more votes wins; among equal votes the smaller first position wins
    score = counts * (k + 1) + (k - first)
    winner = np.argmax(score, axis=1)
    has_vote = counts.max(axis=1) > 0
    win_correct = np.asarray(key_correct, dtype=bool)[winner] & has_vote
    return float(win_correct.mean())


def _check_bootstrap_args(n_resamples: int, alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"bootstrap_ci needs 0 < alpha < 1, got {alpha}")
    if n_resamples < 1:
        raise ValueError(f"bootstrap_ci needs n_resamples >= 1, got {n_resamples}")


def _resampled_means(arr: np.ndarray, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``n_resamples`` with-replacement resamples of ``arr`` (memory bounded)."""
    size = arr.size
    chunk = max(1, min(n_resamples, 2_000_000 // size))  # bound memory to ~16 MB of indices
    means = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, chunk):
        stop = min(n_resamples, start + chunk)
        idx = rng.integers(0, size, size=(stop - start, size))
        means[start:stop] = arr[idx].mean(axis=1)
    return means


def bootstrap_ci(
    values: Sequence[float],
    *,
    n_resamples: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap (1 - alpha) confidence interval of the mean.

    Draws ``n_resamples`` resamples of the values with replacement (local
    ``numpy.random.default_rng(seed)``), computes each resample's mean, and returns the
    ``alpha/2`` and ``1 - alpha/2`` quantiles of those means. One value v -> (v, v).
    Raises ValueError on an empty sequence.
    """
    return macro_bootstrap_ci([values], n_resamples=n_resamples, alpha=alpha, seed=seed)


def macro_bootstrap_ci(
    strata: Sequence[Sequence[float]],
    *,
    n_resamples: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the macro average (1/S) sum_s mean(stratum_s).

    Each stratum (a benchmark's per-problem values) is resampled with replacement on its own,
    so every resample keeps each benchmark's size and weight 1/S. One stratum is
    :func:`bootstrap_ci`; a stratum of one value contributes that value in every resample.
    """
    _check_bootstrap_args(n_resamples, alpha)
    arrays = [np.asarray(v, dtype=np.float64).ravel() for v in strata]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ValueError("bootstrap_ci needs at least one value (in every stratum)")
    if all(a.size == 1 for a in arrays):
        v = float(np.mean([a[0] for a in arrays]))
        return v, v
    rng = np.random.default_rng(seed)
    means = np.mean([_resampled_means(a, n_resamples, rng) for a in arrays], axis=0)
    low, high = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(low), float(high)


MACRO_AVERAGE = "macro_avg"  # the row that averages benchmarks with equal weight
# (metric, interval low column, interval high column); pass@k keeps its historical ci_low / ci_high
METRIC_COLUMNS = (
    ("pass_at_k", "ci_low", "ci_high"),
    ("maj_at_k", "maj_ci_low", "maj_ci_high"),
    ("mean_accuracy", "accuracy_ci_low", "accuracy_ci_high"),
)


@dataclass
class ProblemResult:
    """Graded samples for one problem.

    benchmark:   benchmark name (rows of :func:`summarize` are grouped by it).
    uid:         problem identifier.
    correct:     one flag per sample (n samples).
    answer_keys: canonical answer per sample (None if no answer), used for maj@k.
    votable:     False when answers cannot vote (programs): maj@k is then reported as NaN.
    """

    benchmark: str
    uid: str
    correct: list[bool] = field(default_factory=list)
    answer_keys: list[str | None] = field(default_factory=list)
    votable: bool = True


def summarize(
    results: Sequence[ProblemResult], ks: Sequence[int], *, seed: int = 0
) -> list[dict]:
    """One row per (benchmark, k) with pass@k, its bootstrap CI, maj@k and accuracy.

    Row keys:
      * ``benchmark``, ``k``;
      * ``pass_at_k``: mean over problems of :func:`pass_at_k` (n_i, c_i, k), each problem
        using its own sample count n_i and correct count c_i;
      * ``ci_low``, ``ci_high``: :func:`bootstrap_ci` of those per-problem values (seed);
      * ``maj_at_k``: mean over problems of :func:`maj_at_k` (seed); NaN when the benchmark's
        answers cannot vote (``votable=False``, e.g. code);
      * ``maj_ci_low``, ``maj_ci_high``: bootstrap interval of maj@k (NaN when it is);
      * ``mean_accuracy``: mean over problems of c_i / n_i, with ``accuracy_ci_low/high``;
      * ``n``: samples per problem -- if problems differ, the minimum n_i;
      * ``problems``: number of problems.

    With more than one benchmark, rows named ``macro_avg`` follow: every metric averaged over
    benchmarks with equal weight, its interval from :func:`macro_bootstrap_ci` (problems
    resampled within each benchmark); ``problems`` is then the total.

    Rows are ordered by benchmark (order of first appearance) then ascending k. Raises
    ValueError if some k exceeds a benchmark's (minimum) n, or a problem has no samples or
    mismatched ``correct`` / ``answer_keys`` lengths.
    """
    groups: dict[str, list[ProblemResult]] = {}
    for r in results:
        n_i = len(r.correct)
        if n_i == 0:
            raise ValueError(f"problem {r.uid!r} ({r.benchmark}) has no samples")
        if len(r.answer_keys) != n_i:
            raise ValueError(
                f"problem {r.uid!r} ({r.benchmark}): {n_i} correctness flags but "
                f"{len(r.answer_keys)} answer keys"
            )
        groups.setdefault(r.benchmark, []).append(r)

    k_list = sorted({int(k) for k in ks})
    rows: list[dict] = []
    per_benchmark: dict[tuple[str, int], dict[str, list[float]]] = {}
    for bench, probs in groups.items():
        n_min = min(len(p.correct) for p in probs)
        for k in k_list:
            if k < 1 or k > n_min:
                raise ValueError(
                    f"cannot compute pass@k for k={k} on benchmark {bench!r}: "
                    f"need 1 <= k <= n, and n={n_min} samples per problem"
                )
        counts = [(len(p.correct), int(sum(bool(x) for x in p.correct))) for p in probs]
        accuracy = [c / n for n, c in counts]
        votable = all(p.votable for p in probs)
        for k in k_list:
            values = {
                "pass_at_k": [pass_at_k(n, c, k) for n, c in counts],
                "maj_at_k": [maj_at_k(p.answer_keys, p.correct, k, seed=seed) for p in probs] if votable else [],
                "mean_accuracy": accuracy,
            }
            per_benchmark[bench, k] = values
            rows.append(_row(bench, k, [values], n_min, len(probs), seed))
    if len(groups) > 1:
        for k in k_list:
            strata = [per_benchmark[bench, k] for bench in groups]
            n_min = min(len(p.correct) for probs in groups.values() for p in probs)
            rows.append(_row(MACRO_AVERAGE, k, strata, n_min, sum(len(p) for p in groups.values()), seed))
    return rows


def _row(benchmark: str, k: int, strata: Sequence[dict[str, list[float]]], n: int, problems: int, seed: int) -> dict:
    """One table row: each metric's (macro) mean over the strata and its bootstrap interval."""
    row: dict = {"benchmark": benchmark, "k": k}
    for metric, low_key, high_key in METRIC_COLUMNS:
        parts = [s[metric] for s in strata]
        if any(not p for p in parts):  # e.g. maj@k of programs: no votes
            row[metric], row[low_key], row[high_key] = math.nan, math.nan, math.nan
            continue
        row[metric] = float(np.mean([np.mean(p) for p in parts]))
        row[low_key], row[high_key] = macro_bootstrap_ci(parts, seed=seed)
    row["n"], row["problems"] = n, problems
    return row
