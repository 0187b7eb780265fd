"""Regenerate the tables in docs/ from conf/ and the code: the algorithm presets (docs/algorithms.md, from
conf/algorithm/*.yaml), the step inputs the pieces read (docs/algorithms.md, from
rlbench/algorithm/step_inputs.py), the paper presets (docs/papers.md, from conf/paper/*.yaml) and the
rollout strategies (docs/rollout.md, from the strategy registry).

Each table sits between two marker lines in its page, ``<!-- BEGIN GENERATED: <name> -->`` and
``<!-- END GENERATED: <name> -->``; the prose around it is written by hand. Compose only: no model
or data is loaded.

    python docs/gen_tables.py           # rewrite the tables in place
    python docs/gen_tables.py --check   # exit 1 when a table is out of date (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
DOCS_DIR = ROOT / "docs"

ALGORITHMS_HEADER = "| name | advantage | loss | aggregation | KL | update | paper | run |"
PAPERS_HEADER = "| paper | preset | verified numbers | status | run |"
STRATEGIES_HEADER = "| strategy | module | provides | what it does |"
FIRST_ROWS = ["grpo", "dr_grpo"]  # the baselines lead the algorithm table; the rest is alphabetical


def preset_names() -> list[str]:
    """Every algorithm preset: a YAML file directly in conf/algorithm/."""
    return sorted(path.stem for path in (CONF_DIR / "algorithm").glob("*.yaml"))


def paper_names() -> list[str]:
    """Every paper preset: a YAML file in conf/paper/ (used as ``paper=<name>``)."""
    return sorted(path.stem for path in (CONF_DIR / "paper").glob("*.yaml"))


def _params(node) -> str:
    items = [f"{key}={value}" for key, value in node.items() if key != "name" and value is not None]
    return f" ({', '.join(items)})" if items else ""


def _cells_row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def update_cell(update) -> str:
    """The schedule, its settings block, and the update knobs that differ from one on-policy step."""
    schedule = str(update.get("schedule", "standard"))
    knobs = {
        key: value for key, value in update.items()
        if key != "schedule" and not isinstance(value, DictConfig) and not (key in ("epochs", "minibatches") and value == 1)
    }
    knobs.update(update.get(schedule) or {})
    return f"`{schedule}`{_params(knobs)}"


def critic_cell(critic: DictConfig) -> str:
    """``algorithm.critic``: a value head on the policy (model shared) or a separate critic model, with its settings."""
    kind = "separate critic" if critic.get("model") == "separate" else "value head"
    return f"{kind}{_params({k: v for k, v in critic.items() if k != 'model' and v is not None})}"


def algorithm_row(name: str, cfg: DictConfig) -> str:
    """One preset: its pieces (advantage, loss with parameters, aggregation, KL, update), paper, command."""
    algorithm = cfg.algorithm
    kl = algorithm.kl
    critic = algorithm.get("critic")
    return _cells_row([
        f"`{name}`",
        f"`{algorithm.advantage.name}`" + (f" + {critic_cell(critic)}" if critic else ""),
        f"`{algorithm.loss.name}`{_params(algorithm.loss)}",
        f"`{algorithm.aggregation.name}`",
        "off" if float(kl.coef) == 0 else f"{kl.estimator}, β={kl.coef}" + (", in the reward" if kl.get("placement") == "reward" else ""),
        update_cell(algorithm.get("update") or {}),
        str(algorithm.paper),
        f"`rlbench algorithm={name}`",
    ])


def _row_order(name: str) -> tuple[int, str]:
    return (FIRST_ROWS.index(name), "") if name in FIRST_ROWS else (len(FIRST_ROWS), name)


def algorithms_table(cfgs: dict[str, DictConfig]) -> str:
    """The Markdown table of docs/algorithms.md: one row per preset (name -> composed run config)."""
    columns = ALGORITHMS_HEADER.count("|") - 1
    rows = [ALGORITHMS_HEADER, "|" + "---|" * columns]
    rows += [algorithm_row(name, cfgs[name]) for name in sorted(cfgs, key=_row_order)]
    return "\n".join(rows) + "\n"


def fidelity_cell(fidelity) -> str:
    """A preset's fidelity block as a table cell: "faithful", "partial: <missing>", "adapted: <how>"
    (docs/papers.md, "Fidelity"); "not stated" without a block (tests/test_preset_status.py refuses that)."""
    if fidelity is None:
        return "not stated"
    text = {"partial": fidelity.get("missing"), "adapted": fidelity.get("adapted")}.get(fidelity.status)
    return f"{fidelity.status}: {' '.join(str(text).split())}" if text else str(fidelity.status)


def papers_table(cfgs: dict[str, DictConfig]) -> str:
    """The Markdown table of docs/papers.md: paper, preset, how many reference numbers are verified,
    the fidelity, the command (name -> run config composed with ``paper=<name>``)."""
    rows = [PAPERS_HEADER, "|" + "---|" * (PAPERS_HEADER.count("|") - 1)]
    for name in sorted(cfgs):
        paper = cfgs[name].paper
        verified = sum(bool(entry.verified) for entry in paper.reference)
        cell = f"yes ({verified} of {len(paper.reference)})" if verified else "no"
        title = f"{paper.title} (arXiv:{paper.arxiv})"
        rows.append(_cells_row([title, f"`{cfgs[name].algorithm.name}`", cell, fidelity_cell(paper.get("fidelity")),
                                f"`rlbench paper={name}`"]))
    return "\n".join(rows) + "\n"


def first_sentence(text: str | None) -> str:
    """The first sentence of a docstring, on one line (abbreviations such as "et al." do not end it)."""
    flat = " ".join((text or "").split())
    match = re.search(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.i\.d)(?<!\bvs)\.(\s|$)", flat)
    return flat if match is None else flat[: match.start() + 1]


def strategies_table() -> str:
    """The Markdown table of docs/rollout.md: one row per registered rollout strategy, in the order of its
    room (strategies/, then guided/) and name."""
    import inspect
    import sys

    from rlbench.rollout import STRATEGIES

    def room(name: str) -> str:
        return STRATEGIES[name].__module__.rsplit(".", 2)[-2]

    rows = [STRATEGIES_HEADER, "|---|---|---|---|"]
    for name in sorted(STRATEGIES, key=lambda n: (room(n) != "strategies", n)):
        cls = STRATEGIES[name]
        path = Path(inspect.getfile(cls)).relative_to(ROOT)
        summary = first_sentence(sys.modules[cls.__module__].__doc__)
        provides = ", ".join(f"`{i}`" for i in sorted(cls.provides)) or "-"
        rows.append(_cells_row([f"`rollout={name}`", f"`{path}`", provides, summary]))
    return "\n".join(rows) + "\n"


def compose_all(output_dir: Path) -> tuple[dict[str, DictConfig], dict[str, DictConfig]]:
    """(algorithm preset -> config composed with the smoke experiment, paper -> ``paper=<name>`` config)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        presets = {
            name: compose("config", overrides=[f"algorithm={name}", "experiment=smoke", f"output_dir={output_dir}"])
            for name in preset_names()
        }
        papers = {
            name: compose("config", overrides=[f"paper={name}", f"output_dir={output_dir}"])
            for name in paper_names()
        }
    return presets, papers


