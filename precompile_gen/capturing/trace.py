"""Trace: ``fn(*example_inputs)`` into one ATen graph with make_fx.

Every ``nn.Module`` argument has its parameters and buffers lifted to graph inputs by
functional reparametrisation, so the graph takes ``[*params, *buffers, *user_leaves]``
and nothing live is baked in. If ``fn`` runs a backward, the parameters' gradients are
harvested as extra trailing outputs. An optimizer argument whose step the artifact
captures (``optimizers.SUPPORTED``) has the state
its ``step()`` reads, then one ``lr`` per param group, lifted to inputs after the user
leaves (``optimizers``). The trace runs on copies of the example tensors
(fake ones when an input has a mark_unbacked dim): tracing never changes the example
model, its buffers, its ``.grad`` fields or the example inputs; modules that ``fn``
switches between train and eval mode are put back as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, cast
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from precompile_gen.capture_result import (
    Backend,
    CallConvention,
    InputStrides,
    LocalShards,
    OptimizerArgument,
    ParamGroup,
    PythonValue,
    check_backend,
)
from precompile_gen.capturing import (
    branches,
    convention,
    data_dependent,
    data_parallel,
    dtensors,
    dynamic_dims,
    fully_sharded,
    generator_states,
    global_modes,
    grad_resets,
    graph_checks,
    graph_inputs,
    index_checks,
    optimizers,
    python_state,
    pytree_types,
    records,
    refused_draws,
    sparse_gradients,
    tensor_literals,
    update_order,
    value_sizes,
)
from precompile_gen.runtime.errors import (
    PrecompileError,
    PrecompileNotImplementedError,
    PrecompileValueError,
)
from precompile_gen.tools import timings

log = logging.getLogger(__name__)


def check_arguments(fn: object, backend: str, tracer: str) -> Backend:
    if tracer == "dynamo":
        raise PrecompileNotImplementedError(
            "tracer='dynamo' is not implemented; use tracer='make_fx' (the default)."
        )
    if tracer != "make_fx":
        raise PrecompileValueError(f"tracer must be 'make_fx', got {tracer!r}.")
    if not callable(fn):
        raise ValueError(
            "fn must be callable (the computation to capture), got "
            f"{type(fn).__name__}."
        )
    return check_backend(backend)


@dataclass
class TracedGraph:
    """The captured graph, the tensors it was traced on, and its calling convention,
    which the trace fills once and lowering passes on as it is."""

    gm: torch.fx.GraphModule
    # The tensors the graph was traced on, in graph-input order; lowering needs them.
    # In a capture with mark_unbacked dims they are fakes whose ShapeEnv holds the
    # dims' symbols and bounds, which Inductor compiles against.
    flat_args: list[object]
    # The tensors fn created from Python data (torch.tensor(...)), by the name of the
    # graph input each became; they are the last inputs in ``flat_args``, after the
    # user-input leaves and the optimizers' state and lr tensors.
    constants: list[tuple[str, torch.Tensor]]
    # The example's strides, one per graph input before the lrs (None for a
    # non-tensor leaf or one with dynamic dims): lowering keeps those the compiled
    # graph depends on.
    example_strides: InputStrides
    convention: CallConvention
    # Where the graph was traced on DTensors' local shards, which inputs and outputs
    # are shards.
    local_shards: LocalShards | None = None


def trace(
    fn: Callable[..., object],
    example_inputs: tuple[object, ...],
    *,
    backend: Backend,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> TracedGraph:
    """Trace ``fn(*example_inputs)``; reject what the artifact could not reproduce."""
    call = graph_inputs.classify_arguments(fn, example_inputs)
    # First, on copies: refuses Python effects before the trace would make them.
    with data_parallel.in_place_as_functional():
        python_values = python_state.observe(
            fn, data_parallel.observable(example_inputs)
        )
    capture = _Capture(
        fn,
        example_inputs,
        call,
        graph_inputs.read_module_modes(call.modules),
        python_values,
        backend,
        decompositions,
        numbers=True,
    )
    try:
        return _trace_graph(capture)
    except Exception:
        if not any(
            type(leaf) is float for leaf in pytree.tree_leaves(call.user_inputs)
        ):
            raise
    # fn failed with its float arguments as numbers the graph holds (a torch op
    # that takes only a Python float, a check of their type): they are built in,
    # as the example's values, and the driver holds each call to them.
    log.debug("traced again with the float arguments built in")
    return _trace_graph(dataclasses.replace(capture, numbers=False))


@dataclass(frozen=True)
class _Capture:
    """What every trace of one capture shares: fn and its example call, with the
    arguments sorted, the modules' modes and the Python values read before any
    trace, and how to trace."""

    fn: Callable[..., object]
    example_inputs: tuple[object, ...]
    call: graph_inputs.Arguments
    modes: graph_inputs.ModuleModes
    python_values: list[PythonValue]
    backend: Backend
    decompositions: dict[Any, Callable[..., Any]] | None
    # Whether fn's float arguments are graph inputs (else built in as the example's).
    numbers: bool


def _trace_graph(capture: _Capture) -> TracedGraph:
    """make_fx's graph of fn and its calling convention. A branch on a tensor's
    value is traced both ways and becomes a torch.cond (``branches``)."""
    fn, call = capture.fn, capture.call
    found = branches.explore(functools.partial(_trace_path, capture))
    path = cast(_PathState, found.paths[0].payload)
    lifted, user, inputs = path.lifted, path.user, path.inputs
    merged = branches.Merged(found.paths[0].gm, [], None)
    if found.paths[0].reads:
        _reject_branches_with(path, call.fn_name)
        merged = branches.merge(found)
    gm = merged.gm
    mutated = sorted(
        set().union(*(cast(_PathState, p.payload).mutated for p in found.paths))
    )
    value_sizes.reject_pinned_sizes(gm, call.fn_name)
    dynamic_dims.reject_constrained_dims(user.symbolic, call.fn_name)
    updates = _read_updates(gm, call, lifted, inputs, path.harvest, mutated)
    constants = _constants_as_inputs(gm, fn, call, user.symbolic, inputs.flat_args)
    if found.paths[0].reads:
        # Each path's graph was checked as it was traced; the merge made a new one.
        graph_checks.check_graph_ops(gm)
    _hoist_updates(gm, lifted.state, inputs)
    local = _local_graph(
        gm, path.on_shards, inputs, capture.backend, capture.decompositions
    )
    return _record(capture, gm, local, path, updates, constants, merged)


@dataclass
class _PathState:
    """What one trace of fn traced on and learnt, besides its graph."""

    lifted: graph_inputs.LiftedState
    user: graph_inputs.UserLeaves
    inputs: graph_inputs.GraphInputs
    harvest: records.Harvest
    on_shards: dtensors.LocalTrace | None
    # The positions of the graph inputs the trace updated in place.
    mutated: list[int]


def _trace_path(capture: _Capture, forced: tuple[bool, ...]) -> branches.PathTrace:
    """One trace of fn, on fresh copies of the inputs, its first branches on tensor
    values held to ``forced``."""
    fn, call, backend = capture.fn, capture.call, capture.backend
    lifted = graph_inputs.lift_state(call, capture.example_inputs)
    user = graph_inputs.flatten_user_inputs(
        call, lifted.state, backend, capture.numbers
    )
    inputs = graph_inputs.lay_out(lifted, user, backend)
    harvest = records.Harvest(grad_enabled=torch.is_grad_enabled())
    flat_fn = _flat_function(capture, lifted, user, inputs, harvest)
    generators = refused_draws.torch_generators(call.modules, user.leaves)
    # A fully_shard model's trace runs on local shards (``fully_sharded``).
    on_shards = (
        dtensors.on_local_shards(flat_fn, inputs.flat_args)
        if fully_sharded.holds_sharded(call.modules)
        else None
    )
    with (
        python_state.kept_as_found(capture.example_inputs, capture.python_values),
        branches.following(forced) as reads,
    ):
        gm = _make_fx(
            fn,
            call.fn_name,
            flat_fn,
            inputs.flat_args,
            user.symbolic,
            capture.decompositions,
            harvest.raised_by_fn,
            on_shards,
        )
    refused_draws.reject_torch_generators(gm, fn, generators)
    graph_checks.check_graph_ops(gm)
    state = _PathState(
        lifted, user, inputs, harvest, on_shards, _mutated_inputs(gm, inputs)
    )
    return branches.PathTrace(gm, reads, _agreement(state), _step(state), state)


def _mutated_inputs(
    gm: torch.fx.GraphModule, inputs: graph_inputs.GraphInputs
) -> list[int]:
    """The module state and input leaves the trace updated in place."""
    # The trace ran fn for real (or on fakes), so an in-place update of an input
    # shows in its version counter. (An optimizer's state, after them, always is.)
    # Some kernels write an argument without bumping it (native_batch_norm's running
    # stats): the ops' schemas say which arguments they write.
    written = update_order.written_inputs(gm)
    return [
        position
        for position, (arg, before) in enumerate(
            zip(inputs.flat_args, inputs.versions, strict=True)
        )
        if position < inputs.state_start
        and (graph_inputs.version(arg) != before or position in written)
    ]


def _agreement(path: _PathState) -> dict[str, object]:
    """What every path through fn's branches must share, by what a message calls
    it: the driver handles each call alike."""
    harvest, lifted = path.harvest, path.lifted
    return {
        "what fn returns": (
            records.dump_out_spec(harvest.out_spec),
            harvest.pytree_types,
            harvest.scalar_outputs,
        ),
        "the sparse steps left to the driver": repr(lifted.deferrals.records()),
        "the float arguments used as Python values": sorted(
            harvest.float_arguments.specialized.items()
        ),
    }


def _step(path: _PathState) -> branches.Step:
    """What the path's step does that the driver finishes, which a path through
    fn's branches may skip."""
    harvest = path.harvest
    return branches.Step(
        grads=harvest.grad_param_indices,
        sparse=harvest.sparse_grads,
        resets=sorted(harvest.resets.items()),
        steps=[
            id(entry.optimizer) in harvest.stepped for entry in path.lifted.optimizers
        ],
    )


