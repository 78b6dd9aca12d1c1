"""Capture: trace ``fn(*example_inputs)`` into one ATen graph with make_fx.

Every ``nn.Module`` argument has its parameters and buffers lifted to graph inputs by
functional reparametrisation, so the graph takes ``[*params, *buffers, *user_leaves]``
and nothing live is baked in. If ``fn`` runs a backward, the parameters' gradients are
harvested as extra trailing outputs. The trace runs on copies of the example tensors
(fake ones when an input has a mark_unbacked dim): capture never changes the example
model, its buffers, its ``.grad`` fields or the example inputs.
"""

from __future__ import annotations

import contextlib
import inspect
import sysconfig
import traceback
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import sympy
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.nn.utils import stateless

from precompile_gen.capture_result import (
    BACKENDS,
    Backend,
    CaptureResult,
    DimBounds,
    Shape,
)
from precompile_gen.errors import PrecompileError
from precompile_gen.lower import lower


def capture(
    fn: Callable[..., object],
    *example_inputs: object,
    backend: str = "inductor",
    tracer: str = "make_fx",
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> CaptureResult:
    """Trace ``fn(*example_inputs)`` and lower the graph; no artifact text yet."""
    checked = _check_arguments(fn, backend, tracer)
    traced = trace(fn, example_inputs, backend=checked, decompositions=decompositions)
    return lower(traced, checked)


def _check_arguments(fn: object, backend: str, tracer: str) -> Backend:
    if tracer == "dynamo":
        raise NotImplementedError(
            "tracer='dynamo' is not implemented; use tracer='make_fx' (the default)."
        )
    if tracer != "make_fx":
        raise ValueError(f"tracer must be 'make_fx', got {tracer!r}.")
    if not callable(fn):
        raise ValueError(
            "fn must be callable (the computation to capture), got "
            f"{type(fn).__name__}."
        )
    for known in BACKENDS:
        if backend == known:
            return known
    raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}.")


@dataclass
class ModuleState:
    """The modules' parameters then buffers, each tensor once (tied weights are one
    entry), with the names and per-module bindings used to reparametrise them."""

    tensors: list[torch.Tensor]
    param_names: list[str]
    buffer_names: list[str]
    # (module index, attribute path, index into ``tensors``) for every name, aliases
    # of tied weights included, so each module can be reparametrised completely.
    bindings: list[tuple[int, str, int]]

    @property
    def num_params(self) -> int:
        return len(self.param_names)


@dataclass
class TracedGraph:
    """The captured graph and its calling convention (still holding torch objects)."""

    gm: torch.fx.GraphModule
    # The tensors the graph was traced on, in graph-input order; lowering needs them.
    # In a capture with mark_unbacked dims they are fakes whose ShapeEnv holds the
    # dims' symbols and bounds, which Inductor compiles against.
    flat_args: list[object]
    fn_name: str
    module_positions: list[int]
    num_positional_args: int
    state: ModuleState
    grad_param_indices: list[int]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    user_input_shapes: list[Shape | None]
    user_input_dtypes: list[str | None]
    user_input_devices: list[str | None]
    user_input_bounds: list[DimBounds | None]
    user_input_strides: list[tuple[int, ...] | None]
    user_input_symbols: list[dict[int, str] | None]


def lift_module_state(modules: list[torch.nn.Module]) -> ModuleState:
    """All modules' parameters, then all modules' buffers, interned by identity.

    The artifact's driver re-derives the same list from the runtime model; the order
    (``named_parameters(remove_duplicate=False)``, then buffers) is the calling
    convention and must match it exactly.
    """
    tensors: list[torch.Tensor] = []
    index_of: dict[int, int] = {}
    bindings: list[tuple[int, str, int]] = []
    names: dict[str, list[str]] = {"parameters": [], "buffers": []}
    prefix = len(modules) > 1
    for kind in ("parameters", "buffers"):
        for mi, module in enumerate(modules):
            members = (
                module.named_parameters(remove_duplicate=False)
                if kind == "parameters"
                else module.named_buffers(remove_duplicate=False)
            )
            for name, tensor in members:
                if id(tensor) not in index_of:
                    index_of[id(tensor)] = len(tensors)
                    tensors.append(tensor)
                    names[kind].append(f"m{mi}.{name}" if prefix else name)
                bindings.append((mi, name, index_of[id(tensor)]))
    return ModuleState(tensors, names["parameters"], names["buffers"], bindings)


