"""The package layout: dependencies point one way, down the layers

    run        rlbench.runner, rlbench.cli, rlbench.validation (checks that need the code), rlbench.listing
    training   rlbench.training
    rollout    rlbench.rollout, rlbench.guidance, rlbench.eval
    algorithm  rlbench.algorithm
    data       rlbench.dataset, rlbench.reward, rlbench.model, rlbench.prompting, rlbench.sandbox
    base       rlbench.config (the schemas), rlbench.errors, rlbench.utils, rlbench.faults, rlbench.logger

and no module imports itself through others (lazy imports count; ``if TYPE_CHECKING:`` ones do not)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlbench"
RUN = {"rlbench.runner", "rlbench.cli", "rlbench.validation", "rlbench.listing"}
TRAINING = {"rlbench.training", *RUN}
ROLLOUT = {"rlbench.rollout", "rlbench.guidance", "rlbench.eval", *TRAINING}
ALGORITHM = {"rlbench.algorithm", *ROLLOUT}
DATA = {"rlbench.dataset", "rlbench.reward", "rlbench.model", "rlbench.prompting", "rlbench.sandbox", *ALGORITHM}
# package or top-level module -> the rlbench modules it must not import (at any depth below the package)
FORBIDDEN = {
    **{base: DATA for base in ("config", "errors", "utils", "faults", "logger")},
    **{data: ALGORITHM for data in ("dataset", "reward", "model", "prompting", "sandbox")},
    "algorithm": ROLLOUT,
    **{rollout: TRAINING for rollout in ("rollout", "guidance", "eval")},
    "training": RUN,
    "analysis": TRAINING,
}


def source_files(name: str) -> list[Path]:
    """The files of package ``rlbench.<name>``, or the module ``rlbench/<name>.py``."""
    folder = PACKAGE / name
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{name}.py"]


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
        for path in source_files(package)
        for name in sorted(imported_modules(path))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package])
    ]
    assert not offenders, offenders


def test_every_package_has_its_layer():
    """A new package or top-level module says where it sits (FORBIDDEN) before it can import anything."""
    placed = set(FORBIDDEN) | {name.removeprefix("rlbench.") for name in RUN}
    found = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert found <= placed, sorted(found - placed)


# ------------------------------------------------------------------------------------------ cycles


def module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def runtime_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The rlbench modules ``name`` imports at any depth (inside functions too), except under
    ``if TYPE_CHECKING:``; ``from a.b import c`` counts as importing ``a.b.c`` when that is a module
    and as importing ``a.b`` otherwise."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                wanted.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(parent + ([child.module] if child.module else []))
                submodules = {f"{base}.{alias.name}" for alias in child.names} & set(modules)
                wanted.update(submodules if len(submodules) == len(child.names) else {base, *submodules})
            visit(child)

    visit(ast.parse(path.read_text()))
    found = set()
    for module in wanted:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module and module != name:
            found.add(module)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def test_no_module_imports_itself_through_others():
    modules = module_names()
    graph = {name: runtime_imports(name, path, modules) for name, path in modules.items()}
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(
        " -> ".join(cycle) + ": " + "; ".join(f"{a} imports {sorted(graph[a] & set(cycle))}" for a in cycle)
        for cycle in cycles
    )


def test_a_lazy_import_closes_a_cycle_and_a_type_checking_one_does_not(tmp_path):
    files = {
        "a.py": "from rlbench.b import helper\n",
        "b.py": "def helper():\n    from rlbench.c import late\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlbench.b import helper\n",
    }
    modules = {}
    for file, text in files.items():
        (tmp_path / file).write_text(text)
        modules[f"rlbench.{Path(file).stem}"] = tmp_path / file
    graph = {name: runtime_imports(name, path, modules) for name, path in modules.items()}
    assert graph == {"rlbench.a": {"rlbench.b"}, "rlbench.b": {"rlbench.c"}, "rlbench.c": set()}
    assert import_cycles(graph) == []
    (tmp_path / "c.py").write_text("def late():\n    from rlbench import a\n")
    graph["rlbench.c"] = runtime_imports("rlbench.c", tmp_path / "c.py", modules)
    assert import_cycles(graph) == [["rlbench.a", "rlbench.b", "rlbench.c"]]


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
