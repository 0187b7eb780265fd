"""The package layout: dependencies point one way, algorithm <- rollout <- training <- run."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlbench"
RUN_MODULES = {"rlbench.runner", "rlbench.cli"}
# package -> the rlbench modules it must not import (at any depth below the package)
FORBIDDEN = {
    "algorithm": {"rlbench.rollout", "rlbench.training", *RUN_MODULES},
    "rollout": {"rlbench.training", *RUN_MODULES},
    "training": RUN_MODULES,
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package):
    offenders = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for name in sorted(imported_modules(path))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package])
    ]
    assert not offenders, offenders


def test_the_step_lives_in_the_training_package():
    """rlbench/*.py holds entry points and small shared modules; the training step is not among them."""
    top_level = {path.stem for path in PACKAGE.glob("*.py")}
    assert not top_level & {"trainer", "update", "group_sampling", "advantage_inputs"}


def test_every_strategy_lives_in_the_module_named_after_it():
    """rollout=<name> is rlbench/rollout/strategies/<name>.py or rlbench/rollout/guided/<name>.py, a subclass
    of the base class that declares every hook (so no hook is looked up with getattr)."""
    from rlbench.rollout import STRATEGIES
    from rlbench.rollout.strategy import RolloutStrategy

    misplaced = {name: cls.__module__ for name, cls in STRATEGIES.items()
                 if cls.__module__ not in (f"rlbench.rollout.strategies.{name}", f"rlbench.rollout.guided.{name}")}
    assert not misplaced, misplaced
    assert all(issubclass(cls, RolloutStrategy) for cls in STRATEGIES.values())
    assert {p.stem for p in (PACKAGE / "rollout").glob("*/*.py")} >= set(STRATEGIES)
