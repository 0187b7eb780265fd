"""The grader of a dataset or benchmark, from the ``reward`` config group."""

from __future__ import annotations

from typing import Any

from rlbench.errors import ConfigError
from rlbench.reward.math import MathReward
from rlbench.reward.toy import EvenTokenReward


def make_grader(reward_cfg: Any, data_spec: Any, sandbox_cfg: Any = None) -> Any:
    """The grader of one dataset or benchmark.

    ``reward.name``: ``even_tokens`` (toy) grades everything with the toy reward. Otherwise the
    spec's ``answer_type`` decides: ``code`` runs the tests in the sandbox (reward=code sets its
    mode and values; on a math run a code benchmark is graded all-pass), any other answer type
    (``math``, ``number``, ``expression``, ``set``, ``text``) checks the answer (reward=math sets the
    values; on a code run a math benchmark gets the default math grader). The spec's
    ``tolerance`` (relative) wins over ``reward.tolerance``; ``absolute_tolerance``,
    ``truncated_fallback``, ``last_number_fallback``, ``answer_labels`` and ``list_order`` are the
    spec's alone (the grading conventions of ``docs/evaluation.md``).
    """
    if reward_cfg.name == "even_tokens":
        return EvenTokenReward(threshold=reward_cfg.get("threshold", 0.75))
    if reward_cfg.name not in ("math", "code"):
        raise ConfigError(f"reward={reward_cfg.name} is unknown; choose math, code or even_tokens")
    answer_type = data_spec.get("answer_type") or "math"
    own = reward_cfg if reward_cfg.name == ("code" if answer_type == "code" else "math") else {}
    if answer_type == "code":
        from rlbench.reward.code import CodeReward
        from rlbench.sandbox import limits_from_config

        return CodeReward(
            mode=own.get("mode", "all_pass"),
            correct_reward=own.get("correct_reward", 1.0),
            incorrect_reward=own.get("incorrect_reward", 0.0),
            limits=limits_from_config(sandbox_cfg),
            workers=(sandbox_cfg or {}).get("workers"),
        )
    extraction = own.get("extraction") or data_spec.get("reward_extraction") or "auto"
    tolerance = data_spec.get("tolerance")  # the benchmark's own, else reward.tolerance
    return MathReward(
        correct_reward=own.get("correct_reward", 1.0),
        incorrect_reward=own.get("incorrect_reward", 0.0),
        format_weight=own.get("format_weight", 0.0),
        tolerance=own.get("tolerance", 1e-6) if tolerance is None else tolerance,
        extraction=extraction,
        verify_timeout_s=own.get("verify_timeout_s", 5.0),
        absolute_tolerance=data_spec.get("absolute_tolerance") or 0.0,
        answer_type=answer_type,
        truncated_fallback=data_spec.get("truncated_fallback", True),
        last_number_fallback=data_spec.get("last_number_fallback", True),
        answer_labels=data_spec.get("answer_labels") or "letter",
        list_order=data_spec.get("list_order") or "problem",
    )


def training_grader(cfg: Any) -> Any:
    """The grader of the run's training set (``dataset``), from the composed config."""
    return make_grader(cfg.reward, cfg.dataset, cfg.get("sandbox"))
