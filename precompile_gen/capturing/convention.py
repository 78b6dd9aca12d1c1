"""The calling convention, as capture and ``inspect`` apply it.

How the graph's leading inputs are gathered from the module arguments (and their
hooks counted), how input leaves are named, how a gradient is reset and how a
namedtuple or dataclass type is imported and registered are defined once, as the
artifact's own code: in the runtime support's parts that read no metadata
(``render.CONVENTION_PARTS``), which artifacts carry as their capture needs them.
Here those parts are imported as the modules they are, and the functions below call
them, so capture, ``inspect`` and every artifact follow the same rules.
"""

from __future__ import annotations

from typing import Any

import torch

from precompile_gen.runtime_support import gradients, pytree_types, support


def named_members(
    modules: list[torch.nn.Module], kind: str
) -> list[tuple[str, torch.Tensor]]:
    """Each module's ``named_parameters`` or ``named_buffers`` (``kind``), aliases of
    tied tensors included, by the names the artifact gives them ("m0." prefixes with
    several module arguments)."""
    return support.named_members(modules, kind)


def module_state(
    modules: list[torch.nn.Module],
) -> tuple[list[torch.Tensor], list[str], int]:
    """The graph's leading inputs: the modules' parameters, then their buffers, each
    tensor once; their names (PARAM_NAMES + BUFFER_NAMES); how many are parameters."""
    return support.module_state(modules)


def module_hooks(module: torch.nn.Module) -> dict[str, dict[str, int]]:
    """How many hooks of each kind ``module`` and its submodules have, by module name
    ("" for ``module`` itself), for the modules that have any."""
    return support.module_hooks(module)


def global_module_hooks() -> dict[str, int]:
    """How many hooks of each kind are registered for every module."""
    return support.global_module_hooks()


def leaf_names(
    positions: list[int], names: list[str], arguments: tuple[object, ...]
) -> list[str]:
    """Each leaf of the non-module ``arguments`` (at ``positions`` in the call, which
    the traced function calls ``names``) named by where it sits, e.g.
    "argument 1 (`batch['x'][0]`)"."""
    return support.leaf_names(positions, names, arguments)


def argument(position: int, names: list[str], path: str = "") -> str:
    """How messages name the call's argument at ``position`` (or its part at
    ``path``): "argument 2 (`x`)", by the traced function's ``names``."""
    return support._argument(position, names, path)


def leaf_paths(tree: object) -> list[str]:
    """The path of each of ``tree``'s pytree leaves, as ``pytree.keystr`` writes it."""
    return support.leaf_paths(tree)


def reset_grad(param: torch.Tensor, set_to_none: bool) -> None:
    """What ``zero_grad(set_to_none)`` does to one parameter."""
    gradients.reset_grad(param, set_to_none)


def refused_side_message(where: str, side: bool, reason: str) -> str:
    """The message a graph's assertion gives where a call takes a side of the branch
    at ``where`` (its predicate ``side``) that capture refused for ``reason``; the
    driver raises it as a PrecompileError."""
    return support.refused_side_message(where, side, reason)


def import_pytree_type(path: str) -> Any:
    """The class at ``path`` ("module:qualname"), importing its module."""
    return pytree_types.import_pytree_type(path)


def register_pytree_type(cls: type, path: str) -> None:
    """Have tree specs name ``cls``, a namedtuple or dataclass, by ``path``, and
    pytree open a dataclass into its init fields (unless registered already)."""
    pytree_types.register_pytree_type(cls, path)


def python_value_holder(
    arguments: tuple[object, ...], path: str
) -> tuple[object, str, object] | None:
    """Where the value at ``path`` (PYTHON_VALUES' syntax) sits in a call on
    ``arguments``: the object holding it, and the attribute ("" for an item) or the
    item's key that reaches it; None where the path is not an argument's part or its
    holder is not there."""
    head, _, accessors = path.partition(": ")
    steps = list(support._PATH_STEP.finditer(accessors))
    if not head.startswith("argument ") or not steps:
        return None
    last = steps[-1]
    holder = support._python_value(
        arguments, f"{head}: {accessors[: last.start()]}", None
    )
    if holder is support._ABSENT or holder is support._UNCHECKED:
        return None
    attribute, key = last.groups()
    if attribute:
        return holder, attribute, None
    return holder, "", int(key) if key[0] != "'" else key[1:-1]
