"""Multi-turn environments (``env=<name>``, conf/env/; rollout=multi_turn): the seam is
:mod:`rlbench.rollout.env.base`; one module per environment, each imported here so that a new
environment is its module and its YAML (docs/agents.md)."""

from typing import Any

from rlbench.algorithm.registry import import_family_modules
from rlbench.rollout.env.base import (
    ENVIRONMENTS,
    EnvContext,
    EnvFactory,
    Environment,
    Reset,
    StepResult,
    env_roles,
    register_env,
    validate_env,
)
from rlbench.sandbox import limits_from_config


def env_factory(config: Any, grader: Any, sandbox: Any) -> EnvFactory | None:
    """The run's environment factory (None without ``env``): ``config`` the typed ``env`` node,
    ``grader`` the training grader, ``sandbox`` the ``sandbox`` node (the limits of tool code)."""
    if config is None:
        return None
    return EnvFactory(config, EnvContext(grader=grader, sandbox_limits=limits_from_config(sandbox)))


import_family_modules(__name__, __path__)

__all__ = ["ENVIRONMENTS", "EnvContext", "EnvFactory", "Environment", "Reset", "StepResult", "env_factory", "env_roles",
           "register_env", "validate_env"]
