"""DTensor arguments: parameters, buffers and inputs sharded over a device mesh.

A ``DTensor`` (what ``distribute_tensor`` and ``distribute_module`` make) is a
wrapper: its global shape, dtype and device are the tensor's,
its data is the local shard (``_local_tensor``), and its placements say how the
global tensor is laid out over the mesh. make_fx records the ops a DTensor receives;
the eager graph replays them on the call's DTensors, whose dispatch shards each op
and issues the collectives it needs, as eager does. That replay is right for the
sharding the trace saw, so the artifact records each DTensor input's mesh shape and
placements (``DTENSORS``) and its driver holds every call to them.

The wrapper itself has no storage: storages and data pointers, for aliasing and for
the fast path, are read from the local shard.

Inductor compiles plain tensors, so for the inductor backend ``to_local_graph``
traces that graph once more on the local shards: each DTensor op then records the
local ops and functional collectives its dispatch issues. The compiled graph takes
the inputs' local shards (``SHARD_INPUTS`` records the sharding it computes for) and
returns the local shards of the DTensor results, which the driver wraps again
(``SHARD_OUTPUTS``).

A model sharded with ``fully_shard`` is traced on the local shards from the start,
for either backend (``on_local_shards``): its parameters are gathered by DTensor
conversions, which a trace over DTensors cannot record but one over their local
tensors records like any op (``fully_sharded``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from precompile_gen.capture_result import DTensorLayout, ShardInput, ShardOutput
from precompile_gen.capturing import data_dependent
from precompile_gen.runtime.errors import PrecompileError


def _dtensor_class() -> type | None:
    # No DTensor can exist before torch.distributed.tensor is imported, and importing
    # it for every capture would cost time for nothing.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(value: object) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


def data(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``tensor``'s data: its local shard for a DTensor."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def layout(tensor: torch.Tensor) -> DTensorLayout:
    dtensor: Any = tensor
    return DTensorLayout(
        tuple(dtensor.device_mesh.shape),
        tuple(repr(placement) for placement in dtensor.placements),
    )


def layouts(flat_inputs: list[object]) -> dict[int, DTensorLayout]:
    """Graph-input position -> mesh shape and placements, for the DTensors."""
    return {
        position: layout(value)  # type: ignore[arg-type]
        for position, value in enumerate(flat_inputs)
        if is_dtensor(value)
    }


def copy(
    tensor: torch.Tensor, copy_local: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """A detached DTensor over a copy of ``tensor``'s local shard, on the same mesh
    with the same placements, global shape and strides."""
    from torch.distributed.tensor import DTensor

    dtensor: Any = tensor
    with torch.no_grad():
        result = DTensor.from_local(
            copy_local(dtensor._local_tensor),
            dtensor.device_mesh,
            dtensor.placements,
            run_check=False,
            shape=dtensor.shape,
            stride=dtensor.stride(),
        )
    return result.requires_grad_(tensor.requires_grad)


class LocalGraph(NamedTuple):
    """A graph over DTensors traced again over their local shards."""

    gm: torch.fx.GraphModule
    flat_args: list[object]
    inputs: dict[int, ShardInput]
    outputs: dict[int, ShardOutput]


# The placements a driver can rebuild from their repr, without torch's private types.
_PLACEMENTS = ("Shard", "Replicate", "Partial")


def to_local_graph(
    gm: torch.fx.GraphModule,
    flat_args: list[object],
    decompositions: dict[Any, Callable[..., Any]] | None,
) -> LocalGraph:
    """``gm`` traced again on the local shards of its DTensor inputs
    (``on_local_shards``): DTensor's dispatch runs under the trace and records the
    local ops and collectives it issues. ``gm`` holds its backward as ops already,
    so grad mode is off."""
    local = on_local_shards(gm, flat_args)
    shards = local_args(flat_args)
    with torch.no_grad():
        local_gm = make_fx(local.fn, decomposition_table=decompositions)(
            [a.detach() if isinstance(a, torch.Tensor) else a for a in shards]
        )
    return LocalGraph(local_gm, shards, shard_inputs(flat_args), local.outputs)


class LocalTrace(NamedTuple):
    """``flat_fn`` as make_fx traces it on local shards (``on_local_shards``)."""

    fn: Callable[[list[Any]], list[object]]
    # The DTensor results' placements and global shapes, by output position, filled
    # as the trace runs.
    outputs: dict[int, ShardOutput]


def on_local_shards(
    flat_fn: Callable[[list[Any]], list[object]], flat_args: list[object]
) -> LocalTrace:
    """``flat_fn`` over the local shards of ``flat_args``' DTensors: each call wraps
    them in DTensors with the same specs, which the trace does not track (DTensor's
    dispatch sends it the local ops and collectives), and returns the local shards of
    the DTensor results. Autograd runs on the wrappers, so a backward inside
    ``flat_fn`` is traced as the local ops DTensor issues for it, and so are
    DTensor's conversions, which make wrappers around traced local tensors. (The
    wrappers are untracked: the tracer hands their ops to DTensor, which sends the
    ops on the local shards back to it.)"""
    from torch.distributed.tensor import DTensor

    specs = {i: a._spec for i, a in enumerate(flat_args) if is_dtensor(a)}  # type: ignore[attr-defined]
    _reject_mixed_meshes(specs)
    trainable = {i for i in specs if getattr(flat_args[i], "requires_grad", False)}
    outputs: dict[int, ShardOutput] = {}

    def local_fn(local_args: list[Any]) -> list[object]:
        wrapped = [
            DTensor(arg, specs[i], requires_grad=i in trainable) if i in specs else arg
            for i, arg in enumerate(local_args)
        ]
        results = []
        for position, result in enumerate(flat_fn(wrapped)):
            if is_dtensor(result):
                outputs[position] = _shard_output(result)
                result = result._local_tensor  # type: ignore[attr-defined]
            results.append(result)
        return results

    return LocalTrace(local_fn, outputs)


def local_args(flat_args: list[object]) -> list[object]:
    """``flat_args`` with each DTensor replaced by its local shard."""
    return [data(a) if is_dtensor(a) else a for a in flat_args]  # type: ignore[arg-type]


def shard_inputs(flat_args: list[object]) -> dict[int, ShardInput]:
    """The process groups, placements and local shard shapes of the DTensors among
    ``flat_args``, by position."""
    return {
        i: ShardInput(
            _mesh_groups(a.device_mesh),  # type: ignore[attr-defined]
            _placement_reprs(a.placements),  # type: ignore[attr-defined]
            tuple(data(a).shape),  # type: ignore[arg-type]
        )
        for i, a in enumerate(flat_args)
        if is_dtensor(a)
    }


def _shard_output(dtensor: Any) -> ShardOutput:
    for placement in dtensor.placements:
        if type(placement).__name__ not in _PLACEMENTS:
            raise PrecompileError(
                f"the function returns a DTensor with placement {placement!r}, which "
                "the inductor backend's driver cannot rebuild (it rebuilds Shard, "
                "Replicate and Partial). Return it redistributed to one of those "
                "after the call, or capture with backend='eager'."
            )
    return ShardOutput(
        _placement_reprs(dtensor.placements),
        tuple(dtensor.shape),
        tuple(dtensor.stride()),
    )


def _placement_reprs(placements: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(repr(placement) for placement in placements)


def _mesh_groups(mesh: Any) -> tuple[str, ...]:
    """The process group of each mesh dim, by name: the compiled graph's
    collectives run on these."""
    return tuple(str(mesh.get_group(dim).group_name) for dim in range(mesh.ndim))


def _reject_mixed_meshes(specs: dict[int, Any]) -> None:
    meshes = {_mesh_groups(spec.mesh) for spec in specs.values()}
    if len(meshes) > 1:
        raise PrecompileError(
            "the model and inputs hold DTensors on more than one device mesh "
            f"(process groups {sorted(meshes)}), which the inductor backend does not "
            "support yet: the driver rebuilds the DTensor results on the mesh of the "
            "call's DTensors. Put them on one mesh, or capture with backend='eager'."
        )


# DTensor's own conversions: each makes a DTensor, or a plain tensor, around a local
# tensor outside the ops make_fx records, so the trace would see the result as a
# tensor that existed before the call.
_CONVERSIONS = ("from_local", "to_local", "redistribute", "full_tensor")


@contextlib.contextmanager
def refusing_conversions(fn_name: str) -> Generator[None]:
    """While tracing, DTensor's conversions raise a PrecompileError saying why."""
    cls = _dtensor_class()
    if cls is None:
        yield
        return
    originals = {name: cls.__dict__[name] for name in _CONVERSIONS}
    for name in _CONVERSIONS:
        refuse = _refuser(fn_name, name)
        setattr(cls, name, staticmethod(refuse) if name == "from_local" else refuse)
    cls.redistribute = _unless_unchanged(cls.__dict__["redistribute"])
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)