def _reject_branches_with(path: _PathState, fn_name: str) -> None:
    if path.on_shards is not None or path.inputs.dtensor_layouts:
        raise PrecompileError(
            f"{fn_name!r} branches on a tensor's value, which cannot be captured "
            "together with DTensors or fully_shard yet. Select with "
            "torch.where(condition, a, b), or move the branch out of the function."
        )


def _local_graph(
    gm: torch.fx.GraphModule,
    on_shards: dtensors.LocalTrace | None,
    inputs: graph_inputs.GraphInputs,
    backend: Backend,
    decompositions: dict[Any, Callable[..., Any]] | None,
) -> dtensors.LocalGraph | None:
    """The graph on the DTensor inputs' local shards, where the graph to lower is
    one: traced so (``on_shards``), or traced again so for inductor."""
    if on_shards is not None:
        return dtensors.LocalGraph(
            gm,
            dtensors.local_args(inputs.flat_args),
            dtensors.shard_inputs(inputs.flat_args),
            on_shards.outputs,
        )
    # Optimizer state is a DTensor only where its parameter is.
    if backend == "inductor" and inputs.dtensor_layouts:
        return dtensors.to_local_graph(gm, inputs.flat_args, decompositions)
    return None


def _flat_function(
    capture: _Capture,
    lifted: graph_inputs.LiftedState,
    user: graph_inputs.UserLeaves,
    inputs: graph_inputs.GraphInputs,
    harvest: records.Harvest,
) -> Callable[[list[Any]], list[object]]:
    """fn as make_fx traces it: the graph inputs in one flat list, fn's result leaves
    then the parameters' gradients out."""
    call = capture.call

    def flat_fn(flat: list[Any]) -> list[object]:
        leaves = flat[inputs.num_state : inputs.state_start]
        for index in user.numbers:
            leaves[index] = data_dependent.GraphNumber(
                leaves[index],
                None,
                call.fn_name,
                frozenset({index}),
                harvest.float_arguments,
            )
        user_inputs = pytree.tree_unflatten(leaves, user.in_spec)
        with _running_on_graph_inputs(
            flat, call, capture.modes, lifted, inputs, harvest, bool(user.numbers)
        ):
            args = _interleave(
                capture.example_inputs, call.lifted_positions, user_inputs
            )
            try:
                result = capture.fn(*args)
            except Exception as error:
                harvest.raised_by_fn.append(error)
                raise
        grads = [p.grad for p in flat[: inputs.num_params]]
        _reject_stray_grads(lifted.state, flat[: inputs.state_start], user.names)
        return _graph_outputs(result, grads, call.fn_name, harvest)

    return flat_fn


