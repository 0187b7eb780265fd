"""``rlbench-compare``: compare groups of runs (algorithms, settings) across seeds and benchmarks.

    rlbench-compare RESULTS... [--by algorithm] [--baseline grpo] [--phase after]
                    [--filter key=value ...] [--k 1 4] [--out DIR] [--wandb-run RUN_PATH]
                    [--resamples 1000] [--seed 0]

RESULTS are run folders or folders above them (a multirun folder holds many): every folder below
them that holds ``eval/problems.csv`` is a run. Runs are grouped by dotted keys of their
``config.yaml`` (``--by algorithm.name``; a key naming a config node with a ``name``, such as
``algorithm``, means its name) and selected with ``--filter key=value`` (``key=a,b`` matches either).

For every group, benchmark and k the table reports, from the runs' per-problem counts
(``eval/problems.csv`` of the chosen phase):

* ``pass_at_k``: the mean over seeds (runs) of each run's pass@k, where a run's pass@k is the mean
  over problems of the unbiased estimator (Chen et al. 2021; :func:`rlbench.eval.metrics.pass_at_k`).
  This is exactly the mean over seeds of the ``pass_at_k`` column of the runs' ``eval/passk.csv``.
* ``ci_low`` / ``ci_high``: a 95% percentile interval from a two-level bootstrap that resamples seeds
  and problems (:func:`hierarchical_bootstrap`).
* ``seeds``, ``problems``: how many runs and problems the numbers rest on.
* ``diff`` with ``diff_ci_low`` / ``diff_ci_high``: the group's pass@k minus the baseline group's,
  with a paired bootstrap interval (:func:`paired_bootstrap_difference`), and ``p_value``, a paired
  sign-flip permutation test over problems (:func:`sign_flip_test`).

With more than one benchmark, a ``macro`` row averages the benchmarks (each benchmark weighs the same).
The table goes to ``table.md``, ``table.csv`` and ``table.tex``, the runs behind it to ``runs.csv``,
and two PNG figures are drawn: ``passk_curves.png`` and ``training_curves.png``.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from rlbench.errors import ConfigError, DataError
from rlbench.eval.metrics import pass_at_k
from rlbench.utils import atomic_write_bytes, atomic_write_text

__all__ = [
    "Run",
    "build_table",
    "config_value",
    "find_run_dirs",
    "group_runs",
    "hierarchical_bootstrap",
    "load_run",
    "main",
    "paired_bootstrap_difference",
    "paired_problem_differences",
    "percentile_interval",
    "score_matrix",
    "select_runs",
    "shared_problem_sets",
    "sign_flip_test",
]

MACRO = "macro"
TRAINING_METRICS = ("reward_mean", "response_length", "entropy")
TABLE_COLUMNS = [
    "group", "benchmark", "k", "pass_at_k", "ci_low", "ci_high", "seeds", "problems",
    "baseline", "diff", "diff_ci_low", "diff_ci_high", "p_value",
]


# --------------------------------------------------------------------------------------------
# Statistics (pure functions on per-problem score matrices)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Runs: discovery, configs, grouping
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run folder: its resolved config, per-problem counts, pass@k table and step metrics."""

    path: Path
    config: dict
    problems: pd.DataFrame  # phase, benchmark, uid, n, correct
    passk: pd.DataFrame     # phase, benchmark, k, pass_at_k, ...
    metrics: pd.DataFrame   # one row per training step (may be empty)

    @property
    def name(self) -> str:
        return str(self.path)


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Every folder at or below ``paths`` that holds ``eval/problems.csv``, sorted, without repeats."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if not path.exists():
            raise DataError(f"{path} does not exist; pass run folders or folders that contain them")
        if (path / "eval" / "problems.csv").is_file():
            found.add(path.resolve())
        found.update(p.parent.parent.resolve() for p in path.rglob("eval/problems.csv"))
    return sorted(found)


