"""The calling convention, recorded from what the trace saw: the module state, the
input leaves and their tree, the result's structure, the updates fn made and the
names of the graph's inputs, as the plain records of ``capture_result``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

from precompile_gen.capture_result import (
    DataParallelArgument,
    DeferredStep,
    InputLeaf,
    InputStrides,
    InputTree,
    LeafValue,
    ModuleArgument,
    OptimizerArgument,
    Shape,
    SparseGradients,
    StateTensor,
    Strides,
)
from precompile_gen.capturing import (
    branches,
    data_dependent,
    data_parallel,
    dynamic_dims,
    grad_resets,
    graph_inputs,
    graph_names,
)
from precompile_gen.runtime.errors import (
    PrecompileError,
)


@dataclass
class Harvest:
    """What the flat function learns while make_fx runs fn: the structure of its
    result, which parameters got gradients, and what fn did to the optimizers and
    the ``.grad`` fields."""

    out_spec: pytree.TreeSpec = field(init=False)
    # The namedtuple and dataclass types in fn's result, by import path.
    pytree_types: list[str] = field(default_factory=list)
    scalar_outputs: list[int] = field(default_factory=list)
    grad_param_indices: list[int] = field(default_factory=list)
    # Positions among the gradients returned of those that are sparse.
    sparse_grads: list[int] = field(default_factory=list)
    resets: grad_resets.Resets = field(default_factory=dict)
    # The optimizer arguments whose step() fn called, by id.
    stepped: set[int] = field(default_factory=set)
    # What fn itself raised while traced: it reaches the caller unwrapped.
    raised_by_fn: list[Exception] = field(default_factory=list)
    # The caller's grad mode: the trace turns it on to record a backward.
    grad_enabled: bool = True
    # The float arguments fn computed with, and those it used as Python values.
    float_arguments: data_dependent.FloatArguments = field(
        default_factory=data_dependent.FloatArguments
    )


@dataclass
class Updates:
    """The updates fn made, as the trace saw them."""

    # Positions of the module state and input leaves fn updated in place.
    mutated_inputs: list[int]
    deferred_steps: list[DeferredStep]
    optimizers: list[OptimizerArgument]
    sparse_gradients: SparseGradients | None


def branch_records(harvest: Harvest, merged: branches.Merged) -> dict[str, Any]:
    """The convention's ``.grad`` resets, and what fn's branches on tensor values
    add to it: the branches, and a step a path skips with the resets of its own."""
    step_resets = merged.step_resets or []
    return {
        "grad_resets": [
            reset
            for reset in sorted(harvest.resets.items())
            if reset not in step_resets
        ],
        "skippable_step": merged.step_resets is not None,
        "step_resets": step_resets,
        "value_branches": merged.branches,
    }


def input_names(
    call: graph_inputs.Arguments,
    state: graph_inputs.ModuleState,
    updates: Updates,
    constants: list[tuple[str, torch.Tensor]],
) -> list[str]:
    """Each graph input's name (``graph_names``), in graph-input order."""
    return graph_names.graph_input_names(
        call.argument_names,
        state.param_names,
        state.buffer_names,
        list(zip(call.user_positions, call.user_inputs, strict=True)),
        updates.optimizers,
        [name for name, _ in constants],
    )


def state_tensors(state: graph_inputs.ModuleState) -> list[StateTensor]:
    """The module state, parameters then buffers, as the driver checks it."""
    return [
        StateTensor(
            name=name,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype),
            device=str(tensor.device),
            requires_grad=tensor.requires_grad,
        )
        for name, tensor in zip(
            state.param_names + state.buffer_names, state.tensors, strict=True
        )
    ]


def example_strides(
    state: graph_inputs.ModuleState,
    user: graph_inputs.UserLeaves,
    flat_args: list[object],
    optimizer_arguments: list[OptimizerArgument],
) -> InputStrides:
    """Each graph input's strides before the lrs, as the example had them: the
    module state, the user-input leaves (None for a non-tensor one or one with
    dynamic dims), then the optimizers' state the graph kept."""
    state_strides: Strides = [tuple(tensor.stride()) for tensor in state.tensors]
    start = len(state.tensors) + len(user.leaves)
    count = sum(len(optimizer.state) for optimizer in optimizer_arguments)
    optimizer_state: Strides = []
    for tensor in flat_args[start : start + count]:
        assert isinstance(tensor, torch.Tensor)
        optimizer_state.append(tuple(tensor.stride()))
    return InputStrides(
        params=state_strides[: state.num_params],
        buffers=state_strides[state.num_params :],
        leaves=[
            None
            if marked or not isinstance(leaf, torch.Tensor)
            else tuple(leaf.stride())
            for leaf, marked in zip(user.leaves, user.marks, strict=True)
        ],
        optimizer_state=optimizer_state,
    )