@contextlib.contextmanager
def _running_on_graph_inputs(
    flat: list[Any],
    call: graph_inputs.Arguments,
    modes: graph_inputs.ModuleModes,
    lifted: graph_inputs.LiftedState,
    inputs: graph_inputs.GraphInputs,
    harvest: records.Harvest,
    float_arguments: bool,
) -> Generator[None]:
    """While fn runs traced: the modules and optimizers read and update the graph
    inputs ``flat`` in place of their own tensors, and what fn does to modes,
    ``.grad`` fields, tensor values and sparse steps is recorded or refused
    (``float_arguments``: whether fn's floats are GraphNumbers)."""
    state, num_params = lifted.state, inputs.num_params
    with (
        _modes_restored(modes.submodules, modes.training),
        _reparametrized(call.modules, state, flat[: inputs.num_state]),
        optimizers.stepping_copies(
            lifted.optimizers,
            flat[:num_params],
            flat[inputs.state_start : inputs.lr_start],
            flat[inputs.lr_start : inputs.values_start],
            flat[inputs.values_start :],
        ),
        grad_resets.recording(
            state.tensors[:num_params],
            flat[:num_params],
            harvest.resets,
            [entry.optimizer for entry in lifted.optimizers],
            harvest.stepped,
        ),
        data_dependent.value_reads(call.modules, call.fn_name, float_arguments),
        data_parallel.reducing(
            call.modules, *_module_params(state, flat, len(call.modules))
        ),
        fully_sharded.unsharding(call.modules),
        sparse_gradients.deferring(
            [(e.argument.position, e.optimizer) for e in lifted.optimizers],
            call.sparse_steppers,
            state.tensors[:num_params],
            flat[:num_params],
            lifted.sparse_names,
            state.param_names,
            lifted.deferrals,
        ),
    ):
        yield


