"""Data-parallel capture: DistributedDataParallel arguments and c10d collectives.

A ``DistributedDataParallel`` (DDP) module synchronises gradients from autograd hooks
its reducer installs on the parameters, outside anything make_fx records: traced as
is, its all-reduce would run once, at capture, and never in the artifact. So the
trace runs the wrapped module's forward directly and adds DDP's reduction itself, as
functional collectives the graph keeps: at the end of each backward, the gradients
the backward produced are scaled by ``1 / world_size`` and summed over the process
group, as DDP's reducer does, in buckets of at most ``bucket_cap_mb`` (DDP's buckets
bound the extra memory the flattened copies take; the values are the same however the
gradients are grouped, since each element is reduced on its own).

The in-place collectives ``fn`` calls (``dist.all_reduce(t)`` and its kin) are
recorded as their functional equivalents, the result copied into the tensor.

No collective communicates at capture: a capture on one rank (``precompile_once``)
must not wait for ranks that are not capturing. While tracing, each functional
collective computes a local stand-in of the right shape (the trace needs values,
not the group's), and the graph records the collective itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from precompile_gen.capture_result import DataParallelArgument, ProcessGroupRecord
from precompile_gen.runtime.errors import PrecompileError

_MB = 1024 * 1024


def is_data_parallel(value: object) -> bool:
    if not dist.is_available():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(value, DistributedDataParallel)


def _ddp(module: torch.nn.Module) -> Any:
    # DDP's attributes are untyped; read them through Any.
    return module


def check_module(module: torch.nn.Module, argument: str) -> None:
    """Refuse, before anything runs, a DDP configuration the capture cannot keep in
    the module at ``argument`` (as messages name it)."""
    ddp = _ddp(module)
    where = f"the DistributedDataParallel module at {argument}"
    _check_reducer(ddp, where)
    _check_state(module, ddp, where)


def _check_reducer(ddp: Any, where: str) -> None:
    """Refuse options of DDP's reducer, which the artifact's own all-reduce replaces."""
    comm_hook = ddp._get_ddp_logging_data().get("comm_hook") or "register_comm_hook"
    if ddp._comm_hooks or comm_hook != "register_comm_hook":
        _refuse(
            where,
            f"has a communication hook registered ({comm_hook})",
            "the artifact all-reduces the gradients itself and cannot run the hook",
            "construct the DDP module without the hook",
        )
    if not ddp.require_backward_grad_sync:
        _refuse(
            where,
            "is inside a no_sync() context",
            "the artifact all-reduces every step's gradients",
            "precompile (and call) the step outside no_sync(); accumulate gradients "
            "inside the step before its backward instead",
        )
    if ddp.static_graph:
        _refuse(
            where,
            "was built with static_graph=True",
            "the option only tunes DDP's own reducer, which the artifact does not run",
            "construct it with static_graph=False",
        )
    if ddp.mixed_precision is not None:
        _refuse(
            where,
            "uses DDP's mixed_precision",
            "the artifact reduces gradients in the parameters' dtype",
            "construct it without mixed_precision (autocast inside the step works)",
        )
    if ddp.parameters_to_ignore or ddp._delay_all_reduce_params:
        _refuse(
            where,
            "ignores some parameters or delays their all-reduce",
            "the artifact reduces every parameter's gradient at the end of backward",
            "construct it without _ddp_params_and_buffers_to_ignore / "
            "delay_all_reduce_named_params",
        )


def _check_state(module: torch.nn.Module, ddp: Any, where: str) -> None:
    """Refuse parameters DDP leaves out and buffers it broadcasts."""
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        _refuse(
            where,
            f"has parameters that do not require grad ({', '.join(frozen[:3])})",
            "DDP leaves those out of its reduction, and the artifact's calling "
            "convention would hold the module to that set",
            "wrap only the trained part in DDP, or set requires_grad=True on them "
            "before wrapping",
        )
    if ddp.will_sync_module_buffers():
        _refuse(
            where,
            "broadcasts its buffers from rank 0 before each forward "
            "(broadcast_buffers=True, the default, with buffers "
            f"{', '.join(n for n, _ in list(module.named_buffers())[:3])})",
            "the artifact does not replay that broadcast",
            "construct it with broadcast_buffers=False (and keep the buffers equal "
            "across ranks, e.g. with SyncBatchNorm), or wrap a module without buffers",
        )


def _refuse(where: str, what: str, why: str, fix: str) -> None:
    raise PrecompileError(
        f"{where} {what}, which the capture cannot keep: {why}. Fix: {fix}."
    )


def group_record(group: dist.ProcessGroup) -> ProcessGroupRecord:
    """How the driver recognises ``group``: its name (what the graph's collectives
    refer to it by), backend and global ranks."""
    return ProcessGroupRecord(
        name=str(group.group_name),
        backend=dist.get_backend(group),
        ranks=list(dist.get_process_group_ranks(group)),
    )


def data_parallel_record(
    module: torch.nn.Module, position: int
) -> DataParallelArgument:
    ddp = _ddp(module)
    return DataParallelArgument(
        position=position,
        group=str(ddp.process_group.group_name),
        find_unused_parameters=bool(ddp.find_unused_parameters),
        bucket_cap_mb=ddp.bucket_bytes_cap / _MB,
    )


def graph_groups(gm: torch.fx.GraphModule) -> list[str]:
    """The names of the process groups the graph's functional collectives use."""
    names: list[str] = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "_c10d_functional":
            continue
        for argument, value in zip(target._schema.arguments, node.args, strict=False):
            if argument.name == "group_name" and str(value) not in names:
                names.append(str(value))
    return names


