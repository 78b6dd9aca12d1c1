# Runtime support for Inductor's memory layouts: carried after the calls part
# (precompile_gen/runtime_support/calls.py) by every inductor artifact whose kernels
# specialise on the strides of their inputs, from its first "# ---" heading on. The
# lines above that heading are not carried: they import what the rest of the artifact
# defines, so that ruff and pyrefly check this part as a module of its own.
from precompile_gen.runtime_support.calls import _NUM_STATE, _call_leaf_name
from precompile_gen.runtime_support.declarations import (
    ALIASED_INPUTS,
    BUFFER_STRIDES,
    PARAM_STRIDES,
    USER_INPUT_SHAPES,
    USER_INPUT_STRIDES,
)
from precompile_gen.runtime_support.support import _fail, _layout_message, _same_layout

# isort: split

# --- Memory layouts -----------------------------------------------------------------
# Inductor specialises on the strides of the inputs its kernels read (and those the
# graph updates in place), which are recorded for those only.
import warnings
from typing import cast

import torch


def _check_state_layouts(tensors: list[torch.Tensor], names: list[str]) -> None:
    """Inductor asserts these strides inside the graph, possibly after it has updated
    buffers in place; check them first."""
    expected = PARAM_STRIDES + BUFFER_STRIDES
    for name, tensor, strides in zip(names, tensors, expected):
        if strides is not None and not _same_layout(tensor, strides):
            _fail(_layout_message(f"the model's {name!r}", tensor, strides))


def _uncopied_leaves() -> dict[int, str]:
    """Why a leaf passed in another layout cannot run on a copy in the example's,
    for the leaves where it cannot."""
    reasons: dict[int, str] = {}
    layouts = zip(USER_INPUT_SHAPES, USER_INPUT_STRIDES)
    for index, (shape, strides) in enumerate(layouts):
        if strides is not None and not _distinct_elements(shape or (), strides):
            reasons[index] = (
                "the example's layout repeats elements (an expanded tensor), which a "
                "copy of another tensor cannot keep"
            )
    for group in ALIASED_INPUTS:
        for position in group:
            if position >= _NUM_STATE:
                reasons[position - _NUM_STATE] = (
                    "it shares a storage with other inputs, as at capture, which a "
                    "copy would not"
                )
    for position in globals().get("MUTATED_INPUTS", []):
        if position >= _NUM_STATE:
            reasons[position - _NUM_STATE] = (
                "the graph writes into it in place, and a write into a copy would not "
                "reach the caller's tensor"
            )
    return reasons


def _distinct_elements(shape: tuple[int | None, ...], strides: tuple[int, ...]) -> bool:
    # Each element at an address of its own: the dims' strides, smallest first,
    # each step past all the addresses the smaller dims reach.
    reach = 0
    for stride, size in sorted(zip(strides, shape), key=lambda dim: dim[0]):
        if size is not None and size > 1:
            if stride <= reach:
                return False
            reach += stride * (size - 1)
    return True


_UNCOPIED_LEAVES = _uncopied_leaves()


# The leaves a call has passed in another layout, each warned of once.
_COPIED_LEAVES: set[int] = set()


def _leaves_in_captured_layout(args: tuple[object, ...], leaves: list[object]) -> None:
    """Replace each leaf passed in another layout than the example's with a copy in
    that layout, which the kernels were compiled for; refuse those not to be copied."""
    for index, (leaf, strides) in enumerate(zip(leaves, USER_INPUT_STRIDES)):
        if strides is None:
            continue
        tensor = cast(torch.Tensor, leaf)
        if tensor.stride() == strides or _same_layout(tensor, strides):
            continue
        reason = _UNCOPIED_LEAVES.get(index)
        if reason is not None:
            where = _call_leaf_name(args, index)
            _fail(_uncopied_message(where, tensor, strides, reason))
        copied = torch.empty_strided(
            tensor.shape, strides, dtype=tensor.dtype, device=tensor.device
        )
        leaves[index] = copied.copy_(tensor.detach())
        if index not in _COPIED_LEAVES:
            _COPIED_LEAVES.add(index)
            where = _call_leaf_name(args, index)
            _warn_of_copy(where, tensor, strides)


def _warn_of_copy(what: str, tensor: torch.Tensor, strides: tuple[int, ...]) -> None:
    size = tensor.numel() * tensor.element_size()
    warnings.warn(
        f"{what} has strides {tuple(tensor.stride())}, but the compiled kernels were "
        f"built for the example's {strides}: each call passing this layout copies it "
        f"into the example's before the kernels run ({size} bytes a call). Pass it "
        "in the example's layout (.contiguous() for a contiguous example) to save "
        "the copy, or capture with an example in this layout. (Said once per "
        "artifact.)",
        stacklevel=4,
    )


def _uncopied_message(
    what: str, tensor: torch.Tensor, strides: tuple[int, ...], reason: str
) -> str:
    return (
        f"{what} has strides {tuple(tensor.stride())}, but the example had {strides}, "
        f"which the inductor backend specialises on; {reason}, so it cannot run on a "
        "copy in the example's layout. Pass it in the example's layout (.contiguous() "
        "for a contiguous example), or capture with backend='eager'."
    )