def _graph_outputs(
    result: object, grads: list[Any], fn_name: str, harvest: records.Harvest
) -> list[object]:
    """The graph's outputs: fn's result leaves, then the gradients the parameters
    got; ``harvest`` records how to rebuild the result and whose gradients they are."""
    harvest.pytree_types = pytree_types.record(
        result, functools.partial(_result_part, fn_name), result=True
    )
    result_leaves, harvest.out_spec = pytree.tree_flatten(result)
    result_leaves, harvest.scalar_outputs = data_dependent.scalar_outputs(result_leaves)
    _reject_opaque_results(result, result_leaves, fn_name)
    harvest.grad_param_indices = [i for i, g in enumerate(grads) if g is not None]
    global_modes.check_backward(
        harvest.grad_enabled, bool(harvest.grad_param_indices), fn_name
    )
    harvest.sparse_grads = [
        k for k, g in enumerate(g for g in grads if g is not None) if g.is_sparse
    ]
    return [*result_leaves, *(g for g in grads if g is not None)]


def _make_fx(
    fn: Callable[..., object],
    fn_name: str,
    flat_fn: Callable[[list[Any]], list[object]],
    flat_args: list[object],
    symbolic: dynamic_dims.SymbolicInputs | None,
    decompositions: dict[Any, Callable[..., Any]] | None,
    raised_by_fn: list[Exception],
    on_shards: dtensors.LocalTrace | None,
) -> torch.fx.GraphModule:
    """make_fx's graph of ``flat_fn``; fn's own exception reaches the caller as it
    would eagerly, any other failure becomes a ``PrecompileError`` naming fn. Traced
    ``on_shards`` (its function on the local shards of ``flat_args``), DTensor's
    conversions are recorded like any op."""
    if on_shards is not None:
        flat_fn, flat_args = on_shards.fn, dtensors.local_args(flat_args)
    try:
        # Grad mode on, so a backward inside fn is recorded as graph ops.
        mode = _one_fake_mode() if symbolic is None else symbolic.fake_mode
        with (
            timings.stage("capture: make_fx"),
            torch.enable_grad(),
            mode,
            _compiling(),
            _rnns_step_by_step(),
            refused_draws.refusing_python_rng(fn),
            generator_states.recording() as recorded,
            data_parallel.functional_collectives(),
            contextlib.nullcontext()
            if on_shards is not None
            else dtensors.refusing_conversions(fn_name),
        ):
            gm = make_fx(
                flat_fn,
                decomposition_table=decompositions,
                tracing_mode="real" if symbolic is None else "symbolic",
            )(flat_args)
        generator_states.repeat_first_draws(gm, recorded, fn_name)
        return gm
    except PrecompileError:
        raise
    except Exception as error:
        failure = _trace_failure(error, symbolic, fn_name, raised_by_fn)
        if failure is error:
            raise
        raise failure from error


