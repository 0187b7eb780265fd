"""rlbench-compare: the bootstrap and the paired test on hand-made counts with known answers, the table
against the runner's own passk.csv, grouping and filters, errors, outputs, launchers and sweeps, and
(slow) a real two-algorithm x two-seed sweep through sweeps/ and the compare command."""

import csv
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlbench.analysis.cli import compare, main, parse_args
from rlbench.analysis.runs import config_value, find_run_dirs, group_runs, group_warnings, load_run, select_runs
from rlbench.analysis.statistics import (
    hierarchical_bootstrap,
    paired_bootstrap_difference,
    paired_problem_differences,
    percentile_interval,
    sign_flip_test,
)
from rlbench.analysis.paper import paper_reference
from rlbench.analysis.plots import budget_axis, training_curve_stats
from rlbench.analysis.tables import MACRO, build_table, markdown_table, wide_cells, wide_latex, wide_markdown
from rlbench.errors import ConfigError, DataError
from rlbench.eval.metrics import ProblemResult, summarize
from rlbench.config.schema import LoggerConfig
from rlbench.logger.run_logger import RunLogger

from conftest import CONF_DIR, ROOT



# --------------------------------------------------------------------------- statistics


def test_sign_flip_identical_groups_give_p_one():
    assert sign_flip_test(np.zeros(7)) == 1.0  # exact (2^7 <= 1000)
    assert sign_flip_test(np.zeros(40), n_resamples=200) == 1.0  # Monte Carlo


def test_sign_flip_exact_p_by_hand():
    # d = (1, -1, 2): the 8 sign vectors give sums 2, -2, 4, 0, 0, -4, 2, -2; |sum| >= |2| for 6 of 8
    assert sign_flip_test([1.0, -1.0, 2.0]) == pytest.approx(6 / 8)
    # a group better on all 4 problems: only all-plus and all-minus reach |T|, p = 2 / 16
    assert sign_flip_test([0.5, 0.25, 1.0, 0.75]) == pytest.approx(2 / 16)


def test_sign_flip_monte_carlo_dominating_group_has_small_p():
    p = sign_flip_test(np.full(30, 0.5), n_resamples=2000, seed=1)
    assert 1 / 2001 <= p < 0.005


def test_sign_flip_monte_carlo_agrees_with_exact_enumeration():
    d = np.random.default_rng(3).normal(0.1, 0.5, size=12)
    exact = sign_flip_test(d, n_resamples=2**12)
    approx = sign_flip_test(d, n_resamples=2**12 - 1, seed=5)  # one fewer: Monte Carlo
    assert 0.0 < exact < 1.0 and abs(exact - approx) < 0.03


def test_sign_flip_weights_give_the_macro_statistic():
    # benchmark A (2 problems) and B (4 problems), equal weight per benchmark
    group = [np.array([[1.0, 0.5]]), np.array([[0.0, 0.0, 1.0, 1.0]])]
    base = [np.array([[0.0, 0.5]]), np.array([[0.0, 0.0, 0.0, 1.0]])]
    d, u = paired_problem_differences(group, base)
    assert np.allclose(u, [1 / 4, 1 / 4, 1 / 8, 1 / 8, 1 / 8, 1 / 8])
    macro = np.mean([g.mean() for g in group]) - np.mean([b.mean() for b in base])
    assert float(u @ d) == pytest.approx(macro) == pytest.approx(0.5 * 0.5 + 0.5 * 0.25)


def test_hierarchical_bootstrap_of_a_constant_is_that_constant():
    reps = hierarchical_bootstrap([np.full((3, 5), 0.4)], n_resamples=200)
    assert percentile_interval(reps) == pytest.approx((0.4, 0.4))


def test_hierarchical_bootstrap_variance_resamples_seeds_and_problems_crossed():
    # X[s, i] = a_s + b_i: the replicate is sum_s w_s a_s + sum_i v_i b_i, whose variance is exactly
    # var(a)/S + var(b)/P (population variances). A nested scheme would give var(a)/S + var(b)/(S P).
    a = np.array([0.0, 0.1, 0.2, 0.3])
    b = np.random.default_rng(0).uniform(0.0, 1.0, size=50)
    reps = hierarchical_bootstrap([a[:, None] + b[None, :]], n_resamples=20000, seed=2)
    expected = a.var() / a.size + b.var() / b.size
    assert reps.var() == pytest.approx(expected, rel=0.05)
    assert reps.mean() == pytest.approx((a[:, None] + b[None, :]).mean(), abs=0.005)


def test_hierarchical_bootstrap_one_seed_is_the_problem_bootstrap():
    b = np.random.default_rng(1).uniform(size=40)
    reps = hierarchical_bootstrap([b[None, :]], n_resamples=20000, seed=0)
    assert reps.var() == pytest.approx(b.var() / b.size, rel=0.05)


def test_interval_contains_the_mean():
    x = (np.random.default_rng(4).uniform(size=(3, 30)) > 0.6).astype(float)
    low, high = percentile_interval(hierarchical_bootstrap([x], n_resamples=500))
    assert low < x.mean() < high


def test_paired_bootstrap_is_paired_on_problems():
    # No seed variation: with the same problem resample for both groups, a constant shift of 0.1
    # is recovered exactly in every replicate; identical groups differ by exactly 0.
    x = np.tile(np.random.default_rng(6).uniform(size=20), (3, 1))
    assert np.allclose(paired_bootstrap_difference([x + 0.1], [x], n_resamples=300), 0.1)
    assert np.allclose(paired_bootstrap_difference([x], [x], n_resamples=300), 0.0)