def _read_csv(path: Path, required: Sequence[str]) -> pd.DataFrame:
    if not path.is_file():
        raise DataError(f"{path} is missing; is this a complete rlbench run folder?")
    try:
        frame = pd.read_csv(path, dtype={"uid": str, "benchmark": str, "phase": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DataError(f"{path} cannot be read as CSV: {err}") from err
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise DataError(f"{path} lacks the columns {missing}; it was not written by this rlbench version")
    return frame


def _read_metrics(path: Path) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame()
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError as err:
                raise DataError(f"{path}:{number} is not valid JSON: {err}") from err
    return pd.DataFrame(records)


def load_run(path: str | Path) -> Run:
    """Read a run folder written by :mod:`rlbench.runner`."""
    path = Path(path)
    config_path = path / "config.yaml"
    if not config_path.is_file():
        raise DataError(f"{config_path} is missing; every run folder holds its resolved config.yaml")
    config = OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)
    if not isinstance(config, dict):
        raise DataError(f"{config_path} is not a mapping")
    problems = _read_csv(path / "eval" / "problems.csv", ["phase", "benchmark", "uid", "n", "correct"])
    passk = _read_csv(path / "eval" / "passk.csv", ["phase", "benchmark", "k", "pass_at_k"])
    return Run(path, config, problems, passk, _read_metrics(path / "metrics.jsonl"))


def config_value(config: Mapping[str, Any], key: str) -> Any:
    """The value at dotted ``key``; a node with a ``name`` (e.g. ``algorithm``) stands for its name.

    Raises KeyError when a part of the key is missing, ValueError for a node without a name.
    """
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    if isinstance(node, Mapping):
        if "name" not in node:
            raise ValueError(f"{key} is a config node without a 'name'; name one of its keys, e.g. {key}.<key>")
        return node["name"]
    return node


def format_value(value: Any) -> str:
    """A config value as it is written on the command line: true/false, null, 0.28, grpo."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


EVAL_ONLY = "eval-only"


def run_key(run: Run, key: str) -> str:
    """:func:`config_value` of a run as text, with errors that name the run and the key. For an
    evaluation-only run (``mode=eval``) every ``algorithm`` key reads ``eval-only``: nothing was
    trained, so the composed algorithm is not what distinguishes it."""
    if str(run.config.get("mode", "train")) == "eval" and key.split(".")[0] == "algorithm":
        return EVAL_ONLY
    try:
        return format_value(config_value(run.config, key))
    except KeyError:
        raise ConfigError(
            f"key {key!r} is not in {run.path / 'config.yaml'}; use a dotted key of the resolved config "
            f"(top-level keys: {', '.join(sorted(run.config))})"
        ) from None
    except ValueError as err:
        raise ConfigError(f"{err} (in {run.path / 'config.yaml'})") from None


def parse_filters(filters: Sequence[str]) -> list[tuple[str, set[str]]]:
    """``key=value`` (or ``key=a,b``: either value) strings -> (key, accepted values)."""
    parsed = []
    for item in filters:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"--filter {item!r}: write key=value, e.g. --filter model=tiny or dataset.name=arith")
        parsed.append((key.strip(), {v.strip() for v in value.split(",")}))
    return parsed


def select_runs(runs: Sequence[Run], filters: Sequence[str]) -> list[Run]:
    """The runs whose config matches every filter (see :func:`parse_filters`)."""
    parsed = parse_filters(filters)
    return [run for run in runs if all(run_key(run, key) in accepted for key, accepted in parsed)]


def group_runs(runs: Sequence[Run], by: Sequence[str]) -> dict[str, list[Run]]:
    """Runs grouped by the values of the ``by`` keys, joined with '/' (e.g. ``grpo`` or ``grpo/tiny``)."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        label = "/".join(run_key(run, key) for key in by)
        groups.setdefault(label, []).append(run)
    return groups


def _natural_key(label: str) -> tuple:
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = format_value(value)
    return flat


RUN_SPECIFIC_KEYS = {"seed", "run_name", "output_dir"}


def group_warnings(groups: Mapping[str, Sequence[Run]]) -> list[str]:
    """Warnings about groups that mix settings (config keys other than the seed that differ between
    their runs) or repeat a seed (the same run twice would count as two seeds)."""
    warnings = []
    for label, runs in groups.items():
        flat = [_flatten(run.config) for run in runs]
        keys = sorted(set().union(*flat) - RUN_SPECIFIC_KEYS)
        differing = [k for k in keys if len({f.get(k) for f in flat}) > 1]
        if differing:
            shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
            warnings.append(
                f"group {label!r} mixes runs whose configs differ in {shown}; add the key to --by or --filter"
            )
        seeds = [f.get("seed") for f in flat]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1}, key=str)
        if repeated:
            warnings.append(f"group {label!r} holds several runs with seed {', '.join(map(str, repeated))}")
    return warnings