def _trace_failure(
    error: Exception,
    symbolic: dynamic_dims.SymbolicInputs | None,
    fn_name: str,
    raised_by_fn: list[Exception],
) -> Exception:
    """What a failed trace raises: fn's own exception as eager would raise it, so
    that the caller's ``except`` clauses keep working (a note says where it rose),
    or a ``PrecompileError`` naming fn."""
    untraceable = _untraceable(error, symbolic, fn_name)
    if untraceable is not None:
        return untraceable
    if any(error is raised for raised in raised_by_fn):
        error.add_note(
            f"precompile_gen: {fn_name!r} raised this while it was traced on "
            "copies of the example inputs (capture). Check that "
            f"{fn_name}(*example_inputs) runs eagerly with these inputs; while "
            "tracing, torch.compiler.is_compiling() is true and every tensor is a "
            "copy of the example's."
        )
        return error
    return PrecompileError(
        f"capture failed while tracing {fn_name!r}: {type(error).__name__}: "
        f"{_first_line(error)}. The function must run on the example inputs as "
        "written (positional arguments, modules passed as arguments); check that "
        f"{fn_name}(*example_inputs) runs eagerly."
    )


def _read_updates(
    gm: torch.fx.GraphModule,
    call: graph_inputs.Arguments,
    lifted: graph_inputs.LiftedState,
    inputs: graph_inputs.GraphInputs,
    harvest: records.Harvest,
    mutated_inputs: list[int],
) -> records.Updates:
    """What fn updated: the inputs it wrote, the optimizer steps the graph takes and
    those left to the driver, and the sparse gradients split from the dense."""
    deferred_steps = lifted.deferrals.records()
    optimizer_arguments = _finish_optimizers(
        gm,
        inputs.flat_args,
        inputs.state_start,
        lifted.optimizers,
        harvest.stepped,
        [
            index
            for index in harvest.grad_param_indices
            if not any(index in step.params for step in deferred_steps)
        ],
        call.argument_names,
    )
    param_names = lifted.state.param_names
    lifted.deferrals.reject_reads_after_steps(gm, lifted.sparse_names, param_names)
    sparse = sparse_gradients.split(
        gm,
        harvest.grad_param_indices,
        harvest.sparse_grads,
        lifted.sparse_names,
        param_names,
    )
    return records.Updates(mutated_inputs, deferred_steps, optimizer_arguments, sparse)


def _constants_as_inputs(
    gm: torch.fx.GraphModule,
    fn: Callable[..., object],
    call: graph_inputs.Arguments,
    symbolic: dynamic_dims.SymbolicInputs | None,
    flat_args: list[object],
) -> list[tuple[str, torch.Tensor]]:
    """The tensor literals fn created, lifted to the graph's last inputs and
    appended to ``flat_args`` (as fakes in a symbolic trace)."""
    constants = tensor_literals.lift_constants(
        gm, fn, call.modules, call.module_positions, call.argument_names
    )
    if symbolic is None:
        flat_args += [tensor for _, tensor in constants]
    else:
        flat_args += [symbolic.fake_mode.from_tensor(t) for _, t in constants]
    return constants


def _hoist_updates(
    gm: torch.fx.GraphModule,
    state: graph_inputs.ModuleState,
    inputs: graph_inputs.GraphInputs,
) -> None:
    """Run each parameter's and optimizer state's update as soon as its gradient is
    final (``update_order``)."""
    if not inputs.aliased_inputs:
        update_order.hoist_updates(
            gm, {*range(state.num_params), *range(inputs.state_start, inputs.lr_start)}
        )


