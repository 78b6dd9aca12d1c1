# Runtime support for DTensors: carried after the calls part
# (precompile_gen/runtime_support/calls.py) by every artifact captured with DTensor
# inputs, from its first "# ---" heading on. The lines above that heading are not
# carried: they import what the rest of the artifact defines, so that ruff and pyrefly
# check this part as a module of its own.
from precompile_gen.runtime_support.calls import _NUM_STATE, _call_leaf_name
from precompile_gen.runtime_support.declarations import DTENSORS, USER_INPUT_SHAPES
from precompile_gen.runtime_support.support import _fail

# isort: split

# --- DTensors -----------------------------------------------------------------------
# The graph replays the ops each DTensor received at capture; DTensor's dispatch
# shards them and issues the collectives they need for the placements it finds, so
# the graph is the captured computation only for the captured ones.
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement


def _check_sharding(name: str, position: int, tensor: torch.Tensor) -> None:
    layout = DTENSORS.get(position)
    if not isinstance(tensor, DTensor):
        if layout is not None:
            _fail(
                f"{name} is a plain tensor, but the artifact was captured with a "
                f"DTensor there ({_show_sharding(*layout)}), whose sharding the graph "
                "replays. Pass a DTensor sharded as at capture (distribute_tensor / "
                "distribute_module on such a mesh), or capture again with a plain "
                "tensor."
            )
        return
    sharding = (tuple(tensor.device_mesh.shape), tuple(map(repr, tensor.placements)))
    if layout is None:
        _fail(
            f"{name} is a DTensor ({_show_sharding(*sharding)}), but the artifact was "
            "captured with a plain tensor there. Pass a plain tensor (.full_tensor() "
            "gives the whole of it), or capture again with this DTensor."
        )
    if sharding != layout:
        _fail(
            f"{name} is a DTensor with {_show_sharding(*sharding)}, but the artifact "
            f"was captured with {_show_sharding(*layout)}, and the graph replays the "
            "ops, and the collectives, of that sharding. Redistribute it as at "
            "capture (.redistribute(mesh, placements), or distribute the model as it "
            "was), or capture again with this sharding."
        )
    if _SHARD_INPUTS:
        _check_mesh_groups(name, position, tensor)


def _check_state_sharding(tensors: list[torch.Tensor], names: list[str]) -> None:
    # With the module state's full check, which the fast path vouches for after.
    for position, (name, tensor) in enumerate(zip(names, tensors)):
        _check_sharding(f"the model's {name!r}", position, tensor)


def _check_leaf_sharding(args: tuple[object, ...], leaves: list[object]) -> None:
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            position = _NUM_STATE + index
            if isinstance(leaf, DTensor) or position in DTENSORS:
                _check_sharding(_call_leaf_name(args, index), position, leaf)


def _show_sharding(mesh_shape: tuple[int, ...], placements: tuple[str, ...]) -> str:
    return f"placements ({', '.join(placements)}) on a mesh of shape {mesh_shape}"


# --- The fast path's DTensors -------------------------------------------------------
class _RememberedShards:
    """The DTensors among the tensors the fast path remembers (support's
    _Remembered). A DTensor's data pointer is 0 and its placements are its spec's:
    what holds its data is its local shard, guarded as the other tensors are, and
    its spec is remembered by identity (redistributing makes a new one)."""

    def __init__(self, tensors: list[Any]) -> None:
        self.shards = [
            (tensor, tensor._local_tensor, tensor._spec)
            for tensor in tensors
            if type(tensor) is not torch.Tensor and hasattr(tensor, "_local_tensor")
        ]
        self.local_tensors = [local for _, local, _ in self.shards]

    def hold(self) -> bool:
        return all(
            tensor._local_tensor is local and tensor._spec is spec
            for tensor, local, spec in self.shards
        )