def test_paired_bootstrap_allows_different_seed_counts():
    x, y = np.full((2, 5), 0.5), np.full((3, 5), 0.25)
    assert np.allclose(paired_bootstrap_difference([x], [y], n_resamples=50), 0.25)


# --------------------------------------------------------------------------- hand-made run folders


def write_run(root, name, *, algorithm="grpo", seed=0, model="tiny", clip_high=0.2, problems, ks=(1, 2),
              phase="after", steps=(), step_metrics=(), mode="train"):
    """A run folder written by the runner's own code: RunLogger + summarize, from per-problem counts.

    problems: {benchmark: [(uid, n, correct), ...]}; steps: [(reward_mean, response_length, entropy), ...]."""
    out = root / name
    config = {"algorithm": {"name": algorithm, "loss": {"clip_high": clip_high}}, "model": {"name": model},
              "dataset": {"name": "arith"}, "seed": seed, "run_name": name, "mode": mode}
    logger = RunLogger(out, config, OmegaConf.to_yaml(OmegaConf.create(config)), LoggerConfig(name="files"))
    for step, (reward, length, entropy) in enumerate(steps, 1):
        logger.log_step(step, {"reward_mean": reward, "response_length": length, "entropy": entropy})
    for step, metrics in enumerate(step_metrics, 1):
        logger.log_step(step, metrics)
    results = [ProblemResult(bench, uid, [i < c for i in range(n)], ["x"] * n)
               for bench, rows in problems.items() for uid, n, c in rows]
    rows = [{**r, "phase": phase} for r in summarize(results, ks)]
    problem_rows = [{"phase": phase, "benchmark": bench, "uid": uid, "n": n, "correct": c}
                    for bench, items in problems.items() for uid, n, c in items]
    logger.log_eval(rows, problem_rows, [], {}, step=len(steps))
    logger.finish()
    return out


def counts(bench, correct, n=4):
    return [(f"{bench}/{i}", n, c) for i, c in enumerate(correct)]


@pytest.fixture
def two_groups(tmp_path):
    """grpo and rloo x 2 seeds on two benchmarks (3 and 5 problems), 4 samples per problem."""
    data = {
        ("grpo", 0): ([1, 0, 2], [0, 1, 0, 4, 2]),
        ("grpo", 1): ([2, 0, 1], [1, 1, 0, 3, 2]),
        ("rloo", 0): ([3, 1, 2], [2, 1, 1, 4, 3]),
        ("rloo", 1): ([4, 2, 2], [1, 2, 1, 4, 4]),
    }
    for (algorithm, seed), (a, b) in data.items():
        write_run(tmp_path / "sweep", f"{algorithm}-s{seed}", algorithm=algorithm, seed=seed,
                  problems={"alpha": counts("alpha", a), "beta": counts("beta", b)},
                  steps=[(0.1 * seed, 8.0, 2.0), (0.2 + 0.1 * seed, 7.0, 1.5)])
    runs = [load_run(d) for d in find_run_dirs([tmp_path / "sweep"])]
    return runs, data


def test_an_eval_only_run_is_the_baseline_of_trained_runs(two_groups, tmp_path):
    """mode=eval runs have only the phase 'eval', which stands in for 'after', and group as 'eval-only'
    under algorithm keys (nothing was trained), so a base model is a baseline for trained runs."""
    write_run(tmp_path / "sweep", "base", algorithm="grpo", seed=0, phase="eval", mode="eval",
              problems={"alpha": counts("alpha", [0, 0, 1]), "beta": counts("beta", [0, 0, 0, 1, 0])})
    runs = [load_run(d) for d in find_run_dirs([tmp_path / "sweep"])]
    groups = group_runs(runs, ["algorithm"])
    assert sorted(groups) == ["eval-only", "grpo", "rloo"] and len(groups["grpo"]) == 2
    table = build_table(groups, phase="after", ks=[1], baseline="eval-only", n_resamples=200, seed=0, alpha=0.05)
    row = table[(table["group"] == "grpo") & (table["benchmark"] == "alpha")].iloc[0]
    base = table[(table["group"] == "eval-only") & (table["benchmark"] == "alpha")].iloc[0]
    assert base["pass_at_k"] == pytest.approx(1 / 12)  # one correct of 3 problems x 4 samples
    assert row["diff"] == pytest.approx(row["pass_at_k"] - base["pass_at_k"])


def passk_value(passk, bench, k, phase="after"):
    return float(passk[(passk["phase"] == phase) & (passk["benchmark"] == bench) & (passk["k"] == k)]["pass_at_k"].iloc[0])


def test_table_equals_the_mean_of_the_runs_own_passk_csv(two_groups):
    runs, _ = two_groups
    groups = group_runs(runs, ["algorithm"])
    table = build_table(groups, baseline="grpo", n_resamples=200)
    assert set(table["group"]) == {"grpo", "rloo"} and set(table["k"]) == {1, 2}
    for label, members in groups.items():
        for bench in ("alpha", "beta"):
            for k in (1, 2):
                own = [passk_value(r.passk, bench, k) for r in members]
                row = table[(table["group"] == label) & (table["benchmark"] == bench) & (table["k"] == k)].iloc[0]
                assert row["pass_at_k"] == pytest.approx(np.mean(own), abs=1e-12)
                assert row["ci_low"] <= row["pass_at_k"] <= row["ci_high"]
                assert row["seeds"] == 2 and row["problems"] == {"alpha": 3, "beta": 5}[bench]