def _record(
    capture: _Capture,
    gm: torch.fx.GraphModule,
    local: dtensors.LocalGraph | None,
    path: _PathState,
    updates: records.Updates,
    constants: list[tuple[str, torch.Tensor]],
    merged: branches.Merged,
) -> TracedGraph:
    """The captured graph and its calling convention, as the first path's trace
    saw the inputs; with DTensors on the inductor backend, the graph traced again
    on the local shards (``local``)."""
    call, modes, user, harvest = capture.call, capture.modes, path.user, path.harvest
    flat_args = path.inputs.flat_args
    state = path.lifted.state
    # From the graph on whole tensors, which the call's leaves are.
    names = state.param_names + state.buffer_names
    checks = index_checks.index_checks(gm, names, len(user.leaves))
    example_strides = records.example_strides(
        state, user, flat_args, updates.optimizers
    )
    state_tensors = records.state_tensors(state)
    if local is not None:
        gm, flat_args = local.gm, local.flat_args
    convention = CallConvention(
        fn_name=call.fn_name,
        num_positional_args=len(call.argument_names),
        argument_names=call.argument_names,
        modules=records.module_arguments(call, modes),
        global_module_hooks=modes.global_hooks,
        params=state_tensors[: state.num_params],
        buffers=state_tensors[state.num_params :],
        in_tree=records.input_tree(user.in_spec, len(call.user_positions)),
        leaves=records.input_leaves(user, harvest.float_arguments),
        input_names=records.input_names(call, state, updates, constants),
        aliased_inputs=path.inputs.aliased_inputs,
        out_spec=records.dump_out_spec(harvest.out_spec),
        out_structure=pytree.treespec_pprint(harvest.out_spec),
        grad_param_indices=harvest.grad_param_indices,
        scalar_outputs=harvest.scalar_outputs,
        python_values=capture.python_values,
        optimizers=updates.optimizers,
        process_groups=data_parallel.process_groups(gm, call.modules),
        data_parallel=records.data_parallel_records(call),
        dtensors=path.inputs.dtensor_layouts,
        sparse_gradients=updates.sparse_gradients,
        deferred_steps=updates.deferred_steps,
        pytree_types=list(dict.fromkeys(user.input_types + harvest.pytree_types)),
        mutated_inputs=updates.mutated_inputs,
        index_checks=checks,
        **records.branch_records(harvest, merged),
    )
    shards = None if local is None else LocalShards(local.inputs, local.outputs)
    return TracedGraph(gm, flat_args, constants, example_strides, convention, shards)


def _module_params(
    state: graph_inputs.ModuleState, flat: list[Any], count: int
) -> tuple[list[list[torch.Tensor]], list[list[str]]]:
    """Per module argument, its traced parameters (each once) and their names."""
    params: list[list[torch.Tensor]] = [[] for _ in range(count)]
    names: list[list[str]] = [[] for _ in range(count)]
    for mi, _, index in state.bindings:
        if index < state.num_params and state.param_names[index] not in names[mi]:
            params[mi].append(flat[index])
            names[mi].append(state.param_names[index])
    return params, names


def _untraceable(
    error: Exception,
    symbolic: dynamic_dims.SymbolicInputs | None,
    fn_name: str,
) -> PrecompileError | None:
    """The ``PrecompileError`` for a trace that stopped where fn's code depends on
    tensor values (a guard on a dynamic dim, a value read), or None."""
    guard = dynamic_dims.guard_error_in(error)
    if guard is not None and symbolic is not None:
        return dynamic_dims.data_dependent_error(guard, symbolic, fn_name)
    return data_dependent.value_read_error(error, fn_name)


