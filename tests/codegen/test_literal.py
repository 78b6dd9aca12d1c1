"""The ``literal`` filter: the one place metadata values become Python source.

Whatever it emits must read back with ``ast.literal_eval`` as the same value, with
the same types, and equal values must render to the same text, because the artifact
is pinned byte for byte and ``parse_metadata`` reads it without executing anything.
"""

from __future__ import annotations

import ast
import collections
import enum
import math
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from precompile_gen.codegen.layout import literal


def typed(value: object) -> object:
    """A comparable form that keeps what ``==`` forgets: ``True`` is not ``1``, a
    tuple is not a list and ``-0.0`` is not ``0.0``."""
    if isinstance(value, dict):
        pairs = [(typed(k), typed(v)) for k, v in value.items()]
        return ("dict", sorted(pairs, key=repr))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [typed(v) for v in value])
    if isinstance(value, float):
        return ("float", repr(value))
    return (type(value).__name__, value)


def assert_round_trips(value: object) -> None:
    text = literal(value)
    back = ast.literal_eval(text)
    assert back == value
    assert typed(back) == typed(value), text
    # Rendering what was read back gives the same text: the form is canonical.
    assert literal(back) == text


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -7,
        2**70,
        0.1,
        -2.5,
        1e300,
        5e-324,
        "",
        "plain",
        "it's",
        'say "hi"',
        "both ' and \"",
        "back\\slash",
        "line\nbreak\r\ttab",
        "unicode: \u00e9\u4e2d\U0001f600",
        "\x00 nul and \x7f del",
        b"",
        b"\x00\xff'\"",
        [],
        [1, "a", None],
        (),
        (1,),
        ("only",),
        (1, 2),
        {},
        {"b": 1, "a": 2},
        {0: (1, 64), 2: (None, 8)},
        [(4, 4), (None, 4), ()],
        {"outer": [{"inner": (1, [2, (3,)])}], "x": {b"k": None}},
    ],
    ids=repr,
)
def test_round_trip(value: object) -> None:
    assert_round_trips(value)


def test_negative_zero_keeps_its_sign() -> None:
    back = ast.literal_eval(literal(-0.0))
    assert back == 0.0
    assert math.copysign(1.0, back) == -1.0


def test_one_tuple_and_empty_tuple_stay_tuples() -> None:
    assert literal((1,)) == "(1,)"
    assert literal(()) == "()"
    assert literal(((),)) == "((),)"
    assert ast.literal_eval(literal([(5,)])) == [(5,)]


def test_bool_is_not_rendered_as_int() -> None:
    assert literal(True) == "True"
    assert literal([False, 0]) == "[False, 0]"


def test_dict_keys_are_sorted() -> None:
    assert literal({"b": 1, "a": 2, "c": 3}) == "{'a': 2, 'b': 1, 'c': 3}"
    assert literal({3: None, 1: None, 2: None}) == "{1: None, 2: None, 3: None}"


def test_dict_rendering_ignores_insertion_order() -> None:
    forward = {"x": 1, 2: "two", None: [], b"k": (1,), 1.5: {"z": 0, "y": 1}}
    backward = dict(reversed(list(forward.items())))
    backward[1.5] = {"y": 1, "z": 0}
    assert list(forward) != list(backward)
    assert literal(forward) == literal(backward)
    assert_round_trips(forward)


def test_dict_with_tuple_keys_of_mixed_element_types_renders() -> None:
    # Plain, hashable data: it has a literal form, and equal dicts must render
    # identically however they were built.
    value = {(1, "a"): 0, (1, 2): 1, (None,): 2}
    assert_round_trips(value)
    assert literal(dict(reversed(list(value.items())))) == literal(value)


class Color(enum.IntEnum):
    RED = 1


class Point(NamedTuple):
    x: int
    y: int


class MyStr(str):
    pass


class MyList(list[int]):
    pass


class MyFloat(float):
    pass


@pytest.mark.parametrize(
    "value",
    [
        torch.Size([2, 3]),
        Color.RED,
        Point(1, 2),
        MyStr("text"),
        MyList([1, 2]),
        MyFloat(1.5),
        np.float64(1.5),
        np.int64(3),
        np.array([1, 2]),
        collections.OrderedDict(a=1),
        collections.defaultdict(int, a=1),
        torch.tensor(1.0),
        torch.float32,
        torch.device("cpu"),
        {1, 2},
        frozenset({1}),
        1 + 2j,
        bytearray(b"x"),
        object(),
        float("inf"),
        float("-inf"),
        float("nan"),
    ],
    # An object's repr holds its address, which differs between processes.
    ids=lambda v: type(v).__name__ + ("" if type(v) is object else ":" + repr(v)[:30]),
)
def test_rejects_non_plain_values(value: object) -> None:
    with pytest.raises(TypeError):
        literal(value)


@pytest.mark.parametrize(
    "value",
    [
        [1, torch.Size([2])],
        (1, (2, {3})),
        {"shape": torch.Size([4])},
        {torch.Size([4]): 1},
        {"bounds": {0: (1, float("nan"))}},
        [float("inf")],
        [Color.RED],
    ],
    ids=repr,
)
def test_rejects_non_plain_values_nested_anywhere(value: object) -> None:
    with pytest.raises(TypeError):
        literal(value)


def test_rejection_names_the_offending_type() -> None:
    with pytest.raises(TypeError, match="Size"):
        literal([(2, 3), torch.Size([2, 3])])


_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.binary()
)
_keys = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.binary()
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (
        st.lists(children, max_size=5)
        | st.lists(children, max_size=5).map(tuple)
        | st.dictionaries(_keys, children, max_size=5)
    )


plain_data = st.recursive(_scalars, _containers, max_leaves=25)


def reverse_insertion_order(value: object) -> object:
    if isinstance(value, dict):
        items = list(value.items())[::-1]
        return {k: reverse_insertion_order(v) for k, v in items}
    if isinstance(value, list):
        return [reverse_insertion_order(v) for v in value]
    if isinstance(value, tuple):
        return tuple(reverse_insertion_order(v) for v in value)
    return value


@given(plain_data)
def test_round_trip_property(value: object) -> None:
    assert_round_trips(value)


@given(plain_data)
def test_equal_data_renders_identically_property(value: object) -> None:
    assert literal(reverse_insertion_order(value)) == literal(value)
