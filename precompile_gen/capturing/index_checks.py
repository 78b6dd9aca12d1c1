"""The indices a call passes, checked before the graph runs.

An index out of range is a value error no shape, dtype or device check sees. Eager
ATen raises ``IndexError`` on it; a compiled kernel asserts in its loop, and where
that loop runs in parallel threads the C++ exception cannot reach Python and the
process aborts. Either way the graph has run part of its ops by then, and those that
write the model, its buffers or the optimizer's state may have done so.

So capture finds each op that can refuse an index (``FALLIBLE``) whose index the
graph computes from user-input leaves alone: a leaf itself, or a few functional
integer ops on leaves (views, slices, ``ids + 1``, ``labels.masked_fill(mask, -100)``).
It records an ``IndexCheck``: those ops as a recipe the driver replays with ATen, and
the range eager enforces. The driver runs every check before anything else runs.

An index computed from the model's weights or activations, or through floating-point
ops, has no such check; on the eager backend ``update_order`` keeps each write of a
graph input after the op that refuses it, so that its ``IndexError`` still leaves
the inputs untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from precompile_gen.capture_result import IndexCheck, IndexStep

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

# Ops that pass their argument's values on unchanged, and those that only rearrange
# them: a recipe need not end in one of those, whose values the check reads anyway.
_IDENTITY = {
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
}
_REARRANGING = {
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
}
# A view of the graph's own contiguous copy is replayed as a reshape of the leaf.
_VIEWS = {aten.view.default, aten._unsafe_view.default}
# A longer computation is the graph's to check.
_MAX_STEPS = 12
_NOT_REPLAYABLE = object()


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
    gm: torch.fx.GraphModule, state_names: list[str], num_leaves: int
) -> list[IndexCheck]:
    """The checks of every index the graph computes from user-input leaves alone,
    the graph's inputs being the module state (``state_names``), then the leaves."""
    num_state = len(state_names)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {node: i for i, node in enumerate(placeholders)}
    # By their text: a step's keywords are a dict, which does not hash.
    checks: dict[str, IndexCheck] = {}
    for node in gm.graph.nodes:
        for index, low, high, allowed, what in index_uses(node):
            recipe = _Recipe(position, num_state, num_leaves)
            if not recipe.make(index):
                continue
            owner = _state_name(node.args[0], position, num_state, state_names)
            if owner is not None:
                what = f"{what} of the model's {owner!r}"
            check = IndexCheck(
                tuple(sorted(recipe.sources)),
                tuple(recipe.steps),
                low,
                high,
                allowed,
                what,
            )
            checks.setdefault(repr(check), check)
    return list(checks.values())


def _state_name(
    node: object,
    position: dict[torch.fx.Node, int],
    num_state: int,
    state_names: list[str],
) -> str | None:
    at = position.get(node) if isinstance(node, torch.fx.Node) else None
    return state_names[at] if at is not None and at < num_state else None


class _Recipe:
    """How the driver computes an index from the input leaves: the graph's own ops,
    each an ``IndexStep``, whose arguments refer to a leaf (``{"leaf": k}``) or an
    earlier step's result (``{"step": j}``)."""

    def __init__(
        self, position: dict[torch.fx.Node, int], num_state: int, num_leaves: int
    ) -> None:
        self.position, self.num_state, self.num_leaves = position, num_state, num_leaves
        self.sources: list[int] = []
        self.steps: list[IndexStep] = []
        self.references: dict[torch.fx.Node, dict[str, int]] = {}

    def make(self, index: torch.fx.Node) -> bool:
        """Whether ``index`` is computed from input leaves alone, by few functional
        integer ops; the recipe then ends with it."""
        if self.reference(index) is None:
            return False
        # The last ops only rearranging what the check reads are left out.
        while self.steps and self.steps[-1][0] in _REARRANGING_NAMES:
            source = self.steps.pop()[1][0]
            if isinstance(source, dict) and "leaf" in source:
                self.steps.clear()
        return len(self.steps) <= _MAX_STEPS and (
            bool(self.steps) or len(self.sources) == 1
        )

    def reference(self, node: torch.fx.Node) -> dict[str, int] | None:
        if node in self.references:
            return self.references[node]
        if node.op == "placeholder":
            leaf = self.position[node] - self.num_state
            if not 0 <= leaf < self.num_leaves:
                return None
            self.sources.append(leaf)
            reference = {"leaf": leaf}
        elif node.op == "call_function" and node.target in _IDENTITY:
            source = node.args[0]
            found = (
                self.reference(source) if isinstance(source, torch.fx.Node) else None
            )
            if found is None:
                return None
            reference = found
        else:
            step = self.step(node)
            if step is None:
                return None
            self.steps.append(step)
            reference = {"step": len(self.steps) - 1}
        self.references[node] = reference
        return reference

    def step(self, node: torch.fx.Node) -> IndexStep | None:
        if not _replayable(node) or len(self.steps) >= _MAX_STEPS:
            return None
        target = node.target
        arguments = tuple(self.argument(a) for a in node.args)
        keywords = {name: self.argument(a) for name, a in node.kwargs.items()}
        if any(a is _NOT_REPLAYABLE for a in [*arguments, *keywords.values()]):
            return None
        name = "reshape.default" if target in _VIEWS else _qualified(target)
        return (name, arguments, keywords)

    def argument(self, value: object) -> object:
        """An op's argument as the recipe writes it: a reference, a literal, or
        _NOT_REPLAYABLE (a symbolic size, a device)."""
        if isinstance(value, torch.fx.Node):
            found = self.reference(value)
            return _NOT_REPLAYABLE if found is None else found
        if isinstance(value, (list, tuple)):
            items = tuple(self.argument(v) for v in value)
            return _NOT_REPLAYABLE if _NOT_REPLAYABLE in items else items
        if value is None or type(value) in (int, float, bool, str):
            return value
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        return _NOT_REPLAYABLE


def _replayable(node: torch.fx.Node) -> bool:
    """A functional op, drawing nothing at random and refusing no index, with one
    integer or boolean tensor as its result: cheap, and safe to run twice."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    value = node.meta.get("val")
    return (
        target not in FALLIBLE
        and torch.Tag.nondeterministic_seeded not in target.tags
        and not any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
        )
        and len(target._schema.returns) == 1
        and isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and not value.is_complex()
    )


def _qualified(target: object) -> str:
    # "slice.Tensor": the aten op and overload the driver looks up.
    assert isinstance(target, torch._ops.OpOverload)
    return f"{target.overloadpacket.__name__}.{target._overloadname}"


_REARRANGING_NAMES = {_qualified(op) for op in _REARRANGING} | {"reshape.default"}
