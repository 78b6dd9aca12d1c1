"""The indices a call passes, checked before the graph runs.

An index out of range is a value error no shape, dtype or device check sees. Eager
ATen raises ``IndexError`` on it; a compiled kernel asserts in its loop, and where
that loop runs in parallel threads the C++ exception cannot reach Python and the
process aborts. Either way the graph has run part of its ops by then, and those that
write the model, its buffers or the optimizer's state may have done so.

So capture finds each op that can refuse an index (``FALLIBLE``) whose index tensor
is a user-input leaf, or comes from one through views, slices and selects, and
records an ``IndexCheck``: the leaf, those ops (applied at call time, so that only
the values the graph indexes with are held to the range) and the range eager
enforces. The driver runs every check before anything else runs.

An index the graph computes (``ids + 1``, ``labels.masked_fill(...)``) has no such
check; on the eager backend ``update_order`` keeps each write of a graph input
after such an op, so that its ``IndexError`` still leaves the inputs untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from precompile_gen.capture_result import IndexCheck

aten = torch.ops.aten

# (index node, low, high, value allowed besides, what the op indexes): eager raises
# unless low <= index < high, or index == the allowed value.
IndexUse = tuple[torch.fx.Node, int, int, int | None, str]


def _size(node: object, dim: int) -> object:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    return value.shape[dim]


def _along(name: str, tensor_at: int, dim_at: int, index_at: int) -> Callable:
    """An op indexing its argument ``tensor_at`` along ``dim_at`` with ``index_at``,
    which must lie in [0, size)."""

    def uses(node: torch.fx.Node) -> list[tuple[object, object, object, None, str]]:
        dim = node.args[dim_at]
        tensor = node.args[tensor_at]
        if not isinstance(dim, int):
            return []
        return [(node.args[index_at], 0, _size(tensor, dim), None, f"{name} dim {dim}")]

    return uses


def _embedding(node: torch.fx.Node) -> list[tuple[object, object, object, None, str]]:
    weight, indices = node.args[0], node.args[1]
    return [(indices, 0, _size(weight, 0), None, "embedding rows")]


def _nll_loss(node: torch.fx.Node) -> list[tuple[object, object, object, object, str]]:
    scores, target = node.args[0], node.args[1]
    ignore_index = node.args[4] if len(node.args) > 4 else -100
    value = scores.meta.get("val") if isinstance(scores, torch.fx.Node) else None
    classes = None
    if isinstance(value, torch.Tensor):
        classes = value.shape[0 if value.dim() == 1 else 1]
    return [(target, 0, classes, ignore_index, "loss classes")]


def _advanced(node: torch.fx.Node) -> list[tuple[object, object, object, None, str]]:
    # tensor[indices]: the k-th index addresses dim k while every index before it
    # addressed one dim (a None or an integer tensor); a boolean mask takes several.
    tensor, indices = node.args[0], node.args[1]
    uses: list[tuple[object, object, object, None, str]] = []
    for dim, index in enumerate(_items(indices)):
        if index is None:
            continue
        value = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype in (
            torch.bool,
            torch.uint8,
        ):
            break
        size = _size(tensor, dim)
        low = -size if isinstance(size, int) else None
        uses.append((index, low, size, None, f"indexing dim {dim}"))
    return uses


def _take(node: torch.fx.Node) -> list[tuple[object, object, object, None, str]]:
    tensor = node.args[0]
    value = tensor.meta.get("val") if isinstance(tensor, torch.fx.Node) else None
    numel = value.numel() if isinstance(value, torch.Tensor) else None
    low = -numel if isinstance(numel, int) else None
    return [(node.args[1], low, numel, None, "take elements")]


def _one_hot(node: torch.fx.Node) -> list[tuple[object, object, object, None, str]]:
    classes = node.args[1] if len(node.args) > 1 else -1
    if not isinstance(classes, int) or classes < 0:
        return []
    return [(node.args[0], 0, classes, None, "one_hot classes")]


def _items(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else []


# The ops eager refuses an index of, and where each reads its index and the range.
FALLIBLE: dict[object, Callable[[torch.fx.Node], list]] = {
    aten.embedding.default: _embedding,
    aten.index_select.default: _along("index_select", 0, 1, 2),
    aten.gather.default: _along("gather", 0, 1, 2),
    aten.scatter.src: _along("scatter", 0, 1, 2),
    aten.scatter.value: _along("scatter", 0, 1, 2),
    aten.scatter_.src: _along("scatter", 0, 1, 2),
    aten.scatter_.value: _along("scatter", 0, 1, 2),
    aten.scatter_add.default: _along("scatter_add", 0, 1, 2),
    aten.scatter_add_.default: _along("scatter_add", 0, 1, 2),
    aten.scatter_reduce.two: _along("scatter_reduce", 0, 1, 2),
    aten.index_add.default: _along("index_add", 0, 1, 2),
    aten.index_copy.default: _along("index_copy", 0, 1, 2),
    aten.index_fill.int_Scalar: _along("index_fill", 0, 1, 2),
    aten.index_fill.int_Tensor: _along("index_fill", 0, 1, 2),
    aten.index.Tensor: _advanced,
    aten.index_put.default: _advanced,
    aten.index_put_.default: _advanced,
    aten.take.default: _take,
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss2d_forward.default: _nll_loss,
    aten.one_hot.default: _one_hot,
}

# Ops between a leaf and an index that keep its values, each with the arguments the
# driver applies it with (after the tensor); those that change only the layout need
# not be applied at all.
_LAYOUT_ONLY = {
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
}
_REPLAYED = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.t.default,
    aten.permute.default,
    aten.transpose.int,
    aten.flatten.using_ints,
    aten.slice.Tensor,
    aten.select.int,
}
_VIEWS = {aten.view.default, aten._unsafe_view.default}
# Replayed ops that select some of the values: without one, a path only rearranges
# the leaf's values, and the check reads the leaf itself.
_SELECTING = {aten.slice.Tensor, aten.select.int}


def index_uses(node: torch.fx.Node) -> list[IndexUse]:
    """The indices ``node`` reads and the range eager holds each to; [] for an op
    that refuses no index, or whose range depends on a dynamic dim."""
    reader = FALLIBLE.get(node.target)
    if reader is None:
        return []
    return [
        (index, low, high, allowed, what)
        for index, low, high, allowed, what in reader(node)
        if isinstance(index, torch.fx.Node)
        and type(low) is int
        and type(high) is int
        and (allowed is None or type(allowed) is int)
    ]


def index_checks(
    gm: torch.fx.GraphModule, num_state: int, num_leaves: int, state_names: list[str]
) -> list[IndexCheck]:
    """The checks of every index the graph takes from a user-input leaf."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {node: i for i, node in enumerate(placeholders)}
    checks: dict[IndexCheck, None] = {}
    for node in gm.graph.nodes:
        for index, low, high, allowed, what in index_uses(node):
            found = _path_to_leaf(index, position, num_state, num_leaves)
            if found is None:
                continue
            leaf, path = found
            owner = _state_name(node.args[0], position, num_state, state_names)
            if owner is not None:
                what = f"{what} of the model's {owner!r}"
            checks[IndexCheck(leaf, path, low, high, allowed, what)] = None
    return list(checks)


