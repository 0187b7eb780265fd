"""The validated config as the schema's dataclasses: converted once, after validation, and passed
down the run as typed objects (``RunConfig``, ``TrainerConfig``, ``RolloutConfig``, ...).

Every default is the schema's: a key the composed config leaves out takes the field's default here,
so no reader repeats it. Nodes become their dataclass; open-ended values stay plain containers: the
algorithm's pieces (``{name, <parameters>}``, checked against the registered function), mappings
marked ``open`` (dataset field maps, LlamaConfig fields, paper metadata: only their ``typed_keys``, such as
``paper.fidelity``, become their dataclass) and lists. The settings blocks of a ``settings_blocks`` choice
(``rollout.<strategy>``, ``trainer.prompt_sampler.<name>``) are collected into the node's ``settings`` field, a
mapping from the choice to its block.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Mapping, TypeVar, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlbench.config.schema import AlgorithmConfig, ModelConfig, RolloutConfig, RunConfig, config_fields
from rlbench.config.walk import describe, is_instance, nearest
from rlbench.errors import ConfigError

Schema = TypeVar("Schema")


def typed_config(cfg: DictConfig) -> RunConfig:
    """``cfg`` (checked by the schema walk) as a :class:`RunConfig`; interpolations resolved."""
    return typed_node(cfg, RunConfig)


def typed_node(node: Any, schema: type[Schema]) -> Schema:
    """One node as ``schema``: its fields converted, missing keys at the schema's defaults."""
    hints = typing.get_type_hints(schema)
    values: dict[str, Any] = {}
    keys = config_fields(schema)
    for spec in keys:
        if spec.name not in node:
            continue
        value = node[spec.name]
        meta = spec.metadata
        if "node" in meta:
            values[spec.name] = None if value is None else typed_node(value, meta["node"])
        elif "values" in meta:
            values[spec.name] = {str(key): typed_node(entry, meta["values"]) for key, entry in value.items()}
        else:
            values[spec.name] = plain(value, hints[spec.name])
            for name, key_schema in meta.get("typed_keys", {}).items():  # typed keys of a free mapping (paper.fidelity)
                if value is not None and value.get(name) is not None:
                    values[spec.name][name] = typed_node(value[name], key_schema)
    blocks = [key for key in node.keys() if key not in {spec.name for spec in keys}]
    if blocks:  # the walk allowed them: settings blocks of registered choices
        values["settings"] = {str(key): plain(node[key], dict) for key in blocks}
    return schema(**values)


def plain(value: Any, annotation: Any) -> Any:
    """A leaf value: containers as Python lists and dicts (as tuples in a tuple field), an integer in a
    float field as a float."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(annotation) is tuple and isinstance(value, (list, tuple)):  # tuple[int, ...] or tuple[X, Y]
        items = item_annotations(annotation, len(value))
        return tuple(value) if len(items) != len(value) else tuple(plain(item, arg) for item, arg in zip(value, items))
    return value


def item_annotations(annotation: Any, count: int) -> tuple:
    """The annotation of each of ``count`` items of a ``tuple[...]`` or ``list[X]`` field: ``tuple[X, ...]``
    and ``list[X]`` repeat X, ``tuple[X, Y]`` names each (its length may differ from ``count``)."""
    args = typing.get_args(annotation)
    repeated = typing.get_origin(annotation) is list or (len(args) == 2 and args[1] is Ellipsis)
    return args[:1] * count if repeated else args


def settings_block(values: Mapping[str, Any] | None, options_class: type[Schema], where: str) -> Schema:
    """A settings block of the run layers (``rollout.<strategy>``, ``trainer.prompt_sampler.<name>``) as its
    dataclass ``options_class``: the fields are the keys, their defaults declared there only; each value
    converted (:func:`plain`) and checked against the field's type. ConfigError naming ``where`` for an
    unknown key (with the nearest spelling) or a value of the wrong type. (The algorithm layer imports
    nothing outside itself: it reads its blocks with rlbench.algorithm.schedules.settings_from_block.)"""
    block = dict(values or {})
    keys = {spec.name for spec in dataclasses.fields(options_class)}
    unknown = sorted(set(block) - keys)
    if unknown:
        guesses = [f"'{key}' -> '{guess}'" for key in unknown if (guess := nearest(key, keys))]
        raise ConfigError(
            f"{where} has no key(s) {unknown}; it takes {sorted(keys)}" + (f" (did you mean {', '.join(guesses)}?)" if guesses else "")
        )
    hints = typing.get_type_hints(options_class)
    converted = {key: plain(value, hints[key]) for key, value in block.items()}
    for key, value in converted.items():
        if not of_type(value, hints[key]):
            raise ConfigError(f"{where}.{key}={value!r} is not {type_name(hints[key])}")
    return options_class(**converted)


def of_type(value: Any, annotation: Any) -> bool:
    """Whether a converted value fits its field's annotation: the schema walk's rule for plain types
    (rlbench.config.walk.is_instance), a Literal's choices, Optional, tuples and lists of those."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(of_type(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if annotation is type(None):
        return value is None
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        items = item_annotations(annotation, len(value))
        return len(items) == len(value) and all(of_type(v, a) for v, a in zip(value, items))
    return not isinstance(annotation, type) or is_instance(value, annotation)


def type_name(annotation: Any) -> str:
    """How an error message names a field's type."""
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return describe(annotation)
    return "a " + str(annotation).replace("typing.", "")


def rollout_config(values: Mapping[str, Any]) -> RolloutConfig:
    """The typed ``rollout`` of a plain mapping (tests and scripts build one so): its fields, and each
    strategy's settings block under the strategy's name; missing keys at the schema's defaults."""
    return node_config(values, RolloutConfig)


def model_config(values: Mapping[str, Any]) -> ModelConfig:
    """The typed ``model`` of a mapping (a loaded ``conf/model/<name>.yaml``: tests and scripts load one so)."""
    return node_config(values, ModelConfig)


def node_config(values: Mapping[str, Any], schema: type[Schema]) -> Schema:
    """A plain mapping or a DictConfig as the node ``schema``, missing keys at the schema's defaults."""
    return typed_node(values if isinstance(values, DictConfig) else OmegaConf.create(dict(values)), schema)


def algorithm_settings(algorithm: AlgorithmConfig | Mapping[str, Any]) -> dict[str, Any]:
    """What ``Algorithm.from_config`` reads: the typed ``algorithm`` (or a partial mapping: tests and scripts)
    as a plain mapping holding every key at the schema's default where it was left out. The algorithm
    layer imports nothing outside itself, so its defaults are filled here and it reads no default of its own."""
    values = dataclasses.asdict(algorithm) if dataclasses.is_dataclass(algorithm) else algorithm
    return with_defaults(values, AlgorithmConfig)


def with_defaults(values: Mapping[str, Any] | None, schema: type) -> dict[str, Any]:
    """``values`` with every key of ``schema``: a key left out at the field's default, a node left out (or
    null where the field is not optional) at its own defaults, a given node filled likewise. Keys the
    schema lacks are kept, for the reader's check to refuse with its message."""
    filled = dict(values or {})
    hints = typing.get_type_hints(schema)
    for spec in config_fields(schema):
        value = filled.get(spec.name)
        node = spec.metadata.get("node")
        if node is not None:
            optional = typing.get_origin(hints[spec.name]) in (Union, types.UnionType)
            filled[spec.name] = with_defaults(value, node) if value is not None or not optional else None
        elif spec.name not in filled:
            filled[spec.name] = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
    return filled