def process_groups(
    gm: torch.fx.GraphModule, modules: list[torch.nn.Module]
) -> list[ProcessGroupRecord]:
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    names = graph_groups(gm)
    for module in modules:
        if is_data_parallel(module):
            name = str(_ddp(module).process_group.group_name)
            if name not in names:
                names.append(name)
    return [group_record(_resolve_process_group(GroupName(name))) for name in names]


# Observing: a stand-in that Dynamo can run on deep copies.


class _Unwrapped(torch.nn.Module):
    """A DDP module's stand-in for the observing run: the wrapped module under the
    same attribute, called as DDP calls it (DDP itself cannot be deep-copied)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)


def observable(example_inputs: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(
        _Unwrapped(cast(Any, a).module) if is_data_parallel(a) else a
        for a in example_inputs
    )


# Tracing.


@contextlib.contextmanager
def reducing(
    modules: list[torch.nn.Module],
    params_of: list[list[torch.Tensor]],
    names_of: list[list[str]],
) -> Generator[None]:
    """While ``fn`` is traced: each DDP module's forward runs its wrapped module
    (DDP's reducer would act on the example's parameters, outside the graph), and
    each backward ends by averaging the gradients it produced over the group.
    ``params_of[i]`` are module ``i``'s traced parameters, named ``names_of[i]``."""
    with contextlib.ExitStack() as stack:
        for module, params, names in zip(modules, params_of, names_of, strict=True):
            if is_data_parallel(module):
                stack.enter_context(_plain_forward(module))
                stack.enter_context(_reduced_gradients(module, params, names))
        yield


@contextlib.contextmanager
def _plain_forward(module: torch.nn.Module) -> Generator[None]:
    ddp = _ddp(module)

    def forward(*args: object, **kwargs: object) -> object:
        if not ddp.require_backward_grad_sync:
            raise PrecompileError(
                "the function runs the DistributedDataParallel module's forward "
                "inside no_sync(), which the capture does not support: the artifact "
                "all-reduces every backward's gradients. Accumulate the micro-batches' "
                "losses and call backward once, outside no_sync()."
            )
        return ddp.module(*args, **kwargs)

    module.forward = forward
    try:
        yield
    finally:
        del module.forward


