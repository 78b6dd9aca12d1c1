# Runtime support for every artifact's call: carried after the base part
# (precompile_gen/runtime_support/support.py) and the parts before it, from its first "#
# ---" heading on. The lines above that heading are not carried: they import what the
# other parts and the rest of the artifact define, so that ruff and pyrefly check this
# part as a module of its own.
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from precompile_gen.runtime_support.declarations import (
    _SIGNATURE,
    _TENSOR_ARGUMENTS,
    _USER_POSITIONS,
    ALIASED_INPUTS,
    ARGUMENT_NAMES,
    BUFFER_DEVICES,
    BUFFER_DTYPES,
    BUFFER_NAMES,
    BUFFER_REQUIRES_GRAD,
    BUFFER_SHAPES,
    GLOBAL_MODULE_HOOKS,
    IN_SPEC,
    MODULE_HOOKS,
    MODULE_POSITIONS,
    MODULE_TRAINING,
    NUM_POSITIONAL_ARGS,
    OUT_SPEC,
    PARAM_DEVICES,
    PARAM_DTYPES,
    PARAM_NAMES,
    PARAM_REQUIRES_GRAD,
    PARAM_SHAPES,
    USER_INPUT_BOUNDS,
    USER_INPUT_DEVICES,
    USER_INPUT_DTYPES,
    USER_INPUT_SHAPES,
    USER_INPUT_SYMBOLS,
    USER_INPUT_VALUES,
)
from precompile_gen.runtime_support.support import (
    _argument,
    _arguments_message,
    _CheckedState,
    _describe_state_difference,
    _fail,
    _groups,
    _inference_write_problem,
    _keywords_message,
    _leaf_count_message,
    _mode_and_hook_problem,
    _nesting_message,
    _newly_shared,
    _newly_shared_positions,
    _not_a_module_message,
    _python_values_hold,
    _python_values_problem,
    _remember,
    _remembered_state,
    _same_layout,
    _sharing,
    _state_tensor_problem,
    _storage_pointer,
    _tensor_leaf_problem,
    leaf_names,
    module_state,
)

# isort: split

# --- The calling convention, as the metadata records it -----------------------------
# What the checks below derive from the metadata once, when the artifact is executed.
# The metadata of a capture without a feature leaves out its constants (DTENSORS,
# OPTIMIZERS, PYTREE_TYPES, ...); these parts look them up by name.
import reprlib
import sys

_IN_SPEC: pytree.TreeSpec | None = (
    None if IN_SPEC is None else pytree.treespec_loads(IN_SPEC)
)
_OUT_SPEC: pytree.TreeSpec = pytree.treespec_loads(OUT_SPEC)

_STATE_NAMES: list[str] = PARAM_NAMES + BUFFER_NAMES
_STATE_SHAPES: list[tuple[int, ...]] = PARAM_SHAPES + BUFFER_SHAPES
_STATE_DTYPES: list[str] = PARAM_DTYPES + BUFFER_DTYPES
_STATE_DEVICES: list[str] = PARAM_DEVICES + BUFFER_DEVICES
_STATE_REQUIRES_GRAD: list[bool] = PARAM_REQUIRES_GRAD + BUFFER_REQUIRES_GRAD
_NUM_STATE: int = len(_STATE_NAMES)

# The Python values the graph has built in, held at each call.
_PYTHON_VALUES: list[tuple[str, str]] = globals().get("PYTHON_VALUES", [])
# The float leaves the graph takes as numbers, and where fn used each as a value.
_NUMBER_INPUTS: dict[int, str | None] = globals().get("NUMBER_INPUTS", {})
# The graph inputs that were DTensors (the dtensors part checks their sharding).
_DTENSOR_POSITIONS: dict[int, Any] = globals().get("DTENSORS", {})
# Whether a message may suggest marking a dim dynamic: not where the trace holds
# optimizer state or DTensors, whose shapes it specialises on.
_MARKABLE_DIMS: bool = not (globals().get("OPTIMIZERS") or _DTENSOR_POSITIONS)

