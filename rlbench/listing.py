"""``rlbench-list`` (also ``python -m rlbench.listing``): what each config group offers.

    rlbench-list                 every conf group with its options, every registered piece with the
                                 first line of its docstring, the update schedules and rollout strategies
    rlbench-list --keys [NODE]   the schema's keys under NODE (e.g. algorithm.kl) with defaults and help
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import textwrap
import typing
from pathlib import Path
from typing import Iterator

from rlbench.algorithm.pieces import PIECE_KINDS
from rlbench.config.origin import CONF_DIR, SWEEP_GROUP, SWEEPS_DIR
from rlbench.config.schema import RunConfig, UpdateConfig, config_fields
from rlbench.rollout import STRATEGIES


def summary(text: str | None, width: int = 110) -> str:
    """The first paragraph of a docstring on one line, shortened to ``width`` characters."""
    paragraph = (text or "").strip().split("\n\n")[0]
    return textwrap.shorten(" ".join(paragraph.split()), width=width, placeholder=" ...")


def group_options(conf_dir: Path = CONF_DIR, sweeps_dir: Path = SWEEPS_DIR) -> dict[str, list[str]]:
    """conf group ('algorithm', 'algorithm/loss', ...; 'sweep' from sweeps/) -> its option names, sorted."""
    folders = {folder.relative_to(conf_dir).as_posix(): folder for folder in conf_dir.rglob("*") if folder.is_dir()}
    folders[SWEEP_GROUP] = sweeps_dir
    groups: dict[str, list[str]] = {}
    for group, folder in sorted(folders.items()):
        options = sorted(path.stem for path in folder.glob("*.yaml"))
        if options and "hydra" not in group.split("/"):
            groups[group] = options
    return groups


def group_lines(conf_dir: Path = CONF_DIR) -> Iterator[str]:
    for group, options in group_options(conf_dir).items():
        yield f"{group}: {' '.join(options)}"


def piece_lines() -> Iterator[str]:
    for kind, piece in PIECE_KINDS.items():
        yield f"{kind} (choose with {piece.selected_by}):"
        for name in piece.registry.names():
            parameters = ", ".join(
                f"{key}={p.default}" if p.default is not inspect.Parameter.empty else key
                for key, p in piece.parameters(name).items()
            )
            doc = summary(inspect.getdoc(piece.registry.get(name)))
            yield f"  {name}({parameters}): {doc}"
    schedules = typing.get_args(typing.get_type_hints(UpdateConfig)["schedule"])
    yield f"update schedule (choose with algorithm.update.schedule): {' '.join(schedules)}"
    yield "rollout strategy (choose with rollout=<strategy>):"
    for name, strategy in sorted(STRATEGIES.items()):
        yield f"  {name}: {summary(inspect.getdoc(strategy) or inspect.getdoc(inspect.getmodule(strategy)))}"


def schema_lines(schema: type = RunConfig, prefix: str = "") -> Iterator[str]:
    """Every key of ``schema`` (recursively) with its default and help string."""
    for spec in config_fields(schema):
        path = f"{prefix}.{spec.name}" if prefix else spec.name
        meta = spec.metadata
        if "node" in meta:
            yield f"{path}: {meta['help']}"
            yield from schema_lines(meta["node"], path)
            continue
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        yield f"{path} = {default!r}: {meta.get('help', '')}"


def node_schema(path: str) -> tuple[type, str]:
    """The schema class of a dotted node path ('' is the whole config)."""
    schema, walked = RunConfig, []
    for part in [p for p in path.split(".") if p]:
        fields = {f.name: f for f in config_fields(schema)}
        if part not in fields or "node" not in fields[part].metadata:
            raise SystemExit(f"rlbench-list: '{'.'.join([*walked, part])}' is not a config node")
        schema = fields[part].metadata["node"]
        walked.append(part)
    return schema, ".".join(walked)


# Groups without a schema node of their own, and the groups that are internal (included by other
# files, not chosen on the command line) and hidden from ``rlbench --help``.
GROUP_HELP = {
    "algorithm/advantage": "swap one piece of the algorithm: the advantage estimator",
    "algorithm/loss": "swap one piece of the algorithm: the policy loss",
    "algorithm/aggregation": "swap one piece of the algorithm: how token losses become a scalar",
    "benchmark": "evaluation sets, combined by the eval suites",
    "experiment": "bundles of overrides, applied last (smoke: tiny model, 2 steps)",
    "sweep": "the points of a sweep, for rlbench -m sweep=<name> (docs/compare.md)",
}
HIDDEN_GROUPS = ("paper/common", "experiment/toy_learning")

USAGE = """\
rlbench: benchmark policy-optimization methods for LLMs trained with verifiable rewards.

usage: rlbench [GROUP=OPTION ...] [KEY=VALUE ...]     one run (train, then evaluate)
       rlbench -m [GROUP=A,B ...] [KEY=A,B ...]       a sweep: every combination (rlbench -m sweep=algorithms)
       rlbench --cfg job [-p KEY]                     print the composed config, or one node of it
       rlbench --info defaults                        which file each group came from
       rlbench --hydra-help                           Hydra's flags; tab completion: eval "$(rlbench -sc install=bash)"
       rlbench-list [--keys NODE]                     every option and registered piece; a node's keys with help
       rlbench-compare RESULTS...                     tables and plots across runs (docs/compare.md)"""


def help_lines(conf_dir: Path = CONF_DIR) -> Iterator[str]:
    """``rlbench --help``: the usage, one line per config group (its help and options) and per
    top-level option (its default and help), from the schemas (rlbench/config/schema.py)."""
    nodes = {spec.name: spec.metadata for spec in dataclasses.fields(RunConfig)}
    yield USAGE
    yield ""
    yield "config groups (GROUP=OPTION):"
    for group, options in group_options(conf_dir).items():
        if group.startswith(HIDDEN_GROUPS):
            continue
        described = GROUP_HELP.get(group) or nodes.get(group, {}).get("help", "")
        shown = " ".join(options) if group != "experiment" else " ".join([*options, "toy_learning/<preset>"])
        yield f"  {group:<22} {described}: {shown}"
    yield ""
    yield "options (KEY=VALUE; a group's keys: GROUP.KEY=VALUE, listed by rlbench-list --keys GROUP):"
    for spec in dataclasses.fields(RunConfig):
        if "node" in spec.metadata or spec.name in ("paper", "output_dir"):
            continue
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        yield f"  {spec.name:<22} {spec.metadata.get('help', '')} (default: {default})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlbench-list", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", nargs="?", const="", metavar="NODE", help="list the schema keys under NODE")
    args = parser.parse_args(argv)
    if args.keys is not None:
        lines = schema_lines(*node_schema(args.keys))
    else:
        lines = [*group_lines(), "", *piece_lines()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
