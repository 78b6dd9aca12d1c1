"""Run each parameter's update as soon as its gradient is final.

A traced training step records the optimizer's update after the whole backward, in
the order the optimizer visits its parameters: the first layer's parameters first,
whose gradients the backward finishes last. Run in that order, every gradient is
alive at once before the first update. ``hoist_updates`` moves the nodes from the
first write of a parameter onwards as early as their data and the writes they see
allow, so each update follows the backward op that finishes its gradient; where the
step leaves no gradient behind (``zero_grad(set_to_none=True)`` after ``step()``),
the gradient dies with its update, and the step never holds all of them.

Only the order changes: every node reads the tensors it read before, in the state
it saw them in. An op that writes a tensor still comes after every op that read or
wrote it (or a view of it) before it, and an op that reads a tensor still comes
after the last op that wrote it. Ops whose effects lie outside their tensors
(random draws, collectives, anything without an ATen schema) keep their place
relative to every op before them. And no write moves before an op that may refuse
its index (``index_checks.FALLIBLE``) for the first time, nor before an assertion
of the graph: should that op raise, the graph has written none of its inputs yet.
"""

from __future__ import annotations

import itertools
import operator

import torch

from precompile_gen.capturing import index_checks

# Batch norms whose schemas leave the running stats (arguments 3 and 4) unannotated,
# though they update them in training mode (argument 5).
_BATCH_NORMS = {
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten.batch_norm.default,
    torch.ops.aten._batch_norm_impl_index.default,
    torch.ops.aten.cudnn_batch_norm.default,
    torch.ops.aten.miopen_batch_norm.default,
}
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d", "c10d_functional", "_dtensor"}

# A node's place in the new order: prefix nodes keep (index,), a moved node gets
# its anchor's key plus its rank among the anchor's followers, so sorting the keys
# gives the anchor, then what follows it, then the anchor's next neighbour.
_Key = tuple[int, ...]


def writes_running_stats(
    target: torch._ops.OpOverload, index: int, values: list[object]
) -> bool:
    return target in _BATCH_NORMS and index in (3, 4) and values[5] is True