# Dicts among the inputs, whose keys a call may pass in another order: the artifacts
# whose inputs hold dicts carry the dict_inputs part, which takes them by key. Its
# functions, None in the other artifacts: the inputs with each dict's keys in the
# example's order, and their leaves and spec so.
_IN_EXAMPLE_ORDER: Callable[[tuple[object, ...]], tuple[object, ...]] | None = (
    globals().get("_in_example_order")
)
_FLATTEN_IN_EXAMPLE_ORDER: (
    Callable[[tuple[object, ...]], tuple[list[object], pytree.TreeSpec]] | None
) = globals().get("_flatten_in_example_order")

# Each leaf's shape, dtype and device as a matching tensor reports them, so that such
# a leaf costs one comparison; None where only the full check will do (a DTensor
# leaf, or a plain tensor passed in its place, whose sharding it compares).
_LEAF_SIGNATURES: list[tuple[torch.Size, Any, torch.device] | None] = [
    (
        None
        if shape is None
        or None in shape
        or dtype is None
        or device is None
        or _NUM_STATE + index in _DTENSOR_POSITIONS
        else (
            torch.Size(cast(tuple[int, ...], shape)),
            getattr(torch, dtype.removeprefix("torch."), None),
            torch.device(device),
        )
    )
    for index, (shape, dtype, device) in enumerate(
        zip(USER_INPUT_SHAPES, USER_INPUT_DTYPES, USER_INPUT_DEVICES)
    )
]
# The leaves with dynamic dims: (leaf index, {dim: symbol}).
_LEAF_SYMBOLS: list[tuple[int, dict[int, str]]] = [
    (index, symbols) for index, symbols in enumerate(USER_INPUT_SYMBOLS) if symbols
]
# Inputs that shared a storage at capture: each member's position among the graph's
# inputs, mapped to its group's first position.
_ALIAS_OWNER: dict[int, int] = {
    position: min(group) for group in ALIASED_INPUTS for position in group
}


# --- The call: keywords and autocast ------------------------------------------------
_autocast_enabled = torch._C._is_any_autocast_enabled


def _call_without(
    forward: Callable[..., object],
    args: tuple[object, ...],
    keywords: dict[str, object],
) -> object:
    """forward's answer to a call with keywords (refused) or under autocast: the
    graph computes in the dtypes of its capture (autocast's casts included, where it
    ran inside torch.autocast), on both backends alike; applied again, autocast would
    recast the ops Inductor leaves to torch but not its kernels."""
    if keywords:
        _fail(_keywords_message(keywords, _SIGNATURE))
    with torch._C._DisableAutocast():
        return forward(*args)


# --- The call's arguments -----------------------------------------------------------
def _user_inputs(args: tuple[object, ...]) -> tuple[object, ...]:
    """The call's non-module arguments, in order."""
    return tuple([args[i] for i in _USER_POSITIONS])


def _call_leaf_name(args: tuple[object, ...], leaf_index: int) -> str:
    """How messages name input leaf ``leaf_index`` of the call ``args``."""
    return _leaf_name(_user_inputs(args), leaf_index)


def _leaf_name(user_inputs: tuple[object, ...], leaf_index: int) -> str:
    if _TENSOR_ARGUMENTS:
        # Each leaf is an argument of its own.
        return _argument(_USER_POSITIONS[leaf_index], ARGUMENT_NAMES)
    if _IN_EXAMPLE_ORDER is not None:
        # Named in the order the leaves were taken in: the example's.
        user_inputs = _IN_EXAMPLE_ORDER(user_inputs)
    return leaf_names(_USER_POSITIONS, ARGUMENT_NAMES, user_inputs)[leaf_index]


