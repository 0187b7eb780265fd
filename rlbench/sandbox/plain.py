"""Plain data across the sandbox boundary: exact built-in values to and from a JSON structure.

Used on both sides (standard library only: the supervisor and the harness load it by path, in
isolated mode). Only these exact types cross: ``None``, ``bool``, ``int``, ``float``, ``complex``,
``str``, ``bytes`` and ``list``, ``tuple``, ``dict``, ``set``, ``frozenset`` of them, and
``collections.OrderedDict`` (whose equality depends on order, so it must not become a dict). Subclasses
(an ``int`` with a patched ``__eq__``, an always-equal object) and every other object are refused
with :class:`NotPlain`, so a value the trusted side decodes compares exactly as the built-in type
does.

Wire form (inside one JSON document): ``None``/``bool``/``int``/``float``/``str`` as themselves
(``NaN`` and infinities as JSON's extensions); containers and the other types as a one-key object:
``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"d": [[key, value], ...]}`` dict (``"o"``: an
``OrderedDict``), ``{"s": [...]}``
set, ``{"f": [...]}`` frozenset, ``{"b": "<hex>"}`` bytes, ``{"c": [real, imag]}`` complex,
``{"i": "<hex>"}`` an integer of 64 bits or more.
"""

from __future__ import annotations

from collections import OrderedDict

#: Deepest nesting that crosses (deeper values are refused rather than recursing without bound).
MAX_DEPTH = 100

_SCALARS = (type(None), bool, int, float, str)
#: Integers at least this large (in absolute value) cross as hexadecimal text: decimal conversion
#: of huge integers is limited (``sys.set_int_max_str_digits``) and quadratic.
BIG_INT = 1 << 64


class NotPlain(TypeError):
    """A value that cannot cross the boundary as plain data."""


def to_wire(value, depth: int = 0):
    """The JSON structure of ``value``; raises :class:`NotPlain` for anything but exact plain data."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if kind is int and not -BIG_INT < value < BIG_INT:
        return {"i": format(value, "x")}
    if kind in _SCALARS:
        return value
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[kind]
        return {tag: [to_wire(item, depth + 1) for item in value]}
    if kind is dict or kind is OrderedDict:
        return {"d" if kind is dict else "o": [[to_wire(k, depth + 1), to_wire(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    raise NotPlain(f"a value of type {kind.__name__} is not plain data")


def from_wire(data, depth: int = 0):
    """The value of a JSON structure made by :func:`to_wire`; raises :class:`NotPlain` for
    anything else (unknown tags, wrong shapes, unhashable keys)."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if kind in _SCALARS:
        return data
    if kind is not dict or len(data) != 1:
        raise NotPlain(f"malformed plain data: {kind.__name__}")
    ((tag, body),) = data.items()
    if tag in ("l", "t", "s", "f") and type(body) is list:
        items = [from_wire(item, depth + 1) for item in body]
        build = {"l": list, "t": tuple, "s": set, "f": frozenset}[tag]
        try:
            return build(items)
        except TypeError as exc:  # an unhashable member of a set
            raise NotPlain(f"malformed plain data: {exc}") from None
    if tag in ("d", "o") and type(body) is list:
        result = {} if tag == "d" else OrderedDict()
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise NotPlain("malformed plain data: dict item")
            try:
                result[from_wire(pair[0], depth + 1)] = from_wire(pair[1], depth + 1)
            except TypeError as exc:
                raise NotPlain(f"malformed plain data: {exc}") from None
        return result
    if tag == "b" and type(body) is str:
        try:
            return bytes.fromhex(body)
        except ValueError:
            raise NotPlain("malformed plain data: bytes") from None
    if tag == "i" and type(body) is str:
        try:
            return int(body, 16)
        except ValueError:
            raise NotPlain("malformed plain data: int") from None
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
        return complex(body[0], body[1])
    raise NotPlain(f"malformed plain data: tag {str(tag)[:20]!r}")
