"""The rewrites lowering makes to the traced graph before Inductor compiles it, each
so that the compiled graph computes what eager computes, or with the memory eager
uses:

- ``scale_before_add``: ``add(x, y, alpha=a)`` as ``add(x, mul(y, a))``, so that no
  fusion can lose the scale;
- ``channels_last_once`` and ``weight_gradients_in_weight_layout``: where Inductor
  lays a training step's convolutions out channels-last
  (``convolutions_laid_out_channels_last``), one channels-last copy of each tensor
  they read, shared by forward and backward, and each weight's gradient handed on
  in the weight's own layout;
- ``random_fills_in_eager_layout``: a random fill of a strided tensor draws in the
  tensor's memory order, as eager's does, so a seeded call draws eager's numbers.
"""

from __future__ import annotations

import operator

import torch

from precompile_gen.capturing import update_order

# ``add(x, y, alpha=a)`` and its in-place form, whose ``alpha`` Inductor's fusion of an
# ``mm`` and an ``add`` into one ``addmm`` drops: ``add(mm(a, b), p, alpha=0.1)``, an
# SGD step's weight decay on a gradient the graph has just computed, would become
# ``addmm(p, a, b)``.
_ADDS_WITH_ALPHA = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


def scale_before_add(gm: torch.fx.GraphModule) -> None:
    """Rewrite ``add(x, y, alpha=a)`` as ``add(x, mul(y, a))``, which is how
    Inductor computes it anyway, so that no fusion can lose the scale."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target not in _ADDS_WITH_ALPHA or "alpha" not in node.kwargs:
            continue
        alpha = node.kwargs["alpha"]
        if alpha == 1 or not isinstance(node.args[1], torch.fx.Node):
            continue
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(
                torch.ops.aten.mul.Tensor, (node.args[1], alpha)
            )
        node.args = (node.args[0], scaled)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
        changed = True
    if changed:
        gm.recompile()


# Each convolution's 4-D operands, by position: convolution(input, weight, ...) and
# convolution_backward(grad_output, input, weight, ...).
_CONVOLUTION_OPERANDS = {
    torch.ops.aten.convolution.default: (0, 1),
    torch.ops.aten.convolution_backward.default: (1, 2),
}


def convolutions_laid_out_channels_last(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor will lay this training step's convolutions out
    channels-last (its layout optimisation, which it decides on the whole graph)."""
    backward = torch.ops.aten.convolution_backward.default
    if not gm.graph.find_nodes(op="call_function", target=backward):
        return False
    from torch._inductor.graph import GraphLowering

    return GraphLowering.decide_layout_opt(gm, is_inference=False)


def channels_last_once(gm: torch.fx.GraphModule) -> None:
    """Give each weight or activation that a training step's convolutions read
    one channels-last copy, which its forward and backward convolutions share.

    With convolutions in a training graph Inductor lays them out channels-last, and
    lowers each convolution, and each convolution backward, with a channels-last
    copy of every operand that is not one already. In one graph holding the whole
    step, the copies of one weight or activation are made side by side in the
    forward's kernels and all kept until the backward: two or three copies, where
    torch.compile's forward saves one for its backward. An activation's other
    readers read the copy too, so that the activation is laid out once."""
    graph = gm.graph
    position = {node: index for index, node in enumerate(graph.nodes)}
    writes = update_order.write_positions(graph)
    changed = False
    for operand in _convolution_operands(graph):
        # A reader after the tensor's memory is next written (the optimizer's
        # update of a weight) must read the written tensor.
        written = writes.get(operand, [])
        activation = operand.op != "placeholder"
        readers = [
            (reader, index)
            for reader, index in _plain_reads(operand, everyone=activation)
            if not any(position[operand] < p < position[reader] for p in written)
        ]
        if len(readers) < 2:
            continue
        first = min((reader for reader, _ in readers), key=position.__getitem__)
        with graph.inserting_before(first):
            copy = graph.call_function(
                torch.ops.aten.clone.default,
                (operand,),
                {"memory_format": torch.channels_last},
            )
        copy.meta["val"] = operand.meta["val"].clone(memory_format=torch.channels_last)
        for reader, index in readers:
            reader.update_arg(index, copy)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()