def _split_arguments(
    args: tuple[object, ...],
) -> tuple[list[torch.nn.Module], list[object]]:
    """Check the call's arguments against the captured example; return the modules
    and the flattened leaves of the other arguments."""
    if len(args) != NUM_POSITIONAL_ARGS:
        _fail(_arguments_message(len(args), NUM_POSITIONAL_ARGS, _SIGNATURE))
    modules: list[torch.nn.Module] = []
    for position in MODULE_POSITIONS:
        module = args[position]
        if not isinstance(module, torch.nn.Module):
            _fail(_not_a_module_message(position, ARGUMENT_NAMES, module, _SIGNATURE))
        modules.append(module)
    user_inputs = _user_inputs(args)
    if _TENSOR_ARGUMENTS and all(type(a) is torch.Tensor for a in user_inputs):
        leaves: list[object] = list(user_inputs)
    else:
        leaves = _flattened(user_inputs)
    for index, leaf in enumerate(leaves):
        signature = _LEAF_SIGNATURES[index]
        # A lazy conjugate or negative bit (tensor.conj()) passes the signature.
        if (
            signature is None
            or type(leaf) is not torch.Tensor
            or (leaf.shape, leaf.dtype, leaf.device) != signature
            or leaf.is_conj()
            or leaf.is_neg()
        ):
            _check_leaf(user_inputs, index, leaf)
    if _LEAF_SYMBOLS:
        _check_shared_sizes(user_inputs, leaves)
    return modules, leaves


def _flattened(user_inputs: tuple[object, ...]) -> list[object]:
    # The leaves of inputs that nest, or of tensors passed where the example had
    # other values, in the example's structure.
    leaves, spec = pytree.tree_flatten(user_inputs)
    if _FLATTEN_IN_EXAMPLE_ORDER is not None and spec != _IN_SPEC:
        leaves, spec = _FLATTEN_IN_EXAMPLE_ORDER(user_inputs)
    if _IN_SPEC is not None and spec != _IN_SPEC:
        _fail(_nesting_message(spec, _IN_SPEC))
    if len(leaves) != len(USER_INPUT_SHAPES):
        _fail(_leaf_count_message(len(leaves), len(USER_INPUT_SHAPES)))
    return leaves


def _check_shared_sizes(user_inputs: tuple[object, ...], leaves: list[object]) -> None:
    # Dynamic dims marked with one shape_id share a symbol in the graph, which
    # assumes their sizes are equal.
    seen: dict[str, tuple[str, int]] = {}
    for index, symbols in _LEAF_SYMBOLS:
        for dim, symbol in symbols.items():
            size = cast(torch.Tensor, leaves[index]).shape[dim]
            where = f"{_leaf_name(user_inputs, index)} dim {dim}"
            first = seen.setdefault(symbol, (where, size))
            if first[1] != size:
                _fail(
                    f"{where} has size {size} but {first[0]} has size {first[1]}; "
                    "their dims were marked with one mark_unbacked shape_id, so the "
                    "graph assumes they are equal. Pass equal sizes in those dims."
                )


def _check_leaf(user_inputs: tuple[object, ...], index: int, leaf: object) -> None:
    shape = USER_INPUT_SHAPES[index]
    if shape is None:
        _check_value_leaf(user_inputs, index, leaf)
        return
    name = _leaf_name(user_inputs, index)
    problem = _tensor_leaf_problem(
        name,
        leaf,
        shape,
        USER_INPUT_DTYPES[index],
        USER_INPUT_DEVICES[index],
        can_mark_dims=_MARKABLE_DIMS,
    )
    if problem is not None:
        _fail(problem)
    tensor = cast(torch.Tensor, leaf)
    _check_tensor_kind(name, _NUM_STATE + index, tensor)
    bounds = USER_INPUT_BOUNDS[index]
    for dim, (low, high) in (bounds or {}).items():
        size = tensor.shape[dim]
        if (low is not None and size < low) or (high is not None and size > high):
            _fail(
                f"{name} has size {size} in dim {dim}, "
                "outside the bounds its mark_unbacked declared at capture "
                f"({_show_bounds(low, high)}). Pass a size within them, or capture "
                "again with wider bounds."
            )


def _check_value_leaf(
    user_inputs: tuple[object, ...], index: int, leaf: object
) -> None:
    # A leaf that was not a tensor at capture: the graph specialised on its value,
    # or takes it as a number.
    if index in _NUMBER_INPUTS:
        _check_number_leaf(user_inputs, index, leaf)
        return
    if isinstance(leaf, torch.Tensor):
        _fail(
            f"{_leaf_name(user_inputs, index)} is a tensor, but the captured "
            "example had a non-tensor value there, which the graph specialised "
            "on. Pass the example's value."
        )
    value = USER_INPUT_VALUES[index]
    if value is not None and (type(leaf) is not type(value) or leaf != value):
        traced = reprlib.repr(value)
        _fail(
            f"{_leaf_name(user_inputs, index)} is {reprlib.repr(leaf)}, but the "
            f"function was traced with {traced}, which the graph has built in: "
            f"non-tensor inputs are specialised to the example. Pass {traced}, "
            "or capture again with this value (or with a tensor there, to vary "
            "it)."
        )


