"""The grader of a dataset or benchmark, from the ``reward`` config group."""

from __future__ import annotations

from typing import Any

from rlbench.config.schema import DatasetConfig, RewardConfig, RunConfig, SandboxConfig
from rlbench.errors import ConfigError
from rlbench.reward.genrm import GenRMReward
from rlbench.reward.math import MathReward
from rlbench.reward.toy import EvenTokenReward


def make_grader(reward: RewardConfig, spec: DatasetConfig, sandbox: SandboxConfig | None = None) -> Any:
    """The grader of one dataset or benchmark, from the typed ``reward`` and the benchmark's (or training
    set's) ``spec``; every default is the schema's.

    ``reward.name``: ``even_tokens`` (toy) grades everything with the toy reward; ``fapo_genrm`` grades a
    ``flaw_steps`` spec by FAPO's GenRM reward (rlbench.reward.genrm) and any other spec as a math run would
    (the smoke run's arith evaluation). Otherwise the
    spec's ``answer_type`` decides: ``code`` runs the tests in the sandbox (reward=code sets its
    mode and values; on a math run a code benchmark is graded all-pass), any other answer type
    (``math``, ``number``, ``expression``, ``set``, ``text``) checks the answer (reward=math sets the
    values; on a code run a math benchmark gets the default math grader). The spec's
    ``tolerance`` (relative) wins over ``reward.tolerance``; ``absolute_tolerance``,
    ``truncated_fallback``, ``last_number_fallback``, ``answer_labels`` and ``list_order`` are the
    spec's alone (the grading conventions of ``docs/evaluation.md``).
    """
    if reward.name == "even_tokens":
        return EvenTokenReward(threshold=reward.threshold)
    if reward.name == "fapo_genrm":
        if spec.loader == "flaw_steps":
            return GenRMReward()
        return make_grader(RewardConfig(name="math"), spec, sandbox)
    if reward.name not in ("math", "code"):
        raise ConfigError(f"reward={reward.name} is unknown; choose math, code, even_tokens or fapo_genrm")
    answer_type = spec.answer_type or "math"
    kind = "code" if answer_type == "code" else "math"
    own = reward if reward.name == kind else RewardConfig(name=kind)  # the other kind's grader at its defaults
    if answer_type == "code":
        from rlbench.reward.code import CodeReward
        from rlbench.sandbox import limits_from_config

        sandbox = sandbox or SandboxConfig()
        return CodeReward(
            mode=own.mode,
            correct_reward=own.correct_reward,
            incorrect_reward=own.incorrect_reward,
            limits=limits_from_config(sandbox),
            workers=sandbox.workers,
        )
    return MathReward(
        correct_reward=own.correct_reward,
        incorrect_reward=own.incorrect_reward,
        format_weight=own.format_weight,
        tolerance=own.tolerance if spec.tolerance is None else spec.tolerance,  # the benchmark's own, else reward.tolerance
        extraction=own.extraction or spec.reward_extraction or "auto",
        verify_timeout_s=own.verify_timeout_s,
        absolute_tolerance=spec.absolute_tolerance,
        answer_type=answer_type,
        truncated_fallback=spec.truncated_fallback,
        last_number_fallback=spec.last_number_fallback,
        answer_labels=spec.answer_labels,
        list_order=spec.list_order,
    )


def training_grader(config: RunConfig) -> Any:
    """The grader of the run's training set (``dataset``), from the typed config."""
    return make_grader(config.reward, config.dataset, config.sandbox)