# --------------------------------------------------------------------------------------------
# Per-problem score matrices
# --------------------------------------------------------------------------------------------


def phase_problems(run: Run, phase: str) -> pd.DataFrame:
    """The run's problems.csv rows of ``phase``; a clear error when the phase is absent.

    An evaluation-only run (``mode=eval``) has one phase, ``eval``; it stands in for ``before``
    and ``after``, so a base model or a checkpoint can be the baseline of trained runs."""
    phases = set(run.problems["phase"].unique())
    if phase in ("before", "after") and phase not in phases and phases == {"eval"}:
        phase = "eval"
    rows = run.problems[run.problems["phase"] == phase]
    if rows.empty:
        available = ", ".join(sorted(run.problems["phase"].unique())) or "none"
        raise DataError(f"run {run.name} has no '{phase}' evaluation (it has: {available}); choose --phase")
    duplicated = rows[rows.duplicated(["benchmark", "uid"], keep=False)]
    if not duplicated.empty:
        first = duplicated.iloc[0]
        raise DataError(f"{run.path / 'eval' / 'problems.csv'}: problem {first['uid']!r} of {first['benchmark']} "
                        f"appears more than once in phase {phase}")
    return rows


def shared_problem_sets(runs: Sequence[Run], phase: str) -> dict[str, list[str]]:
    """benchmark -> its problem uids (sorted), checked to be identical in every run.

    Pairing problems across runs is only possible when all runs scored the same problems, so any
    disagreement (a benchmark missing in a run, or a different set of problems) is a DataError that
    names the two runs and the problems that differ.
    """
    reference = runs[0]
    reference_sets = {
        bench: set(rows["uid"]) for bench, rows in phase_problems(reference, phase).groupby("benchmark", sort=False)
    }
    for run in runs[1:]:
        sets = {bench: set(rows["uid"]) for bench, rows in phase_problems(run, phase).groupby("benchmark", sort=False)}
        if set(sets) != set(reference_sets):
            raise DataError(
                f"runs evaluate different benchmarks, so they cannot be compared: {reference.name} has "
                f"{sorted(reference_sets)}, {run.name} has {sorted(sets)}; select comparable runs with --filter"
            )
        for bench, uids in sets.items():
            if uids != reference_sets[bench]:
                only_here = sorted(uids - reference_sets[bench])
                only_there = sorted(reference_sets[bench] - uids)
                raise DataError(
                    f"runs scored different {bench} problems, so pairing is impossible: {run.name} has "
                    f"{len(only_here)} problems that {reference.name} lacks (e.g. {only_here[:3]}) and lacks "
                    f"{len(only_there)} that it has (e.g. {only_there[:3]}); check eval.limit and the benchmark data"
                )
    return {bench: sorted(uids, key=_natural_key) for bench, uids in reference_sets.items()}


_pass_at_k = functools.lru_cache(maxsize=None)(pass_at_k)


def score_matrix(runs: Sequence[Run], phase: str, benchmark: str, uids: Sequence[str], k: int) -> np.ndarray:
    """(runs x problems) matrix of per-problem unbiased pass@k, columns in ``uids`` order."""
    matrix = np.empty((len(runs), len(uids)))
    for row, run in enumerate(runs):
        rows = phase_problems(run, phase)
        counts = rows[rows["benchmark"] == benchmark].set_index("uid").loc[list(uids)]
        smallest_n = int(counts["n"].min())
        if k > smallest_n:
            raise ConfigError(
                f"k={k} exceeds the {smallest_n} samples per problem of {benchmark} in run {run.name} "
                f"(its eval.n); choose --k values up to {smallest_n}"
            )
        matrix[row] = [_pass_at_k(int(n), int(c), k) for n, c in zip(counts["n"], counts["correct"])]
    return matrix


