"""rlbench/algorithm is the bottom layer: its pieces are pure tensor functions that training,
rollout and reward code build on, so it imports none of them (dependencies point one way:
algorithm <- rollout <- training <- run). Checked on the source of every module, including
imports inside functions."""

import ast
from pathlib import Path

import pytest

ALGORITHM_DIR = Path(__file__).resolve().parents[1] / "rlbench" / "algorithm"
#: The only rlbench modules the algorithm layer may import from.
ALLOWED = ("rlbench.algorithm", "rlbench.errors")


def package_of(path: Path) -> str:
    return ".".join(path.relative_to(ALGORITHM_DIR.parents[1]).with_suffix("").parts[:-1])


def rlbench_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute or relative rlbench import in ``source``, a module of
    ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "rlbench"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "rlbench":
                found.append((node.lineno, module))
    return found


def allowed(module: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in ALLOWED)


MODULES = sorted(ALGORITHM_DIR.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ALGORITHM_DIR)))
def test_algorithm_modules_import_only_the_algorithm_layer(path):
    bad = [f"line {line}: {module}" for line, module in rlbench_imports(path.read_text(), package_of(path)) if not allowed(module)]
    assert not bad, f"{path.name} imports outside {ALLOWED} (training, rollout, reward, ...): {bad}"


def test_the_check_sees_forbidden_imports():
    source = "import torch\nfrom rlbench.reward.math import Grade\n\ndef f():\n    import rlbench.training.step\n    from . import kl\n"
    modules = [module for _, module in rlbench_imports(source, "rlbench.algorithm")]
    assert modules == ["rlbench.reward.math", "rlbench.training.step", "rlbench.algorithm"]
    assert [allowed(m) for m in modules] == [False, False, True]


@pytest.mark.parametrize("package", ["losses", "advantages"])
def test_every_family_module_is_imported_so_its_pieces_register(package):
    import importlib
    import sys

    importlib.import_module(f"rlbench.algorithm.{package}")
    modules = {p.stem for p in (ALGORITHM_DIR / package).glob("*.py")} - {"__init__"}
    assert modules and all(f"rlbench.algorithm.{package}.{m}" in sys.modules for m in modules)
