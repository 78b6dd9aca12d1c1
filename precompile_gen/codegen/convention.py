"""The calling convention, as capture and ``inspect`` apply it.

How the graph's leading inputs are gathered from the module arguments (and their
hooks counted), how input leaves are named, how a gradient is reset and how a
namedtuple or dataclass type is imported and registered are defined once, as the
artifact's own code: in the runtime support's parts that read no metadata
(``render.CONVENTION_PARTS``), which artifacts carry as their capture needs them.
Here those parts are executed once, and the functions below call them, so capture,
``inspect`` and every artifact follow the same rules.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _driver_code() -> dict[str, Any]:
    from precompile_gen.codegen.render import CONVENTION_PARTS, runtime_support

    namespace: dict[str, Any] = {"__name__": "precompile_gen_convention"}
    text = runtime_support(CONVENTION_PARTS)
    exec(compile(text, "<templates/runtime>", "exec"), namespace)
    return namespace


def named_members(
    modules: list[torch.nn.Module], kind: str
) -> list[tuple[str, torch.Tensor]]:
    """Each module's ``named_parameters`` or ``named_buffers`` (``kind``), aliases of
    tied tensors included, by the names the artifact gives them ("m0." prefixes with
    several module arguments)."""
    return _driver_code()["named_members"](modules, kind)


def module_state(
    modules: list[torch.nn.Module],
) -> tuple[list[torch.Tensor], list[str], int]:
    """The graph's leading inputs: the modules' parameters, then their buffers, each
    tensor once; their names (PARAM_NAMES + BUFFER_NAMES); how many are parameters."""
    return _driver_code()["module_state"](modules)


def module_hooks(module: torch.nn.Module) -> dict[str, dict[str, int]]:
    """How many hooks of each kind ``module`` and its submodules have, by module name
    ("" for ``module`` itself), for the modules that have any."""
    return _driver_code()["module_hooks"](module)


def global_module_hooks() -> dict[str, int]:
    """How many hooks of each kind are registered for every module."""
    return _driver_code()["global_module_hooks"]()


def leaf_names(
    positions: list[int], names: list[str], arguments: tuple[object, ...]
) -> list[str]:
    """Each leaf of the non-module ``arguments`` (at ``positions`` in the call, which
    the traced function calls ``names``) named by where it sits, e.g.
    "argument 1 (`batch['x'][0]`)"."""
    return _driver_code()["leaf_names"](positions, names, arguments)


def argument(position: int, names: list[str], path: str = "") -> str:
    """How messages name the call's argument at ``position`` (or its part at
    ``path``): "argument 2 (`x`)", by the traced function's ``names``."""
    return _driver_code()["_argument"](position, names, path)


def leaf_paths(tree: object) -> list[str]:
    """The path of each of ``tree``'s pytree leaves, as ``pytree.keystr`` writes it."""
    return _driver_code()["leaf_paths"](tree)


def reset_grad(param: torch.Tensor, set_to_none: bool) -> None:
    """What ``zero_grad(set_to_none)`` does to one parameter."""
    _driver_code()["reset_grad"](param, set_to_none)


def refused_side_message(where: str, side: bool, reason: str) -> str:
    """The message a graph's assertion gives where a call takes a side of the branch
    at ``where`` (its predicate ``side``) that capture refused for ``reason``; the
    driver raises it as a PrecompileError."""
    return _driver_code()["refused_side_message"](where, side, reason)


def import_pytree_type(path: str) -> Any:
    """The class at ``path`` ("module:qualname"), importing its module."""
    return _driver_code()["import_pytree_type"](path)


def register_pytree_type(cls: type, path: str) -> None:
    """Have tree specs name ``cls``, a namedtuple or dataclass, by ``path``, and
    pytree open a dataclass into its init fields (unless registered already)."""
    _driver_code()["register_pytree_type"](cls, path)


def python_value_holder(
    arguments: tuple[object, ...], path: str
) -> tuple[object, str, object] | None:
    """Where the value at ``path`` (PYTHON_VALUES' syntax) sits in a call on
    ``arguments``: the object holding it, and the attribute ("" for an item) or the
    item's key that reaches it; None where the path is not an argument's part or its
    holder is not there."""
    code = _driver_code()
    head, _, accessors = path.partition(": ")
    steps = list(code["_PATH_STEP"].finditer(accessors))
    if not head.startswith("argument ") or not steps:
        return None
    last = steps[-1]
    holder = code["_python_value"](
        arguments, f"{head}: {accessors[: last.start()]}", None
    )
    if holder is code["_ABSENT"] or holder is code["_UNCHECKED"]:
        return None
    attribute, key = last.groups()
    if attribute:
        return holder, attribute, None
    return holder, "", int(key) if key[0] != "'" else key[1:-1]
