"""Check a composed config against the schemas of ``rlbench.config.schema``.

Every key must be a field of its node's schema (else: the nearest valid spelling, by difflib), every
value must have the field's type and lie in its bounds, and every piece node's parameters must be
parameters of the registered function (its signature, read through the registry). Each message
names the key, what is allowed, and where the value came from (``rlbench.config.origin``).

The registries themselves (pieces, rollout strategies, prompt samplers) live in the layers above;
the run layer passes what they hold in as :class:`Registered` (``rlbench.validation.registered``).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import operator
import typing
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Literal, Mapping, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlbench.config.origin import ValueOrigins
from rlbench.config.schema import MOVED_KEYS, PIECE_PARAMETER_BOUNDS, RunConfig, config_fields
from rlbench.errors import ConfigError


BOUND_TESTS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le)}


@dataclass(frozen=True)
class Registered:
    """What the registries hold, named by the schema but not imported by it."""

    pieces: Mapping[str, Any]  # piece kind -> its PieceKind (rlbench/algorithm/pieces.py): registry, many, parameters()
    choices: Mapping[str, Collection[str]]  # path of a ``settings_blocks`` key (rollout.strategy) -> the registered names


def check_against_schema(cfg: DictConfig, registered: Registered, origins: ValueOrigins | None = None) -> None:
    """Raise :class:`ConfigError` for the first key or value the schema does not allow."""
    _Walk(registered, origins if origins is not None else ValueOrigins.from_hydra()).node(cfg, RunConfig, "")


def nearest(key: str, valid: Iterable[str]) -> str | None:
    """The closest valid spelling of ``key`` (difflib ratio >= 0.6), or None."""
    matches = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


class _Walk:
    def __init__(self, registered: Registered, origins: ValueOrigins):
        self.piece_kinds, self.choices = registered.pieces, registered.choices
        self.origins = origins

    def fail(self, path: str, message: str) -> None:
        origin = self.origins.of(path)
        raise ConfigError(f"{message} (set by {origin})" if origin else message)

    def unknown_key(self, path: str, key: str, valid: Iterable[str], what: str) -> None:
        if _join(path, key) in MOVED_KEYS:
            self.fail(_join(path, key), f"unknown key '{_join(path, key)}': it moved to {MOVED_KEYS[_join(path, key)]}")
        valid = sorted(valid)
        suggestion = nearest(key, valid)
        hint = f"did you mean '{suggestion}'? " if suggestion else ""
        self.fail(_join(path, key), f"unknown key '{_join(path, key)}': {what} has no '{key}'; {hint}valid keys: {', '.join(valid)}")

    # ------------------------------------------------------------------------------- schema nodes

    def node(self, value: Any, schema: type, path: str) -> None:
        if not isinstance(value, DictConfig):
            self.fail(path, f"{path} must be a mapping of {{{', '.join(f.name for f in config_fields(schema))}}}, got {value!r}")
        fields = {f.name: f for f in config_fields(schema)}
        hints = typing.get_type_hints(schema)
        extra = {  # the settings block of each registered choice of a settings_blocks key, only with that choice
            name: (key, name)
            for key, spec in fields.items() if spec.metadata.get("settings_blocks")
            for name in self.choices[_join(path, key)] if name not in fields
        }
        for key in value.keys():
            if key not in fields and key not in extra:
                self.unknown_key(path, str(key), [*fields, *extra], path or "the top level of the config")
        for key in value.keys():
            if key in extra:
                self.only_with(value, fields, extra[key], _join(path, key))
            else:
                self.field(value, str(key), fields[key], hints[key], _join(path, key), fields)

    def field(
        self, parent: DictConfig, key: str, spec: dataclasses.Field, annotation: Any, path: str,
        siblings: typing.Mapping[str, dataclasses.Field],
    ) -> None:
        if OmegaConf.is_missing(parent, key):
            return  # ??? : the runner reports it when it is read
        try:
            value = parent[key]
        except Exception:  # an interpolation that resolves only inside a Hydra run (${hydra:...})
            return
        meta = spec.metadata
        if "only_with" in meta:
            self.only_with(parent, siblings, meta["only_with"], path)
        if "node" in meta:
            if value is not None:
                self.node(value, meta["node"], path)
        elif "piece" in meta:
            self.pieces(value, meta["piece"], path)
        elif "values" in meta:
            if not isinstance(value, DictConfig):
                self.fail(path, f"{path} must be a mapping, got {value!r}")
            for name in value.keys():
                self.node(value[name], meta["values"], _join(path, name))
        elif "registry" in meta:
            registry = self.piece_kinds[meta["registry"]].registry
            if value not in registry:
                self.unknown_name(path, value, registry)
        elif not meta.get("open") or not isinstance(value, DictConfig):
            self.value(value, annotation, spec.default is None, meta, path)
        else:  # a free mapping: only its typed keys are checked (paper.fidelity)
            for name, schema in meta.get("typed_keys", {}).items():
                if value.get(name) is not None:
                    self.node(value[name], schema, _join(path, name))

    def only_with(
        self, parent: DictConfig, siblings: typing.Mapping[str, dataclasses.Field], choice: tuple[str, str], path: str
    ) -> None:
        """A settings block (not null) for a choice of ``selector`` that is not the selected one is refused."""
        selector, wanted = choice
        if parent.get(path.rpartition(".")[2]) is None:
            return
        selected = parent.get(selector, siblings[selector].default)
        if selected != wanted:
            where = _join(path.rpartition(".")[0], selector)
            self.fail(
                path,
                f"{path} holds the settings of {where}={wanted}, but {where} is {selected}; "
                f"set {where}={wanted} or remove the block (~{path})",
            )

    # ------------------------------------------------------------------------------- values

    def value(self, value: Any, annotation: Any, nullable: bool, bounds: typing.Mapping[str, Any], path: str) -> None:
        if annotation is Any:
            return
        if typing.get_origin(annotation) is Union:
            arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation, nullable = arguments[0], True
        if value is None:
            if not nullable:
                self.fail(path, f"{path} must be {describe(annotation)}, got null")
            return
        if typing.get_origin(annotation) is Literal:
            choices = typing.get_args(annotation)
            if value not in choices:
                suggestion = nearest(str(value), map(str, choices))
                hint = f"did you mean '{suggestion}'? " if suggestion else ""
                self.fail(path, f"{path}={value!r} is unknown; {hint}choose one of: {', '.join(map(str, choices))}")
            return
        if not is_instance(value, annotation):
            self.fail(path, f"{path} must be {describe(annotation)}, got {value!r}")
        self.bounds(value, bounds, path)

    def bounds(self, value: Any, bounds: typing.Mapping[str, Any], path: str) -> None:
        declared = [name for name in BOUND_TESTS if name in bounds]
        if any(not BOUND_TESTS[name][1](value, bounds[name]) for name in declared):
            allowed = " and ".join(f"{BOUND_TESTS[name][0]} {bounds[name]}" for name in declared)
            self.fail(path, f"{path} must be {allowed}, got {value}")

    # ------------------------------------------------------------------------------- pieces

    def unknown_name(self, path: str, name: Any, registry: Any) -> None:
        suggestion = nearest(str(name), registry.names())
        hint = f"did you mean '{suggestion}'? " if suggestion else ""
        self.fail(path, f"{path}={name}: no {registry.kind} of that name; {hint}choose one of {', '.join(registry.names())}")

    def pieces(self, value: Any, kind: str, path: str) -> None:
        if value is None:
            return  # Algorithm.from_config says which option to pick
        if isinstance(value, ListConfig):
            for index, entry in enumerate(value):
                self.piece(entry, kind, _join(path, index))
        elif self.piece_kinds[kind].many:
            self.fail(path, f"{path} must be a list of {{name, parameters}} entries, got {value!r}")
        else:
            self.piece(value, kind, path)

    def piece(self, value: Any, kind: str, path: str) -> None:
        registry = self.piece_kinds[kind].registry
        if not isinstance(value, DictConfig) or "name" not in value:
            self.fail(path, f"{path} must be {{name: <{registry.kind}>, <parameters>}}; choose a name from {', '.join(registry.names())}")
        name = value["name"]
        if name not in registry:
            self.unknown_name(_join(path, "name"), name, registry)
        accepted = registry.accepted_inputs(name)  # the registry's rule: any parameter of the signature
        for key in value.keys():
            if key != "name" and key not in accepted:
                self.unknown_key(path, str(key), ["name", *self.piece_kinds[kind].parameters(name)], f"{registry.kind} '{name}'")
        parameters = inspect.signature(registry.get(name)).parameters
        for key in value.keys():
            if key == "name" or OmegaConf.is_missing(value, key):
                continue
            default = parameters[key].default
            annotation = Any if default is None or default is inspect.Parameter.empty else type(default)
            self.value(value[key], annotation, default is None, PIECE_PARAMETER_BOUNDS.get(str(key), {}), _join(path, key))


def is_instance(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is a config value of the plain type ``annotation`` (a bool is not a number; a float
    is finite)."""
    if annotation is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if annotation is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if annotation is list:
        return isinstance(value, (ListConfig, list))
    if annotation is dict:
        return isinstance(value, (DictConfig, dict))
    return isinstance(value, annotation)