def input_tree(in_spec: pytree.TreeSpec, count: int) -> InputTree:
    """The record of ``in_spec``, the tree of ``count`` non-module arguments."""
    try:
        dumped = pytree.treespec_dumps(in_spec)
    except (NotImplementedError, TypeError):
        # Only the driver's structure check reads IN_SPEC; the leaf checks still run.
        return InputTree(None, None)
    nodes, holds_dicts = [in_spec], False
    while nodes and not holds_dicts:
        node = nodes.pop()
        holds_dicts = node.type is dict
        nodes += node.children()
    flat = (
        in_spec.type is tuple
        and in_spec.num_children == count
        and all(child.is_leaf() for child in in_spec.children())
    )
    return InputTree(dumped, pytree.treespec_pprint(in_spec), holds_dicts, flat)


def dump_out_spec(out_spec: pytree.TreeSpec) -> str:
    # The driver rebuilds the result from OUT_SPEC, so unlike IN_SPEC it is required.
    try:
        return pytree.treespec_dumps(out_spec)
    except (NotImplementedError, TypeError) as error:
        raise PrecompileError(
            "the function's result has a structure that cannot be serialised into the "
            f"artifact ({type(error).__name__}: {error}). This happens for a type "
            "registered with torch.utils._pytree without a serialized_type_name, or "
            "without a JSON-serialisable context. Return a tuple, list or dict of "
            "tensors (namedtuples and dataclasses defined at module level work too), "
            "or register the type with a serialized_type_name."
        ) from error


def data_parallel_records(call: graph_inputs.Arguments) -> list[DataParallelArgument]:
    return [
        data_parallel.data_parallel_record(module, position)
        for position, module in zip(call.module_positions, call.modules, strict=True)
        if data_parallel.is_data_parallel(module)
    ]


def module_arguments(
    call: graph_inputs.Arguments, modes: graph_inputs.ModuleModes
) -> list[ModuleArgument]:
    return [
        ModuleArgument(position, training, hooks)
        for position, training, hooks in zip(
            call.module_positions, modes.training, modes.hooks, strict=True
        )
    ]


def input_leaves(
    user: graph_inputs.UserLeaves, float_arguments: data_dependent.FloatArguments
) -> list[InputLeaf]:
    """What the driver checks of each user-input leaf: a float traced as a graph
    input keeps no value, unless fn used it as one."""
    used = float_arguments.specialized
    return [
        InputLeaf(
            shape=_shape(leaf, marked),
            dtype=_dtype(leaf),
            device=_device(leaf),
            bounds=bounds,
            symbols=symbols,
            value=_leaf_value(leaf)
            if index not in user.numbers or index in used
            else None,
            number=index in user.numbers,
            number_use=used.get(index),
        )
        for index, (leaf, marked, bounds, symbols) in enumerate(
            zip(
                user.leaves,
                user.marks,
                dynamic_dims.declared_bounds(user.marks),
                [None] * len(user.leaves)
                if user.symbolic is None
                else user.symbolic.leaf_symbols,
                strict=True,
            )
        )
    ]


def _leaf_value(leaf: object) -> LeafValue | None:
    # The trace builds a scalar argument's value into the graph (``x * scale`` records
    # the number), so the artifact holds each call to it. Other objects cannot be
    # written into the artifact and compared; non-finite floats neither.
    if type(leaf) not in (bool, int, float, str):
        return None
    if isinstance(leaf, float) and not math.isfinite(leaf):
        return None
    return cast(LeafValue, leaf)


def _shape(leaf: object, marks: dict[int, dynamic_dims.DimMark]) -> Shape | None:
    # A marked dim is None: the artifact accepts any size there.
    if not isinstance(leaf, torch.Tensor):
        return None
    return tuple(None if dim in marks else size for dim, size in enumerate(leaf.shape))


def _dtype(leaf: object) -> str | None:
    return str(leaf.dtype) if isinstance(leaf, torch.Tensor) else None


def _device(leaf: object) -> str | None:
    return str(leaf.device) if isinstance(leaf, torch.Tensor) else None
