"""Sizes that values decide: ``torch.nonzero``, ``masked_select``, boolean-mask
indexing, ``torch.where(mask)``, ``repeat_interleave`` with a tensor of repeats.

make_fx records such an op, so the graph gives each call its own size. But where
code reads that size as a Python int (``idx.shape[0]``, ``len(idx)``), or a recorded
op takes it as an argument (autograd's backward of ``index_add`` expands to the
example's size), the trace records the example's number, and a call whose values
give another size would compute with it: silently, where the number bounds a slice.

``SymbolicSizes`` runs make_fx's graph again on fake tensors of the example's sizes,
where each of those ops' sizes is an unbacked symbol (as under ``torch.compile`` with
``capture_dynamic_output_shape_ops``): a size read while tracing that is a symbol is
refused at the line that reads it (``size_read_error``), and after the trace a graph
whose ops pin a symbol to the example's number is refused (``reject_pinned_sizes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn, cast

import torch
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

from precompile_gen.runtime.errors import PrecompileError

# The reads of a tensor's sizes as Python ints, and the dims each reads: all of them,
# or the one its argument names (size(d)), or the first (len).
_ALL_DIMS = (torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement)
_SHAPE = cast(Any, torch.Tensor).shape.__get__


def _read_dims(
    func: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[int, ...] | None:
    """The dims ``func(*args)`` reads as Python ints; None if it reads none."""
    tensor = args[0] if args else None
    if not isinstance(tensor, torch.Tensor):
        return None
    if func == _SHAPE:
        return tuple(range(tensor.dim()))
    if func is torch.Tensor.__len__:
        return (0,)
    if func in _ALL_DIMS:
        if func is torch.Tensor.size and len(args) > 1 and isinstance(args[1], int):
            return (args[1] % max(tensor.dim(), 1),)
        return tuple(range(tensor.dim()))
    return None


def _decides_size(node: torch.fx.Node) -> bool:
    """Whether the values of ``node``'s inputs decide the size of its result."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.dynamic_output_shape not in target.tags:
        return False
    if target is torch.ops.aten.index.Tensor:
        # Indexing with integer tensors has the indices' size; with a mask, the
        # count of its true values.
        indices = node.args[1] if len(node.args) > 1 else []
        return any(
            isinstance(index, torch.fx.Node) and _dtype(index) in _MASKS
            for index in indices  # type: ignore[union-attr]
        )
    return True


_MASKS = (torch.bool, torch.uint8)


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


class SymbolicSizes:
    """make_fx's graph, run on fake tensors, node by node as far as asked: each
    node's sizes, with an unbacked symbol where values decide one."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.shape_env = ShapeEnv(allow_dynamic_output_shape_ops=True)
        self.mode = torch._subclasses.fake_tensor.FakeTensorMode(
            shape_env=self.shape_env, allow_non_fake_inputs=True
        )
        # Each node run so far -> its fake value (None where it could not run), the
        # last one run; the nodes whose sizes values may decide (they or a node they
        # are computed from run such an op), and the last one looked at.
        self.values: dict[torch.fx.Node, object] = {}
        self._last_run: torch.fx.Node | None = None
        self.tainted: set[torch.fx.Node] = set()
        self._last_tainted: torch.fx.Node | None = None
        # The nodes that pinned a symbol to a number: an argument of theirs is the
        # example's size.
        self.pinning: list[torch.fx.Node] = []

    def _pinned(self) -> dict[str, object]:
        return {
            str(symbol): value
            for symbol, value in self.shape_env.replacements.items()
            if free_unbacked_symbols(symbol) and not free_unbacked_symbols(value)
        }

    def _after(self, last: torch.fx.Node | None) -> Iterator[torch.fx.Node]:
        # The graph grows while make_fx traces: from where the last walk stopped.
        node = next(iter(self.graph.nodes), None) if last is None else last.next
        while node is not None and node.op != "root":
            yield node
            node = node.next

    def taint(self, node: torch.fx.Node) -> bool:
        """Whether values may decide ``node``'s sizes (cheap: nothing runs)."""
        for other in self._after(self._last_tainted):
            if _decides_size(other) or any(
                i in self.tainted for i in other.all_input_nodes
            ):
                self.tainted.add(other)
            self._last_tainted = other
            if other is node:
                break
        return node in self.tainted

    def run_to(self, node: torch.fx.Node | None = None) -> None:
        """Run the graph on fake tensors up to ``node`` (all of it for None)."""
        if node is not None and node in self.values:
            return
        with self.mode:
            for other in self._after(self._last_run):
                pinned = len(self._pinned())
                self.values[other] = self._run(other)
                if len(self._pinned()) > pinned:
                    self.pinning.append(other)
                self._last_run = other
                if other is node:
                    return

    def _run(self, node: torch.fx.Node) -> object:
        example = node.meta.get("val")
        if node.op in ("placeholder", "get_attr"):
            if not isinstance(example, torch.Tensor):
                return example
            return torch.empty_strided(
                example.shape,
                example.stride(),
                dtype=example.dtype,
                device=example.device,
            )
        if node.op != "call_function" or not callable(node.target):
            return None
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n: cast(Any, self.values.get(n))
        )
        try:
            return node.target(*args, **kwargs)
        except Exception:
            # An op fake tensors cannot run: its sizes are unknown.
            return None

    def value_decided(self, node: torch.fx.Node, dims: tuple[int, ...]) -> set[int]:
        """Those of ``dims`` of ``node`` that values decide: a symbol there, or every
        one where fake tensors could not run the graph that far."""
        self.run_to(node)
        value = self.values.get(node)
        if not isinstance(value, torch.Tensor):
            return set(dims)
        return {
            d
            for d in dims
            if d < value.dim()
            and isinstance(value.shape[d], torch.SymInt)
            and free_unbacked_symbols(value.shape[d])
        }