@contextlib.contextmanager
def _reduced_gradients(
    module: torch.nn.Module, params: list[torch.Tensor], names: list[str]
) -> Generator[None]:
    ddp = _ddp(module)
    group = ddp.process_group
    ready: list[int] = []

    def reduce_ready() -> None:
        indices = sorted(ready)
        ready.clear()
        # DDP fills its buckets in reverse parameter order (backward's order).
        for bucket in _buckets(
            [params[i] for i in reversed(indices)], ddp.bucket_bytes_cap
        ):
            _all_reduce_mean(bucket, group)

    def hook(index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient(param: torch.Tensor) -> None:
            if not ready:
                torch.autograd.Variable._execution_engine.queue_callback(reduce_ready)
            if index not in ready:
                ready.append(index)

        return on_gradient

    handles = [
        param.register_post_accumulate_grad_hook(hook(index))
        for index, param in enumerate(params)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    got = [p.grad is not None for p in params]
    if any(got) and not all(got):
        unused = [name for name, g in zip(names, got, strict=True) if not g]
        raise PrecompileError(
            "parameters of the DistributedDataParallel module got no gradient in "
            f"the traced step ({', '.join(unused[:3])}): DDP would all-reduce zeros "
            "for them (find_unused_parameters=True) or fail, and the artifact "
            "reduces only the gradients the step computes. Use every parameter in "
            "the loss, or wrap only the parameters the step trains in DDP."
        )


def _buckets(
    params: list[torch.Tensor], cap_bytes: int
) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for param in params:
        grad = cast(torch.Tensor, param.grad)
        nbytes = grad.numel() * grad.element_size()
        if bucket and (size + nbytes > cap_bytes or grad.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(param)
        size += nbytes
    if bucket:
        yield bucket


def _all_reduce_mean(params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    from torch.distributed import _functional_collectives as funcol

    grads = [cast(torch.Tensor, p.grad) for p in params]
    # As DDP's reducer: each rank's gradient times 1 / world_size, then summed.
    scale = 1.0 / group.size()
    flat = torch.cat([g.reshape(-1) for g in grads]).mul_(scale)
    reduced = funcol.all_reduce(flat, "sum", group)
    offset = 0
    for grad in grads:
        grad.copy_(reduced[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


# In-place c10d collectives, as functional ones.

_REDUCE_OPS = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min"}


def _reduce_op(op: object, name: str) -> str:
    key = str(getattr(op, "name", op)).rsplit(".", 1)[-1].upper()
    if key not in _REDUCE_OPS:
        raise PrecompileError(
            f"the function calls torch.distributed.{name} with op={op}, which has no "
            "functional equivalent the capture records (SUM, AVG, MAX and MIN do). "
            "Use one of those, or call the collective outside the function."
        )
    return _REDUCE_OPS[key]


def _synchronous(name: str, async_op: bool) -> None:
    if async_op:
        raise PrecompileError(
            f"the function calls torch.distributed.{name} with async_op=True, whose "
            "Work handle the artifact cannot return. Call it with async_op=False; "
            "the captured graph orders the collective itself."
        )


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    resolved = group if group is not None else dist.group.WORLD
    assert resolved is not None  # a capture calling a collective has a group
    return resolved


def _all_reduce(
    tensor: torch.Tensor,
    op: object = dist.ReduceOp.SUM if dist.is_available() else None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> None:
    from torch.distributed import _functional_collectives as funcol

    _synchronous("all_reduce", async_op)
    tensor.copy_(funcol.all_reduce(tensor, _reduce_op(op, "all_reduce"), _group(group)))


def _broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> None:
    from torch.distributed import _functional_collectives as funcol

    _synchronous("broadcast", async_op)
    resolved = _group(group)
    root = (
        group_src
        if group_src is not None
        else dist.get_group_rank(resolved, cast(int, src))
    )
    tensor.copy_(funcol.broadcast(tensor, root, resolved))


def _all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> None:
    from torch.distributed import _functional_collectives as funcol

    _synchronous("all_gather_into_tensor", async_op)
    gathered = funcol.all_gather_tensor(input, 0, _group(group))
    output.copy_(gathered.reshape(output.shape))


def _reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: object = dist.ReduceOp.SUM if dist.is_available() else None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> None:
    _synchronous("reduce_scatter_tensor", async_op)
    resolved = _group(group)
    functional = torch.ops._c10d_functional
    flat = input.reshape(resolved.size() * output.numel())
    reduced = functional.reduce_scatter_tensor(
        flat,
        _reduce_op(op, "reduce_scatter_tensor"),
        resolved.size(),
        resolved.group_name,
    )
    output.copy_(functional.wait_tensor(reduced).reshape(output.shape))


_FUNCTIONAL: dict[str, Callable[..., None]] = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    # The names torch now prefers for the two above.
    "all_gather_single": _all_gather_into_tensor,
    "reduce_scatter_single": _reduce_scatter_tensor,
}


# The other collectives and point-to-point calls: refused where they are called,
# before they could communicate (the observing run executes what Dynamo does not
# compile, and a capture on one rank would wait for the others forever).
_REFUSED = (
    "all_gather",
    "all_gather_object",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "scatter_object_list",
    "send",
)


def _refusing(name: str) -> Callable[..., None]:
    def refused(*args: object, **kwargs: object) -> None:
        raise PrecompileError(
            f"the function calls torch.distributed.{name}, which the capture cannot "
            "record (it has no functional equivalent here). Use all_reduce, "
            "broadcast, all_gather_into_tensor or reduce_scatter_tensor (recorded as "
            "functional collectives), or call it outside the function."
        )

    return refused


@contextlib.contextmanager
def in_place_as_functional() -> Generator[None]:
    """The in-place collectives as functional ones, the result copied back; the
    others refused."""
    if not dist.is_available() or not dist.is_initialized():
        yield
        return
    from torch.distributed import distributed_c10d

    replacements = {
        **{name: _refusing(name) for name in _REFUSED},
        **_FUNCTIONAL,
    }
    owners = (dist, distributed_c10d)
    originals = [
        (owner, name, getattr(owner, name))
        for owner in owners
        for name in replacements
        if hasattr(owner, name)
    ]
    for owner, name, _ in originals:
        setattr(owner, name, replacements[name])
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextlib.contextmanager
def functional_collectives() -> Generator[None]:
    """While ``fn`` is traced: the in-place collectives record as functional ones,
    and no collective communicates."""
    if not dist.is_available() or not dist.is_initialized():
        yield
        return
    with in_place_as_functional(), _LocalCollectives():
        yield


def locally(gm: torch.fx.GraphModule) -> Callable[..., object]:
    """``gm``'s forward, with its functional collectives computed locally (for the
    observing run, which runs Dynamo's graphs on copies and must not communicate).
    Dynamo's graphs name collectives in several ways (functions, op packets), so
    every graph is run so once a process group exists."""
    if not dist.is_available() or not dist.is_initialized():
        return gm.forward

    @functools.wraps(gm.forward)
    def local(*args: object, **kwargs: object) -> object:
        with _LocalCollectives():
            return gm.forward(*args, **kwargs)

    return local


def _group_size(group_name: object) -> int:
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return _resolve_process_group(GroupName(str(group_name))).size()


class _LocalCollectives(TorchDispatchMode):
    """Functional collectives computed on this rank alone: a result of the right
    shape and dtype (the group's own values only exist at run time), so that
    tracing never waits for another rank. Under make_fx the collective is recorded
    in the graph as called; only its execution is local."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        if namespace == "c10d":
            raise PrecompileError(
                f"the function calls the in-place collective {func}, which a "
                "functional artifact cannot record. Call torch.distributed.all_reduce, "
                "broadcast, all_gather_into_tensor or reduce_scatter_tensor (recorded "
                "as functional collectives), or torch.distributed."
                "_functional_collectives directly."
            )
        name = func._schema.name.split("::")[-1]
        if namespace != "_c10d_functional" or name == "wait_tensor":
            # Waiting on a collective that never ran returns at once.
            return func(*args, **kwargs)
        return _recorded(func, args, kwargs, _local_result(func, name, args))


def _local_result(func: Any, name: str, args: tuple[Any, ...]) -> torch.Tensor:
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        tensor = args[0]
        if name in ("all_reduce_", "broadcast_"):
            # The in-place variants: the tensor as this rank has it.
            return tensor
        if name in ("all_reduce", "broadcast"):
            return tensor.clone()
        if name == "all_gather_into_tensor":
            return torch.cat([tensor] * _group_size(args[-1]))
        if name == "reduce_scatter_tensor":
            return tensor.chunk(_group_size(args[-1]))[0].clone()
    raise PrecompileError(
        f"the function calls the functional collective {func}, which the capture "
        "does not support (all_reduce, broadcast, all_gather_into_tensor and "
        "reduce_scatter_tensor are). Call it outside the function."
    )


def _recorded(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: torch.Tensor
) -> torch.Tensor:
    """``result``, recorded in the graph being traced (if any) as ``func``'s output."""
    import torch.utils._pytree as pytree
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return result
    tracer = mode.tracer

    def proxy_of(tensor: torch.Tensor) -> Any:
        return proxy_tensor.get_proxy_slot(tensor, tracer).proxy

    proxy = tracer.create_proxy(
        "call_function",
        func,
        pytree.tree_map_only(torch.Tensor, proxy_of, args),
        pytree.tree_map_only(torch.Tensor, proxy_of, kwargs),
    )
    proxy_tensor.track_tensor_tree(result, proxy, constant=None, tracer=tracer)
    return result