def _check_number_leaf(
    user_inputs: tuple[object, ...], index: int, leaf: object
) -> None:
    name = _leaf_name(user_inputs, index)
    if type(leaf) is not float:
        shown = "a tensor" if isinstance(leaf, torch.Tensor) else reprlib.repr(leaf)
        _fail(
            f"{name} is {shown}, but the function was traced with a "
            "float there, which the graph takes as a number. Pass a Python float "
            "(float(value))."
        )
    value = USER_INPUT_VALUES[index]
    if value is not None and leaf != value:
        _fail(
            f"{name} is {leaf!r}, but the function used its traced value {value!r} "
            f"as a Python value at {_NUMBER_INPUTS[index]} (a comparison, a "
            "conversion, or an argument of a torch function that takes only a "
            f"number), which the graph has built in. Pass {value!r}, or compute "
            "with it there as with a number (arithmetic, or a tensor argument) and "
            "capture again."
        )


def _numbers_to_tensors(leaves: list[object]) -> None:
    # The graph takes each float leaf it computes with (NUMBER_INPUTS) as the 0-dim
    # float64 tensor it was traced with; the checks that follow see what it sees (an
    # index computed from one is checked as the graph computes it).
    for index in _NUMBER_INPUTS:
        leaves[index] = torch.scalar_tensor(
            cast(float, leaves[index]), dtype=torch.float64
        )


def _show_bounds(low: int | None, high: int | None) -> str:
    # In mark_unbacked's own keywords, which is where the user declared them.
    shown = [] if low is None else [f"min={low}"]
    return ", ".join(shown + ([] if high is None else [f"max={high}"]))


def _check_tensor_kind(name: str, position: int, tensor: torch.Tensor) -> None:
    """A plain tensor where the capture had a plain tensor (a DTensor's sharding is
    checked by the dtensors part's steps)."""
    if position in _DTENSOR_POSITIONS:
        return
    # No DTensor exists unless torch.distributed.tensor was imported.
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(tensor, module.DTensor):
        _fail(
            f"{name} is a DTensor (sharded over a device mesh), but the artifact was "
            "captured with a plain tensor there. Pass a plain tensor (.full_tensor() "
            "gives the whole of it), or capture again with DTensors."
        )


# --- The module arguments' state ----------------------------------------------------
def _checked_state(
    args: tuple[object, ...],
    modules: list[torch.nn.Module],
    *checks: Callable[[list[torch.Tensor], list[str]], None],
) -> _CheckedState:
    """The modules' state, held to the traced model's: in full at a first call, and
    whenever the fast path cannot vouch that nothing it relied on has changed (the
    Python values the graph has built in included), with the capture's own
    ``checks`` of it (layouts, sharding); then remembered."""
    state = _remembered_state(modules)
    if state is not None and (not _PYTHON_VALUES or _python_values_hold(args)):
        return state
    tensors, names, _ = module_state(modules)
    _check_module_state(modules, tensors, names)
    problem = _python_values_problem(args, _PYTHON_VALUES, ARGUMENT_NAMES)
    if problem is not None:
        _fail(problem)
    for check in checks:
        check(tensors, names)
    return _remember(modules, tensors)


def _check_module_state(
    modules: list[torch.nn.Module], tensors: list[torch.Tensor], names: list[str]
) -> None:
    if names != _STATE_NAMES:
        _fail(_describe_state_difference(modules, names, _STATE_NAMES))
    for position, (name, tensor, shape, dtype, device, requires_grad) in enumerate(
        zip(
            names,
            tensors,
            _STATE_SHAPES,
            _STATE_DTYPES,
            _STATE_DEVICES,
            _STATE_REQUIRES_GRAD,
        )
    ):
        problem = _state_tensor_problem(
            name, tensor, shape, dtype, device, requires_grad
        )
        if problem is not None:
            _fail(problem)
        _check_tensor_kind(f"the model's {name!r}", position, tensor)
    problem = _mode_and_hook_problem(
        modules, MODULE_TRAINING, MODULE_HOOKS, GLOBAL_MODULE_HOOKS
    )
    if problem is not None:
        _fail(problem)