@contextlib.contextmanager
def _compiling() -> Generator[None]:
    """``torch.compiler.is_compiling()`` is true while fn is traced, as it is in
    torch.export's non-strict trace: library code checks it to take a path that
    traces (transformers builds attention masks without data-dependent branches).
    And torch knows the trace for the non-strict one it is: selective activation
    checkpointing then caches and recomputes as eager does, where it would otherwise
    cache every op for a partitioner that this graph never meets (and refuse a
    random op's output that dropout scales in place)."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        with torch.compiler._non_strict_tracing_context():
            yield
    finally:
        torch.compiler._is_compiling_flag = previous


@contextlib.contextmanager
def _one_fake_mode() -> Generator[None]:
    """One FakeTensorMode for the metadata of every value a real-mode trace records
    (each node's ``meta["val"]``), where make_fx makes a mode per value: making one
    walks the whole Python stack, which was a third of a large model's trace (GPT-2
    small's step records some 6,600 values). The values are the same fake tensors,
    now of one mode, as the values of a fake or symbolic trace are."""
    from torch.fx.experimental import proxy_tensor

    make_mode = proxy_tensor.FakeTensorMode
    shared = make_mode(allow_fallback_kernels=True)

    def one_mode(**kwargs: Any) -> Any:
        # Only the mode extract_val makes for a real tensor's value is shared.
        return (
            shared
            if kwargs == {"allow_fallback_kernels": True}
            else make_mode(**kwargs)
        )

    with mock.patch.object(proxy_tensor, "FakeTensorMode", one_mode):
        yield


@contextlib.contextmanager
def _rnns_step_by_step() -> Generator[None]:
    """Trace LSTM, GRU and RNN layers as torch's step-by-step formulation (matrix
    products and activations per time step) rather than oneDNN's fused layer:
    that layer hands its backward a workspace only while grad mode is on, and the
    artifact runs the graph without it, so the backward would get None. Other ops
    are recorded the same either way; oneDNN still serves them at run time."""
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)


@contextlib.contextmanager
def _reparametrized(
    modules: list[torch.nn.Module], state: graph_inputs.ModuleState, tensors: list[Any]
) -> Generator[None]:
    with contextlib.ExitStack() as stack:
        for mi, module in enumerate(modules):
            mapping = {name: tensors[ti] for i, name, ti in state.bindings if i == mi}
            stack.enter_context(
                # Tying would add back the aliases the bindings leave out on purpose.
                stateless._reparametrize_module(module, mapping, tie_weights=False)
            )
        yield


@contextlib.contextmanager
def _modes_restored(
    submodules: list[list[tuple[str, torch.nn.Module]]],
    module_training: list[list[bool]],
) -> Generator[None]:
    """Put every module back in the mode it was in before ``fn`` ran; refuse a
    function that switched one: the artifact cannot switch the runtime model.
    ``submodules`` holds each module argument's ``named_modules()`` as they were
    before ``fn`` ran, aligned with ``module_training``."""
    try:
        yield
    finally:
        switched: tuple[str, torch.nn.Module, bool] | None = None
        for index, named in enumerate(submodules):
            for (name, submodule), was_training in zip(
                named, module_training[index], strict=True
            ):
                if submodule.training != was_training:
                    if switched is None:
                        prefix = f"m{index}" if len(submodules) > 1 else ""
                        qualified = ".".join(p for p in (prefix, name) if p)
                        switched = (qualified, submodule, was_training)
                    submodule.training = was_training
    if switched is not None:
        name, submodule, was_training = switched
        before, after = ("training", "eval") if was_training else ("eval", "training")
        subject = f"module {name!r}" if name else "the model"
        raise PrecompileError(
            f"the function switches {subject} ({type(submodule).__name__}) from "
            f"{before} to {after} mode (a .train() or .eval() call inside it), which "
            "the artifact cannot replay on the runtime model. Put the model in "
            f"{after} mode before precompiling and before each call instead, and "
            "remove the switch from the function."
        )


def _interleave(
    example_inputs: tuple[object, ...],
    lifted_positions: list[int],
    user_inputs: tuple[object, ...],
) -> list[object]:
    """fn's positional arguments: the modules and optimizers in place, the user
    inputs around them."""
    remaining = iter(user_inputs)
    return [
        a if i in lifted_positions else next(remaining)
        for i, a in enumerate(example_inputs)
    ]


def _result_part(fn_name: str, path: str) -> str:
    """How messages name the part of fn's result at ``path``."""
    return f"the result of {fn_name!r}" + (f" at {path}" if path else "")


# What a graph can return as a leaf of the function's result.
_RESULT_LEAF_TYPES = (
    torch.Tensor,
    bool,
    int,
    float,
    str,
    type(None),
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
    torch.dtype,
    torch.device,
)


def _reject_opaque_results(result: object, leaves: list[object], fn_name: str) -> None:
    # Any other object (a library's cache object, say) is neither a tensor nor a
    # container pytree can open; make_fx would fail on it with a bare type name.
    index = next(
        (
            i
            for i, leaf in enumerate(leaves)
            if not isinstance(leaf, _RESULT_LEAF_TYPES)
        ),
        None,
    )
    if index is None:
        return
    # The leaves' paths only for the message: a second walk over the result.
    path = convention.leaf_paths(result)[index]
    where = f"at {path}" if path else "as a whole"
    raise PrecompileError(
        f"{fn_name!r} returns an object of type {type(leaves[index]).__name__} "
        f"{where}, which is neither a tensor nor a container torch.utils._pytree can "
        "open: an artifact returns tensors, Python scalars and tuples, lists and "
        "dicts of them. Return the tensors you need (for a transformers model, pass "
        "use_cache=False to leave its cache out of the output), or register the "
        "type with torch.utils._pytree.register_pytree_node."
    )


