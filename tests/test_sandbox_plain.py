"""Plain data across the sandbox boundary (``rlbench/sandbox/plain.py``): exact round trips, and
everything that is not exact plain data refused."""

from __future__ import annotations

import json
import math

import pytest

from rlbench.sandbox.plain import MAX_DEPTH, NotPlain, from_wire, to_wire

VALUES = [
    None, True, False, 0, -7, 3 ** 200, -(2 ** 64), 2 ** 64 - 1, 1.5, -0.0, float("inf"), "", "héllo\udc80",
    b"\x00\xff", 2 - 3j, [], (), {}, set(), frozenset(),
    [1, (2, [3, {4: "x", (5, 6): frozenset({7})}]), {8.5, None}, b"", True],
]  # fmt: skip


def through_json(value):
    return from_wire(json.loads(json.dumps(to_wire(value))))


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_plain_values_cross_exactly(value):
    back = through_json(value)
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)  # nested types too (a tuple stays a tuple, -0.0 stays -0.0)


def test_nan_crosses():
    assert math.isnan(through_json(float("nan")))


class AlwaysEqual:
    def __eq__(self, other):
        return True


class Int(int):
    def __eq__(self, other):
        return True


class Str(str):
    pass


class Dict(dict):
    pass


@pytest.mark.parametrize(
    "value", [AlwaysEqual(), Int(3), Str("a"), Dict(), [1, Int(2)], {"k": Str("v")}, (x for x in ()), print, object]
)
def test_anything_else_is_refused(value):
    with pytest.raises(NotPlain):
        to_wire(value)


def test_depth_is_bounded():
    deep = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(NotPlain, match="deeper"):
        to_wire(deep)


@pytest.mark.parametrize(
    "data",
    [{"x": []}, {"l": [], "t": []}, {"l": "abc"}, {"s": [{"l": []}]}, {"d": [[{"l": []}, 1]]}, {"d": [[1]]},
     {"b": "zz"}, {"c": [1, 2]}, {"i": "not hex"}, [1, 2]],
)  # fmt: skip
def test_malformed_wire_data_is_refused(data):
    with pytest.raises(NotPlain):
        from_wire(data)


def test_an_ordered_dict_crosses_as_itself_in_order():
    """Its equality depends on order: as a plain dict, ``OrderedDict(b=1, a=2)`` would equal
    ``OrderedDict(a=2, b=1)``."""
    from collections import OrderedDict

    value = OrderedDict([("b", 1), ("a", [OrderedDict([(2, None), (1, None)])])])
    back = through_json(value)
    assert type(back) is OrderedDict and list(back) == ["b", "a"] and back == value
    assert type(back["a"][0]) is OrderedDict and list(back["a"][0]) == [2, 1]
    assert back != OrderedDict([("a", value["a"]), ("b", 1)])