def _refuser(fn_name: str, name: str) -> Callable[..., Any]:
    def refuse(*args: object, **kwargs: object) -> Any:
        raise PrecompileError(
            f"{fn_name!r} calls DTensor.{name}() (reached from "
            f"{data_dependent.user_line(code=False)}), which capture does not "
            "support yet: it converts between a DTensor and its local tensor outside "
            "the tensor ops the trace records, so the graph could not repeat it. "
            "Tensor parallelism's parallelize_module hooks (ColwiseParallel, "
            "RowwiseParallel input and output layouts) call it too. Keep the "
            "function on DTensor ops: pass the inputs as DTensors "
            "(distribute_tensor), shard the parameters with distribute_module or "
            "distribute_tensor, and convert the result (.full_tensor(), .to_local(), "
            ".redistribute()) after the call."
        )

    return refuse


def _unless_unchanged(refuse: Callable[..., Any]) -> Callable[..., Any]:
    """``redistribute`` that returns the DTensor itself where it asks for the mesh and
    placements it already has (tensor parallelism's hooks do, for inputs already
    laid out as they want), which is the identity for values and gradients."""

    def redistribute(
        self: Any,
        device_mesh: object = None,
        placements: object = None,
        **options: object,
    ) -> Any:
        if (
            # async_op changes nothing where nothing moves; a dtype does.
            options.get("forward_dtype") is None
            and options.get("backward_dtype") is None
            and (device_mesh is None or device_mesh == self.device_mesh)
            and placements is not None
            and _normalised(self, placements) == tuple(self.placements)
        ):
            return self
        return refuse(self, device_mesh, placements, **options)

    return redistribute


