"""What the trace runs on: fn's arguments sorted by what becomes of each, the module
and optimizer state lifted to graph inputs, the user inputs flattened into leaves,
and the graph inputs laid out in order, as copies (or fakes) of the example's.

Each step refuses, before anything is traced, the inputs the artifact could not hold
calls to: a module inside a container, a lazy conjugate bit, aliasing a symbolic
trace cannot rebuild.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

from precompile_gen.capture_result import (
    AliasGroup,
    Backend,
    DTensorLayout,
)
from precompile_gen.capturing import (
    aliasing,
    convention,
    data_parallel,
    dtensors,
    dynamic_dims,
    fully_sharded,
    graph_names,
    optimizers,
    pytree_types,
    sparse_gradients,
)
from precompile_gen.runtime.errors import (
    PrecompileError,
    listed,
)

log = logging.getLogger(__name__)


def function_name(fn: object) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@dataclass
class ModuleState:
    """The modules' parameters then buffers, each tensor once (tied weights are one
    entry), with the names and per-module bindings used to reparametrise them."""

    tensors: list[torch.Tensor]
    param_names: list[str]
    buffer_names: list[str]
    # (module index, attribute path, index into ``tensors``) for every attribute that
    # holds one, aliases of tied weights included, so each module can be
    # reparametrised completely; a submodule reachable by several paths is bound by
    # the first only, since all its paths name one attribute.
    bindings: list[tuple[int, str, int]]

    @property
    def num_params(self) -> int:
        return len(self.param_names)


def _warn_of_hooks(
    module_hooks: list[dict[str, dict[str, int]]], global_module_hooks: dict[str, int]
) -> None:
    # A hook's tensor computations are traced into the graph (spectral_norm's and
    # pruning's pre-hooks compute the weight), but the artifact never calls the hook
    # itself: what it does besides (recording activations, logging) happens once,
    # now. Worth a word, not a refusal.
    hooked = [
        f"{'m' + str(index) + '.' if len(module_hooks) > 1 else ''}{name or '<root>'}"
        for index, hooks in enumerate(module_hooks)
        for name in hooks
    ]
    if global_module_hooks:
        hooked.append("every module (global module hooks)")
    if hooked:
        log.warning(
            "module hooks are traced into the graph, and the artifact never calls "
            "them: what they compute on tensors is built in, but anything else they "
            "do (recording, logging) happens only now, at capture. Hooked: %s.",
            listed(hooked, str),
        )


def lift_module_state(modules: list[torch.nn.Module]) -> ModuleState:
    """The graph's leading inputs as the calling convention gathers them
    (``convention.module_state``), with the bindings that reparametrise each module
    completely, aliases of tied tensors included."""
    tensors, names, num_params = convention.module_state(modules)
    index_of = {id(tensor): index for index, tensor in enumerate(tensors)}
    bindings = []
    # Swapping one attribute twice in one reparametrisation would restore it to the
    # first swap's tensor, replacing the user's parameter, so each is bound once.
    bound: set[tuple[int, str]] = set()
    for mi, module in enumerate(modules):
        for kind in ("named_parameters", "named_buffers"):
            for name, tensor in convention.named_members([module], kind):
                owner_path, _, attribute = name.rpartition(".")
                slot = (id(module.get_submodule(owner_path)), attribute)
                if slot not in bound:
                    bound.add(slot)
                    bindings.append((mi, name, index_of[id(tensor)]))
    return ModuleState(tensors, names[:num_params], names[num_params:], bindings)


@dataclass
class Arguments:
    """fn's positional arguments by what the trace does with each: module arguments
    and supported optimizers are lifted to graph inputs, a SparseAdam is left to the
    driver (no graph input either), and the rest are the user inputs."""

    fn_name: str
    # Messages name each argument by position and by fn's own name for it.
    argument_names: list[str]
    module_positions: list[int]
    modules: list[torch.nn.Module]
    optimizer_positions: list[int]
    sparse_steppers: list[tuple[int, torch.optim.Optimizer]]
    lifted_positions: list[int]
    user_positions: list[int]
    user_inputs: tuple[object, ...]


def classify_arguments(
    fn: Callable[..., object], example_inputs: tuple[object, ...]
) -> Arguments:
    """Sort fn's arguments, refusing the FSDP2 and DDP configurations the artifact
    cannot keep before anything runs."""
    fn_name = function_name(fn)
    arguments = graph_names.argument_names(fn, len(example_inputs))
    module_positions = [
        i for i, a in enumerate(example_inputs) if isinstance(a, torch.nn.Module)
    ]
    modules = [cast(torch.nn.Module, example_inputs[i]) for i in module_positions]
    for position, module in zip(module_positions, modules, strict=True):
        where = convention.argument(position, arguments)
        fully_sharded.check_module(module, where)
        if data_parallel.is_data_parallel(module):
            data_parallel.check_module(module, where)
    optimizer_positions = [
        i for i, a in enumerate(example_inputs) if optimizers.is_supported(a)
    ]
    sparse_steppers = [
        (i, cast(torch.optim.Optimizer, a))
        for i, a in enumerate(example_inputs)
        if sparse_gradients.is_sparse_stepper(a)
    ]
    lifted_positions = [
        *module_positions,
        *optimizer_positions,
        *(i for i, _ in sparse_steppers),
    ]
    user_positions = [
        i for i in range(len(example_inputs)) if i not in lifted_positions
    ]
    return Arguments(
        fn_name=fn_name,
        argument_names=arguments,
        module_positions=module_positions,
        modules=modules,
        optimizer_positions=optimizer_positions,
        sparse_steppers=sparse_steppers,
        lifted_positions=lifted_positions,
        user_positions=user_positions,
        user_inputs=tuple(example_inputs[i] for i in user_positions),
    )


@dataclass
class ModuleModes:
    """Each module argument's submodules with their train/eval modes and hooks, read
    before tracing: fn may switch modes itself, and the driver checks the modes and
    hooks a call arrives with."""

    submodules: list[list[tuple[str, torch.nn.Module]]]
    training: list[list[bool]]
    # The hooks the trace runs are built into the graph: each call must bring the same.
    hooks: list[dict[str, dict[str, int]]]
    global_hooks: dict[str, int]


def read_module_modes(modules: list[torch.nn.Module]) -> ModuleModes:
    """The modes and hooks of ``modules``, warning of the hooks (``_warn_of_hooks``)."""
    submodules = [list(module.named_modules()) for module in modules]
    modes = ModuleModes(
        submodules=submodules,
        training=[[m.training for _, m in named] for named in submodules],
        hooks=[convention.module_hooks(module) for module in modules],
        global_hooks=convention.global_module_hooks(),
    )
    _warn_of_hooks(
        [
            fully_sharded.without_own_hooks(module, hooks)
            for module, hooks in zip(modules, modes.hooks, strict=True)
        ],
        modes.global_hooks,
    )
    return modes


@dataclass
class LiftedState:
    """The module state and the supported optimizers' state, lifted to graph inputs;
    the parameters with sparse gradients, whose steps the driver takes."""

    state: ModuleState
    # Index into the parameters -> the module whose ``sparse=True`` makes it sparse.
    sparse_names: dict[int, str]
    optimizers: list[optimizers.LiftedOptimizer]
    deferrals: sparse_gradients.Deferrals


def lift_state(call: Arguments, example_inputs: tuple[object, ...]) -> LiftedState:
    """Lift the module arguments' state, then the optimizers' state (which must be
    that of lifted parameters)."""
    state = lift_module_state(call.modules)
    params = state.tensors[: state.num_params]
    sparse_names = sparse_gradients.sparse_params(call.modules, params)
    lifted_optimizers = [
        optimizers.lift(
            cast(torch.optim.Optimizer, example_inputs[position]),
            position,
            params,
            sparse_names,
            where=convention.argument(position, call.argument_names),
        )
        for position in call.optimizer_positions
    ]
    deferrals = sparse_gradients.Deferrals(call.argument_names)
    return LiftedState(state, sparse_names, lifted_optimizers, deferrals)


@dataclass
class UserLeaves:
    """The user inputs flattened into the leaves the graph takes after the module
    state, with their mark_unbacked dims and, where any is marked, the fakes the
    trace runs on."""

    # The namedtuple and dataclass types among the inputs, by import path.
    input_types: list[str]
    leaves: list[object]
    in_spec: pytree.TreeSpec
    names: list[str]
    marks: list[dict[int, dynamic_dims.DimMark]]
    symbolic: dynamic_dims.SymbolicInputs | None
    # The float leaves traced as graph inputs (``data_dependent.FloatArguments``).
    numbers: list[int]


def flatten_user_inputs(
    call: Arguments, state: ModuleState, backend: Backend, numbers: bool
) -> UserLeaves:
    """Flatten the user inputs, refusing a module among them and the dim marks the
    artifact cannot honour; with ``numbers``, the float leaves are traced as graph
    inputs (a symbolic trace's are built in)."""
    # Before flattening: a dataclass is opened once registered.
    input_types = [
        path
        for position, argument in zip(
            call.user_positions, call.user_inputs, strict=True
        )
        for path in pytree_types.record(
            argument,
            functools.partial(convention.argument, position, call.argument_names),
        )
    ]
    user_leaves, in_spec = pytree.tree_flatten(call.user_inputs)
    leaf_names = convention.leaf_names(
        call.user_positions, call.argument_names, call.user_inputs
    )
    _reject_nested_modules(user_leaves, leaf_names)
    _reject_lazy_bits(user_leaves, leaf_names)
    marks = dynamic_dims.read_dim_marks(user_leaves, leaf_names, backend)
    symbolic = (
        dynamic_dims.symbolic_inputs(state.tensors, user_leaves, leaf_names, marks)
        if any(marks)
        else None
    )
    floats = [i for i, leaf in enumerate(user_leaves) if type(leaf) is float]
    return UserLeaves(
        input_types,
        user_leaves,
        in_spec,
        leaf_names,
        marks,
        symbolic,
        floats if numbers and symbolic is None else [],
    )


@dataclass
class GraphInputs:
    """The tensors the graph is traced on, in graph-input order: the module state,
    the user-input leaves, the optimizers' state, one ``lr`` per param group, then
    the values tensor of each group with numbers its step may read at each call."""

    flat_args: list[object]
    num_state: int
    num_params: int
    # Where the optimizers' state begins, where their lrs begin, and their groups'
    # values tensors.
    state_start: int
    lr_start: int
    values_start: int
    aliased_inputs: list[AliasGroup]
    # The DTensor graph inputs' mesh shapes and placements, by position.
    dtensor_layouts: dict[int, DTensorLayout]
    # Each tensor's version counter before the trace: an update fn makes in place
    # shows as a change.
    versions: list[int | None]


def lay_out(lifted: LiftedState, user: UserLeaves, backend: Backend) -> GraphInputs:
    """Lay out the graph inputs, refusing the combinations of aliasing, DTensors,
    dim marks and optimizers the trace cannot hold."""
    state = lifted.state
    aliased_inputs = _aliased_inputs(state, user)
    dtensor_layouts = dtensors.layouts([*state.tensors, *user.leaves])
    # Inductor gets the graph traced again on the local shards after the trace,
    # which a symbolic trace's fakes cannot give: refused before the trace costs
    # anything.
    if backend == "inductor" and dtensor_layouts and user.symbolic is not None:
        raise PrecompileError(
            "mark_unbacked dims and DTensors cannot be captured together on the "
            "inductor backend yet. Leave the dims static, or capture with "
            "backend='eager'."
        )
    # The optimizers' state and lr tensors follow the input leaves.
    optimizer_state = [t for entry in lifted.optimizers for t in entry.state]
    lrs = optimizers.lr_tensors(lifted.optimizers)
    values = optimizers.value_tensors(lifted.optimizers)
    num_state = len(state.tensors)
    state_start = num_state + len(user.leaves)
    flat_args = _tensors_to_trace(
        lifted, user, aliased_inputs, [*optimizer_state, *lrs, *values]
    )
    return GraphInputs(
        flat_args=flat_args,
        num_state=num_state,
        num_params=state.num_params,
        state_start=state_start,
        lr_start=state_start + len(optimizer_state),
        values_start=state_start + len(optimizer_state) + len(lrs),
        aliased_inputs=aliased_inputs,
        dtensor_layouts=dtensor_layouts,
        versions=[version(arg) for arg in flat_args],
    )


def _aliased_inputs(state: ModuleState, user: UserLeaves) -> list[AliasGroup]:
    """The module state and input leaves that share a storage; a DTensor among them
    is refused."""
    flat = [*state.tensors, *user.leaves]
    aliased_inputs = aliasing.alias_groups(flat)
    dtensors.reject_aliasing(
        aliased_inputs,
        flat,
        [
            *(
                f"the model's {name!r}"
                for name in state.param_names + state.buffer_names
            ),
            *user.names,
        ],
    )
    return aliased_inputs


def _tensors_to_trace(
    lifted: LiftedState,
    user: UserLeaves,
    aliased_inputs: list[AliasGroup],
    optimizer_inputs: list[torch.Tensor],
) -> list[object]:
    """Copies of the example tensors, or with mark_unbacked dims the fakes they
    become, so that tracing changes none of the example's."""
    state = lifted.state
    if user.symbolic is None:
        flat_args = aliasing.copies_for_trace([*state.tensors, *user.leaves])
        for index in user.numbers:
            number = cast(float, user.leaves[index])
            flat_args[len(state.tensors) + index] = torch.tensor(
                number, dtype=torch.float64
            )
        flat_args += optimizer_inputs
        return flat_args
    if lifted.optimizers:
        raise PrecompileError(
            "an optimizer argument cannot be captured together with mark_unbacked "
            "dims. Leave the dims static, or call the optimizer after the "
            "precompiled function."
        )
    _reject_symbolic_aliasing(
        aliased_inputs,
        [*state.tensors, *user.leaves],
        [{}] * len(state.tensors) + user.marks,
    )
    return user.symbolic.flat_args


def _reject_nested_modules(leaves: list[object], leaf_names: list[str]) -> None:
    # Only positional module arguments have their state lifted to graph inputs; the
    # parameters of a module inside a list or dict would be baked in as constants.
    for name, leaf in zip(leaf_names, leaves, strict=True):
        if isinstance(leaf, torch.nn.Module):
            raise PrecompileError(
                f"{name} is an nn.Module ({type(leaf).__name__}) inside a container, "
                "but only modules passed as positional arguments have their "
                "parameters and buffers lifted to inputs of the artifact. Pass it as "
                "an argument of its own: fn(encoder, head, x) rather than "
                "fn({'encoder': encoder, 'head': head}, x)."
            )


def _reject_lazy_bits(leaves: list[object], leaf_names: list[str]) -> None:
    # The driver refuses a conjugate or negative bit on an input at every call, since
    # a graph's kernels read memory as it is; a capture on one would make an artifact
    # that no call passes.
    for name, leaf in zip(leaf_names, leaves, strict=True):
        if isinstance(leaf, torch.Tensor) and (leaf.is_conj() or leaf.is_neg()):
            bit, resolve = (
                ("conjugate", "resolve_conj")
                if leaf.is_conj()
                else ("negative", "resolve_neg")
            )
            raise PrecompileError(
                f"{name} is a lazy view with its {bit} bit set (as tensor.conj() "
                "and tensor.conj().imag leave them), which the artifact's calls "
                f"refuse. Capture and call with the tensor resolved, .{resolve}()."
            )


def _reject_symbolic_aliasing(
    groups: list[AliasGroup], flat: list[object], marks: list[dict[int, Any]]
) -> None:
    # A capture with mark_unbacked dims traces on fakes: a tensor passed twice is one
    # fake, but views of one storage cannot be rebuilt at symbolic offsets, and the
    # strides of a tensor with a marked dim are not fixed, so neither can alias.
    for group in groups:
        if len({id(flat[position]) for position in group}) > 1:
            raise PrecompileError(
                "two inputs are views of one storage (or a view and its base), "
                "which a capture with mark_unbacked dims cannot trace as eager runs "
                "it. Pass separate tensors (.clone() one of them), or leave the dims "
                "static (do not mark them)."
            )
        if any(marks[position] for position in group):
            raise PrecompileError(
                "a tensor with a mark_unbacked dim is passed in more than one "
                "position (or is also a parameter), which a capture with dynamic "
                "dims cannot hold calls to. Pass it once, or pass a .clone() in the "
                "other position."
            )


def version(value: object) -> int | None:
    # A DTensor's local shard is what an update writes.
    return dtensors.data(value)._version if isinstance(value, torch.Tensor) else None
