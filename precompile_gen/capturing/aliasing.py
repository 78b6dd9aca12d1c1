"""Aliasing among the graph's inputs: which of them share one storage.

Eager PyTorch sees the same tensor passed twice, or two views of one storage, as one
piece of memory: an in-place update through one is visible through the other. The
trace must see the same, so capture copies the example inputs with their aliasing
kept; and the graph is only right for that aliasing (make_fx reads a tensor passed
twice as one input, and AOTAutograd compiles views of one storage as one base at
their offsets), so the artifact records it as ``ALIASED_INPUTS`` and its driver holds
every call to it.
"""

from __future__ import annotations

from typing import cast

import torch

from precompile_gen.capture_result import AliasGroup
from precompile_gen.capturing import dtensors


def _is_plain_tensor(value: object) -> bool:
    # Subclasses (fake tensors, ...) keep their own notion of storage; a DTensor's
    # data is its local shard's.
    return (
        type(value) is torch.Tensor
        or type(value) is torch.nn.Parameter
        or dtensors.is_dtensor(value)
    )


def storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """What identifies ``tensor``'s storage; None for an empty one, which no other
    tensor can see into."""
    pointer = dtensors.data(tensor).untyped_storage().data_ptr()
    return None if pointer == 0 else (str(tensor.device), pointer)


def alias_groups(flat_inputs: list[object]) -> list[AliasGroup]:
    """The groups of ``flat_inputs`` positions whose tensors share one storage (the
    same tensor in two positions included), in order of their first member."""
    groups = []
    for positions in _positions_by_storage(flat_inputs).values():
        if len(positions) > 1:
            tensors = [cast(torch.Tensor, flat_inputs[p]) for p in positions]
            groups.append(
                {
                    position: (int(tensor.storage_offset()), tuple(tensor.stride()))
                    for position, tensor in zip(positions, tensors, strict=True)
                }
            )
    return groups


def _positions_by_storage(values: list[object]) -> dict[tuple[str, int], list[int]]:
    positions: dict[tuple[str, int], list[int]] = {}
    for position, value in enumerate(values):
        if _is_plain_tensor(value):
            key = storage_key(cast(torch.Tensor, value))
            if key is not None:
                positions.setdefault(key, []).append(position)
    return positions


def copies_for_trace(values: list[object]) -> list[object]:
    """Detached copies of the tensors among ``values`` (anything else as it is), with
    the same strides and ``requires_grad``, and the aliasing among them kept.

    make_fx's real mode runs every op for real, so tracing on the originals would
    apply fn's side effects (BatchNorm's running stats, in-place input updates, the
    ``.grad`` a backward writes) to the caller's example model and inputs. The strides
    are kept because the inductor backend specialises on them; the aliasing because
    the graph is traced for it. A tensor in two positions is one copy; tensors that
    share a storage are views of one copied storage, at the same offsets and with
    the same view base (AOTAutograd rebuilds aliased inputs from their ``_base``).
    """
    shared = {
        key
        for key, positions in _positions_by_storage(values).items()
        if len(positions) > 1
    }
    copies: dict[int, torch.Tensor] = {}
    storages: dict[tuple[str, int], torch.UntypedStorage] = {}
    result: list[object] = []
    for value in values:
        if not _is_plain_tensor(value):
            result.append(value)
            continue
        tensor = cast(torch.Tensor, value)
        if dtensors.is_dtensor(tensor):
            if id(tensor) not in copies:
                copies[id(tensor)] = dtensors.copy(tensor, _copy)
            result.append(copies[id(tensor)])
            continue
        if id(tensor) not in copies:
            key = storage_key(tensor)
            if key is not None and key in shared:
                if key not in storages:
                    storages[key] = tensor.untyped_storage().clone()
                copy = _view_copy(tensor, storages[key], copies)
            else:
                copy = _copy(tensor)
            copies[id(tensor)] = copy.requires_grad_(tensor.requires_grad)
        result.append(copies[id(tensor)])
    return result


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    if torch._debug_has_internal_overlap(tensor) != 0:
        # An expanded tensor repeats elements, which copy_ cannot write: copy the
        # storage it reads, and read it the same way.
        return _on_storage(tensor, tensor.untyped_storage().clone())
    copy = torch.empty_strided(
        tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device
    )
    with torch.no_grad():
        copy.copy_(tensor)
    return copy


def _view_copy(
    tensor: torch.Tensor,
    storage: torch.UntypedStorage,
    copies: dict[int, torch.Tensor],
) -> torch.Tensor:
    """``tensor``'s geometry on the copied ``storage``: a view of the copy of its view
    base where it has one, so the copies are views of one base as the originals are."""
    base = tensor._base
    if base is None:
        return _on_storage(tensor, storage)
    if id(base) not in copies:
        copies[id(base)] = _on_storage(base, storage)
    with torch.no_grad():
        return copies[id(base)].as_strided(
            tensor.size(), tensor.stride(), tensor.storage_offset()
        )


def _on_storage(like: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    tensor = torch.empty(0, dtype=like.dtype, device=like.device)
    with torch.no_grad():
        tensor.set_(storage, like.storage_offset(), like.size(), like.stride())
    return tensor
