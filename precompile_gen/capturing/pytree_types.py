"""Namedtuples and dataclasses among a function's inputs and in its result.

The artifact names such a type in IN_SPEC and OUT_SPEC by its import path
("module:qualname") and imports it when loaded, so that a call takes and returns the
same types as the function. torch's pytree opens a namedtuple but not a dataclass:
capture registers each dataclass it meets as a pytree node of its init fields (as
``torch.export.register_dataclass`` does), and the artifact does the same when loaded.
A type the artifact could not import by its path (one defined inside a function) is
refused, except a namedtuple input, which leaves IN_SPEC unrecorded as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from precompile_gen.capturing import convention
from precompile_gen.runtime.errors import PrecompileError


def record(
    tree: object, where: Callable[[str], str], *, result: bool = False
) -> list[str]:
    """Register each namedtuple and dataclass type in ``tree`` (an input, or the
    function's ``result``; ``where`` names its part at a pytree path) under its import
    path; return the paths of those registered so, for the artifact to register them
    when loaded."""
    paths: list[str] = []
    _visit(tree, where, "", result, paths)
    return paths


def _visit(
    tree: object,
    where: Callable[[str], str],
    keys: str,
    result: bool,
    paths: list[str],
) -> None:
    kind, cls = _kind(tree), type(tree)
    if kind is not None:
        path = f"{cls.__module__}:{cls.__qualname__}"
        # A type registered already (by its library, or by an earlier capture) is
        # left as it is; it is recorded if specs name it by its path.
        registered = (
            pytree.SUPPORTED_NODES
            if kind == "dataclass"
            else pytree.SUPPORTED_SERIALIZED_TYPES
        )
        if cls not in registered and _importable(cls, path, kind, where(keys), result):
            convention.register_pytree_type(cls, path)
        if _serialized_name(cls) == path and path not in paths:
            paths.append(path)
    if pytree.tree_is_leaf(tree):
        return
    node = pytree.SUPPORTED_NODES[pytree._get_node_type(tree)]
    keyed: list[tuple[Any, object]]
    if node.flatten_with_keys_fn is not None:
        keyed = node.flatten_with_keys_fn(tree)[0]
    else:
        children = node.flatten_fn(tree)[0]
        keyed = [(pytree.SequenceKey(i), child) for i, child in enumerate(children)]
    for key, child in keyed:
        _visit(child, where, keys + pytree.keystr((key,)), result, paths)


def _kind(value: object) -> str | None:
    if pytree.is_namedtuple_instance(value):
        return "namedtuple"
    if (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and not isinstance(value, torch.Tensor | torch.nn.Module)
    ):
        return "dataclass"
    return None


def _serialized_name(cls: type) -> str | None:
    serialized = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
    return None if serialized is None else serialized.serialized_type_name


def _importable(cls: type, path: str, kind: str, where: str, result: bool) -> bool:
    """Whether the artifact can import ``cls`` by ``path``; a result type or a
    dataclass it cannot is refused, a namedtuple input is not (its structure then
    goes unchecked)."""
    try:
        if convention.import_pytree_type(path) is cls:
            return True
    except (ImportError, AttributeError):
        pass
    if kind == "namedtuple" and not result:
        return False
    inside = "<locals>" in cls.__qualname__
    why = (
        "it is defined inside a function, so it has no import path"
        if inside
        else f"{path} does not import it here (no such module, no such attribute "
        "in it, or another object under that name)"
    )
    raise PrecompileError(
        f"{where} is a {kind} of type {cls.__qualname__!r}, which the artifact must "
        f"import by its path (module:qualname) to rebuild, but {why}. Define "
        f"{cls.__name__} at module level, in the script or a module the loading "
        "process imports, under its own name; or use a tuple or a dict instead."
    )