def weight_gradients_in_weight_layout(gm: torch.fx.GraphModule) -> None:
    """Hand each convolution weight's gradient to its readers in the weight's own
    layout, copied in a kernel of its own.

    A channels-last convolution backward returns the weight's gradient
    channels-last. Read so, an optimizer's update of a contiguous weight becomes a
    fused kernel that transposes in small tiles of the kernel's 3x3 positions, a few
    times slower than the same update on a gradient laid out like the weight plus
    the copy that lays it out (torch.compile's gradient accumulation makes that
    copy too)."""
    # Registers torch.ops.prims.inductor_force_stride_order.
    import torch._inductor.inductor_prims

    force_stride_order = torch.ops.prims.inductor_force_stride_order.default
    graph = gm.graph
    backward = torch.ops.aten.convolution_backward.default
    changed = False
    for node in graph.find_nodes(op="call_function", target=backward):
        weight = node.args[2]
        if _is_channels_last_copy(weight):
            weight = weight.args[0]
        layout = tuple(weight.meta["val"].stride())
        if not all(type(stride) is int for stride in layout):
            continue  # a dynamic capture's symbolic strides: Inductor's layout
        for gradient in list(node.users):
            if gradient.target is not operator.getitem or gradient.args[1] != 1:
                continue
            with graph.inserting_after(gradient):
                copy = graph.call_function(force_stride_order, (gradient, layout))
            copy.meta["val"] = force_stride_order(gradient.meta["val"], layout)
            gradient.replace_all_uses_with(
                copy, delete_user_cb=lambda user, copy=copy: user is not copy
            )
            changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _is_channels_last_copy(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a copy ``channels_last_once`` made."""
    return (
        node.target is torch.ops.aten.clone.default
        and node.kwargs.get("memory_format") is torch.channels_last
    )


def _convolution_operands(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The 4-D tensors, not channels-last already, that the convolutions read."""
    operands: dict[torch.fx.Node, None] = {}
    for target, indices in _CONVOLUTION_OPERANDS.items():
        for node in graph.find_nodes(op="call_function", target=target):
            for index in indices:
                operand = node.args[index]
                value = getattr(operand, "meta", {}).get("val")
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() == 4
                    and not value.is_contiguous(memory_format=torch.channels_last)
                ):
                    operands[operand] = None
    return list(operands)


def _plain_reads(
    operand: torch.fx.Node, *, everyone: bool
) -> list[tuple[torch.fx.Node, int]]:
    """(reader, argument index) of each op that reads ``operand`` as a plain input,
    neither writing it nor returning a view of it: the convolutions, or with
    ``everyone`` every such op."""
    reads = []
    for reader in operand.users:
        target = reader.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        if not everyone and target not in _CONVOLUTION_OPERANDS:
            continue
        for index, (argument, value) in enumerate(
            zip(target._schema.arguments, reader.args, strict=False)
        ):
            if value is operand and argument.alias_info is None:
                reads.append((reader, index))
    return reads


def random_fills_in_eager_layout(gm: torch.fx.GraphModule) -> None:
    """Give each tensor a random op fills in place (dropout's mask:
    ``empty_like(x).bernoulli_(p)``) the layout eager gives it.

    A fill draws its numbers in the order of the tensor's memory (and ``normal_``
    draws contiguous tensors by another algorithm), while eager's ``empty_like``
    keeps the layout of its input (a transposed attention output, say) and
    Inductor's lays the tensor out contiguously: the same seed would fill another
    mask. Inductor keeps the strides of ``empty_strided``, and hands the fallback
    kernels (uniform_, normal_, ...) tensors in them; ``bernoulli_`` it lowers to a
    fill of a contiguous copy, so that one fills a contiguous tensor shaped as
    eager's memory is, permuted back into the logical order. A ``zeros_like`` (or
    ``ones_like``, ``full_like``) that a fill overwrites is such an allocation too:
    the fill writes every element."""
    graph = gm.graph
    empties = [
        node
        for target in _ALLOCATIONS_LIKE
        for node in graph.find_nodes(op="call_function", target=target)
    ]
    position = {node: index for index, node in enumerate(graph.nodes)}
    changed = False
    for node in empties:
        value = _static_value(node)
        if value is None or not node.users:
            continue
        fill = min(node.users, key=position.__getitem__)
        if not (_fills_randomly(fill) and fill.args[0] is node):
            continue
        if fill.target in _FILLS_OF_A_CONTIGUOUS_COPY:
            changed |= _fill_in_memory_order(graph, node, fill, value)
        else:
            _allocate_strided(graph, node, value)
            changed = True
    for target, fill in _LIKE_OPS.items():
        for node in list(graph.find_nodes(op="call_function", target=target)):
            value = _static_value(node)
            if value is not None and node.kwargs.get("generator") is None:
                _fill_strided(graph, node, value, fill)
                changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _static_value(node: torch.fx.Node) -> torch.Tensor | None:
    # A dynamic capture's sizes are symbols, which a node cannot take as constants;
    # its random tensors keep Inductor's layout (README, "Random numbers").
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    if not all(type(n) is int for n in (*value.shape, *value.stride())):
        return None
    return value


