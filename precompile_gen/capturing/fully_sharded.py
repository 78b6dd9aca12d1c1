"""FSDP2 capture: modules sharded with ``fully_shard``.

Between calls, each parameter of a ``fully_shard`` module is a ``DTensor`` sharded
over the module's mesh. FSDP2's own forward hooks all-gather a module's parameters
before it computes, swap them into the module as plain tensors, free them after, and
reduce-scatter the gradients from autograd hooks: all of it outside the ops a trace
records. So the trace replaces those two hooks with its own, which express the same
steps as DTensor ops on the graph's inputs (as torchtitan's SimpleFSDP does):

- before the module computes, each parameter it manages is redistributed from its
  shards to a replicated DTensor, an all-gather, and its local tensor, the whole
  parameter, stands in for it in the module;
- that local tensor's gradient is declared ``Partial("avg")``, so autograd's way
  back to the sharded parameter is a reduce-scatter that averages over the mesh, as
  FSDP2 reduces gradients, and the parameter's ``.grad`` is its shard;
- with ``reshard_after_forward`` (the default for modules other than the root), the
  backward gathers the parameter again rather than keeping the forward's copy:
  autograd saves a token in its place (``saved_tensors_hooks``) and gathers anew
  when the backward needs it, so a whole parameter lives only from its all-gather to
  its last use, in the forward and again in the backward.

The trace runs on the local shards (``dtensors.on_local_shards``), so the graph holds
the local ops and the functional collectives, for both backends. What FSDP2 offers
beyond that (CPU offload, mixed precision, HSDP, hooks on its own events) is refused
by ``check_module`` before anything runs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from precompile_gen.capturing import dtensors
from precompile_gen.runtime.errors import PrecompileError


def _fsdp() -> Any:
    # Nothing is sharded with fully_shard unless torch.distributed.fsdp was imported.
    return sys.modules.get("torch.distributed.fsdp")


def sharded_modules(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The submodules of ``module`` (itself included) that ``fully_shard`` wrapped."""
    fsdp = _fsdp()
    if fsdp is None:
        return
    for name, submodule in module.named_modules():
        if isinstance(submodule, fsdp.FSDPModule):
            yield name, submodule


def holds_sharded(modules: list[torch.nn.Module]) -> bool:
    return any(True for module in modules for _ in sharded_modules(module))


def _state(module: torch.nn.Module) -> Any:
    return module._get_fsdp_state()  # type: ignore[operator]


def check_module(module: torch.nn.Module, argument: str) -> None:
    """Refuse, before anything runs, what the artifact cannot reproduce of the
    ``fully_shard`` modules in the module at ``argument`` (as messages name it)."""
    for name, submodule in sharded_modules(module):
        where = f"module {name!r} of " if name else ""
        where += f"the module at {argument}"
        state = _state(submodule)
        if len(state._modules) > 1:
            _refuse(
                where,
                "shares one fully_shard call with other modules "
                "(fully_shard([module_a, module_b]))",
                "the capture all-gathers each module's parameters before it computes",
                "call fully_shard on each module separately",
            )
        for group in state._fsdp_param_groups:
            _check_group(where, group)
            _check_sharded_now(where, group)