def written_inputs(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the graph inputs that an op's schema says it writes, directly or
    through a view of them."""
    storage = _storages(gm.graph)
    written = set().union(*(_written(node, storage) for node in gm.graph.nodes))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {i for i, node in enumerate(placeholders) if node in written}


def hoist_updates(gm: torch.fx.GraphModule, updated: set[int]) -> None:
    """Move the updates of the graph inputs at positions ``updated`` (parameters and
    optimizer state) as early as the graph allows; see the module's docstring."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    storage = _storages(gm.graph)
    targets = {storage[placeholders[i]] for i in updated if i < len(placeholders)}
    start = next(
        (i for i, n in enumerate(nodes) if targets & _written(n, storage)), None
    )
    if start is None:
        return
    keys: dict[torch.fx.Node, _Key] = {n: (i,) for i, n in enumerate(nodes[:start])}
    keys.update({n: () for n in placeholders})
    followers: dict[torch.fx.Node | None, int] = {}
    last_write: dict[torch.fx.Node, torch.fx.Node] = {}
    # Per memory: its last write, and its latest read or write in the new order.
    last_touch: dict[torch.fx.Node, torch.fx.Node] = {}
    latest: torch.fx.Node | None = nodes[start - 1] if start else None
    fallible = _fallible_ops(nodes)
    last_fallible: torch.fx.Node | None = None
    in_flight: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for index, node in enumerate(nodes):
        read = _read(node, storage, in_flight)
        written = _written(node, storage)
        if index >= start:
            anchor = _anchor(node, read, written, keys, last_write, last_touch, latest)
            if written and last_fallible is not None:
                anchor = max(
                    anchor or last_fallible, last_fallible, key=keys.__getitem__
                )
            rank = followers.get(anchor, 0)
            followers[anchor] = rank + 1
            keys[node] = (keys[anchor] if anchor is not None else (-1,)) + (rank,)
            if latest is None or keys[node] > keys[latest]:
                latest = node
        # Moved nodes can land before nodes that preceded them, so a memory's
        # latest touch in the new order is not always its last one in the old.
        for s in read | written:
            if s not in last_touch or keys[node] > keys[last_touch[s]]:
                last_touch[s] = node
        for s in written:
            last_write[s] = node
        if node in fallible:
            last_fallible = node
    _reorder(nodes, placeholders, sorted(nodes, key=keys.__getitem__))
    gm.graph.lint()
    gm.recompile()


def _fallible_ops(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The ops that may refuse an index no earlier op has checked against the same
    range (a gather's backward scatters with the index its forward checked), and
    the graph's own assertions (a refused side of a branch, a range check)."""
    checked: set[tuple[object, ...]] = set()
    fallible: set[torch.fx.Node] = set()
    for node in nodes:
        if node.target in _ASSERTIONS:
            fallible.add(node)
        for index, low, high, allowed, _ in index_checks.index_uses(node):
            if (index, low, high, allowed) not in checked:
                checked.add((index, low, high, allowed))
                fallible.add(node)
    return fallible


_ASSERTIONS = {torch.ops.aten._assert_async.msg, torch.ops.aten._assert_async.default}


def _reorder(
    nodes: list[torch.fx.Node],
    placeholders: list[torch.fx.Node],
    ordered: list[torch.fx.Node],
) -> None:
    """Move the graph's ``nodes`` into the order ``ordered``, after its
    placeholders."""
    if placeholders:
        placeholders[-1].append(ordered[0])
    elif ordered[0] is not nodes[0]:
        nodes[0].prepend(ordered[0])
    for previous, node in itertools.pairwise(ordered):
        previous.append(node)


def _anchor(
    node: torch.fx.Node,
    read: set[torch.fx.Node],
    written: set[torch.fx.Node],
    keys: dict[torch.fx.Node, _Key],
    last_write: dict[torch.fx.Node, torch.fx.Node],
    last_touch: dict[torch.fx.Node, torch.fx.Node],
    latest: torch.fx.Node | None,
) -> torch.fx.Node | None:
    """The node the moved ``node`` must follow: the latest, in the new order, of
    what it reads, the last writes of what it reads, and every earlier touch of what
    it writes."""
    if _has_outside_effects(node):
        return latest
    after = list(node.all_input_nodes)
    after += [last_write[s] for s in read if s in last_write]
    after += [last_touch[s] for s in written if s in last_touch]
    return max(after, key=keys.__getitem__, default=None)


def write_positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[int]]:
    """For each node, the positions (in graph order) of the ops that write its
    value's memory: in place, through a view, or as batch norm's running stats."""
    storage = _storages(graph)
    by_memory: dict[torch.fx.Node, list[int]] = {}
    for index, node in enumerate(graph.nodes):
        for memory in _written(node, storage):
            by_memory.setdefault(memory, []).append(index)
    return {node: by_memory.get(memory, []) for node, memory in storage.items()}


def writes(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes any tensor's memory (in place, or running stats)."""
    return bool(_written(node, _Itself()))


class _Itself(dict[torch.fx.Node, torch.fx.Node]):
    """A storage map in which every node is its own memory."""

    def __missing__(self, node: torch.fx.Node) -> torch.fx.Node:
        return node


def _has_outside_effects(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return True
    if target is operator.getitem:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return (
        torch.Tag.nondeterministic_seeded in target.tags
        or target.namespace in _COLLECTIVE_NAMESPACES
    )


def _storages(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """For each node, the node whose tensor's memory its value is: a view's or an
    in-place op's result shares its argument's."""
    storage: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        storage[node] = node
        source = _aliased_argument(node)
        if source is not None and source in storage:
            storage[node] = storage[source]
    return storage


def _aliased_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    target = node.target
    if target is operator.getitem:
        source = node.args[0]
        # An item of a list of views (split, unbind) is a view of their base.
        if isinstance(source, torch.fx.Node) and _aliased_argument(source) is not None:
            return source
        return None
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    sets = {
        alias
        for result in schema.returns
        if result.alias_info is not None
        for alias in result.alias_info.before_set
    }
    if not sets:
        return None
    for argument, value in zip(schema.arguments, _argument_values(node), strict=True):
        if (
            argument.alias_info is not None
            and sets & set(argument.alias_info.before_set)
            and isinstance(value, torch.fx.Node)
        ):
            return value
    return None


def _written(
    node: torch.fx.Node, storage: dict[torch.fx.Node, torch.fx.Node]
) -> set[torch.fx.Node]:
    """The memories ``node`` writes, by its schema (and batch norm's running stats)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return set()
    values = _argument_values(node)
    written: set[torch.fx.Node] = set()
    for index, (argument, value) in enumerate(
        zip(target._schema.arguments, values, strict=True)
    ):
        writes = argument.alias_info is not None and argument.alias_info.is_write
        if writes or writes_running_stats(target, index, values):
            items = value if isinstance(value, (list, tuple)) else [value]
            written |= {storage[v] for v in items if isinstance(v, torch.fx.Node)}
    return written


def _argument_values(node: torch.fx.Node) -> list[object]:
    target = node.target
    assert isinstance(target, torch._ops.OpOverload)
    return [
        node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        for i, argument in enumerate(target._schema.arguments)
    ]


def _read(
    node: torch.fx.Node,
    storage: dict[torch.fx.Node, torch.fx.Node],
    in_flight: dict[torch.fx.Node, set[torch.fx.Node]],
) -> set[torch.fx.Node]:
    """The memory ``node`` reads. A functional collective reads its input until its
    wait_tensor returns, so the wait reads it too (``in_flight``, by collective):
    no write may land between the two."""
    read = {storage[n] for n in node.all_input_nodes if n in storage}
    target = node.target
    if target is torch.ops._c10d_functional.wait_tensor.default:
        return read.union(*(in_flight.get(n, set()) for n in node.all_input_nodes))
    if (
        isinstance(target, torch._ops.OpOverload)
        and target.namespace in _COLLECTIVE_NAMESPACES
    ):
        in_flight[node] = read
    return read
