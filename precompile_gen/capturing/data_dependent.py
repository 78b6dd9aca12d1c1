"""Data-dependent code: what the trace does where ``fn`` reads a tensor's value.

make_fx records tensor operations, not Python values: a value read from a tensor while
tracing (``bool(t)``, ``.item()``, ``.tolist()``) is the example's, and whatever fn
computes from it would be built into the graph for every call; so would a Python
number passed in. The common reads are captured as eager runs them, and float
arguments are numbers of the graph; every other read is refused, naming the line in
fn's code.

- ``t.item()`` in fn's own code, and each float argument, is a ``GraphNumber``: its
  arithmetic is the graph's, and returned from fn, the graph returns its tensor and
  the driver calls ``.item()`` on it (``SCALAR_OUTPUTS``). Any other use of an
  argument's specialises the graph on its value (``FloatArguments``); of an
  ``.item()``'s, a comparison is a branch (``branches``) and the rest is refused.
- A ``bool(t)`` inside ``torch.distributions`` is argument validation (``if not
  valid.all(): raise ValueError``): the trace takes the example's branch and the graph
  asserts, at every call, that the call's value is the example's.
- Any other ``bool(t)`` is a branch, traced both ways (``branches``).
- ``F.one_hot(t, num_classes)`` checks that each value lies in ``[0, num_classes)``:
  it is traced as the same encoding computed by comparison, and the graph asserts
  that range at every call, where eager raises (``_checked_one_hot``).
- ``BatchNorm(momentum=None)`` in training mode divides by
  ``float(num_batches_tracked)``: its forward is traced as the same update with the
  factor kept a tensor (``cumulative_batch_norms``).

A read of a size that values decide (``len(t[mask])``) is ``value_sizes``' to judge. A
value read from a tensor computed from constants alone is the same at every call, and
is read: by fn (``torch.arange(3).tolist()``) or inside ``torch.istft``
(``_ConstantReads``).
"""

from __future__ import annotations

import contextlib
import linecache
import operator
import sys
import sysconfig
import types
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.fx.experimental import proxy_tensor
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from precompile_gen.capturing import branches, value_sizes
from precompile_gen.runtime.errors import PrecompileError

# Frames in these folders are library code (torch, this package, the standard
# library but its site-packages); the user's code is every other frame.
_LIBRARY_DIRS = (
    str(Path(torch.__file__).parent) + "/",
    str(Path(__file__).parents[1]) + "/",
)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + "/"
_SITE_DIR = sysconfig.get_paths()["purelib"] + "/"
_DISTRIBUTIONS_DIR = str(Path(torch.distributions.__file__).parent) + "/"
# make_fx's refusal of a value read from a traced tensor (``_local_scalar_dense``).
_MAKE_FX_VALUE_READ = "get value out of a tracing tensor"
# The attribute a refused value read carries to name the torch op that read it.
_READER = "_precompile_gen_value_reader"
_FIXES = (
    "Keep the computation on tensors: select with torch.where(condition, a, b), "
    "branch with torch.cond(predicate, true_fn, false_fn, operands), or move the "
    "branch (or the value read) out of the function, after the precompiled call. "
    "Returning t.item() itself is supported."
)


class DataDependentError(PrecompileError):
    """fn read a tensor's value in a way the artifact cannot reproduce."""


def is_library(filename: str) -> bool:
    """Whether a frame in ``filename`` is library code rather than the user's."""
    if filename.startswith(_STDLIB_DIR) and not filename.startswith(_SITE_DIR):
        return True
    return filename.startswith(_LIBRARY_DIRS)


def _where(
    filename: str, lineno: int, *, code: bool = True, portable: bool = False
) -> str:
    line = linecache.getline(filename, lineno).strip() if code else ""
    shown = _portable(filename) if portable else filename
    return f"{shown}:{lineno}" + (f" ({line})" if line else "")


def _portable(filename: str) -> str:
    """``filename`` as the artifact's text names it, with no folder of the capturing
    machine: relative to the working directory where it lies under it, from the
    library's own folder for torch's (``torch/...``), else its name alone."""
    path = Path(filename)
    for root in (Path.cwd(), Path(torch.__file__).parents[1]):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return path.name