def trace(
    fn: Callable[..., object],
    example_inputs: tuple[object, ...],
    *,
    backend: Backend,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> TracedGraph:
    """Trace ``fn(*example_inputs)``; reject what the artifact could not reproduce."""
    fn_name = getattr(fn, "__name__", type(fn).__name__)
    module_positions = [
        i for i, a in enumerate(example_inputs) if isinstance(a, torch.nn.Module)
    ]
    modules = [cast(torch.nn.Module, example_inputs[i]) for i in module_positions]
    state = lift_module_state(modules)
    user_inputs = tuple(
        a for i, a in enumerate(example_inputs) if i not in module_positions
    )
    user_leaves, in_spec = pytree.tree_flatten(user_inputs)
    leaf_names = _leaf_names(example_inputs, module_positions, user_inputs)
    marks = _read_dim_marks(user_leaves, leaf_names, backend)
    symbolic = (
        _symbolic_inputs(state.tensors, user_leaves, leaf_names, marks)
        if any(marks)
        else None
    )
    if symbolic is None:
        flat_args = [_copy_for_trace(t) for t in [*state.tensors, *user_leaves]]
    else:
        flat_args = symbolic.flat_args
    num_state = len(state.tensors)
    harvest: dict[str, Any] = {}

    def flat_fn(flat: list[Any]) -> list[object]:
        inputs = pytree.tree_unflatten(flat[num_state:], in_spec)
        with _reparametrized(modules, state, flat[:num_state]):
            args = _interleave(example_inputs, module_positions, inputs)
            result = fn(*args)
        grads = [p.grad for p in flat[: state.num_params]]
        _reject_stray_grads(state, flat, leaf_names)
        result_leaves, harvest["out_spec"] = pytree.tree_flatten(result)
        harvest["grad_param_indices"] = [
            i for i, g in enumerate(grads) if g is not None
        ]
        return [*result_leaves, *(g for g in grads if g is not None)]

    try:
        # Grad mode on, so a backward inside fn is recorded as graph ops.
        mode = contextlib.nullcontext() if symbolic is None else symbolic.fake_mode
        with torch.enable_grad(), mode:
            gm = make_fx(
                flat_fn,
                decomposition_table=decompositions,
                tracing_mode="real" if symbolic is None else "symbolic",
            )(flat_args)
    except PrecompileError:
        raise
    except Exception as error:
        guard = _guard_error_in(error)
        if guard is not None and symbolic is not None:
            raise _data_dependent_error(guard, symbolic, fn_name) from error
        raise PrecompileError(
            f"capture failed while tracing {fn_name!r}: {type(error).__name__}: "
            f"{_first_line(error)}. The function must run on the example inputs as "
            "written (positional arguments, modules passed as arguments); check that "
            f"{fn_name}(*example_inputs) runs eagerly."
        ) from error

    if symbolic is not None:
        _reject_constrained_dims(symbolic, fn_name)
    _reject_constants(gm, fn, modules, module_positions)
    _reject_control_flow(gm)
    _reject_effectful_ops(gm)
    return TracedGraph(
        gm=gm,
        flat_args=flat_args,
        fn_name=fn_name,
        module_positions=module_positions,
        num_positional_args=len(example_inputs),
        state=state,
        grad_param_indices=harvest["grad_param_indices"],
        in_spec=in_spec,
        out_spec=harvest["out_spec"],
        user_input_shapes=[
            _shape(t, m) for t, m in zip(user_leaves, marks, strict=True)
        ],
        user_input_dtypes=[_dtype(t) for t in user_leaves],
        user_input_devices=[_device(t) for t in user_leaves],
        user_input_bounds=_declared_bounds(marks),
        user_input_strides=[
            None if m or not isinstance(t, torch.Tensor) else tuple(t.stride())
            for t, m in zip(user_leaves, marks, strict=True)
        ],
        user_input_symbols=(
            [None] * len(user_leaves) if symbolic is None else symbolic.leaf_symbols
        ),
    )


def _copy_for_trace(value: object) -> object:
    """A detached copy with the same strides and ``requires_grad``.

    make_fx's real mode runs every op for real, so tracing on the originals would
    apply fn's side effects (BatchNorm's running stats, in-place input updates, the
    ``.grad`` a backward writes) to the caller's example model and inputs. The strides
    are kept because the inductor backend specialises on them.
    """
    if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
        return value
    tensor = cast(torch.Tensor, value)
    copy = torch.empty_strided(
        tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device
    )
    with torch.no_grad():
        copy.copy_(tensor)
    return copy.requires_grad_(tensor.requires_grad)


@contextlib.contextmanager
def _reparametrized(
    modules: list[torch.nn.Module], state: ModuleState, tensors: list[Any]
) -> Generator[None]:
    with contextlib.ExitStack() as stack:
        for mi, module in enumerate(modules):
            mapping = {name: tensors[ti] for i, name, ti in state.bindings if i == mi}
            stack.enter_context(
                stateless._reparametrize_module(module, mapping, tie_weights=True)
            )
        yield


def _interleave(
    example_inputs: tuple[object, ...],
    module_positions: list[int],
    user_inputs: tuple[object, ...],
) -> list[object]:
    """fn's positional arguments: the modules in place, the user inputs around them."""
    remaining = iter(user_inputs)
    return [
        a if i in module_positions else next(remaining)
        for i, a in enumerate(example_inputs)
    ]


def _leaf_names(
    example_inputs: tuple[object, ...],
    module_positions: list[int],
    user_inputs: tuple[object, ...],
) -> list[str]:
    """Each user-input leaf named by where it sits in the call, e.g. "argument 1['x']"
    (the artifact's driver names leaves the same way)."""
    user_positions = [
        i for i in range(len(example_inputs)) if i not in module_positions
    ]
    names = []
    for path, _ in pytree.tree_flatten_with_path(user_inputs)[0]:
        position = user_positions[cast(pytree.SequenceKey, path[0]).idx]
        names.append(f"argument {position}{pytree.keystr(path[1:])}")
    return names


def _reject_stray_grads(
    state: ModuleState, flat: list[Any], leaf_names: list[str]
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
    for name, leaf in zip(leaf_names, user_leaves, strict=True):
        if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
            raise PrecompileError(
                f"the input {name} (a {tuple(leaf.shape)} tensor) received a "
                "gradient, but only parameter gradients are returned by the artifact. "
                "Make it a parameter of a module argument if you need its gradient, "
                "or pass it with requires_grad=False."
            )


@dataclass(frozen=True)
class DimMark:
    """What ``torch._dynamo.decorators.mark_unbacked`` declared for one dim."""

    # Dims with the same label share one symbol, so the graph treats them as equal.
    shape_id: object
    min: int | None
    max: int | None
    # A size for Inductor to tune for; never a guard, so any size stays valid.
    hint_override: int | None


def _read_dim_marks(
    user_leaves: list[object], leaf_names: list[str], backend: Backend
) -> list[dict[int, DimMark]]:
    """The mark_unbacked dims of each user-input leaf; reject the marks the artifact
    cannot honour.

    The marks are the private attributes torch._dynamo.decorators stamps on a tensor.
    """
    marks: list[dict[int, DimMark]] = []
    for name, leaf in zip(leaf_names, user_leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            marks.append({})
            continue
        if getattr(leaf, "_dynamo_dynamic_indices", None):
            raise PrecompileError(
                f"the input {name} has a mark_dynamic dim, which a precompiled "
                "artifact cannot honour (it would need guards and recompilation). Mark "
                "the dim with torch._dynamo.decorators.mark_unbacked instead (inductor "
                "backend), or leave it static."
            )
        if any((getattr(leaf, "_specialize_on", None) or {}).values()):
            raise PrecompileError(
                f"the input {name} has a specialize_on list: an artifact is one "
                "graph, not one specialisation per value. Remove specialize_on."
            )
        # mark_unbacked(strict=True) records only the strict set; both mean "never
        # specialise this dim", which capture enforces for every marked dim.
        dims = {
            *(getattr(leaf, "_dynamo_unbacked_indices", None) or ()),
            *(getattr(leaf, "_dynamo_strict_unbacked_indices", None) or ()),
        }
        if dims:
            _check_markable(leaf, name, backend)
        marks.append(_leaf_marks(leaf, name, dims))
    _check_shared_sizes(user_leaves, leaf_names, marks)
    return marks


def _check_markable(leaf: torch.Tensor, name: str, backend: Backend) -> None:
    if backend != "inductor":
        raise PrecompileError(
            f"the input {name} has a mark_unbacked dynamic dim, which the {backend} "
            "backend does not support (it runs the graph traced for the example's "
            "static shapes). Capture with backend='inductor' to keep the dim dynamic, "
            "or leave the dim static (do not mark it)."
        )
    if type(leaf) is not torch.Tensor and type(leaf) is not torch.nn.Parameter:
        # The dynamic dims are traced on a plain fake tensor, which would drop the
        # subclass and trace the wrong computation.
        raise PrecompileError(
            f"the input {name} is a tensor subclass ({type(leaf).__name__}) with a "
            "mark_unbacked dim, which capture cannot keep dynamic. Mark a plain "
            "torch.Tensor input instead, or leave the dim static (do not mark it)."
        )


def _leaf_marks(leaf: torch.Tensor, name: str, dims: set[int]) -> dict[int, DimMark]:
    shape_ids = getattr(leaf, "_dynamo_shape_ids", None) or {}
    bounds = getattr(leaf, "_dynamo_unbacked_bounds", None) or {}
    hints = getattr(leaf, "_dynamo_hint_overrides", None) or {}
    marks: dict[int, DimMark] = {}
    for marked in sorted(dims):
        if not -leaf.dim() <= marked < leaf.dim():
            raise PrecompileError(
                f"the input {name} has {leaf.dim()} dims, but mark_unbacked marked "
                f"dim {marked}. Mark a dim in range(-{leaf.dim()}, {leaf.dim()})."
            )
        low, high = bounds.get(marked, (None, None))
        dim = marked % leaf.dim()
        size = leaf.shape[dim]
        if (low is not None and size < low) or (high is not None and size > high):
            raise PrecompileError(
                f"the input {name} has size {size} in dim {dim}, outside the bounds "
                f"its mark_unbacked declares ({_show_bounds(low, high)}). Pass an "
                "example within them, or widen min/max."
            )
        marks[dim] = DimMark(shape_ids.get(marked), low, high, hints.get(marked))
    return dict(sorted(marks.items()))


def _check_shared_sizes(
    user_leaves: list[object], leaf_names: list[str], marks: list[dict[int, DimMark]]
) -> None:
    # Dims sharing a shape_id become one symbol: the example must agree with that.
    first: dict[object, tuple[str, int]] = {}
    for name, leaf, leaf_marks in zip(leaf_names, user_leaves, marks, strict=True):
        for dim, mark in leaf_marks.items():
            if mark.shape_id is None:
                continue
            size = cast(torch.Tensor, leaf).shape[dim]
            where, want = first.setdefault(mark.shape_id, (f"{name} dim {dim}", size))
            if size != want:
                raise PrecompileError(
                    f"the dims marked with mark_unbacked shape_id={mark.shape_id!r} "
                    f"must have equal sizes, but {where} has {want} and {name} dim "
                    f"{dim} has {size}. Pass examples whose sizes agree, or give the "
                    "dims different shape_ids."
                )


def _show_bounds(low: int | None, high: int | None) -> str:
    # In mark_unbacked's own keywords, which is where the user declared them.
    shown = [] if low is None else [f"min={low}"]
    return ", ".join(shown + ([] if high is None else [f"max={high}"]))


def _declared_bounds(marks: list[dict[int, DimMark]]) -> list[DimBounds | None]:
    """Each leaf's declared (min, max) per marked dim, for the driver to check: a
    bound on an unbacked symbol is only an assumption inside the compiled graph."""
    bounds: list[DimBounds | None] = []
    for leaf_marks in marks:
        declared = {
            dim: (mark.min, mark.max)
            for dim, mark in leaf_marks.items()
            if mark.min is not None or mark.max is not None
        }
        bounds.append(declared or None)
    return bounds


@dataclass
class SymbolicInputs:
    """Fake graph inputs for a capture with mark_unbacked dims, and what the checks
    after the trace need to know about the dims' symbols."""

    flat_args: list[object]
    fake_mode: FakeTensorMode
    # Each marked dim's symbol and the input dims it stands for ("argument 1 dim 0").
    dims_of: dict[sympy.Symbol, list[str]]
    # The runtime assumptions the marks themselves put on the symbols (size >= 0 and
    # the declared bounds); any other one is a constraint that fn added.
    declared: set[sympy.Basic]
    # Per user-input leaf: each marked dim's symbol name, or None for an unmarked leaf.
    leaf_symbols: list[dict[int, str] | None]


def _symbolic_inputs(
    state_tensors: list[torch.Tensor],
    user_leaves: list[object],
    leaf_names: list[str],
    marks: list[dict[int, DimMark]],
) -> SymbolicInputs:
    """Fakes for every graph input: static shapes, except an unbacked symbol per
    marked dim (one per shape_id).

    An unbacked symbol has no example value behind it, so torch cannot specialise the
    graph on it: a computation that needs its value fails at capture instead of
    baking the example's size into the artifact.
    """
    shape_env = ShapeEnv()
    # Non-fake tensors the function closes over must reach _reject_constants, which
    # names them, rather than fail inside fake tensor propagation.
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    symbol_of: dict[object, torch.SymInt] = {}
    dims_of: dict[sympy.Symbol, list[str]] = {}
    leaf_symbols: list[dict[int, str] | None] = []
    flat_args: list[object] = []
    with fake_mode:
        flat_args.extend(_fake_copy(fake_mode, t) for t in state_tensors)
        for name, leaf, leaf_marks in zip(leaf_names, user_leaves, marks, strict=True):
            if not leaf_marks:
                flat_args.append(_fake_copy(fake_mode, leaf))
                leaf_symbols.append(None)
                continue
            tensor = cast(torch.Tensor, leaf)
            sizes: list[int | torch.SymInt] = list(tensor.shape)
            symbols: dict[int, str] = {}
            for dim, mark in leaf_marks.items():
                symbol = None
                if mark.shape_id is not None:
                    symbol = symbol_of.get(mark.shape_id)
                if symbol is None:
                    symbol = shape_env.create_unbacked_symint()
                    torch._check(symbol >= 0)
                    if mark.shape_id is not None:
                        symbol_of[mark.shape_id] = symbol
                hinted = symbol.node.expr in shape_env.var_to_hint_override
                if mark.hint_override is not None and not hinted:
                    # One hint per symbol: the first of a shape_id's hints wins.
                    shape_env._set_unbacked_var_to_hint_override(
                        symbol, mark.hint_override
                    )
                # Every mark's own bounds hold, also where a shape_id shares a symbol.
                if mark.min is not None:
                    torch._check(symbol >= mark.min)
                if mark.max is not None:
                    torch._check(symbol <= mark.max)
                dims_of.setdefault(cast(sympy.Symbol, symbol.node.expr), []).append(
                    f"{name} dim {dim}"
                )
                sizes[dim] = symbol
                symbols[dim] = str(symbol.node.expr)
            leaf_symbols.append(dict(sorted(symbols.items())))
            fake = torch.empty(
                sizes,
                dtype=tensor.dtype,
                device=tensor.device,
                memory_format=_marked_memory_format(tensor, name),
            )
            flat_args.append(fake.requires_grad_(tensor.requires_grad))
    declared: set[sympy.Basic] = {
        assertion.expr
        for assertions in shape_env.deferred_runtime_asserts.values()
        for assertion in assertions
    }
    return SymbolicInputs(flat_args, fake_mode, dims_of, declared, leaf_symbols)


def _fake_copy(fake_mode: FakeTensorMode, value: object) -> object:
    """The fake counterpart of ``_copy_for_trace``: same shape, strides and
    ``requires_grad``, and no ``.grad`` (a backward in fn must start from None)."""
    if not isinstance(value, torch.Tensor):
        return value
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        fake = torch.empty_strided(
            value.size(), value.stride(), dtype=value.dtype, device=value.device
        )
        return fake.requires_grad_(value.requires_grad)
    # from_tensor keeps a subclass's structure, but also fakes its .grad.
    fake = fake_mode.from_tensor(value, static_shapes=True)
    fake.grad = None
    return fake


def _marked_memory_format(tensor: torch.Tensor, name: str) -> torch.memory_format:
    """The layout to give a marked input's fake, so the artifact expects the example's
    layout (Inductor bakes each input's strides)."""
    for memory_format in (
        torch.contiguous_format,
        torch.channels_last,
        torch.channels_last_3d,
    ):
        if tensor.is_contiguous(memory_format=memory_format):
            return memory_format
    raise PrecompileError(
        f"the input {name} has a mark_unbacked dim and strides {tensor.stride()} that "
        "are neither contiguous, channels_last nor channels_last_3d, so its layout "
        "cannot be expressed for a dynamic size. Pass it in one of those layouts "
        "(e.g. .contiguous()), or leave the dim static (do not mark it)."
    )


def _data_dependent_error(
    error: GuardOnDataDependentSymNode, symbolic: SymbolicInputs, fn_name: str
) -> PrecompileError:
    """Name the marked dims a guard needed, in the words of the user's call."""
    legend = _legend(error.cond, symbolic)
    frame = _user_frame(error)
    at = f"at {frame}: " if frame else ""
    decision = (
        f"torch needed the value of {error.cond}"
        if isinstance(error.cond, sympy.Symbol)
        else f"torch had to decide {error.cond}"
    )
    if legend:
        return PrecompileError(
            f"{fn_name!r} needs to know the size of {' and '.join(legend.values())} "
            f"({at}{decision}, where {_show_legend(legend)}), but the dim is marked "
            "with mark_unbacked: its size is unknown at capture and the artifact "
            "cannot specialise on it. Make the computation independent of that size "
            "(no Python branch on it, no view to a fixed shape), declare min/max on "
            "the mark if a range decides it (e.g. min=2 rules out size 1), or leave "
            "the dim static (do not mark it)."
        )
    return PrecompileError(
        f"{fn_name!r} branches on a value computed from tensor data ({at}{decision}). "
        "A capture with mark_unbacked dims traces on fake tensors, which hold no "
        "data. Compute both outcomes and select with torch.where, or leave the dims "
        "static (do not mark them)."
    )


def _user_frame(error: BaseException) -> str | None:
    """Where in the user's code ``error`` was raised: the innermost frame outside
    torch, the standard library and this package."""
    library = (
        str(Path(torch.__file__).parent),
        str(Path(__file__).parent),
        sysconfig.get_paths()["stdlib"],
    )
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith(library)
    ]
    if not frames:
        return None
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"


def _reject_constrained_dims(symbolic: SymbolicInputs, fn_name: str) -> None:
    """Reject constraints fn put on a marked dim while tracing.

    The compiled graph assumes them without checking them at run time (and the
    driver checks only the declared bounds), so a call that broke one would compute
    garbage or read out of bounds.
    """
    shape_env = cast(ShapeEnv, symbolic.fake_mode.shape_env)
    for symbol, dims in symbolic.dims_of.items():
        pinned = shape_env.replacements.get(symbol)
        if pinned is not None and pinned.is_number:
            raise PrecompileError(
                f"{fn_name!r} fixes {' and '.join(dims)} to the size {pinned} (e.g. "
                "a view or reshape to a fixed shape), but the dim is marked with "
                "mark_unbacked, so the artifact would accept other sizes it cannot "
                "handle. Compute the shape from the input (e.g. x.view(x.shape[0], "
                "-1)), or leave the dim static (do not mark it)."
            )
    for assertions in shape_env.deferred_runtime_asserts.values():
        for assertion in assertions:
            legend = _legend(assertion.expr, symbolic)
            if not legend or assertion.expr in symbolic.declared:
                continue
            fix = (
                "If these dims are always equal, mark them with the same "
                "mark_unbacked shape_id;"
                if len(legend) > 1
                else "If it is a range, declare it with mark_unbacked(min=..., "
                "max=...), which the artifact checks;"
            )
            raise PrecompileError(
                f"{fn_name!r} only works when {assertion.expr} (where "
                f"{_show_legend(legend)}), a condition on dims marked with "
                "mark_unbacked that the artifact cannot check at run time. "
                f"{fix} otherwise leave the dims static (do not mark them)."
            )


def _legend(expr: sympy.Basic, symbolic: SymbolicInputs) -> dict[sympy.Basic, str]:
    """The marked-dim symbols in ``expr``, each with the input dims it stands for."""
    return {
        symbol: " = ".join(symbolic.dims_of[symbol])
        for symbol in sorted(expr.free_symbols, key=str)
        if symbol in symbolic.dims_of
    }


def _show_legend(legend: dict[sympy.Basic, str]) -> str:
    return ", ".join(f"{symbol} is {dims}" for symbol, dims in legend.items())


def _reject_constants(
    gm: torch.fx.GraphModule,
    fn: Callable[..., object],
    modules: list[torch.nn.Module],
    module_positions: list[int],
) -> None:
    """A tensor the graph reads that is neither an input nor computed would be baked
    into the artifact as a constant; name where it came from."""
    constants = [
        (node.target, getattr(gm, str(node.target)))
        for node in gm.graph.find_nodes(op="get_attr")
    ]
    constants = [(t, c) for t, c in constants if isinstance(c, torch.Tensor)]
    if not constants:
        return
    origins = _tensor_origins(fn, modules, module_positions)
    described = []
    for _, tensor in constants:
        where = origins.get(
            id(tensor),
            "a tensor created inside the function from Python data, e.g. "
            "torch.tensor([...])",
        )
        described.append(f"{where} (shape {tuple(tensor.shape)}, {tensor.dtype})")
    raise PrecompileError(
        "the function reads tensors that are neither inputs nor computed from inputs, "
        "so they would be baked into the artifact as constants: "
        + "; ".join(described)
        + ". Pass each one as an argument: register module state with "
        "register_buffer / nn.Parameter, and create literals outside the function."
    )


def _tensor_origins(
    fn: Callable[..., object],
    modules: list[torch.nn.Module],
    module_positions: list[int],
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
    for position, module in zip(module_positions, modules, strict=True):
        for path, submodule in module.named_modules():
            registered = {**submodule._parameters, **submodule._buffers}
            for name, value in vars(submodule).items():
                if isinstance(value, torch.Tensor) and name not in registered:
                    qualified = f"{path}.{name}" if path else name
                    origins[id(value)] = (
                        f"the plain attribute {qualified!r} of the module at argument "
                        f"{position} (not a registered parameter or buffer)"
                    )
    return origins


def _reject_control_flow(gm: torch.fx.GraphModule) -> None:
    # torch.cond and friends trace into nested GraphModules that the artifact's single
    # flat graph cannot carry.
    subgraphs = [
        str(node.target)
        for node in gm.graph.find_nodes(op="get_attr")
        if isinstance(getattr(gm, str(node.target), None), torch.fx.GraphModule)
    ]
    if subgraphs:
        raise PrecompileError(
            "the function uses a control-flow operator (torch.cond, torch.while_loop, "
            f"...) whose branches were captured as subgraphs {subgraphs}; an artifact "
            "holds one flat graph, so these are not supported. Compute both branches "
            "and select with torch.where, or branch in Python (the trace then follows "
            "the example's path)."
        )


def _reject_effectful_ops(gm: torch.fx.GraphModule) -> None:
    from torch._higher_order_ops.effects import _get_effect

    for node in gm.graph.nodes:
        is_op = node.op == "call_function" and isinstance(
            node.target, torch._ops.OpOverload
        )
        if is_op and _get_effect(node.target) is not None:
            raise PrecompileError(
                f"the function calls the effectful operator {node.target} (it has side "
                "effects that must be ordered, such as printing), which cannot be "
                "captured into a functional artifact. Move it out of the function."
            )


def _shape(leaf: object, marks: dict[int, DimMark]) -> Shape | None:
    # A marked dim is None: the artifact accepts any size there.
    if not isinstance(leaf, torch.Tensor):
        return None
    return tuple(None if dim in marks else size for dim, size in enumerate(leaf.shape))


def _dtype(leaf: object) -> str | None:
    return str(leaf.dtype) if isinstance(leaf, torch.Tensor) else None


def _device(leaf: object) -> str | None:
    return str(leaf.device) if isinstance(leaf, torch.Tensor) else None


def _guard_error_in(error: BaseException) -> GuardOnDataDependentSymNode | None:
    """The data-dependent guard failure behind ``error``: torch raises it inside fn's
    own code, which may catch it and raise another exception from it."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, GuardOnDataDependentSymNode):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