def _reject_stray_grads(
    state: graph_inputs.ModuleState, flat: list[Any], leaf_names: list[str]
) -> None:
    # Only parameter gradients are returned to the caller; any other gradient the
    # traced backward produced would be silently dropped by the artifact.
    buffers = flat[state.num_params : len(state.tensors)]
    for name, buffer in zip(state.buffer_names, buffers, strict=True):
        if buffer.grad is not None:
            raise PrecompileError(
                f"the buffer {name!r} received a gradient (it has "
                "requires_grad=True), but only parameter gradients are returned by the "
                "artifact. Register it as an nn.Parameter, or set requires_grad=False "
                "on it."
            )
    user_leaves = flat[len(state.tensors) :]
    # A parameter also passed as an input is one tensor, whose gradient is harvested.
    lifted = {id(tensor) for tensor in flat[: len(state.tensors)]}
    for name, leaf in zip(leaf_names, user_leaves, strict=True):
        if id(leaf) in lifted:
            continue
        if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
            raise PrecompileError(
                f"the input {name} (a {tuple(leaf.shape)} tensor) received a "
                "gradient, but only parameter gradients are returned by the artifact. "
                "Make it a parameter of a module argument if you need its gradient, "
                "or pass it with requires_grad=False."
            )


def _finish_optimizers(
    gm: torch.fx.GraphModule,
    flat_args: list[object],
    state_start: int,
    lifted: list[optimizers.LiftedOptimizer],
    stepped: set[int],
    grad_param_indices: list[int],
    names: list[str],
) -> list[OptimizerArgument]:
    """The optimizer arguments as the trace used them: a state tensor the step never
    read (its parameter got no gradient, or fn did not step) is no graph input, and
    a stepping optimizer must have read each group's ``lr`` from its tensor (``names``:
    the traced function's names for its arguments, for the message)."""
    if not lifted:
        return []
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    position = state_start
    unused: list[int] = []
    arguments = []
    for entry in lifted:
        kept = []
        for spec in entry.argument.state:
            if optimizers.state_read(gm.graph, placeholders[position]):
                kept.append(spec)
            else:
                unused.append(position)
            position += 1
        arguments.append(
            entry.argument._replace(steps=id(entry.optimizer) in stepped, state=kept)
        )
    position += _check_lrs_read(
        arguments, placeholders[position:], grad_param_indices, names
    )
    arguments = [
        argument._replace(groups=groups)
        for argument, groups in zip(
            arguments,
            _groups_with_values(gm.graph, placeholders, position, lifted, unused),
            strict=True,
        )
    ]
    _drop_inputs(gm, unused)
    gm.recompile()  # state_read may have erased nodes
    for index in reversed(unused):
        del flat_args[index]
    return arguments


def _check_lrs_read(
    arguments: list[OptimizerArgument],
    placeholders: list[torch.fx.Node],
    grad_param_indices: list[int],
    names: list[str],
) -> int:
    """Refuse a stepping optimizer whose step did not read a group's lr from its
    tensor (``placeholders``, from the first lr on); how many lrs there are."""
    position = 0
    for argument in arguments:
        for number, group in enumerate(argument.groups):
            updated = any(index in grad_param_indices for index in group.params)
            if (
                argument.steps
                and updated
                and not placeholders[position].users
                and argument.name not in optimizers.LR_AT_FIRST_STEP_ONLY
            ):
                raise PrecompileError(
                    f"the step of the optimizer {argument.name} at "
                    f"{convention.argument(argument.position, names)} did not "
                    f"read param group {number}'s lr from the tensor the artifact "
                    "passes, so the graph would keep "
                    "the example's learning rate. This configuration of the "
                    "optimizer is not supported inside the artifact; call it after "
                    "the precompiled function."
                )
            position += 1
    return position


def _groups_with_values(
    graph: torch.fx.Graph,
    placeholders: list[torch.fx.Node],
    position: int,
    lifted: list[optimizers.LiftedOptimizer],
    unused: list[int],
) -> list[list[ParamGroup]]:
    """Each optimizer's groups as the traced step used their numbers, the values
    tensors starting at ``position``; a values tensor the graph does not read joins
    ``unused``."""
    result = []
    for entry in lifted:
        groups = []
        for number, (group, candidates) in enumerate(
            zip(entry.argument.groups, entry.candidates, strict=True)
        ):
            read = False
            if candidates:
                read = optimizers.values_read(graph, placeholders[position])
                if not read:
                    unused.append(position)
                position += 1
            groups.append(
                optimizers.traced_group(group, number, candidates, entry.reads, read)
            )
        result.append(groups)
    return result


def _drop_inputs(gm: torch.fx.GraphModule, positions: list[int]) -> None:
    """Remove the unused graph inputs at ``positions``."""
    if not positions:
        return
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    for position in positions:
        graph.erase_node(placeholders[position])
    tensor_literals.unpack_inputs(gm, len(placeholders) - len(positions))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