def default_ks(runs: Sequence[Run], phase: str) -> list[int]:
    """The k values that every run's passk.csv reports for ``phase``."""
    per_run = [set(run.passk.loc[run.passk["phase"] == phase, "k"].astype(int)) for run in runs]
    ks = sorted(set.intersection(*per_run))
    if not ks:
        raise DataError(f"the runs' eval/passk.csv files share no k for phase {phase}; pass --k")
    return ks


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def table_row(label, benchmark, k, matrices, *, baseline_label, baseline_matrices, n_resamples, seed, alpha):
    """One table row from per-benchmark score matrices (several: the macro row)."""
    mean = float(np.mean([m.mean() for m in matrices]))
    ci_low, ci_high = percentile_interval(hierarchical_bootstrap(matrices, n_resamples=n_resamples, seed=seed), alpha)
    row = {
        "group": label, "benchmark": benchmark, "k": k, "pass_at_k": mean, "ci_low": ci_low, "ci_high": ci_high,
        "seeds": matrices[0].shape[0], "problems": sum(m.shape[1] for m in matrices),
        "baseline": baseline_label or "", "diff": math.nan, "diff_ci_low": math.nan, "diff_ci_high": math.nan,
        "p_value": math.nan,
    }
    if baseline_matrices is not None and label != baseline_label:
        differences, weights = paired_problem_differences(matrices, baseline_matrices)
        diff_low, diff_high = percentile_interval(
            paired_bootstrap_difference(matrices, baseline_matrices, n_resamples=n_resamples, seed=seed), alpha
        )
        row.update(
            diff=mean - float(np.mean([m.mean() for m in baseline_matrices])),
            diff_ci_low=diff_low,
            diff_ci_high=diff_high,
            p_value=sign_flip_test(differences, weights, n_resamples=n_resamples, seed=seed),
        )
    return row


def build_table(
    groups: Mapping[str, Sequence[Run]],
    *,
    phase: str = "after",
    ks: Sequence[int] | None = None,
    baseline: str | None = None,
    n_resamples: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """One row per (group, benchmark, k), plus a ``macro`` row per (group, k) with several benchmarks.

    Columns: see the module docstring (``TABLE_COLUMNS``). Rows are ordered by benchmark, k, then
    group (the baseline first). Raises ConfigError for an unknown baseline, DataError when runs
    disagree on their problems.
    """
    if not groups:
        raise DataError("no runs to compare")
    if baseline is not None and baseline not in groups:
        raise ConfigError(f"--baseline {baseline!r} is not a group; the groups are: {', '.join(groups)}")
    if n_resamples < 1:
        raise ConfigError(f"--resamples must be >= 1, got {n_resamples}")
    all_runs = [run for runs in groups.values() for run in runs]
    problem_sets = shared_problem_sets(all_runs, phase)
    ks = sorted({int(k) for k in ks}) if ks else default_ks(all_runs, phase)
    if ks[0] < 1:
        raise ConfigError(f"--k values must be >= 1, got {ks}")
    labels = sorted(groups, key=lambda g: (g != baseline, _natural_key(g)))
    benchmarks = list(problem_sets)
    resampling = {"n_resamples": n_resamples, "seed": seed, "alpha": alpha}
    rows = []
    for k in ks:
        matrices = {
            label: [score_matrix(groups[label], phase, bench, problem_sets[bench], k) for bench in benchmarks]
            for label in labels
        }
        base = matrices.get(baseline) if baseline is not None else None
        for index, bench in enumerate(benchmarks):
            for label in labels:
                rows.append(table_row(label, bench, k, [matrices[label][index]], baseline_label=baseline,
                                      baseline_matrices=None if base is None else [base[index]], **resampling))
        if len(benchmarks) > 1:
            for label in labels:
                rows.append(table_row(label, MACRO, k, matrices[label], baseline_label=baseline,
                                      baseline_matrices=base, **resampling))
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    order = {bench: i for i, bench in enumerate([*benchmarks, MACRO])}
    table["_bench"] = table["benchmark"].map(order)
    table["_group"] = table["group"].map({label: i for i, label in enumerate(labels)})
    return table.sort_values(["_bench", "k", "_group"], kind="stable").drop(columns=["_bench", "_group"]).reset_index(drop=True)


# --------------------------------------------------------------------------------------------
# Output: Markdown, CSV, LaTeX
# --------------------------------------------------------------------------------------------


def _interval_text(value: float, low: float, high: float, signed: bool = False) -> str:
    if math.isnan(value):
        return "—"
    number = f"{value:+.3f}" if signed else f"{value:.3f}"
    return f"{number} [{low:.3f}, {high:.3f}]"


def _p_text(p: float) -> str:
    if math.isnan(p):
        return "—"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def display_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Header and text cells shared by the Markdown and LaTeX tables."""
    baseline = next((b for b in table["baseline"] if b), "")
    header = ["group", "benchmark", "k", "pass@k [95% CI]", "seeds", "problems"]
    if baseline:
        header += [f"Δ vs {baseline} [95% CI]", "p (sign-flip)"]
    cells = []
    for r in table.itertuples(index=False):
        line = [str(r.group), str(r.benchmark), str(r.k), _interval_text(r.pass_at_k, r.ci_low, r.ci_high),
                str(r.seeds), str(r.problems)]
        if baseline:
            is_baseline = r.group == baseline
            line += ["(baseline)" if is_baseline else _interval_text(r.diff, r.diff_ci_low, r.diff_ci_high, True),
                     "" if is_baseline else _p_text(r.p_value)]
        cells.append(line)
    return header, cells


def markdown_table(table: pd.DataFrame) -> str:
    header, cells = display_rows(table)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(line) + " |" for line in cells]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "Δ": r"$\Delta$",
                  "—": "---"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex_table(table: pd.DataFrame) -> str:
    """A LaTeX ``tabular`` (no packages needed) with the Markdown table's cells."""
    header, cells = display_rows(table)
    spec = "lll" + "l" + "rr" + ("lr" if len(header) > 6 else "")
    lines = [f"\\begin{{tabular}}{{{spec}}}", "\\hline", " & ".join(map(latex_escape, header)) + " \\\\", "\\hline"]
    lines += [" & ".join(map(latex_escape, line)) + " \\\\" for line in cells]
    lines += ["\\hline", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def runs_table(groups: Mapping[str, Sequence[Run]]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"group": label, "seed": run.config.get("seed"), "run": run.name} for label, runs in groups.items() for run in runs]
    )