def generated_tables(output_dir: Path) -> dict[Path, dict[str, str]]:
    """page -> {marker name -> table text} for every generated table."""
    from rlbench.algorithm.step_inputs import STEP_INPUTS

    presets, papers = compose_all(output_dir)
    return {
        DOCS_DIR / "algorithms.md": {"algorithms": algorithms_table(presets), "step-inputs": STEP_INPUTS.markdown_table()},
        DOCS_DIR / "papers.md": {"papers": papers_table(papers)},
        DOCS_DIR / "rollout.md": {"strategies": strategies_table()},
    }


def replace_region(text: str, marker: str, body: str) -> str:
    """``text`` with the lines between ``<!-- BEGIN GENERATED: marker -->`` and its END line replaced."""
    pattern = re.compile(
        rf"(<!-- BEGIN GENERATED: {re.escape(marker)} -->\n).*?(<!-- END GENERATED: {re.escape(marker)} -->)", re.S
    )
    if not pattern.search(text):
        raise ValueError(f"no '<!-- BEGIN/END GENERATED: {marker} -->' markers")
    return pattern.sub(lambda match: match.group(1) + body + match.group(2), text, count=1)


def stale_pages(tables: dict[Path, dict[str, str]]) -> dict[Path, str]:
    """page -> its regenerated text, for the pages whose text differs from what is on disk."""
    stale = {}
    for page, regions in tables.items():
        text = page.read_text()
        new = text
        for marker, body in regions.items():
            new = replace_region(new, marker, body)
        if new != text:
            stale[page] = new
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report out-of-date tables (exit 1)")
    args = parser.parse_args(argv)
    stale = stale_pages(generated_tables(Path(tempfile.mkdtemp())))
    for page, text in stale.items():
        if args.check:
            print(f"{page.relative_to(ROOT)} is out of date: run python docs/gen_tables.py", file=sys.stderr)
        else:
            page.write_text(text)
            print(f"rewrote {page.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