def test_table_values_by_hand(two_groups):
    runs, data = two_groups
    table = build_table(group_runs(runs, ["algorithm"]), baseline="grpo", ks=[1], n_resamples=200)
    # pass@1 = c / n; alpha: grpo seeds (1+0+2)/12, (2+0+1)/12 -> 0.25; rloo (3+1+2)/12, (4+2+2)/12 -> 7/12
    alpha = table.query("benchmark == 'alpha'").set_index("group")
    assert alpha.loc["grpo", "pass_at_k"] == pytest.approx(0.25)
    assert alpha.loc["rloo", "pass_at_k"] == pytest.approx(7 / 12)
    assert alpha.loc["rloo", "diff"] == pytest.approx(7 / 12 - 0.25)
    assert np.isnan(alpha.loc["grpo", "diff"]) and np.isnan(alpha.loc["grpo", "p_value"])
    # rloo is better on all 3 alpha problems: exact sign-flip p = 2 / 8
    assert alpha.loc["rloo", "p_value"] == pytest.approx(2 / 8)
    beta = table.query("benchmark == 'beta'").set_index("group")
    macro = table.query("benchmark == @MACRO").set_index("group")
    for g in ("grpo", "rloo"):
        assert macro.loc[g, "pass_at_k"] == pytest.approx((alpha.loc[g, "pass_at_k"] + beta.loc[g, "pass_at_k"]) / 2)
    assert macro.loc["rloo", "problems"] == 8
    assert macro.loc["rloo", "diff_ci_low"] <= macro.loc["rloo", "diff"] <= macro.loc["rloo", "diff_ci_high"]
    assert list(table["benchmark"]) == ["alpha", "alpha", "beta", "beta", MACRO, MACRO]
    assert list(table["group"][:2]) == ["grpo", "rloo"]  # the baseline first


def test_identical_groups_differ_by_zero_with_p_one(tmp_path):
    for algorithm in ("grpo", "rloo"):
        for seed in (0, 1):
            write_run(tmp_path, f"{algorithm}-{seed}", algorithm=algorithm, seed=seed,
                      problems={"alpha": counts("alpha", [seed, 2, 3, 1])})
    runs = [load_run(d) for d in find_run_dirs([tmp_path])]
    row = build_table(group_runs(runs, ["algorithm"]), baseline="grpo", n_resamples=200).query("group == 'rloo'")
    assert (row["diff"] == 0).all() and (row["p_value"] == 1).all()


def test_grouping_and_filters(tmp_path):
    specs = [("grpo", 0, "tiny", 0.2), ("grpo", 1, "tiny", 0.28), ("rloo", 0, "tiny", 0.2), ("grpo", 0, "smol", 0.2)]
    for i, (algorithm, seed, model, clip) in enumerate(specs):
        write_run(tmp_path, f"r{i}", algorithm=algorithm, seed=seed, model=model, clip_high=clip,
                  problems={"alpha": counts("alpha", [1, 2])})
    runs = [load_run(d) for d in find_run_dirs([tmp_path])]
    assert config_value(runs[0].config, "algorithm") == "grpo"  # a node with a name stands for it
    by_algorithm = group_runs(runs, ["algorithm"])
    assert {k: len(v) for k, v in by_algorithm.items()} == {"grpo": 3, "rloo": 1}
    assert set(group_runs(runs, ["algorithm", "model"])) == {"grpo/tiny", "rloo/tiny", "grpo/smol"}
    assert set(group_runs(runs, ["algorithm.loss.clip_high"])) == {"0.2", "0.28"}
    assert len(select_runs(runs, ["model=tiny"])) == 3
    assert len(select_runs(runs, ["model=tiny", "algorithm=grpo"])) == 2
    assert len(select_runs(runs, ["seed=1,0", "model.name=smol"])) == 1
    warnings = group_warnings(by_algorithm)
    assert any("'grpo'" in w and "model.name" in w for w in warnings)
    assert any("'grpo'" in w and "seed 0" in w for w in warnings)
    assert not group_warnings(group_runs(select_runs(runs, ["seed=1"]), ["algorithm"]))
    with pytest.raises(ConfigError, match="optimizer.*config.yaml"):
        group_runs(runs, ["optimizer"])
    with pytest.raises(ConfigError, match="key=value"):
        select_runs(runs, ["model"])
    with pytest.raises(ConfigError, match="without a 'name'"):
        group_runs(runs, ["algorithm.loss"])