def _normalised(dtensor: Any, placements: Any) -> tuple[object, ...]:
    from torch.distributed.tensor import Shard

    return tuple(
        Shard(p.dim + dtensor.ndim) if type(p) is Shard and p.dim < 0 else p
        for p in placements
    )


def holds_dtensors(arguments: tuple[object, ...]) -> bool:
    """Whether a module argument's parameters or buffers, or an input, is a DTensor."""
    if _dtensor_class() is None:
        return False
    modules = [a for a in arguments if isinstance(a, torch.nn.Module)]
    return any(
        is_dtensor(t)
        for t in [
            *(t for m in modules for t in (*m.parameters(), *m.buffers())),
            *pytree.tree_leaves(arguments),
        ]
    )


def reject_aliasing(
    groups: list[dict[int, Any]], flat: list[object], names: list[str]
) -> None:
    """Refuse DTensors that share a local storage with another input: the driver
    holds calls to the aliasing of plain tensors only."""
    for group in groups:
        members = sorted(group)
        if any(is_dtensor(flat[position]) for position in members):
            shown = " and ".join(names[position] for position in members)
            raise PrecompileError(
                f"{shown} share one storage and at least one of them is a DTensor: "
                "aliasing among DTensors (the same DTensor passed twice, or views "
                "of one local shard) is not supported. Pass separate tensors "
                "(.clone() one of them)."
            )