def user_line(skip: int = 2, *, code: bool = True, portable: bool = False) -> str:
    """The innermost frame of the user's code on the current stack, from the caller's
    caller outward (``skip`` frames up from here); ``portable``: its file named as
    the artifact's text may name it (``_portable``)."""
    frame: types.FrameType | None = sys._getframe(skip)
    while frame is not None and is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "an unknown line"
    return _where(
        frame.f_code.co_filename, frame.f_lineno, code=code, portable=portable
    )


def _library_only(traceback: types.TracebackType | None) -> bool:
    """Whether no frame of the user's code lies on ``traceback``: the read happened
    in the op, not in user code it calls back (a checkpointed module, a custom
    autograd.Function's forward)."""
    while traceback is not None:
        if not is_library(traceback.tb_frame.f_code.co_filename):
            return False
        traceback = traceback.tb_next
    return True


def _innermost_user_frame(traceback: types.TracebackType | None) -> str:
    where = "an unknown line"
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if not is_library(code.co_filename):
            where = _where(code.co_filename, traceback.tb_lineno)
        traceback = traceback.tb_next
    return where


def value_read_error(error: BaseException, fn_name: str) -> PrecompileError | None:
    """make_fx's refusal of a value read, as a ``PrecompileError`` naming the line of
    fn's code that read it; None for any other error."""
    size_use = value_sizes.size_use_error(error, fn_name)
    if size_use is not None:
        return size_use
    if not isinstance(error, RuntimeError) or _MAKE_FX_VALUE_READ not in str(error):
        return None
    reader = getattr(error, _READER, None)
    if reader is not None:
        return _op_refusal(reader, error, fn_name)
    return _refusal(
        f"{fn_name!r} converts a tensor computed from its inputs to a Python value "
        "(float(t), int(t), .item(); with mark_unbacked dims also bool(t) or if t:) "
        "at "
        f"{_innermost_user_frame(error.__traceback__)}"
    )