def test_errors_name_what_to_change(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "no runs found" in capsys.readouterr().err

    a = write_run(tmp_path / "runs", "a", problems={"alpha": counts("alpha", [1, 2, 3])})
    write_run(tmp_path / "runs", "b", algorithm="rloo", problems={"alpha": counts("alpha", [1, 2])})
    runs = [load_run(d) for d in find_run_dirs([tmp_path / "runs"])]
    with pytest.raises(ConfigError, match="--baseline 'ppo'.*grpo, rloo"):
        build_table(group_runs(runs, ["algorithm"]), baseline="ppo")
    with pytest.raises(DataError, match=r"different alpha problems.*pairing is impossible") as err:
        build_table(group_runs(runs, ["algorithm"]))
    assert str(a) in str(err.value) and str(tmp_path / "runs" / "b") in str(err.value)
    with pytest.raises(DataError, match="no 'before' evaluation.*after"):
        build_table(group_runs(runs[:1], ["algorithm"]), phase="before")
    with pytest.raises(ConfigError, match="k=8 exceeds the 4 samples"):
        build_table(group_runs(runs[:1], ["algorithm"]), ks=[8])

    write_run(tmp_path / "other", "c", problems={"beta": counts("beta", [1])})
    mixed = [runs[0], load_run(tmp_path / "other" / "c")]
    with pytest.raises(DataError, match="different benchmarks"):
        build_table(group_runs(mixed, ["algorithm", "run_name"]))
    assert main([str(tmp_path / "runs"), "--filter", "model=nope", "--out", str(tmp_path / "o")]) == 2
    assert "matches --filter model=nope" in capsys.readouterr().err


def test_main_writes_tables_and_plots(two_groups, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(tmp_path / "sweep"), "--by", "algorithm", "--baseline", "grpo", "--k", "1", "2",
                 "--out", str(out), "--resamples", "200"]) == 0
    printed = capsys.readouterr().out
    assert "| method | alpha pass@1 | alpha Δ pass@1 vs grpo | alpha pass@2 | alpha maj@2 |" in printed
    assert (out / "table.md").read_text() in printed
    table = pd.read_csv(out / "table.csv")
    runs, _ = two_groups
    groups = group_runs(runs, ["algorithm"])
    expected = build_table(groups, baseline="grpo", ks=[1, 2], n_resamples=200)
    assert np.allclose(table["pass_at_k"], expected["pass_at_k"]) and np.allclose(table["ci_low"], expected["ci_low"])
    assert (out / "table_long.md").read_text() == markdown_table(expected)
    tex = (out / "table.tex").read_text()
    assert "\\toprule" in tex and "\\midrule" in tex and "\\bottomrule" in tex and "\\hline" not in tex
    assert "\\multicolumn{4}{c}{alpha}" in tex and "\\cmidrule(lr){2-5}" in tex and "$\\Delta$ pass@1 vs grpo" in tex
    assert tex.count("\\textbf{") == (out / "table.md").read_text().count("**") // 2
    wide = pd.read_csv(out / "table_wide.csv").set_index("group")
    cells = wide_cells(expected, groups, n_resamples=200)
    for cell in cells.itertuples():
        assert wide.loc[cell.group, f"{cell.benchmark} {cell.metric}"] == pytest.approx(cell.mean, nan_ok=True)
    for png in ("passk_curves.png", "training_curves.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "runs.csv") as f:
        assert sorted((r["group"], r["seed"]) for r in csv.DictReader(f)) == [
            ("grpo", "0"), ("grpo", "1"), ("rloo", "0"), ("rloo", "1")]


def test_wide_table_numbers_equal_the_runs_own_files(two_groups):
    """pass@1 and pass@k cells: the mean over seeds of each run's passk.csv; maj@k: of each run's
    maj_at_k; Δ and p: the long table's; the best of each column in bold."""
    runs, _ = two_groups
    groups = group_runs(runs, ["algorithm"])
    table = build_table(groups, baseline="grpo", ks=[1, 2], n_resamples=200)
    cells = wide_cells(table, groups, n_resamples=200).set_index(["group", "benchmark", "metric"])
    assert sorted(set(cells.index.get_level_values("metric"))) == ["maj@2", "pass@1", "pass@2"]
    for label, members in groups.items():
        for bench in ("alpha", "beta"):
            for k in (1, 2):
                own = np.mean([passk_value(r.passk, bench, k) for r in members])
                assert cells.loc[(label, bench, f"pass@{k}"), "mean"] == pytest.approx(own, abs=1e-12)
            own_maj = [float(r.passk[(r.passk["phase"] == "after") & (r.passk["benchmark"] == bench)
                                     & (r.passk["k"] == 2)]["maj_at_k"].iloc[0]) for r in members]
            maj = cells.loc[(label, bench, "maj@2")]
            assert maj["mean"] == pytest.approx(np.mean(own_maj), abs=1e-12)
            assert min(own_maj) - 1e-12 <= maj["ci_low"] <= maj["mean"] <= maj["ci_high"] <= max(own_maj) + 1e-12
        macro = [np.mean([passk_value(r.passk, b, 1) for b in ("alpha", "beta")]) for r in members]
        assert cells.loc[(label, MACRO, "pass@1"), "mean"] == pytest.approx(np.mean(macro), abs=1e-12)
    rloo = cells.loc[("rloo", "alpha", "pass@1")]
    long_row = table.query("group == 'rloo' and benchmark == 'alpha' and k == 1").iloc[0]
    assert rloo["diff"] == long_row["diff"] and rloo["p_value"] == long_row["p_value"]
    for cell in cells.itertuples():  # significant: a Δ whose interval excludes 0, nothing else
        assert cell.significant == (cell.diff_ci_low > 0 or cell.diff_ci_high < 0)
    markdown = wide_markdown(cells.reset_index())
    grpo_line = next(line for line in markdown.splitlines() if line.startswith("| grpo |"))
    rloo_line = next(line for line in markdown.splitlines() if line.startswith("| rloo |"))
    assert "(baseline)" in grpo_line and "| 0.583 ± " in rloo_line  # rloo's alpha pass@1 = 7/12: a mean, not bold
    # the Δ with its 95% interval beside the p-value, bold exactly when the interval excludes 0
    delta = f"+{7 / 12 - 0.25:.3f} [{rloo['diff_ci_low']:.3f}, {rloo['diff_ci_high']:.3f}], p 0.250"
    assert (f"**{delta}**" if rloo["significant"] else f"| {delta} |") in rloo_line
    assert markdown.count("**") == 2 * int(cells.xs("pass@1", level="metric")["significant"].sum())  # Δ columns: pass@1


def test_wide_table_bolds_only_significant_differences_and_leaves_out_zero_columns(two_groups):
    """A best mean is not bold; a Δ is bold when its 95% interval excludes 0 (whatever its sign); a
    column that is 0 for every method (maj@k without extracted answers) is left out and named under
    the table, in Markdown and LaTeX alike."""
    runs, _ = two_groups
    groups = group_runs(runs, ["algorithm"])
    table = build_table(groups, baseline="grpo", ks=[1, 2], n_resamples=50)
    cells = wide_cells(table, groups, n_resamples=50)
    rloo_alpha = (cells["group"] == "rloo") & (cells["benchmark"] == "alpha") & (cells["metric"] == "pass@1")
    rloo_beta = (cells["group"] == "rloo") & (cells["benchmark"] == "beta") & (cells["metric"] == "pass@1")
    cells.loc[rloo_alpha, ["diff", "diff_ci_low", "diff_ci_high"]] = [-0.2, -0.3, -0.1]  # excludes 0: significant
    cells.loc[rloo_beta, ["diff", "diff_ci_low", "diff_ci_high"]] = [0.2, -0.01, 0.4]    # includes 0: not
    cells["significant"] = (cells["diff_ci_low"] > 0) | (cells["diff_ci_high"] < 0)
    cells.loc[cells["metric"] == "maj@2", "mean"] = 0.0
    markdown = wide_markdown(cells)
    header, _, grpo_line, rloo_line = markdown.splitlines()[:4]
    assert header == "| method | alpha pass@1 | alpha Δ pass@1 vs grpo | alpha pass@2 | beta pass@1 | " \
                     "beta Δ pass@1 vs grpo | beta pass@2 | macro pass@1 | macro Δ pass@1 vs grpo | macro pass@2 |"
    assert "**-0.200 [-0.300, -0.100], p " in rloo_line and "| +0.200 [-0.010, 0.400], p " in rloo_line
    assert "**" not in grpo_line
    assert markdown.endswith("\nLeft out, 0 (or undefined) for every method: alpha maj@2, beta maj@2, macro maj@2.\n")
    tex = wide_latex(cells)
    assert "maj@2" not in tex and tex.count("\\textbf{") == markdown.count("**") // 2


def test_figures_share_colours_leave_out_flat_panels_and_fit_a_column(tmp_path, monkeypatch):
    """One colour per method in both figures of a comparison (whatever order each draws them in); a
    training panel whose curves are all constant (KL 0 here) is named in the caption, not drawn; the
    figures are one paper column wide."""
    import rlbench.analysis.plots as plots

    figures = {}
    monkeypatch.setattr(plots, "_save_figure", lambda fig, path: figures.__setitem__(path.name, fig))
    for algorithm, seed in (("rloo", 0), ("grpo", 0), ("dr_grpo", 0)):
        write_run(tmp_path / "runs", f"{algorithm}-s{seed}", algorithm=algorithm, seed=seed,
                  problems={"alpha": counts("alpha", [1, 2, 3])},
                  step_metrics=[{"outcome_mean": 0.1 * i + len(algorithm) / 10, "kl": 0.0, "entropy": 1.0 - 0.1 * i}
                                for i in range(3)])
    groups = group_runs([load_run(d) for d in find_run_dirs([tmp_path / "runs"])], ["algorithm"])
    table = build_table(groups, baseline="grpo", ks=[1, 2], n_resamples=20)
    plots.plot_passk_curves(table, tmp_path / "passk_curves.png")
    assert plots.plot_training_curves({label: groups[label] for label in ("rloo", "dr_grpo", "grpo")},
                                      tmp_path / "training_curves.png")
    colours = []
    for name in ("passk_curves.png", "training_curves.png"):
        fig = figures[name]
        assert fig.get_size_inches()[0] == pytest.approx(plots.COLUMN_WIDTH_IN)
        lines = [line for ax in fig.axes for line in ax.get_lines()]
        colours.append({line.get_label().split(" (")[0]: line.get_color() for line in lines})
    assert colours[0] == colours[1] and len(set(colours[0].values())) == 3
    training = figures["training_curves.png"]
    titles = [ax.get_title() for ax in training.axes if ax.get_visible()]
    assert titles == ["accuracy (outcome): outcome_mean", "entropy: entropy"]
    assert "constant, not drawn: KL 0" in training.get_suptitle()


def test_budget_axis_interpolates_seeds_onto_a_common_grid(tmp_path):
    """Two seeds that spend wall seconds at different rates: on the wall_seconds axis each curve is
    read at the same budgets, up to the smaller total; on generated_tokens, tokens = tokens/s x s."""
    a = write_run(tmp_path, "a", seed=0, problems={"alpha": counts("alpha", [1])},
                  step_metrics=[{"outcome_mean": 0.0, "step_s": 1.0, "tokens_per_s": 10.0},
                                {"outcome_mean": 1.0, "step_s": 1.0, "tokens_per_s": 10.0}])
    b = write_run(tmp_path, "b", seed=1, problems={"alpha": counts("alpha", [1])},
                  step_metrics=[{"outcome_mean": 0.0, "step_s": 2.0, "tokens_per_s": 10.0},
                                {"outcome_mean": 0.5, "step_s": 2.0, "tokens_per_s": 10.0}])
    runs = [load_run(a), load_run(b)]
    assert list(budget_axis(runs[1].metrics, "wall_seconds")) == [2.0, 4.0]
    assert list(budget_axis(runs[1].metrics, "generated_tokens")) == [20.0, 40.0]
    stats = training_curve_stats(runs, "outcome_mean", "wall_seconds")
    assert stats["x"].iloc[0] == 2.0 and stats["x"].iloc[-1] == 2.0  # run a reaches only 2 s
    assert stats["mean"].iloc[-1] == pytest.approx((1.0 + 0.0) / 2)  # a at 2 s: 1.0; b at 2 s: 0.0
    by_step = training_curve_stats(runs, "outcome_mean")
    assert list(by_step["x"]) == [1, 2] and list(by_step["mean"]) == [0.0, 0.75]
    assert main([str(tmp_path), "--phase", "after", "--budget", "generated_tokens", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "training_curves.png").is_file()


def test_paper_reference_numbers_beside_the_runs(tmp_path, capsys):
    """--paper dapo: each of conf/paper/dapo.yaml's reference entries (AIME 2024, in %) with its
    value and verified flag, beside each group's pass@1 on aime24 in %; an unknown paper is refused."""
    for seed, correct in ((0, [1, 0, 2]), (1, [2, 1, 0])):
        write_run(tmp_path / "runs", f"dapo-s{seed}", algorithm="dapo", seed=seed,
                  problems={"aime24": counts("aime24", correct)})
    out = tmp_path / "out"
    assert main([str(tmp_path / "runs"), "--paper", "dapo", "--out", str(out), "--resamples", "100"]) == 0
    printed = capsys.readouterr().out
    beside = (out / "paper.md").read_text()
    assert beside in printed
    reference = paper_reference("dapo")
    rows = [line for line in beside.splitlines() if line.startswith("| AIME 2024")]
    assert len(rows) == len(reference) == 3
    ours = 100 * np.mean([3 / 12, 3 / 12])  # pass@1 = correct / (3 problems x 4 samples) per seed
    for row, entry in zip(rows, reference):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == str(entry["value"]) and cells[3] == ("verified" if entry["verified"] else "not verified")
        assert cells[5].startswith(f"{ours:.1f} [") and "(pass@1, 2 seeds)" in cells[5]
    assert main([str(tmp_path / "runs"), "--paper", "dapoo", "--out", str(tmp_path / "o2")]) == 2
    assert "no conf/paper/dapoo.yaml" in capsys.readouterr().err and not (tmp_path / "o2").exists()


def test_console_script_entry_is_the_cli_main():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["rlbench-compare"].partition(":")
    assert getattr(importlib.import_module(module), function) is main


@pytest.mark.slow
def test_python_m_rlbench_analysis_writes_the_table_main_writes(two_groups, tmp_path):
    args = [str(tmp_path / "sweep"), "--baseline", "grpo", "--k", "1", "--resamples", "50"]
    assert main([*args, "--out", str(tmp_path / "by_main")]) == 0
    proc = subprocess.run([sys.executable, "-m", "rlbench.analysis", *args, "--out", str(tmp_path / "by_module")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=_subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "by_module" / "table.csv").read_text() == (tmp_path / "by_main" / "table.csv").read_text()


def test_training_curves_are_skipped_without_steps(tmp_path):
    write_run(tmp_path / "runs", "a", problems={"alpha": counts("alpha", [1, 2])}, phase="eval")
    assert main([str(tmp_path / "runs"), "--phase", "eval", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "passk_curves.png").exists() and not (tmp_path / "o" / "training_curves.png").exists()


@pytest.mark.slow
def test_wandb_run_receives_the_table_offline(two_groups, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "out"
    assert main([str(tmp_path / "sweep"), "--baseline", "grpo", "--out", str(out), "--resamples", "100",
                 "--wandb-run", "rlbench-test/cmp123"]) == 0
    runs = list((out / "wandb").glob("offline-run-*-cmp123"))
    assert len(runs) == 1
    tables = list(runs[0].glob("files/media/table/compare/table*.table.json"))
    assert tables, "the comparison table was not logged to wandb"
    logged = json.loads(tables[0].read_text())
    csv_table = pd.read_csv(out / "table.csv")
    column = logged["columns"].index("pass_at_k")
    assert logged["columns"][:3] == ["group", "benchmark", "k"]
    assert np.allclose([r[column] for r in logged["data"]], csv_table["pass_at_k"])


# --------------------------------------------------------------------------- launchers and sweeps


@pytest.mark.parametrize("choice, target, settings", [
    ("parallel", "JoblibLauncher", {"n_jobs": 2}),
    ("slurm", "SlurmLauncher", {"gpus_per_node": 1, "timeout_min": 240}),
    ("submitit_local", "LocalLauncher", {}),
])
def test_launcher_choices_compose(choice, target, settings):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={choice}", "output_dir=/tmp/unused"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    for key, value in settings.items():
        assert cfg.hydra.launcher[key] == value


def compose_sweep(name, overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[f"sweep={name}", *overrides, "output_dir=/tmp/unused"],
                       return_hydra_config=True)


def test_sweep_files_compose():
    algorithms = compose_sweep("algorithms", ["algorithm=rloo", "seed=1"])
    assert algorithms.algorithm.name == "rloo" and algorithms.seed == 1
    assert dict(algorithms.hydra.sweeper.params) == {"algorithm": "grpo,dr_grpo", "seed": "0,1,2"}
    clip = compose_sweep("clip_higher", ["algorithm.loss.clip_high=0.24", "seed=1", "experiment=smoke"])
    assert clip.algorithm.name == "dapo" and clip.algorithm.loss.clip_low == 0.2
    assert clip.algorithm.loss.clip_high == 0.24 and clip.model.name == "tiny"
    assert clip.run_name == "dapo-ch0.24-tiny-arith-s1"
    assert dict(clip.hydra.sweeper.params) == {"algorithm.loss.clip_high": "0.2,0.24,0.28,0.32", "seed": "0,1,2"}


def _subprocess_env():
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    return env


def _run(args, timeout=900):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=_subprocess_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    _run(["-m", "rlbench.cli", "-m", "experiment=smoke", "hydra/launcher=submitit_local", "seed=0,1",
          "trainer.steps=1", "eval.limit=2", "eval.n=2", "eval.k=[1,2]", "logger=files", "trainer.save_model=false",
          f"hydra.sweep.dir={sweep}"])
    assert len(find_run_dirs([sweep])) == 2
    jobs = [d for d in (sweep / ".submitit").iterdir() if list(d.glob("*_result.pkl"))]
    assert len(jobs) == 2  # each run went through a submitit job


@pytest.mark.slow
def test_sweep_then_compare_end_to_end(tmp_path):
    """Must-show 4 of the benchmark issue: grpo and rloo x seeds 0, 1 with experiment=smoke through
    sweep=algorithms, then rlbench-compare. The same sweep is the zoo issue's must-show 4: one
    `-m` command runs grpo, dr_grpo, dapo, gspo and rloo (seed 0); a second adds seed 1 for grpo and
    rloo. The tiny random model scores 0 under the math grader, so the toy even-token reward (also the
    evaluation grader) makes the pass@k values differ from zero and between seeds."""
    sweep, out = tmp_path / "sweep", tmp_path / "compare"
    common = ["-m", "rlbench.cli", "-m", "sweep=algorithms", "experiment=smoke", "reward=even_tokens", "logger=files", "trainer.save_model=false"]
    _run([*common, "algorithm=grpo,dr_grpo,dapo,gspo,rloo", "seed=0", f"hydra.sweep.dir={sweep / 'seed0'}"])
    ran = sorted(load_run(d).config["algorithm"]["name"] for d in find_run_dirs([sweep]))
    assert ran == ["dapo", "dr_grpo", "grpo", "gspo", "rloo"]
    _run([*common, "algorithm=grpo,rloo", "seed=1", f"hydra.sweep.dir={sweep / 'seed1'}"])
    proc = _run(["-m", "rlbench.analysis", str(sweep), "--by", "algorithm", "--baseline", "grpo", "--out", str(out),
                 "--filter", "algorithm=grpo,rloo"])
    assert "| method | arith pass@1 | arith Δ pass@1 vs grpo |" in proc.stdout and "| grpo | " in proc.stdout
    for name in ("table.md", "table.csv", "table.tex", "table_wide.csv", "passk_curves.png", "training_curves.png"):
        assert (out / name).stat().st_size > 0, name

    table = pd.read_csv(out / "table.csv")
    assert sorted(table["group"].unique()) == ["grpo", "rloo"] and sorted(table["k"].unique()) == [1, 2, 4]
    own = pd.concat(
        pd.read_csv(d / "eval" / "passk.csv").assign(group=load_run(d).config["algorithm"]["name"],
                                                    seed=load_run(d).config["seed"])
        for d in find_run_dirs([sweep])
    ).query("phase == 'after' and group in ['grpo', 'rloo']")
    assert len(own) == 2 * 2 * 3
    assert own["pass_at_k"].max() > 0  # the check below is not on zeros only
    expected = own.groupby(["group", "benchmark", "k"])["pass_at_k"].mean()
    for row in table.itertuples():
        assert row.pass_at_k == pytest.approx(expected[(row.group, row.benchmark, row.k)], abs=1e-12)
        assert row.seeds == 2 and row.ci_low <= row.pass_at_k <= row.ci_high
    assert table.query("group == 'rloo'")["p_value"].between(0, 1).all()


def test_cost_table_reads_rewards_at_equal_cost(tmp_path):
    """Two methods, one cheap (10 generated tokens and 1 s per step) and one dear (20 and 2): at equal
    cost each is read where the dearer one's total ends; the totals are sums over steps."""
    from rlbench.analysis.tables import cost_markdown, cost_table

    def steps(tokens, seconds, rewards):
        return [{"outcome_mean": r, "step_s": seconds, "generated_tokens": tokens, "reused_tokens": 1.0, "engine_s": seconds / 2}
                for r in rewards]

    cheap = write_run(tmp_path, "cheap", seed=0, algorithm="tree", problems={"alpha": counts("alpha", [1, 0])},
                      step_metrics=steps(10.0, 1.0, [0.0, 0.2, 0.4, 0.6]))
    dear = write_run(tmp_path, "dear", seed=0, algorithm="grpo", problems={"alpha": counts("alpha", [1, 1])},
                     step_metrics=steps(20.0, 2.0, [0.0, 0.5]))
    raw = cost_table(group_runs([load_run(cheap), load_run(dear)], ["algorithm"]))
    table = raw.set_index("group")
    assert raw.attrs["equal_generated_tokens"] == 40.0 and raw.attrs["equal_wall_seconds"] == 4.0
    assert table.loc["tree", "generated_tokens"] == 40.0 and table.loc["grpo", "generated_tokens"] == 40.0
    assert table.loc["tree", "wall_seconds"] == 4.0 and table.loc["grpo", "engine_seconds"] == 2.0
    assert table.loc["tree", "reward_at_generated_tokens"] == pytest.approx(0.6)  # its last step: 40 tokens
    assert table.loc["grpo", "reward_at_generated_tokens"] == pytest.approx(0.5)
    assert table.loc["tree", "reward_final"] == pytest.approx(0.6) and table.loc["grpo", "reward_final"] == pytest.approx(0.5)
    assert "| tree | 1 | 40 | 4 |" in cost_markdown(raw)
    assert main([str(tmp_path), "--phase", "after", "--out", str(tmp_path / "o")]) == 0
    assert "reward at equal tokens" in (tmp_path / "o" / "cost.md").read_text()


def test_groups_sort_by_value_and_the_cost_table_follows(tmp_path, capsys):
    """Swept clip values 0.2, 0.32, 0.24, 0.28 (written in that order) come out 0.2, 0.24, 0.28, 0.32 in
    the groups and the cost table, not in folder order; one group is "1 group"."""
    from rlbench.analysis.tables import cost_table

    for i, clip in enumerate([0.2, 0.32, 0.24, 0.28]):
        write_run(tmp_path / "runs", f"r{i}", clip_high=clip, problems={"alpha": counts("alpha", [1, 2])},
                  step_metrics=[{"outcome_mean": 0.5, "step_s": 1.0, "generated_tokens": 4.0}])
    runs = [load_run(d) for d in find_run_dirs([tmp_path / "runs"])]
    groups = group_runs(runs, ["algorithm.loss.clip_high"])
    assert list(groups) == ["0.2", "0.24", "0.28", "0.32"]
    assert list(cost_table(groups)["group"]) == ["0.2", "0.24", "0.28", "0.32"]
    assert main([str(tmp_path / "runs" / "r0"), "--out", str(tmp_path / "one")]) == 0
    assert "comparison of 1 run in 1 group:" in capsys.readouterr().out


def test_an_existing_output_folder_is_kept_unless_overwrite(two_groups, tmp_path, capsys, monkeypatch):
    """A non-empty --out (e.g. the committed example) is refused before any run is read; --overwrite
    replaces it; without --out every comparison gets a folder of its own, even within one second."""
    out = tmp_path / "committed"
    out.mkdir()
    (out / "table.md").write_text("committed\n")
    assert main([str(tmp_path / "sweep"), "--out", str(out), "--resamples", "50"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "table.md").read_text() == "committed\n"
    assert main([str(tmp_path / "sweep"), "--out", str(out), "--overwrite", "--resamples", "50"]) == 0
    assert (out / "table.md").read_text() != "committed\n"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt: "same-second")
    first = compare(parse_args([str(tmp_path / "sweep"), "--resamples", "50"]))
    second = compare(parse_args([str(tmp_path / "sweep"), "--resamples", "50"]))
    assert first != second and (first / "table.md").exists() and (second / "table.md").exists()


def test_metric_curves_are_the_per_step_means_of_the_runs_own_metrics(tmp_path, capsys):
    """--metrics: a step metric per step and group, mean / min / max over the group's runs (a run that stopped
    early counts only for its steps); a name no run logged is refused before anything is written."""
    for algorithm, seed, calls in (("retool", 0, [0.1, 0.3]), ("retool", 1, [0.3, 0.5, 0.2]), ("grpo", 0, [0.0, 0.0])):
        write_run(tmp_path / "sweep", f"{algorithm}-s{seed}", algorithm=algorithm, seed=seed,
                  problems={"alpha": counts("alpha", [1, 2])},
                  step_metrics=[{"reward_mean": 0.0, "multi_turn_tool_calls": c} for c in calls])
    out = tmp_path / "out"
    assert main([str(tmp_path / "sweep"), "--metrics", "multi_turn_tool_calls", "--out", str(out), "--resamples", "50"]) == 0
    curves = pd.read_csv(out / "metrics.csv")
    retool = curves[curves["group"] == "retool"].set_index("step")
    assert retool["mean"].tolist() == pytest.approx([0.2, 0.4, 0.2])
    assert retool["min"].tolist() == pytest.approx([0.1, 0.3, 0.2]) and retool["runs"].tolist() == [2, 2, 1]
    assert curves[curves["group"] == "grpo"]["mean"].tolist() == [0.0, 0.0]
    markdown = (out / "metrics.md").read_text()
    assert "| step | grpo | retool |" in markdown and "| 2 | 0.000 | 0.400 |" in markdown and "| 3 |  | 0.200 |" in markdown
    refused = tmp_path / "refused"
    assert main([str(tmp_path / "sweep"), "--metrics", "tool_rate", "--out", str(refused)]) == 2
    assert "no run logged it" in capsys.readouterr().err and not refused.exists()