# --------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg canvas)
# --------------------------------------------------------------------------------------------


def _save_figure(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(path, buffer.getvalue())


def plot_passk_curves(table: pd.DataFrame, path: Path) -> None:
    """One panel per benchmark (and the macro average): mean pass@k against k per group, with the
    bootstrap interval as a band."""
    from matplotlib.figure import Figure

    benchmarks = list(dict.fromkeys(table["benchmark"]))
    fig = Figure(figsize=(4.2 * len(benchmarks), 3.6), layout="constrained")
    axes = fig.subplots(1, len(benchmarks), squeeze=False)[0]
    for ax, bench in zip(axes, benchmarks):
        rows = table[table["benchmark"] == bench]
        for label, curve in rows.groupby("group", sort=False):
            curve = curve.sort_values("k")
            line = ax.plot(curve["k"], curve["pass_at_k"], marker="o", label=f"{label} ({curve['seeds'].iloc[0]} seeds)")
            ax.fill_between(curve["k"], curve["ci_low"], curve["ci_high"], color=line[0].get_color(), alpha=0.2)
        ks = sorted(rows["k"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(bench)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("pass@k: mean over seeds, band = 95% bootstrap interval (seeds x problems)", fontsize=9)
    _save_figure(fig, path)


def training_curve_stats(runs: Sequence[Run], metric: str) -> pd.DataFrame:
    """step -> mean, min and max of ``metric`` over the runs that logged it at that step."""
    frames = [run.metrics[["step", metric]] for run in runs if not run.metrics.empty and metric in run.metrics]
    if not frames:
        return pd.DataFrame(columns=["step", "mean", "min", "max"])
    values = pd.concat(frames).groupby("step")[metric]
    return pd.DataFrame({"mean": values.mean(), "min": values.min(), "max": values.max()}).reset_index()


def plot_training_curves(groups: Mapping[str, Sequence[Run]], path: Path, metrics: Sequence[str] = TRAINING_METRICS) -> bool:
    """One panel per training metric: the mean over seeds per step for each group, with the min-max
    range over seeds as a band. Returns False (and draws nothing) when no run logged training steps."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    stats = {(label, m): training_curve_stats(runs, m) for label, runs in groups.items() for m in metrics}
    if all(s.empty for s in stats.values()):
        return False
    fig = Figure(figsize=(4.2 * len(metrics), 3.6), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics):
        for label in groups:
            s = stats[(label, metric)]
            if s.empty:
                continue
            line = ax.plot(s["step"], s["mean"], label=f"{label} ({len(groups[label])} seeds)")
            ax.fill_between(s["step"], s["min"], s["max"], color=line[0].get_color(), alpha=0.2)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("training: mean over seeds, band = min-max over seeds", fontsize=9)
    _save_figure(fig, path)
    return True


# --------------------------------------------------------------------------------------------
# wandb
# --------------------------------------------------------------------------------------------


def parse_wandb_run(reference: str) -> dict[str, str | None]:
    """``entity/project/run_id``, ``project/run_id`` or ``run_id`` -> wandb.init arguments."""
    parts = [p for p in reference.strip().split("/") if p]
    if not 1 <= len(parts) <= 3:
        raise ConfigError(f"--wandb-run {reference!r}: write entity/project/run_id, project/run_id or run_id")
    parts = [None] * (3 - len(parts)) + parts
    return {"entity": parts[0], "project": parts[1] or "rlbench", "id": parts[2]}


def log_to_wandb(reference: str, table: pd.DataFrame, images: Mapping[str, Path], out_dir: Path) -> str:
    """Log the table as ``compare/table`` (a wandb.Table) and the figures as images to the run
    ``reference`` (resumed if it exists, created otherwise; offline without an API key). Returns the
    local wandb run folder."""
    import wandb

    from rlbench.logger.run_logger import wandb_mode

    run = wandb.init(**parse_wandb_run(reference), resume="allow", dir=str(out_dir), mode=wandb_mode("auto"),
                     job_type="compare", reinit="finish_previous")
    try:
        payload: dict[str, Any] = {"compare/table": wandb.Table(dataframe=table)}
        payload.update({f"compare/{name}": wandb.Image(str(p)) for name, p in images.items()})
        run.log(payload)
        return str(Path(run.dir).parent)
    finally:
        run.finish()


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlbench-compare",
        description="Compare groups of rlbench runs: pass@k table over seeds with bootstrap intervals and a "
        "paired test against a baseline group, plus pass@k and training-curve plots.",
    )
    parser.add_argument("results", nargs="+", help="run folders or folders containing them (e.g. a multirun folder)")
    parser.add_argument("--by", nargs="+", default=["algorithm"],
                        help="dotted config keys that define the groups (default: algorithm, i.e. algorithm.name)")
    parser.add_argument("--baseline", default=None, help="the group the paired test compares against (e.g. grpo)")
    parser.add_argument("--phase", default="after", help="evaluation phase: after (default), before or eval")
    parser.add_argument("--filter", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="keep runs whose config matches (key=a,b matches either value)")
    parser.add_argument("--k", nargs="+", type=int, default=None, help="k values (default: those in every passk.csv)")
    parser.add_argument("--out", default=None, help="output folder (default: results/compare/<time>)")
    parser.add_argument("--wandb-run", default=None, metavar="RUN_PATH",
                        help="also log the table to this wandb run: entity/project/run_id, project/run_id or run_id")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap and permutation resamples (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the resampling (default 0)")
    return parser.parse_args(argv)


def compare(args: argparse.Namespace) -> Path:
    """Run the comparison described by parsed arguments; returns the output folder."""
    run_dirs = find_run_dirs(args.results)
    if not run_dirs:
        raise DataError(f"no runs found under {', '.join(args.results)} (a run folder holds eval/problems.csv)")
    runs = select_runs([load_run(d) for d in run_dirs], args.filter)
    if not runs:
        raise DataError(f"none of the {len(run_dirs)} runs found matches --filter {' '.join(args.filter)}")
    groups = group_runs(runs, args.by)
    for warning in group_warnings(groups):
        print(f"rlbench-compare: warning: {warning}", file=sys.stderr)
    table = build_table(groups, phase=args.phase, ks=args.k, baseline=args.baseline,
                        n_resamples=args.resamples, seed=args.seed)

    out = Path(args.out) if args.out else Path("results") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    markdown = markdown_table(table)
    atomic_write_text(out / "table.md", markdown)
    atomic_write_text(out / "table.csv", table.to_csv(index=False))
    atomic_write_text(out / "table.tex", latex_table(table))
    atomic_write_text(out / "runs.csv", runs_table(groups).to_csv(index=False))
    images = {"passk_curves": out / "passk_curves.png"}
    plot_passk_curves(table, images["passk_curves"])
    if plot_training_curves(groups, out / "training_curves.png"):
        images["training_curves"] = out / "training_curves.png"
    print(markdown)
    if args.wandb_run:
        print(f"wandb: {log_to_wandb(args.wandb_run, table, images, out)}")
    print(f"comparison of {len(runs)} runs in {len(groups)} groups: {out}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rlbench-compare`` and ``python -m rlbench.compare``; returns the exit status."""
    args = parse_args(argv)
    try:
        compare(args)
    except (ConfigError, DataError) as err:
        print(f"rlbench-compare: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