def _check_group(where: str, group: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    if isinstance(group.mesh_info, HSDPMeshInfo) or group.mesh_info.mesh.ndim > 1:
        _refuse(
            where,
            "is sharded over a 2-D mesh (HSDP: replicated and sharded)",
            "the capture all-gathers and reduce-scatters over a 1-D mesh only",
            "shard it over a 1-D mesh (init_device_mesh(device, (world_size,)))",
        )
    if group.mp_policy != MixedPrecisionPolicy():
        _refuse(
            where,
            f"has a mixed-precision policy ({group.mp_policy})",
            "the capture computes and reduces in the parameters' own dtype",
            "shard it without mp_policy; torch.autocast inside the step is captured",
        )
    if type(group.offload_policy) is not OffloadPolicy:
        _refuse(
            where,
            "offloads its parameters to the CPU (CPUOffloadPolicy)",
            "the compiled step keeps the shards where they are",
            "shard it without offload_policy",
        )
    if isinstance(group.post_forward_mesh_info, HSDPMeshInfo):
        _refuse(
            where,
            "reshards after forward to a smaller mesh (reshard_after_forward=<int>)",
            "the capture reshards to the module's own mesh or not at all",
            "pass reshard_after_forward=True or False",
        )
    for problem, fix in _event_settings(group):
        _refuse(where, problem, "the artifact does not run FSDP2's own hooks", fix)


def _check_sharded_now(where: str, group: Any) -> None:
    """Refuse a module FSDP2 left unsharded: its parameters are whole plain tensors
    until it reshards, and a capture of them would reduce no gradient."""
    for param in group.fsdp_params:
        owner, name = _slots(param._module_info)[0]
        if not dtensors.is_dtensor(owner._parameters[name]):
            _refuse(
                where,
                f"holds its parameter {name!r} unsharded (a forward ran without its "
                "backward, or unshard() was called)",
                "FSDP2 keeps whole parameters in the module until it reshards, and "
                "the artifact's convention would hold every call to them",
                "call reshard() on the fully_shard modules before precompiling",
            )


def _event_settings(group: Any) -> Iterator[tuple[str, str]]:
    """The settings of FSDP2's own events that change what a step computes."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    if not group.reduce_grads:
        yield (
            "skips the gradient reduce-scatter (set_requires_gradient_sync(False))",
            "capture with gradient sync on; accumulate micro-batches inside the step",
        )
    if group._all_reduce_hook is not None:
        yield "has an all-reduce hook (set_all_reduce_hook)", "remove the hook"
    if group.gradient_divide_factor is not None:
        yield (
            "divides gradients by a custom factor (set_gradient_divide_factor)",
            "leave the factor at its default (the mesh size); scale the loss instead",
        )
    if (
        type(group._all_gather_comm) is not DefaultAllGather
        or type(group._reduce_scatter_comm) is not DefaultReduceScatter
    ):
        yield (
            "has a custom all-gather or reduce-scatter (set_custom_all_gather, "
            "set_custom_reduce_scatter)",
            "shard it with FSDP2's default collectives",
        )


def _refuse(where: str, what: str, why: str, fix: str) -> None:
    raise PrecompileError(
        f"{where} {what}, which the capture of a fully_shard (FSDP2) model cannot "
        f"keep: {why}. Fix: {fix}."
    )


def without_own_hooks(
    module: torch.nn.Module, hooks: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """``hooks`` (``convention.module_hooks``) less the forward hook pair of each
    fully_shard module in ``module``, which the trace replaces rather than runs."""
    own = {"forward pre-hook": 1, "forward hook": 1}
    sharded = {name for name, _ in sharded_modules(module)}
    result = {}
    for name, counts in hooks.items():
        if name in sharded:
            counts = {k: n - own.get(k, 0) for k, n in counts.items()}
            counts = {k: n for k, n in counts.items() if n}
        if counts:
            result[name] = counts
    return result


# Tracing.


@dataclass
class _Gathered:
    """A whole parameter the forward gathered, and how to gather it again."""

    sharded: torch.Tensor
    whole: torch.Tensor
    # The backward's own gathering, once it has needed one.
    again: torch.Tensor | None = None


# Whole parameters the backward gathers anew, by the data pointer of their storage
# (every view autograd saves of one shares it).
_Regathered = dict[int, _Gathered]


@contextlib.contextmanager
def unsharding(modules: list[torch.nn.Module]) -> Generator[None]:
    """While ``fn`` is traced: FSDP2's forward hooks of every ``fully_shard`` module
    in ``modules`` replaced by the all-gather and reduce-scatter as DTensor ops."""
    sharded = [(n, m) for module in modules for n, m in sharded_modules(module)]
    if not sharded:
        yield
        return
    roots = {id(m) for module in modules for m in _roots(module)}
    regathered: _Regathered = {}
    with contextlib.ExitStack() as stack:
        for _, module in sharded:
            state = _state(module)
            reshard = _reshards_after_forward(state, id(module) in roots)
            swaps = _ParameterSwaps(state, reshard, regathered)
            stack.enter_context(
                _hook_replaced(module, "_forward_pre_hooks", state, swaps.pre_forward)
            )
            stack.enter_context(
                _hook_replaced(module, "_forward_hooks", state, swaps.post_forward)
            )
        stack.enter_context(
            torch.autograd.graph.saved_tensors_hooks(
                functools.partial(_pack, regathered), _unpack
            )
        )
        yield


def _roots(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The fully_shard modules with no fully_shard module above them: FSDP2 makes
    each the root of its subtree when its forward first runs."""
    names = [name for name, _ in sharded_modules(module)]
    return [
        module.get_submodule(name)
        for name in names
        if not any(
            name.startswith(f"{other}.") or (other == "" and name) for other in names
        )
    ]


def _reshards_after_forward(state: Any, root: bool) -> bool:
    # FSDP2 keeps the root's parameters gathered from forward to backward unless the
    # user chose otherwise (its lazy init does so; the trace runs before any).
    if root and state._auto_reshard_after_forward:
        return False
    return any(g.post_forward_mesh_info is not None for g in state._fsdp_param_groups)


@contextlib.contextmanager
def _hook_replaced(
    module: torch.nn.Module, attribute: str, state: Any, hook: Callable[..., None]
) -> Generator[None]:
    handle = (
        state._pre_forward_hook_handle
        if attribute == "_forward_pre_hooks"
        else state._post_forward_hook_handle
    )
    hooks = getattr(module, attribute)
    original = hooks[handle.id]
    hooks[handle.id] = hook
    try:
        yield
    finally:
        hooks[handle.id] = original


class _ParameterSwaps:
    """One ``fully_shard`` module's parameters swapped for whole ones around its
    forward."""

    def __init__(self, state: Any, reshard: bool, regathered: _Regathered) -> None:
        self.slots = [
            slot
            for group in state._fsdp_param_groups
            for param in group.fsdp_params
            for slot in _slots(param._module_info)
        ]
        self.reshard = reshard
        self.regathered = regathered
        self.saved: list[list[torch.Tensor]] = []

    def pre_forward(
        self, module: torch.nn.Module, args: object, kwargs: object
    ) -> None:
        originals = [owner._parameters[name] for owner, name in self.slots]
        gathered: dict[int, torch.Tensor] = {}
        for (owner, name), sharded in zip(self.slots, originals, strict=True):
            assert sharded is not None
            if id(sharded) not in gathered:
                gathered[id(sharded)] = self._gather(sharded)
            owner._parameters[name] = gathered[id(sharded)]  # type: ignore[assignment]
        self.saved.append(originals)  # type: ignore[arg-type]

    def post_forward(
        self, module: torch.nn.Module, args: object, output: object
    ) -> None:
        originals = self.saved.pop()
        for (owner, name), sharded in zip(self.slots, originals, strict=True):
            owner._parameters[name] = sharded  # type: ignore[assignment]

    def _gather(self, sharded: torch.Tensor) -> torch.Tensor:
        whole = _all_gathered(sharded)
        if self.reshard and whole.requires_grad:
            self.regathered[_storage_key(whole)] = _Gathered(sharded, whole)
        return whole


def _slots(info: Any) -> list[tuple[torch.nn.Module, str]]:
    return [
        (info.module, info.param_name),
        *zip(info.shared_modules, info.shared_param_names, strict=True),
    ]


def _all_gathered(sharded: Any) -> torch.Tensor:
    """The whole parameter as a plain tensor: its shards all-gathered, its gradient
    reduce-scattered back, averaged over the mesh."""
    from torch.distributed.tensor import Partial, Replicate

    mesh = sharded.device_mesh
    replicated = sharded.redistribute(mesh, [Replicate()] * mesh.ndim)
    return replicated.to_local(grad_placements=[Partial("avg")] * mesh.ndim)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _pack(regathered: _Regathered, tensor: torch.Tensor) -> Any:
    gathered = regathered.get(_storage_key(tensor))
    if gathered is None:
        return tensor
    # A view of a whole parameter: what to gather, and the view's place in it.
    return gathered, tensor.size(), tensor.stride(), tensor.storage_offset()


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    gathered, size, stride, offset = packed
    if gathered.again is None:
        with torch.no_grad():
            gathered.again = _all_gathered(gathered.sharded).detach()
    again = gathered.again
    shift = again.storage_offset() - gathered.whole.storage_offset()
    return again.as_strided(size, stride, offset + shift)