def describe(annotation: Any) -> str:
    """A plain type as messages name it ("an integer")."""
    return {
        bool: "true or false", int: "an integer", float: "a finite number", str: "a string", list: "a list", dict: "a mapping",
    }.get(annotation, str(annotation))


def unknown_override_message(cfg: DictConfig, key_path: str, override: str) -> str | None:
    """The message for a plain ``key=value`` override whose key is not in the composed config (Hydra
    refuses those with its own error): the first missing segment of ``key_path``, its nearest valid
    spelling among the keys beside it, and the override; None when every segment exists."""
    node: Any = cfg
    parts = key_path.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in node.keys():  # not `part in node`: False for a required value (???) an override sets
            parent = ".".join(parts[:depth])
            if _join(parent, part) in MOVED_KEYS:
                return (f"unknown key '{_join(parent, part)}': it moved to {MOVED_KEYS[_join(parent, part)]} "
                        f"(set by the command-line override '{override}')")
            valid = sorted(str(k) for k in node.keys())
            suggestion = nearest(part, valid)
            hint = f"did you mean '{suggestion}'? " if suggestion else ""
            where = parent or "the top level of the config"
            return (f"unknown key '{_join(parent, part)}': {where} has no '{part}'; {hint}valid keys: "
                    f"{', '.join(valid)} (set by the command-line override '{override}')")
        if OmegaConf.is_missing(node, part) or depth == len(parts) - 1:
            return None  # model=checkpoint's path: ??? until the override sets it; a known leaf, not resolved
            # (its value may interpolate ${hydra:...}, unset outside a run: rollout.mcts_prefix.teacher_tree)
        node = node[part]
    return None