def _is_operator(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return name.startswith("__") and name.endswith("__")


def _holds_numbers(tree: object) -> bool:
    return any(isinstance(leaf, GraphNumber) for leaf in pytree.tree_leaves(tree))


def _op_name(func: Callable[..., Any]) -> str:
    name = resolve_name(func) or getattr(func, "__name__", repr(func))
    return name.replace("torch.functional.", "torch.")


def _op_refusal(
    reader: Callable[..., Any], error: BaseException, fn_name: str
) -> DataDependentError:
    name = _op_name(reader)
    instead = _INSTEAD.get(name, "")
    return DataDependentError(
        f"{fn_name!r} calls {name} at {_innermost_user_frame(error.__traceback__)}, "
        "and that op reads a value out of its tensor argument itself (a range or "
        "size check, or a result whose size depends on the values), which the "
        "trace cannot follow: the artifact would keep the example's value for every "
        f"call. {instead}Otherwise call it outside the precompiled function, on its "
        "inputs before the call or on its outputs after, and pass the result in."
    )


# Ops that read a value, and how to compute the same without the read.
_INSTEAD = {
    "torch.nn.functional.one_hot": (
        "Give it num_classes (F.one_hot(t, num_classes), t of dtype int64): then "
        "its number of classes is not read from t, and the artifact checks t's "
        "range at every call. "
    ),
}


def _refusal(lead: str) -> DataDependentError:
    return DataDependentError(
        f"{lead}. The trace records tensor operations, not "
        "Python values, so the artifact would keep the example's value (and any "
        f"branch decided on it) for every call. {_FIXES}"
    )


def _depends_on_inputs(tensor: object) -> bool:
    """Whether make_fx computed ``tensor`` from a graph input or a random draw: a
    value read from it would differ between calls. (One computed only from
    constants, ``torch.arange(3)``, is the same at every call.)"""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None or not isinstance(tensor, torch.Tensor):
        return False
    slot = proxy_tensor.get_proxy_slot(tensor, mode.tracer, None)
    if slot is None or slot.constant is not None:
        return False
    pending, seen = [slot.proxy.node], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        target = node.target
        random = isinstance(target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in target.tags
        )
        if node.op == "placeholder" or random:
            return True
        pending.extend(node.all_input_nodes)
    return False


@dataclass
class FloatArguments:
    """fn's float arguments, traced as graph inputs (0-dim float64 tensors), and
    where fn used each other than in arithmetic: the graph keeps the example's value
    of those, which the driver then holds each call to (``specialized``)."""

    # The leaf index of each argument fn used as a Python value -> where it did first.
    specialized: dict[int, str] = field(default_factory=dict)


class GraphNumber:
    """A Python number fn computes with that the graph holds as a 0-dim tensor:
    ``t.item()`` in fn's own code, or a float argument (``FloatArguments``), and
    what fn computes from them.

    Its arithmetic (+, -, *, / and negation, with Python numbers, tensors and other
    such numbers) is the graph's: with numbers, in float64 as Python computes with
    floats; with tensors, as ATen computes with a Python number (``loss /
    loss.item()``, ``logits / temperature``). Returned from fn, the graph returns
    its tensor and the driver calls ``.item()`` on it (``SCALAR_OUTPUTS``).

    Any other use (a comparison, a branch, a conversion, a torch call that takes a
    number) needs its value. Computed from float arguments alone, it has the
    example's: the use specialises the graph on those arguments, as make_fx would,
    and the driver holds each call to their values. Computed from ``.item()``, no
    call could be checked against the example's number: a comparison or its truth
    value is a branch on its tensor (``branches``), and any other use is refused."""

    __slots__ = ("arguments", "fn_name", "sources", "tensor", "where")

    def __init__(
        self,
        tensor: torch.Tensor,
        where: str | None,
        fn_name: str,
        sources: frozenset[int] = frozenset(),
        arguments: FloatArguments | None = None,
    ) -> None:
        self.tensor = tensor
        # The line of the first .item() it is computed from; None for none.
        self.where = where
        self.fn_name = fn_name
        # The float arguments (leaf indices) it is computed from.
        self.sources = sources
        self.arguments = arguments

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        # isinstance(value, float) holds, as it does for the number eager has.
        return float if self.tensor.is_floating_point() else int

    def _number(self) -> torch.Tensor | None:
        """The value as the graph computes with it: a float's as float64; None for
        any other kind of number, whose arithmetic is a Python use."""
        if not self.tensor.is_floating_point():
            return None
        return self.tensor.to(torch.float64)

    def example(self, why: str | None = None) -> float | int | bool:
        """The example's value, for a use the graph cannot compute (``why`` names
        the torch op); refused for a value computed from ``.item()``."""
        if self.where is not None:
            raise _refusal(
                f"{self.fn_name!r} computes with the Python number that .item() gave "
                f"at {self.where}, {why + ' ' if why else ''}at {user_line(3)}"
            )
        assert self.arguments is not None
        # The artifact's metadata carries it (NUMBER_INPUTS).
        line = user_line(3, portable=True)
        for leaf in sorted(self.sources):
            self.arguments.specialized.setdefault(leaf, line)
        with proxy_tensor.disable_proxy_modes_tracing():
            return self.tensor.item()


def _branch_on(number: GraphNumber, name: str, args: tuple[object, ...]) -> bool | None:
    """A comparison or truth value of a number computed from ``.item()``, as a branch
    on its tensor's value (``branches``): in float64 for floats, as Python compares
    them. None where the other operand is no number, or no path is followed."""
    others = []
    for other in args:
        if isinstance(other, GraphNumber):
            other = _compared(other)
        elif type(other) not in (int, float, bool):
            return None
        others.append(other)
    value = _compared(number)
    predicate = value if name == "bool" else getattr(operator, name)(value, *others)
    return branches.read(predicate, user_line(3, portable=True))


def _compared(number: GraphNumber) -> torch.Tensor:
    # A float's as float64, as Python compares it; an int's as it is.
    value = number._number()
    return number.tensor if value is None else value


# The uses of a number from .item() that read its truth: each is a branch.
_BRANCHING = frozenset({"bool", "eq", "ne", "lt", "le", "gt", "ge"})


def example_values(tree: object, why: str) -> object:
    """``tree`` with each ``GraphNumber`` in it replaced by the example's value."""
    return pytree.tree_map_only(GraphNumber, lambda n: n.example(why), tree)


def _python_use(name: str) -> Callable[..., object]:
    def use(self: GraphNumber, *args: object) -> object:
        if name in _BRANCHING and self.where is not None:
            outcome = _branch_on(self, name, args)
            if outcome is not None:
                return outcome
        value = self.example()
        method = getattr(value, f"__{name}__", None)
        if method is None:
            return NotImplemented
        return method(*[a.example() if isinstance(a, GraphNumber) else a for a in args])

    return use


def _arithmetic(name: str, reflected: bool) -> Callable[..., object]:
    op = getattr(operator, name)

    def compute(self: GraphNumber, other: object) -> object:
        number = self._number()
        plain = isinstance(other, int | float) and not isinstance(other, bool)
        if isinstance(other, GraphNumber):
            other_number = other._number()
            if number is None or other_number is None:
                return _PYTHON_USES[f"r{name}" if reflected else name](self, other)
            result = op(other_number, number) if reflected else op(number, other_number)
            return _derived(self, result, other)
        if number is None or not (plain or _promotes_a_float(other)):
            return _PYTHON_USES[f"r{name}" if reflected else name](self, other)
        if not isinstance(other, torch.Tensor):
            if name == "truediv" and reflected:
                _assert_nonzero(self, number)
            # Both float64 tensors: Tensor.__rtruediv__ would multiply by the
            # reciprocal, rounding twice where Python divides once.
            other_number = number.new_full((), cast(float, other))
            result = op(other_number, number) if reflected else op(number, other_number)
            return _derived(self, result)
        if name == "truediv" and not reflected:
            # number / tensor: torch computes it as tensor.reciprocal() * number.
            return _REFLECTED_MUL(self, other.reciprocal())
        # As ATen computes with a Python float: in the dtype it promotes the
        # tensor to, or float32 for a half-precision one (the scalar's opmath).
        promoted = torch.result_type(other, 1.0)
        at = torch.float32 if promoted in (torch.float16, torch.bfloat16) else promoted
        a, b = other.to(at), number.to(at)
        return (op(a, b) if reflected else op(b, a)).to(promoted)

    return compute


def _assert_nonzero(divisor: GraphNumber, number: torch.Tensor) -> None:
    # Python raises ZeroDivisionError where the graph would give inf.
    what = (
        f"the number .item() gave at {branches.assertion_message(divisor.where)}"
        if divisor.where is not None
        else "a float argument"
    )
    torch._assert_async(
        number != 0,
        f"precompile_gen: a division by {what} divides by zero, where eager raises "
        "ZeroDivisionError",
    )


def _promotes_a_float(other: object) -> bool:
    return isinstance(other, torch.Tensor) and not other.is_complex()


def _derived(
    number: GraphNumber, tensor: torch.Tensor, other: GraphNumber | None = None
) -> GraphNumber:
    if other is None:
        return GraphNumber(
            tensor, number.where, number.fn_name, number.sources, number.arguments
        )
    return GraphNumber(
        tensor,
        number.where if number.where is not None else other.where,
        number.fn_name,
        number.sources | other.sources,
        number.arguments or other.arguments,
    )


def _unary(op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., object]:
    def compute(self: GraphNumber) -> object:
        number = self._number()
        if number is None:
            return _PYTHON_USES[op.__name__](self)
        return _derived(self, op(number))

    return compute


# Every way Python computes with a number: each is a use of the example's value, but
# a float's arithmetic, which the graph computes.
_UNARY = ("bool", "float", "int", "index", "complex", "round", "trunc", "floor")
_UNARY += ("ceil", "abs", "format", "str", "repr", "hash", "neg", "pos")
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
_ARITHMETIC = ("add", "sub", "mul", "truediv")
_BINARY = ("floordiv", "mod", "pow", "divmod", "and", "or", "xor", "lshift", "rshift")
_BINARY += ("matmul",)
_PYTHON_USES = {
    name: _python_use(name)
    for name in [
        *_UNARY,
        *_COMPARISONS,
        *_BINARY,
        *(f"r{name}" for name in (*_BINARY, *_ARITHMETIC)),
        *_ARITHMETIC,
    ]
}
for _name, _use in _PYTHON_USES.items():
    setattr(GraphNumber, f"__{_name}__", _use)
for _name in _ARITHMETIC:
    setattr(GraphNumber, f"__{_name}__", _arithmetic(_name, reflected=False))
    setattr(GraphNumber, f"__r{_name}__", _arithmetic(_name, reflected=True))
GraphNumber.__neg__ = _unary(operator.neg)  # type: ignore[attr-defined]
GraphNumber.__pos__ = _unary(operator.pos)  # type: ignore[attr-defined]
_REFLECTED_MUL = _arithmetic("mul", reflected=True)


class _ValueReads(TorchFunctionMode):
    def __init__(self, fn_name: str, numbers: bool) -> None:
        super().__init__()
        self.fn_name = fn_name
        # Whether a GraphNumber may be among an op's arguments: fn has float
        # arguments, or has read an .item(). Until then no op's are searched.
        self.numbers = numbers
        self.size_reads = value_sizes.SizeReads()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if self.numbers and not _is_operator(func) and _holds_numbers((args, kwargs)):
            # A number the op takes as a Python number: the example's (a Tensor
            # operator returns NotImplemented instead, so that Python runs the
            # number's own arithmetic).
            args, kwargs = cast(
                tuple[tuple[Any, ...], dict[str, Any]],
                example_values((args, kwargs), f"passed to {_op_name(func)}"),
            )
        size = self.size_reads.read(func, args, user_line, self.fn_name)
        if size is not value_sizes.NOT_A_SIZE_READ:
            return size
        if func is F.one_hot and _one_hot_checkable(*args, **kwargs):
            return _checked_one_hot(*args, **kwargs, where=user_line(code=False))
        if func not in _READS or not args:
            return _run_op(func, args, kwargs)
        if not _depends_on_inputs(args[0]):
            if isinstance(args[0], torch.Tensor) and not proxy_tensor.is_fake(args[0]):
                # The same value at every call: read it, as make_fx reads constants.
                with proxy_tensor.disable_proxy_modes_tracing():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        return self._read(func, args, kwargs, sys._getframe(1))

    def _read(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        frame: types.FrameType,
    ) -> object:
        """A read of a value computed from the inputs, called from ``frame``."""
        caller = frame.f_code.co_filename
        if func is torch.Tensor.item and not is_library(caller):
            self.numbers = True
            return GraphNumber(args[0].detach(), user_line(3), self.fn_name)
        if func is torch.Tensor.tolist:
            raise _refusal(
                f"{self.fn_name!r} calls .tolist() on a tensor computed from its "
                f"inputs at {user_line(3)}"
            )
        if func is torch.Tensor.__bool__ and caller.startswith(_DISTRIBUTIONS_DIR):
            return _asserted_bool(args[0], user_line(3, code=False))
        if func is torch.Tensor.__bool__:
            outcome = branches.read(args[0], _branch_line(frame))
            if outcome is not None:
                return outcome
        return func(*args, **kwargs)


def _branch_line(frame: types.FrameType) -> str:
    """Where a branch reads a value, as the artifact's header names it: the user's
    line, and the library's line that reads it where a library does (a module's
    forward)."""
    where = user_line(4, portable=True)
    if not is_library(frame.f_code.co_filename):
        return where
    library = _where(frame.f_code.co_filename, frame.f_lineno, portable=True)
    return f"{library}, called from {where}"


def _run_op(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> object:
    try:
        if func in _READING_CONSTANTS:
            with _ConstantReads():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
    except RuntimeError as error:
        # The innermost torch function a value read fails in is the op whose own
        # code reads it (F.one_hot's range check), not the user.
        if (
            _MAKE_FX_VALUE_READ in str(error)
            and func not in _CONVERSIONS
            and not hasattr(error, _READER)
            and _library_only(error.__traceback__)
        ):
            setattr(error, _READER, func)
        raise


_READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__)
# The user's own conversions of a tensor to a Python value: a read where they are
# called is the user's, not an op's.
_CONVERSIONS = {
    *_READS,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__complex__,
    torch.Tensor.__format__,
}


def _one_hot_checkable(tensor: object, num_classes: int = -1) -> bool:
    """Whether ``F.one_hot(tensor, num_classes)`` reads nothing but its range check:
    its number of classes is given, and its index tensor, computed from the inputs,
    is one eager accepts (int64, and real: a symbolic trace has no values)."""
    return (
        type(num_classes) is int
        and num_classes >= 0
        and isinstance(tensor, torch.Tensor)
        and tensor.dtype == torch.int64
        and not proxy_tensor.is_fake(tensor)
        and _depends_on_inputs(tensor)
    )


def _checked_one_hot(
    tensor: torch.Tensor, num_classes: int = -1, *, where: str
) -> torch.Tensor:
    """``F.one_hot(tensor, num_classes)`` without reading a value: the same int64
    encoding, computed by comparing with each class, and the range eager checks
    (where it raises) asserted in the graph at every call."""
    place = branches.assertion_message(where)
    in_range = ((tensor >= 0) & (tensor < num_classes)).all()
    torch._assert_async(
        in_range,
        f"precompile_gen: F.one_hot at {place} is given a class value outside [0, "
        f"{num_classes}), where eager raises RuntimeError (Class values must be "
        "non-negative and smaller than num_classes)",
    )
    classes = torch.arange(num_classes, device=tensor.device)
    return (tensor.unsqueeze(-1) == classes).to(torch.int64)


def _asserted_bool(tensor: torch.Tensor, where: str) -> bool:
    """The example's ``bool(tensor)``, with an assertion in the graph that each call
    gives the same: the trace follows the example's branch only."""
    if proxy_tensor.is_fake(tensor):
        # A symbolic trace has no value to follow; make_fx's refusal names the line.
        return bool(tensor)
    with proxy_tensor.disable_proxy_modes_tracing():
        value = bool(tensor)
    held = tensor.bool() if value else tensor.logical_not()
    place = branches.assertion_message(where)
    torch._assert_async(
        held,
        "precompile_gen: a torch.distributions argument check gives another result "
        f"than at capture (the distribution built at {place}): a parameter or value "
        "is outside its constraint, where eager raises ValueError",
    )
    return value


class _ConstantReads(TorchDispatchMode):
    """A value an op reads inside itself (``torch.istft`` compares its window's
    envelope, ``aten.equal``) from tensors computed from constants alone (a
    ``torch.hann_window`` fn creates) is the same at every call: read, as make_fx
    reads constants, where make_fx would refuse any read of a traced tensor."""

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs)) if func in _OP_READS else []
        if leaves and not any(
            proxy_tensor.is_fake(leaf) or _depends_on_inputs(leaf) for leaf in leaves
        ):
            with proxy_tensor.disable_proxy_modes_tracing():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# The ops that give a tensor's value to the C++ code that calls them.
