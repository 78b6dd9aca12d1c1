"""Dynamic dims: ``torch._dynamo.decorators.mark_unbacked`` marks, read for capture.

Each marked dim of a user input becomes an unbacked symbol (dims sharing a
``shape_id`` share one), so the graph is traced for any size of it. An unbacked symbol
has no example value, so a computation that needs the size fails at capture instead of
baking the example's; the declared min/max become driver checks, because inside the
compiled graph a bound is only an assumption. The marks are private attributes the
decorator stamps on a tensor.
"""

from __future__ import annotations

import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from precompile_gen.capture_result import Backend, DimBounds
from precompile_gen.runtime.errors import PrecompileError, PrecompileNotImplementedError


@dataclass(frozen=True)
class DimMark:
    """What ``torch._dynamo.decorators.mark_unbacked`` declared for one dim."""

    # Dims with the same label share one symbol, so the graph treats them as equal.
    shape_id: object
    min: int | None
    max: int | None
    # A size for Inductor to tune for; never a guard, so any size stays valid.
    hint_override: int | None


def read_dim_marks(
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
        raise PrecompileNotImplementedError(
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


def declared_bounds(marks: list[dict[int, DimMark]]) -> list[DimBounds | None]:
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


def symbolic_inputs(
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
    dims = _MarkedDims()
    leaf_symbols: list[dict[int, str] | None] = []
    flat_args: list[object] = []
    # A tensor passed twice is one fake with one set of symbols, as it is one copy
    # in a static capture.
    seen: dict[int, tuple[object, dict[int, str] | None]] = {}
    with fake_mode:
        for tensor in state_tensors:
            fake = _fake_copy(fake_mode, tensor)
            seen[id(tensor)] = (fake, None)
            flat_args.append(fake)
        for name, leaf, leaf_marks in zip(leaf_names, user_leaves, marks, strict=True):
            if isinstance(leaf, torch.Tensor) and id(leaf) in seen:
                fake, leaf_symbol_names = seen[id(leaf)]
            elif leaf_marks:
                fake, leaf_symbol_names = _marked_fake(
                    cast(torch.Tensor, leaf), name, leaf_marks, shape_env, dims
                )
            else:
                fake, leaf_symbol_names = _fake_copy(fake_mode, leaf), None
            seen[id(leaf)] = (fake, leaf_symbol_names)
            flat_args.append(fake)
            leaf_symbols.append(leaf_symbol_names)
    declared: set[sympy.Basic] = {
        assertion.expr
        for assertions in shape_env.deferred_runtime_asserts.values()
        for assertion in assertions
    }
    return SymbolicInputs(flat_args, fake_mode, dims.dims_of, declared, leaf_symbols)


@dataclass
class _MarkedDims:
    """The symbols made so far for marked dims."""

    # One symbol per shape_id: dims that share one have one size.
    symbol_of: dict[object, torch.SymInt] = field(default_factory=dict)
    # Each symbol and the input dims it stands for ("argument 1 dim 0").
    dims_of: dict[sympy.Symbol, list[str]] = field(default_factory=dict)


def _marked_fake(
    tensor: torch.Tensor,
    name: str,
    leaf_marks: dict[int, DimMark],
    shape_env: ShapeEnv,
    dims: _MarkedDims,
) -> tuple[torch.Tensor, dict[int, str]]:
    """The fake for an input with marked dims, and each marked dim's symbol name."""
    sizes: list[int | torch.SymInt] = list(tensor.shape)
    symbols: dict[int, str] = {}
    for dim, mark in leaf_marks.items():
        symbol = _dim_symbol(mark, shape_env, dims)
        dims.dims_of.setdefault(cast(sympy.Symbol, symbol.node.expr), []).append(
            f"{name} dim {dim}"
        )
        sizes[dim] = symbol
        symbols[dim] = str(symbol.node.expr)
    leaf_symbol_names = dict(sorted(symbols.items()))
    fake = torch.empty(
        sizes,
        dtype=tensor.dtype,
        device=tensor.device,
        memory_format=_marked_memory_format(tensor, name),
    )
    fake.requires_grad_(tensor.requires_grad)
    return fake, leaf_symbol_names


def _dim_symbol(mark: DimMark, shape_env: ShapeEnv, dims: _MarkedDims) -> torch.SymInt:
    """The unbacked symbol for one marked dim (its shape_id's, or a new one), with
    the mark's hint and bounds put on it."""
    symbol = None
    if mark.shape_id is not None:
        symbol = dims.symbol_of.get(mark.shape_id)
    if symbol is None:
        symbol = shape_env.create_unbacked_symint()
        torch._check(symbol >= 0)
        if mark.shape_id is not None:
            dims.symbol_of[mark.shape_id] = symbol
    hinted = symbol.node.expr in shape_env.var_to_hint_override
    if mark.hint_override is not None and not hinted:
        # One hint per symbol: the first of a shape_id's hints wins.
        shape_env._set_unbacked_var_to_hint_override(symbol, mark.hint_override)
    # Every mark's own bounds hold, also where a shape_id shares a symbol.
    if mark.min is not None:
        torch._check(symbol >= mark.min)
    if mark.max is not None:
        torch._check(symbol <= mark.max)
    return symbol


def _fake_copy(fake_mode: FakeTensorMode, value: object) -> object:
    """The fake counterpart of capture's trace copies: same shape, strides and
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


def data_dependent_error(
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
        str(Path(__file__).parents[1]),
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


def reject_constrained_dims(symbolic: SymbolicInputs | None, fn_name: str) -> None:
    """Reject constraints fn put on a marked dim while tracing (None: no dim is).

    The compiled graph assumes them without checking them at run time (and the
    driver checks only the declared bounds), so a call that broke one would compute
    garbage or read out of bounds.
    """
    if symbolic is None:
        return
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


def guard_error_in(error: BaseException) -> GuardOnDataDependentSymNode | None:
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