# The ops that allocate a tensor in their input's layout, as eager's ``empty_like``.
_ALLOCATIONS_LIKE = (
    torch.ops.aten.empty_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.full_like.default,
)


# ``rand_like(x)`` is ``empty_like(x).uniform_(0, 1)`` in eager; Inductor calls it
# on x in the layout it chose for x, which need not be eager's. ``bernoulli(x, p)``
# fills a contiguous tensor in eager, and Inductor a copy of x in x's layout. Each
# maps to its fill and the fill's arguments where the op has none after x.
_LIKE_OPS = {
    torch.ops.aten.rand_like.default: (torch.ops.aten.uniform_.default, (0.0, 1.0)),
    torch.ops.aten.randn_like.default: (torch.ops.aten.normal_.default, (0.0, 1.0)),
    torch.ops.aten.bernoulli.p: (torch.ops.aten.bernoulli_.float, ()),
}


def _fill_strided(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    value: torch.Tensor,
    fill: tuple[torch._ops.OpOverload, tuple[float, ...]],
) -> None:
    target, arguments = fill
    strided = _empty_strided(graph, node, value)
    with graph.inserting_before(node):
        filled = graph.call_function(target, (strided, *(node.args[1:] or arguments)))
    filled.meta = dict(node.meta)
    node.replace_all_uses_with(filled)
    graph.erase_node(node)


# The in-place random ops Inductor lowers to a fill of a contiguous copy of their
# input, whatever its strides.
_FILLS_OF_A_CONTIGUOUS_COPY = (torch.ops.aten.bernoulli_.float,)


def _allocate_strided(
    graph: torch.fx.Graph, node: torch.fx.Node, value: torch.Tensor
) -> None:
    strided = _empty_strided(graph, node, value)
    node.replace_all_uses_with(strided)
    graph.erase_node(node)


def _empty_strided(
    graph: torch.fx.Graph, node: torch.fx.Node, value: torch.Tensor
) -> torch.fx.Node:
    """An uninitialised tensor like ``value``, in its strides, before ``node``."""
    with graph.inserting_before(node):
        strided = graph.call_function(
            torch.ops.aten.empty_strided.default,
            (list(value.shape), list(value.stride())),
            {"dtype": value.dtype, "device": value.device},
        )
    strided.meta = dict(node.meta)
    return strided


def _fill_in_memory_order(
    graph: torch.fx.Graph, node: torch.fx.Node, fill: torch.fx.Node, value: torch.Tensor
) -> bool:
    order = _memory_order(value)
    if order is None or order == sorted(order):
        return False
    with graph.inserting_before(node):
        base = graph.call_function(
            torch.ops.aten.empty.memory_format,
            ([value.shape[dim] for dim in order],),
            {"dtype": value.dtype, "device": value.device},
        )
    fill.args = (base, *fill.args[1:])
    inverse = sorted(range(len(order)), key=order.__getitem__)
    with graph.inserting_after(fill):
        mask = graph.call_function(torch.ops.aten.permute.default, (fill, inverse))
    for user in list(fill.users):
        if user is not mask:
            user.replace_input_with(fill, mask)
    node.replace_all_uses_with(mask)
    graph.erase_node(node)
    return True


def _fills_randomly(node: torch.fx.Node) -> bool:
    # An in-place op that draws from the generator: bernoulli_, uniform_, normal_...
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    first = target._schema.arguments[0] if target._schema.arguments else None
    return (
        torch.Tag.nondeterministic_seeded in target.tags
        and first is not None
        and first.alias_info is not None
        and first.alias_info.is_write
    )


def _memory_order(value: torch.Tensor) -> list[int] | None:
    """The dims of a dense tensor from the outermost in memory to the innermost, or
    None where its layout is no permutation of a contiguous one."""
    order = sorted(
        range(value.dim()), key=lambda dim: (-value.stride(dim), -value.shape[dim])
    )
    expected = 1
    for dim in reversed(order):
        if value.shape[dim] != 1 and value.stride(dim) != expected:
            return None
        expected *= value.shape[dim]
    return order
