"""Tensor literals: the tensors fn builds from Python data (``torch.tensor(-100.0)``),
lifted out of the graph into inputs that the artifact feeds from literals.
"""

from __future__ import annotations

import inspect
import types
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

from precompile_gen.capturing import convention
from precompile_gen.runtime.errors import PrecompileError

# How many elements a tensor literal may have to be kept in the artifact as text.
MAX_CONSTANT_ELEMENTS = 4096
# make_fx records ``torch.tensor(data)`` as a constant that one of these copies into
# the graph: the mark of a tensor fn created from Python data, rather than one that
# existed before fn ran (which make_fx reads directly).
FRESH_TENSOR_OPS = (
    torch.ops.aten.lift_fresh_copy.default,
    torch.ops.aten.lift_fresh.default,
)
# The dtypes whose values ``tolist()`` gives as Python bools, ints and floats.
_LITERAL_DTYPES = frozenset(
    (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
)


def lift_constants(
    gm: torch.fx.GraphModule,
    fn: Callable[..., object],
    modules: list[torch.nn.Module],
    module_positions: list[int],
    arguments: list[str],
) -> list[tuple[str, torch.Tensor]]:
    """Turn each tensor literal fn created (``torch.tensor(-100.0)``) into a graph
    input after the user-input leaves, which the artifact feeds from a literal; reject
    every other tensor the graph reads that is neither an input nor computed: it
    existed before fn ran, may change between calls, and would be baked in."""
    origins = _tensor_origins(fn, modules, module_positions, arguments)
    literals: list[tuple[torch.fx.Node, torch.Tensor]] = []
    rejected: dict[int, str] = {}  # each tensor once, however many nodes read it
    for node in gm.graph.find_nodes(op="get_attr"):
        tensor = getattr(gm, str(node.target))
        if not isinstance(tensor, torch.Tensor):
            continue
        fresh = bool(node.users) and all(
            user.target in FRESH_TENSOR_OPS for user in node.users
        )
        problem = _literal_problem(tensor) if fresh else None
        if fresh and id(tensor) not in origins and problem is None:
            literals.append((node, tensor))
            continue
        where = origins.get(
            id(tensor),
            "a tensor created inside the function from Python data, e.g. "
            f"torch.tensor([...]), {problem}"
            if fresh
            else "a tensor that existed before the function ran (e.g. one held by "
            "a library or a closure)",
        )
        rejected[id(tensor)] = f"{where} (shape {tuple(tensor.shape)}, {tensor.dtype})"
    if rejected:
        # Alike tensors once, counted: a library's state is often several of them.
        counted = [
            text if count == 1 else f"{count} x {text}"
            for text, count in Counter(rejected.values()).items()
        ]
        raise PrecompileError(
            "the function reads tensors that are neither inputs nor computed from "
            "inputs, so they would be baked into the artifact as constants: "
            + "; ".join(counted)
            + ". Pass each one as an argument: register module state with "
            "register_buffer / nn.Parameter, and pass large literals in as inputs; "
            "or use the object that holds it outside the function."
        )
    return _as_graph_inputs(gm, literals)


def _literal_problem(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be written into the artifact as a literal, or None."""
    if tensor.numel() > MAX_CONSTANT_ELEMENTS:
        return (
            f"with {tensor.numel()} elements, more than the {MAX_CONSTANT_ELEMENTS} "
            "the artifact keeps as a readable literal"
        )
    if tensor.dtype not in _LITERAL_DTYPES:
        return f"of dtype {tensor.dtype}, which has no Python literal"
    if torch.tensor(tensor.tolist()).shape != tensor.shape:
        return f"of shape {tuple(tensor.shape)}, which a nested list cannot express"
    return None


def _as_graph_inputs(
    gm: torch.fx.GraphModule, literals: list[tuple[torch.fx.Node, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """Replace each literal's ``get_attr`` with a placeholder after the others."""
    if not literals:
        return []
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    lifted = []
    # Each insertion lands right after the last placeholder, so insert in reverse.
    with graph.inserting_after(placeholders[-1]):
        for index, (node, tensor) in reversed(list(enumerate(literals))):
            placeholder = graph.placeholder(f"literal{index}")
            node.replace_all_uses_with(placeholder)
            graph.erase_node(node)
            delattr(gm, str(node.target))
            lifted.append((placeholder.name, tensor.detach()))
    lifted.reverse()
    unpack_inputs(gm, len(placeholders) + len(lifted))
    return lifted


def unpack_inputs(gm: torch.fx.GraphModule, count: int) -> None:
    """After placeholders were added or removed: make_fx's code takes one list
    argument and unpacks it by its in_spec, which must say ``count`` inputs."""
    codegen = cast(Any, gm.graph._codegen)
    flat = [0] * count
    codegen.pytree_info = codegen.pytree_info._replace(
        in_spec=pytree.tree_structure((flat,))
    )
    gm.recompile()


def _held_tensors(value: object, holder: str, origins: dict[int, str]) -> None:
    """The tensors an object the function uses holds as attributes of its own (a
    GradScaler's scale, a statistic a helper keeps), into ``origins``."""
    if isinstance(value, torch.nn.Module | types.ModuleType | type):
        return  # a module argument's are named below; a module's or class's are code
    for attribute, held in getattr(value, "__dict__", {}).items():
        if isinstance(held, torch.Tensor):
            origins.setdefault(
                id(held),
                f"the attribute {attribute!r} of {holder} (a {type(value).__name__})",
            )


def _tensor_origins(
    fn: Callable[..., object],
    modules: list[torch.nn.Module],
    module_positions: list[int],
    arguments: list[str],
) -> dict[int, str]:
    """Where a closed-over tensor could come from, by identity."""
    origins: dict[int, str] = {}
    try:
        closure = inspect.getclosurevars(fn)
        scopes = {"global": closure.globals, "closed-over variable": closure.nonlocals}
    except TypeError:  # builtins and callable objects have no code to inspect
        scopes = {}
    for scope, variables in scopes.items():
        for name, value in variables.items():
            if isinstance(value, torch.Tensor):
                origins[id(value)] = f"the {scope} {name!r}"
            else:
                _held_tensors(value, f"the {scope} {name!r}", origins)
    for position, module in zip(module_positions, modules, strict=True):
        for path, submodule in module.named_modules():
            registered = {**submodule._parameters, **submodule._buffers}
            for name, value in vars(submodule).items():
                if isinstance(value, torch.Tensor) and name not in registered:
                    qualified = f"{path}.{name}" if path else name
                    origins[id(value)] = (
                        f"the plain attribute {qualified!r} of the module at "
                        f"{convention.argument(position, arguments)} (not a "
                        "registered parameter or buffer)"
                    )
    return origins
