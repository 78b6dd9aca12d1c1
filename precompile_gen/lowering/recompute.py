"""Recompute, where its readers are far apart, a tensor that cheap ops make from
tensors the graph holds there anyway.

A training step captured whole is one graph: the forward's activations are read
again by the backward, much later, and Inductor keeps each one alive in between.
``torch.compile`` splits forward and backward, and its partitioner saves fewer
tensors for the backward, recomputing the cheap ones (a batch norm's or an
activation function's output) from those it saves. This pass does the same inside
the one graph: after Inductor's own post-grad passes, for each tensor whose readers
are far apart, it repeats the pointwise ops that made it just before its late
readers, when every tensor those ops read is alive there anyway (or is small), and
lets the early copy die after its early readers.

It runs as Inductor's ``post_grad_custom_post_pass``: on the decomposed, functional
graph, where a batch norm is pointwise ops and reductions.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from precompile_gen.capturing import update_order

# A tensor worth freeing early holds at least this many bytes.
_MIN_BYTES = 64 * 1024
# Readers are far apart when more than this share of the graph's nodes, and more
# than _MIN_GAP nodes, lie between them: a forward's activation and its backward.
_GAP_SHARE = 20
_MIN_GAP = 50
# An input the recomputation keeps alive longer must be this many times smaller
# than the tensor recomputed (a batch norm's per-channel mean, say).
_SMALL = 8


class RecomputeFarReads(CustomGraphPass):
    """The post-grad pass; ``uuid`` keys Inductor's cache on its source."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        recompute_far_reads(graph)

    def uuid(self) -> str:
        return get_hash_for_files((__file__, update_order.__file__)).hex()


def recompute_far_reads(graph: torch.fx.Graph) -> int:
    """Recompute each tensor whose readers are far apart before its late readers;
    the number of tensors recomputed."""
    nodes = list(graph.nodes)
    position = {node: float(index) for index, node in enumerate(nodes)}
    min_gap = max(_MIN_GAP, len(nodes) // _GAP_SHARE)
    written = update_order.write_positions(graph)
    count = 0
    for node in nodes:
        size = _nbytes(node)
        if not _pure(node) or _is_view(node) or size is None or size < _MIN_BYTES:
            continue
        late = _late_readers(node, position, min_gap)
        if not late or any(reader.op == "output" for reader in late):
            continue
        at = late[0]
        chain: list[torch.fx.Node] = []
        if not _plan(size, node, at, position, written, chain):
            continue
        recomputed = _insert_before(graph, at, chain)
        for copy in recomputed:
            position[copy] = position[at] - 0.5
        for reader in late:
            reader.replace_input_with(node, recomputed[-1])
        count += 1
    if count:
        graph.lint()
    return count


def _insert_before(
    graph: torch.fx.Graph, at: torch.fx.Node, chain: list[torch.fx.Node]
) -> list[torch.fx.Node]:
    """Copies of the ops in ``chain`` before ``at``, each reading the copies of
    those before it."""
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(at):
        for original in chain:
            copies[original] = graph.node_copy(original, lambda a: copies.get(a, a))
    return list(copies.values())


def _late_readers(
    node: torch.fx.Node, position: dict[torch.fx.Node, float], min_gap: int
) -> list[torch.fx.Node]:
    """The readers after the widest gap between ``node`` and its readers, in graph
    order, if that gap is wide enough to be worth freeing the tensor across."""
    readers = sorted(node.users, key=position.__getitem__)
    points = [position[node], *(position[reader] for reader in readers)]
    widest, index = max(
        ((points[i + 1] - points[i], i) for i in range(len(readers))),
        default=(0.0, 0),
    )
    if widest < min_gap:
        return []
    return readers[index:]


def _plan(
    size: int,
    node: torch.fx.Node,
    at: torch.fx.Node,
    position: dict[torch.fx.Node, float],
    written: dict[torch.fx.Node, list[int]],
    chain: list[torch.fx.Node],
) -> bool:
    """Append to ``chain``, inputs first, the ops that recompute ``node`` (part of
    a tensor of ``size`` bytes) before ``at``; False if one of its inputs can be
    neither read there nor recomputed."""
    for argument in node.all_input_nodes:
        if argument in chain or not isinstance(argument.meta.get("val"), torch.Tensor):
            continue
        # The recomputation must read what the original read: no op may write the
        # argument's memory before ``at``.
        if any(p < position[at] for p in written.get(argument, [])):
            return False
        if argument.op == "placeholder" or _alive_at(argument, at, position):
            continue
        argument_size = _nbytes(argument)
        if argument_size is not None and _SMALL * argument_size <= size:
            continue
        if not _pure(argument) or not _plan(
            size, argument, at, position, written, chain
        ):
            return False
    chain.append(node)
    return True


def _alive_at(
    node: torch.fx.Node, at: torch.fx.Node, position: dict[torch.fx.Node, float]
) -> bool:
    return any(position[reader] >= position[at] for reader in node.users)


def _pure(node: torch.fx.Node) -> bool:
    """A pointwise op or a view, drawing no random numbers and writing nothing."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if any(
        argument.alias_info is not None and argument.alias_info.is_write
        for argument in target._schema.arguments
    ):
        return False
    return torch.Tag.pointwise in target.tags or _is_view(node)


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return (
        len(returns) == 1
        and returns[0].alias_info is not None
        and not returns[0].alias_info.is_write
    )


def _nbytes(node: torch.fx.Node) -> int | None:
    """The bytes of ``node``'s tensor; None where its size is symbolic."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    numel = value.numel()
    return numel * value.element_size() if isinstance(numel, int) else None