class ValueDecidedSize:
    """A size read as a Python int that the values decide, in the shape a traced
    tensor's ``.shape`` or ``.size()`` gives: shown as the example's, refused at any
    use (the other dims of the shape are plain ints)."""

    __slots__ = ("example", "fn_name", "where")

    def __init__(self, example: int, where: str, fn_name: str) -> None:
        self.example = example
        self.where = where
        self.fn_name = fn_name

    def _refuse(self, *args: object) -> NoReturn:
        raise size_read_error(self.fn_name, self.where)

    def __repr__(self) -> str:
        return f"{self.example} (its values decide it)"


for _name in (
    *("index", "int", "float", "bool", "hash", "neg", "pos", "abs", "invert"),
    *("eq", "ne", "lt", "le", "gt", "ge"),
    *(
        prefix + name
        for name in ("add", "sub", "mul", "floordiv", "truediv", "mod", "pow")
        for prefix in ("", "r")
    ),
):
    setattr(ValueDecidedSize, f"__{_name}__", ValueDecidedSize._refuse)


class SizeReads:
    """The reads of traced tensors' sizes while make_fx traces fn."""

    def __init__(self) -> None:
        # Made at the first read of a traced tensor's size, for its graph.
        self._sizes: SymbolicSizes | None = None
        _GIVEN.clear()

    def read(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        where: Callable[[], str],
        fn_name: str,
    ) -> object:
        """``func(*args)``, where it reads a size of a traced tensor that the values
        of the graph's inputs decide: the shape with such sizes as
        ``ValueDecidedSize``, or the refusal of ``len``; ``NOT_A_SIZE_READ`` for
        any other call."""
        dims = _read_dims(func, args)
        # Dynamo traces torch.cond's branches through this mode: its own sizes.
        if not dims or torch.compiler.is_dynamo_compiling():
            return NOT_A_SIZE_READ
        mode = proxy_tensor.get_proxy_mode()
        if mode is None or proxy_tensor.is_fake(args[0]):
            return NOT_A_SIZE_READ
        slot = proxy_tensor.get_proxy_slot(args[0], mode.tracer, None)
        if slot is None or slot.constant is not None:
            return NOT_A_SIZE_READ
        node = slot.proxy.node
        if self._sizes is None or self._sizes.graph is not node.graph:
            self._sizes = SymbolicSizes(node.graph)
        if not self._sizes.taint(node):
            return NOT_A_SIZE_READ
        decided = self._sizes.value_decided(node, dims)
        if not decided:
            return NOT_A_SIZE_READ
        line = where()
        _GIVEN.append(line)
        if func is torch.Tensor.__len__:
            raise size_read_error(fn_name, line)
        if func in (torch.Tensor.numel, torch.Tensor.nelement):
            return ValueDecidedSize(args[0].numel(), line, fn_name)
        shape = [
            ValueDecidedSize(size, line, fn_name) if d in decided else size
            for d, size in enumerate(args[0].shape)
        ]
        if func is torch.Tensor.size and len(args) > 1:
            return shape[dims[0]]
        return tuple(shape)


# What ``SizeReads.read`` gives for a call that reads no size values decide.
NOT_A_SIZE_READ = object()
# Where the trace under way read sizes that values decide (captures take turns).
_GIVEN: list[str] = []


def size_use_error(error: BaseException, fn_name: str) -> PrecompileError | None:
    """The refusal of a torch op given a ``ValueDecidedSize``, whose argument parser
    raises TypeError (``zeros(): argument 'size' must be tuple of ints``), or None
    for any other error."""
    if isinstance(error, TypeError) and _GIVEN:
        return size_read_error(fn_name, _GIVEN[-1])
    return None


def size_read_error(fn_name: str, where: str) -> PrecompileError:
    return PrecompileError(
        f"{fn_name!r} reads, at {where}, a size that the values of its inputs decide "
        "(of the result of torch.nonzero, masked_select, boolean-mask indexing, "
        "torch.where(mask) or repeat_interleave, or of a tensor computed from one) "
        "as a Python int. The trace would keep the example's size for every call. "
        "Compute with the tensor itself rather than its size (x[mask] rather than "
        "x[:len(idx)]), or call the function with sizes fixed (pad to a bound, with "
        "a mask)."
    )


def reject_pinned_sizes(gm: torch.fx.GraphModule, fn_name: str) -> None:
    """Refuse a graph whose recorded ops take a size that values decide as the
    example's number (the symbol the fake run gives it is pinned to a value)."""
    deciding = [node for node in gm.graph.nodes if _decides_size(node)]
    if not deciding:
        return
    sizes = SymbolicSizes(gm.graph)
    sizes.run_to()
    pinned = sizes._pinned()
    if not pinned:
        return
    ops = sorted({str(node.target) for node in deciding})
    takers = sorted({str(node.target) for node in sizes.pinning})
    numbers = ", ".join(f"{k} = {v}" for k, v in sorted(pinned.items()))
    raise PrecompileError(
        f"{fn_name!r} calls {', '.join(ops)}, whose result's size the values of its "
        f"inputs decide, and the trace's {', '.join(takers)} takes that size as the "
        f"example's number ({numbers}): most often a backward, such as index_add's "
        "or index_select's, which autograd builds for the sizes it saw. A call whose "
        "values give another size would fail or compute with the example's. "
        "Dispatch with dense masks instead (out = out + mask * expert(x), with mask "
        "of a fixed shape), or call the function with sizes fixed (pad to a bound)."
    )
