"""Analysis of finished runs: ``rlbench-compare`` compares groups of runs (algorithms, settings)
across seeds and benchmarks.

    rlbench-compare RESULTS... [--by algorithm] [--baseline grpo] [--phase after]
                    [--filter key=value ...] [--k 1 4] [--out DIR] [--wandb-run RUN_PATH]
                    [--budget step|generated_tokens|wall_seconds] [--resamples 1000] [--seed 0]

RESULTS are run folders or folders above them (a multirun folder holds many): every folder below
them that holds ``eval/problems.csv`` is a run. Runs are grouped by dotted keys of their
``config.yaml`` (``--by algorithm.name``; a key naming a config node with a ``name``, such as
``algorithm``, means its name) and selected with ``--filter key=value`` (``key=a,b`` matches either).

For every group, benchmark and k the table reports, from the runs' per-problem counts
(``eval/problems.csv`` of the chosen phase):

* ``pass_at_k``: the mean over seeds (runs) of each run's pass@k, where a run's pass@k is the mean
  over problems of the unbiased estimator (Chen et al. 2021, arXiv:2107.03374
  sec. 2.1; :func:`rlbench.eval.metrics.pass_at_k`).
  This is exactly the mean over seeds of the ``pass_at_k`` column of the runs' ``eval/passk.csv``.
* ``ci_low`` / ``ci_high``: a 95% percentile interval from a two-level bootstrap that resamples seeds
  and problems (:func:`~rlbench.analysis.statistics.hierarchical_bootstrap`).
* ``seeds``, ``problems``: how many runs and problems the numbers rest on.
* ``diff`` with ``diff_ci_low`` / ``diff_ci_high``: the group's pass@k minus the baseline group's,
  with a paired bootstrap interval (:func:`~rlbench.analysis.statistics.paired_bootstrap_difference`), and ``p_value``, a paired
  sign-flip permutation test over problems (:func:`~rlbench.analysis.statistics.sign_flip_test`).

With more than one benchmark, a ``macro`` row averages the benchmarks (each benchmark weighs the same).
This long table goes to ``table.csv`` and ``table_long.md``. The wide, paper-ready table (methods ×
benchmarks; pass@1, its Δ vs the baseline with p, pass@k and maj@k at the largest k; mean ± half the
interval; the best of each column in bold) goes to ``table.md`` (printed), ``table.tex`` (booktabs)
and ``table_wide.csv``; the runs behind them to ``runs.csv``. Two PNG figures are drawn:
``passk_curves.png`` and ``training_curves.png`` (accuracy as the graders' outcome, KL, entropy, clip
fraction, response length; against steps or ``--budget`` generated tokens or wall seconds).

Modules, in the order of the pipeline:

* :mod:`~rlbench.analysis.runs`: find run folders, read their files, select and group them;
* :mod:`~rlbench.analysis.statistics`: the bootstraps and the sign-flip test (pure functions);
* :mod:`~rlbench.analysis.tables`: the table and its Markdown, CSV and LaTeX renderings;
* :mod:`~rlbench.analysis.plots`: the figures;
* :mod:`~rlbench.analysis.cli`: the command line (``rlbench-compare``, ``python -m rlbench.analysis``).
"""