_OP_READS = {
    torch.ops.aten.equal.default,
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
}


# The torch functions that read such values inside, traced under ``_ConstantReads``.
_READING_CONSTANTS = {torch.istft, torch.Tensor.istft}


@contextlib.contextmanager
def value_reads(
    modules: list[torch.nn.Module], fn_name: str, float_arguments: bool
) -> Generator[None]:
    """While fn is traced (with ``float_arguments`` as GraphNumbers, if any): the
    reads described in the module docstring."""
    with cumulative_batch_norms(modules), _ValueReads(fn_name, float_arguments):
        yield


def scalar_outputs(leaves: list[object]) -> tuple[list[object], list[int]]:
    """fn's result leaves with each returned ``.item()`` as its tensor, which the
    graph returns, and the positions the driver turns back into Python numbers."""
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, GraphNumber)]
    return [
        leaf.tensor if isinstance(leaf, GraphNumber) else leaf for leaf in leaves
    ], positions


def _cumulative_forward(module: Any, input: torch.Tensor) -> torch.Tensor:
    # Eager's update with momentum=None: factor = 1 / num_batches_tracked after the
    # increment, running = (1 - factor) * running + factor * batch statistic. The
    # batch statistics come from batch_norm itself with momentum 1 into zeroed
    # tensors, so the output and the unbiased variance are eager's own.
    module._check_input_dim(input)
    module.num_batches_tracked.add_(1)
    factor = module.num_batches_tracked.double().reciprocal()
    batch_mean = torch.zeros_like(module.running_mean)
    batch_var = torch.zeros_like(module.running_var)
    output = F.batch_norm(
        input,
        batch_mean,
        batch_var,
        module.weight,
        module.bias,
        True,
        1.0,
        module.eps,
    )
    with torch.no_grad():
        module.running_mean.mul_(1 - factor).add_(batch_mean * factor)
        module.running_var.mul_(1 - factor).add_(batch_var * factor)
    return output


def _is_cumulative(module: torch.nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return (
        isinstance(module, _BatchNorm)
        and type(module).forward is _BatchNorm.forward
        and module.momentum is None
        and module.training
        and module.track_running_stats
    )


@contextlib.contextmanager
def cumulative_batch_norms(modules: list[torch.nn.Module]) -> Generator[None]:
    """Trace each BatchNorm with momentum=None in training mode (a cumulative
    average of the batch statistics) through ``_cumulative_forward``."""
    patched = [
        submodule
        for module in modules
        for submodule in module.modules()
        if _is_cumulative(submodule)
    ]
    for submodule in patched:
        submodule.forward = types.MethodType(_cumulative_forward, submodule)
    try:
        yield
    finally:
        for submodule in patched:
            del submodule.forward