def _state_name(
    node: object,
    position: dict[torch.fx.Node, int],
    num_state: int,
    state_names: list[str],
) -> str | None:
    at = position.get(node) if isinstance(node, torch.fx.Node) else None
    return state_names[at] if at is not None and at < num_state else None


def _path_to_leaf(
    index: torch.fx.Node,
    position: dict[torch.fx.Node, int],
    num_state: int,
    num_leaves: int,
) -> tuple[int, tuple[tuple[str, tuple[object, ...]], ...]] | None:
    """The leaf ``index`` comes from and the ops that make it, in the order the
    driver applies them; None where it is computed otherwise."""
    path: list[tuple[str, tuple[object, ...]]] = []
    node = index
    while node.op != "placeholder":
        target = node.target
        if node.op != "call_function" or (node.kwargs and target not in _LAYOUT_ONLY):
            return None
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            return None
        if target in _REPLAYED:
            arguments = tuple(_literal(a) for a in node.args[1:])
            if any(a is None for a in arguments):
                return None
            # A view of the graph's own contiguous copy is a reshape of the leaf.
            name = "reshape.default" if target in _VIEWS else _qualified(target)
            path.append((name, arguments))
        elif target not in _LAYOUT_ONLY:
            return None
        node = source
    leaf = position[node] - num_state
    if not 0 <= leaf < num_leaves:
        return None
    path.reverse()
    # The ops after the last selection only rearrange the values it selected.
    while path and path[-1][0] not in _SELECTING_NAMES:
        path.pop()
    return leaf, tuple(path)


def _literal(value: object) -> object:
    """An op's argument as the driver passes it: an int, or a tuple of ints; None for
    anything else (a symbolic size)."""
    if type(value) is int:
        return value
    if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
        return tuple(value)
    return None


def _qualified(target: object) -> str:
    # "slice.Tensor": the aten op and overload the driver looks up.
    assert isinstance(target, torch._ops.OpOverload)
    return f"{target.overloadpacket.__name__}.{target._overloadname}"


_SELECTING_NAMES = {_qualified(op) for op in _SELECTING}