# --- Storages shared among the graph's inputs ---------------------------------------
def _check_aliasing(
    args: tuple[object, ...], state: _CheckedState, leaves: list[object]
) -> None:
    """The graph was traced, and compiled, for the aliasing among its inputs at
    capture (make_fx reads a tensor passed twice as one input; views of one storage
    are compiled as one base at fixed offsets), usually none: hold the call to it."""
    if not ALIASED_INPUTS:
        members = _newly_shared_positions(state, leaves)
        if members:
            _fail(_newly_shared(_input_names(args, members)))
        return
    sharing = _sharing(state, list(map(_storage_pointer, leaves)))
    if sharing != _ALIAS_OWNER:
        _fail(_describe_aliasing_difference(args, sharing))
    inputs = [*state.tensors, *leaves]
    for group in ALIASED_INPUTS:
        for position, (offset, strides) in group.items():
            tensor = cast(torch.Tensor, inputs[position])
            if tensor.storage_offset() != offset or not _same_layout(tensor, strides):
                others = _input_names(args, sorted(set(group) - {position}))
                _fail(
                    f"{_input_names(args, [position])} shares a storage with "
                    f"{others} as at capture, but at offset {tensor.storage_offset()} "
                    f"with strides {tuple(tensor.stride())} in it, where the graph "
                    f"was traced with offset {offset} and strides {strides}. Pass "
                    "views at the example's offsets, or capture again with these."
                )


def _describe_aliasing_difference(
    args: tuple[object, ...], sharing: dict[int, int]
) -> str:
    # Error path only: name the first group that differs, in the words of the call.
    now, then = _groups(sharing), _groups(_ALIAS_OWNER)
    for members in now:
        if members not in then:
            return _newly_shared(_input_names(args, members))
    members = next(members for members in then if members not in now)
    return (
        f"{_input_names(args, members)} were one tensor (or views of one storage) at "
        "capture, and the graph was traced and compiled as such, but they do not "
        "share one storage in this call. Pass them as at capture (the same tensor, "
        "or views of one), or capture again with separate tensors."
    )


def _input_names(args: tuple[object, ...], positions: list[int]) -> str:
    user_inputs = _user_inputs(args)
    names = []
    for position in positions:
        if position < _NUM_STATE:
            names.append(f"the model's {_STATE_NAMES[position]!r}")
        else:
            names.append(_leaf_name(user_inputs, position - _NUM_STATE))
    if len(names) == 1:
        return names[0]
    if len(names) > 4:
        # A model whose parameters are views of one flat tensor shares a storage
        # among all of them: name a few and count the rest, as _listed does.
        return ", ".join(names[:3]) + f" and {len(names) - 3} more"
    return ", ".join(names[:-1]) + " and " + names[-1]


def _check_inference_writes(
    state: _CheckedState, leaves: list[object], mutated_inputs: list[int]
) -> None:
    # Only outside inference mode does torch refuse the graph's in-place updates
    # (of ``mutated_inputs``, MUTATED_INPUTS).
    if not torch.is_inference_mode_enabled():
        problem = _inference_write_problem(state, leaves, mutated_inputs, _STATE_NAMES)
        if problem is not None:
            _fail(problem)


# --- The result ---------------------------------------------------------------------
def _result(flat_outputs: list[Any]) -> object:
    """The function's result, in its structure, from the graph's flat outputs."""
    return pytree.tree_unflatten(flat_outputs, _OUT_SPEC)


def _with_numbers(flat_outputs: list[Any], scalar_outputs: list[int]) -> list[Any]:
    # The function returned these (SCALAR_OUTPUTS) as t.item(): the graph returns t.
    results = list(flat_outputs)
    for index in scalar_outputs:
        results[index] = cast(torch.Tensor, results[index]).item()
    return results