# --- Local shards -------------------------------------------------------------------
# Inductor compiles plain tensors, and a fully_shard model's trace gathers its
# parameters from their shards: capture traced DTensor's dispatch into the local ops
# and collectives it issues, so the graph computes on local shards, for the sharding,
# process groups and shard shapes of SHARD_INPUTS, and returns the local shards of
# the DTensor results (SHARD_OUTPUTS). The module state and the input leaves are
# held to their sharding by _check_sharding (and the fast path, which remembers each
# spec); the optimizers' state, the graph inputs after them, by _local_shards.
# SHARD_INPUTS and SHARD_OUTPUTS, which only such a capture's metadata has.
_SHARD_INPUTS: dict[int, Any] = globals().get("SHARD_INPUTS", {})
_SHARD_OUTPUTS: dict[int, Any] = globals().get("SHARD_OUTPUTS", {})


def _check_mesh_groups(name: str, position: int, tensor: DTensor) -> None:
    groups = _mesh_groups(tensor.device_mesh)
    if groups != _SHARD_INPUTS[position][0]:
        _fail(
            f"{name} is a DTensor on a mesh over the process groups {groups}, but the "
            "compiled graph runs its collectives on the example's mesh, over "
            f"{_SHARD_INPUTS[position][0]}. Put it on a mesh over those groups (the "
            "example's mesh), or capture again with this mesh."
        )
    _check_shard_shape(name, position, tensor)


def _check_shard_shape(name: str, position: int, tensor: DTensor) -> None:
    # The graph pads and slices for the capturing rank's shards, which another
    # rank's can differ from where a dim does not divide by the mesh size.
    shape = tuple(tensor._local_tensor.shape)
    if shape != _SHARD_INPUTS[position][2]:
        _fail(
            f"this rank's shard of {name} has shape {shape}, but the graph computes "
            f"on shards of shape {_SHARD_INPUTS[position][2]}, those of the rank that "
            "captured it: a pair is made for its rank's shards. Load on each rank "
            "the pair that rank captured (precompile() on every rank)."
        )


_OPTIMIZER_SHARDS = {
    position: (groups, placements)
    for position, (groups, placements, _) in _SHARD_INPUTS.items()
    if position >= _NUM_STATE + len(USER_INPUT_SHAPES)
}


def _local_shards(inputs: list[Any]) -> tuple[list[Any], DeviceMesh]:
    for position, (groups, placements) in _OPTIMIZER_SHARDS.items():
        tensor = inputs[position]
        sharding = (
            (_mesh_groups(tensor.device_mesh), tuple(map(repr, tensor.placements)))
            if isinstance(tensor, DTensor)
            else None
        )
        if sharding != (groups, placements):
            shown = (
                "a plain tensor"
                if sharding is None
                else f"a DTensor with placements ({', '.join(sharding[1])}) on the "
                f"process groups {sharding[0]}"
            )
            _fail(
                f"an optimizer's state tensor is {shown}, but the graph was compiled "
                f"for placements ({', '.join(placements)}) on the process groups "
                f"{groups}: it runs the local ops and collectives of that sharding. "
                "Shard it as at capture (as its parameter is), or capture again with "
                "this sharding."
            )
        _check_shard_shape("an optimizer's state tensor", position, tensor)
    shards = list(inputs)
    for position in _SHARD_INPUTS:
        shards[position] = inputs[position]._local_tensor
    return shards, inputs[next(iter(_SHARD_INPUTS))].device_mesh


def _mesh_groups(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(str(mesh.get_group(dim).group_name) for dim in range(mesh.ndim))


def _placement(text: str) -> Placement:
    # Capture records only these three kinds, by their repr.
    kind, argument = text.removesuffix(")").split("(", 1)
    if kind == "Shard":
        return Shard(int(argument.removeprefix("dim=")))
    if kind == "Partial":
        return Partial(argument)
    return Replicate()


def _dtensor_results(outputs: list[Any], mesh: DeviceMesh) -> list[Any]:
    results = list(outputs)
    for position, (_, shape, stride) in _SHARD_OUTPUTS.items():
        results[position] = DTensor.from_local(
            outputs[position],
            mesh,
            _RESULT_PLACEMENTS[position],
            run_check=False,
            shape=torch.Size(shape),
            stride=stride,
        )
    return results


_RESULT_PLACEMENTS = {
    position: tuple(map(_placement, placements))
    for position, (placements, _, _) in _SHARD_OUTPUTS.items()
}
