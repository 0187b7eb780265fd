"""Evaluation: metrics over graded samples (pass@k, maj@k, bootstrap CIs)."""

from rlbench.eval.metrics import ProblemResult, bootstrap_ci, maj_at_k, pass_at_k, summarize

__all__ = ["ProblemResult", "bootstrap_ci", "maj_at_k", "pass_at_k", "summarize"]
