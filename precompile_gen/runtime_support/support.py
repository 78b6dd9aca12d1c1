# Runtime support: code that every artifact of this precompile_gen version carries
# verbatim, whatever its capture: this base part, then the parts its capture needs
# (precompile_gen/runtime_support/*.py, named in the section's title). Section 3 writes
# out the capture's calling convention as data and lists its steps in forward(); the
# functions here carry them out, reading the metadata constants (section 2) and section
# 3's by name, as the functions of one module do. The section's title holds this text's
# sha256, so a reviewer can tell it is the known text without reading it again. This
# base part reads no metadata when it is executed, so that capture and inspect run the
# same code (precompile_gen.capturing.convention).
import bisect
import re
import reprlib
import sys
import weakref
from collections.abc import Callable
from itertools import chain
from operator import attrgetter
from typing import Any, NoReturn, cast

import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle


# --- Errors -------------------------------------------------------------------------
class PrecompileError(RuntimeError):
    """A call broke the artifact's contract (used when precompile_gen is absent)."""


def _fail(message: str) -> NoReturn:
    # precompile_gen is imported here, on the error path only, so callers that have it
    # can catch its PrecompileError; the artifact never depends on it to run.
    error_type: type[RuntimeError]
    try:
        from precompile_gen import PrecompileError as error_type
    except ImportError:
        error_type = PrecompileError
    raise error_type(message)


# A graph holds a side of a branch on a tensor's value that capture could not serve as
# a subgraph asserting that no call takes it. The assertion's message starts with this,
# so the driver raises the RuntimeError it gives as the PrecompileError it is: the call,
# not the program, left what the artifact serves.
_REFUSED_SIDE = "precompile_gen: this call takes the side of the branch at "


def refused_side_message(where: str, side: bool, reason: str) -> str:
    """The message of the assertion a refused side of the branch at ``where`` makes:
    the call's predicate was ``side``, a side capture refused for ``reason``."""
    return (
        f"{_REFUSED_SIDE}{where} where it is {side}, which capture could not serve "
        f"({reason}). Run this call eagerly, or make that side return and update "
        "what the other does, and capture again."
    )


def _raise_refused_side(error: BaseException) -> None:
    """Raise ``error``, a graph's failure, as a PrecompileError where it is a refused
    side's assertion (eager's and Inductor's assertions give its message as is)."""
    text = str(error)
    if isinstance(error, RuntimeError) and text.startswith(_REFUSED_SIDE):
        _fail(text.removeprefix("precompile_gen: "))


# --- Messages -----------------------------------------------------------------------
def _listed(items: list[Any], show: Callable[[Any], str] = repr, limit: int = 3) -> str:
    """``items`` as a message lists them: all of them when there are few, else the
    first ``limit`` and how many more, e.g. "['a', 'b', 'c'] and 43 more". A model
    of another architecture differs in dozens of names, and a message that lists
    them all buries its first line, the one that says what to do."""
    if len(items) <= limit + 1:
        return "[" + ", ".join(map(show, items)) + "]"
    shown = ", ".join(map(show, items[:limit]))
    return f"[{shown}] and {len(items) - limit} more"


# --- The call's arguments -----------------------------------------------------------
def _argument(position: int, names: list[str], path: str = "") -> str:
    """How messages name the call's argument at ``position``, or its part at ``path``:
    by position and by the traced function's own name for it (``names``,
    ARGUMENT_NAMES), e.g. "argument 1 (`batch['input_ids']`)"."""
    return f"argument {position} (`{names[position]}{path}`)"


def _arguments_message(count: int, expected: int, signature: str) -> str:
    return (
        f"forward() takes {expected} positional arguments ({signature}), the same as "
        f"the traced function, but got {count}. Pass the module(s) and inputs in the "
        "order the function was captured with."
    )


def _not_a_module_message(
    position: int, names: list[str], argument: object, signature: str
) -> str:
    return (
        f"{_argument(position, names)} must be an nn.Module, as in the traced call "
        f"({signature}), but got {type(argument).__name__}. Pass the model at "
        f"position {position}."
    )


def _nesting_message(spec: pytree.TreeSpec, expected: pytree.TreeSpec) -> str:
    return (
        "the inputs are nested differently from the captured example: expected "
        f"{pytree.treespec_pprint(expected)}, got {pytree.treespec_pprint(spec)} (the "
        "module positions shown as omitted). Pass inputs with the example's "
        "containers, keys and lengths."
    )


def _leaf_count_message(count: int, expected: int) -> str:
    return (
        f"the inputs flatten to {count} leaves, but the captured example had "
        f"{expected}. Pass inputs with the example's structure."
    )


def _keywords_message(keywords: dict[str, object], signature: str) -> str:
    return (
        f"forward() takes positional arguments only ({signature}), as the traced "
        f"function was captured, but got keyword argument(s) {sorted(keywords)}. "
        "Pass every argument by position, in the order of the captured call."
    )


def _tensor_leaf_problem(
    name: str,
    leaf: object,
    shape: tuple[int | None, ...],
    dtype: str | None,
    device: str | None,
    can_mark_dims: bool,
) -> str | None:
    """What is wrong with the input leaf ``name`` for the example's tensor of this
    shape (None for a dynamic dim), dtype and device; None if nothing is. Where the
    capture could not have had ``mark_unbacked`` dims (an optimizer argument, DTensors)
    the shape message does not suggest them."""
    if not isinstance(leaf, torch.Tensor):
        return (
            f"{name} must be a tensor of shape {_show_shape(shape)}, as in the "
            f"captured example, but got {type(leaf).__name__}. Pass a tensor there."
        )
    if len(leaf.shape) != len(shape) or any(
        want is not None and got != want for got, want in zip(leaf.shape, shape)
    ):
        return (
            f"{name} has shape {tuple(leaf.shape)}, but the artifact was captured "
            f"with shape {_show_shape(shape)}; shapes are specialised to the example. "
            "Pass that shape, or capture again with this one"
            + (
                " (a dynamic dim can be marked with mark_unbacked on the inductor "
                "backend)."
                if can_mark_dims
                else "."
            )
        )
    if str(leaf.dtype) != dtype:
        return (
            f"{name} has dtype {leaf.dtype}, but the artifact was captured with "
            f"{dtype}. Convert it with .to({dtype}), or capture again with this dtype."
        )
    if str(leaf.device) != device:
        return _no_cuda_problem(name, str(leaf.device), device) or (
            f"{name} is on device {str(leaf.device)!r}, but the artifact was captured "
            f"on {device!r}. Move it with .to({device!r}), or capture again on this "
            "device."
        )
    return _lazy_bit_problem(name, leaf)


def _no_cuda_problem(name: str, got: str, want: str | None) -> str | None:
    """The message for a tensor off the CUDA device it was captured on, where this
    process has no CUDA device to move it to; None where it has one."""
    # Asked only once a device differs: the checks of a matching call never pay it.
    if want is None or not want.startswith("cuda") or got.startswith("cuda"):
        return None
    if torch.cuda.is_available():
        return None
    return (
        f"{name} is on device {got!r}, but the artifact was captured for CUDA, on "
        f"{want!r}, and this machine has no CUDA device (torch.cuda.is_available() "
        "is False). Run it on a machine with a GPU, or capture again on CPU."
    )


def _lazy_bit_problem(name: str, leaf: torch.Tensor) -> str | None:
    # .conj() and .conj().imag return views whose conjugate or negative bit asks each
    # op to apply it lazily; the graph was captured on resolved tensors and its
    # kernels read the memory as it is.
    if leaf.is_conj():
        return (
            f"{name} is a lazily conjugated view (its conjugate bit is set, as "
            "tensor.conj() leaves it), which the graph, traced on a resolved "
            "tensor, does not apply. Pass it resolved, with .resolve_conj()."
        )
    if leaf.is_neg():
        return (
            f"{name} is a lazily negated view (its negative bit is set, as "
            "tensor.conj().imag leaves it), which the graph, traced on a resolved "
            "tensor, does not apply. Pass it resolved, with .resolve_neg()."
        )
    return None


def _show_shape(shape: tuple[int | None, ...]) -> str:
    # A dynamic dim (None) accepts any size.
    return "(" + ", ".join("*" if d is None else str(d) for d in shape) + ")"


# --- Input leaves by their paths -----------------------------------------------------
# A leaf is named by where it sits in its argument ("argument 1 (`batch['x'][0]`)"),
# as capture and inspect name it too.
def leaf_names(
    positions: list[int], names: list[str], arguments: tuple[object, ...]
) -> list[str]:
    """Each leaf of the non-module ``arguments`` (at ``positions`` in the call, which
    the traced function calls ``names``) named by where it sits, e.g.
    "argument 1 (`batch['x'][0]`)"."""
    return [
        _argument(position, names, path)
        for position, argument in zip(positions, arguments, strict=True)
        for path in leaf_paths(argument)
    ]


def leaf_paths(tree: object) -> list[str]:
    """The path of each of ``tree``'s pytree leaves as ``pytree.keystr`` writes it
    (``['x'][0]``); by position for a node type registered without
    ``flatten_with_keys_fn``, where ``tree_flatten_with_path`` would raise."""
    if pytree.tree_is_leaf(tree):
        return [""]
    node = pytree.SUPPORTED_NODES[pytree._get_node_type(tree)]
    keyed: list[tuple[Any, object]]
    if node.flatten_with_keys_fn is not None:
        keyed = node.flatten_with_keys_fn(tree)[0]
    else:
        children = node.flatten_fn(tree)[0]
        keyed = [(pytree.SequenceKey(i), child) for i, child in enumerate(children)]
    return [
        pytree.keystr((key,)) + path
        for key, child in keyed
        for path in leaf_paths(child)
    ]


# --- The module arguments' state ----------------------------------------------------
def named_members(
    modules: list[torch.nn.Module], kind: str
) -> list[tuple[str, torch.Tensor]]:
    """Each module's ``named_parameters`` or ``named_buffers`` (``kind``), aliases of
    tied tensors included, named as PARAM_NAMES and BUFFER_NAMES name them: with
    several module arguments, prefixed by the module's index ("m0.", "m1.", ...)."""
    prefix = len(modules) > 1
    return [
        (f"m{index}.{name}" if prefix else name, tensor)
        for index, module in enumerate(modules)
        for name, tensor in getattr(module, kind)(remove_duplicate=False)
    ]


def module_state(
    modules: list[torch.nn.Module],
) -> tuple[list[torch.Tensor], list[str], int]:
    """The graph's leading inputs: the modules' parameters, then their buffers, each
    tensor once; their names (PARAM_NAMES + BUFFER_NAMES); how many are parameters."""
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    seen: set[int] = set()
    num_params = 0
    for kind in ("named_parameters", "named_buffers"):
        for name, tensor in named_members(modules, kind):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
                names.append(name)
        num_params = num_params or len(tensors)
    return tensors, names, num_params


# The hooks nn.Module runs around a module's forward and backward, by kind, and the
# attribute (on each module, and global in torch.nn.modules.module) holding them.
_HOOK_KINDS: dict[str, str] = {
    "forward pre-hook": "forward_pre_hooks",
    "forward hook": "forward_hooks",
    "backward pre-hook": "backward_pre_hooks",
    "backward hook": "backward_hooks",
}


def module_hooks(module: torch.nn.Module) -> dict[str, dict[str, int]]:
    """How many hooks of each kind ``module`` and its submodules have, by module name
    ("" for ``module`` itself), for the modules that have any."""
    hooks: dict[str, dict[str, int]] = {}
    for name, submodule in module.named_modules():
        counts = {
            kind: len(registered)
            for kind, attribute in _HOOK_KINDS.items()
            if (registered := getattr(submodule, f"_{attribute}"))
        }
        if counts:
            hooks[name] = counts
    return hooks


def global_module_hooks() -> dict[str, int]:
    """How many hooks of each kind are registered for every module
    (``torch.nn.modules.module.register_module_forward_hook`` and its kin)."""
    registry = vars(torch.nn.modules.module)
    return {
        kind: len(registered)
        for kind, attribute in _HOOK_KINDS.items()
        if (registered := registry[f"_global_{attribute}"])
    }


def _state_tensor_problem(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    dtype: str,
    device: str,
    requires_grad: bool,
) -> str | None:
    """What is wrong with the model's tensor ``name`` for the traced model's of this
    shape, dtype, device and requires_grad; None if nothing is."""
    if tuple(tensor.shape) != tuple(shape):
        return (
            f"the model's {name!r} has shape {tuple(tensor.shape)}, but the traced "
            f"model's had {tuple(shape)}. Pass a model of the traced architecture, "
            "or capture again with this model."
        )
    if str(tensor.dtype) != dtype:
        return (
            f"the model's {name!r} has dtype {tensor.dtype}, but the traced "
            f"model's had {dtype}. Convert the model with .to({dtype}), or capture "
            "again with this dtype."
        )
    if str(tensor.device) != device:
        return _no_cuda_problem(
            f"the model's {name!r}", str(tensor.device), device
        ) or (
            f"the model's {name!r} is on device {str(tensor.device)!r}, but the "
            f"traced model's was on {device!r}. Move the model with "
            f".to({device!r}), or capture again on this device."
        )
    if tensor.requires_grad != requires_grad:
        return (
            f"the model's {name!r} has requires_grad={tensor.requires_grad}, but "
            f"the traced model's had {requires_grad}, and which gradients the "
            "graph computes was fixed by it. Set it back with "
            f".requires_grad_({requires_grad}), or capture again with this setting."
        )
    return None


def _mode_and_hook_problem(
    modules: list[torch.nn.Module],
    module_training: list[list[bool]],
    module_hooks_traced: list[dict[str, dict[str, int]]],
    global_hooks_traced: dict[str, int],
) -> str | None:
    """What differs from the traced modules' train/eval modes (MODULE_TRAINING) and
    hooks (MODULE_HOOKS, GLOBAL_MODULE_HOOKS); None if nothing does."""
    several = len(modules) > 1
    for index, (module, traced_modes) in enumerate(zip(modules, module_training)):
        if [m.training for m in module.modules()] != traced_modes:
            return _describe_mode_difference(index, module, traced_modes, several)
    for index, (module, traced_hooks) in enumerate(zip(modules, module_hooks_traced)):
        hooks = module_hooks(module)
        if hooks != traced_hooks:
            return _describe_hook_difference(
                _subject(index, several), module, hooks, traced_hooks
            )
    global_hooks = global_module_hooks()
    if global_hooks != global_hooks_traced:
        traced = {"": global_hooks_traced}
        return _describe_hook_difference(None, None, {"": global_hooks}, traced)
    return None


def _describe_state_difference(
    modules: list[torch.nn.Module], names: list[str], traced_names: list[str]
) -> str:
    # Error path only: the first line says what to do; the lines after it name the
    # members, aliases of tied tensors included, to tell a tying difference apart
    # from a missing or renamed member.
    first_name: dict[int, str] = {}
    alias_of: dict[str, str] = {}
    for kind in ("named_parameters", "named_buffers"):
        for name, tensor in named_members(modules, kind):
            alias_of[name] = first_name.setdefault(id(tensor), name)
    missing = [n for n in traced_names if n not in names and n not in alias_of]
    unexpected = [n for n in names if n not in traced_names]
    tied = [
        f"{n!r} to {alias_of[n]!r}"
        for n in traced_names
        if n not in names and n in alias_of
    ]
    details = []
    if tied:
        details.append(f"tied here, separate in the traced model: {_listed(tied, str)}")
    if missing:
        details.append(f"missing {_listed(missing)}")
    if unexpected:
        details.append(
            f"unexpected {_listed(unexpected)} (absent from the traced model, or "
            "tied to another tensor there)"
        )
    differ = len(tied) + len(missing) + len(unexpected)
    if not details:
        position = next(
            i for i, (a, b) in enumerate(zip(names, traced_names)) if a != b
        )
        details.append(
            f"position {position} holds {names[position]!r} where the traced model "
            f"had {traced_names[position]!r}"
        )
    how = f"{differ} names differ" if differ else "the same names in another order"
    lines = "".join(f"\n  {line}" for line in details)
    return (
        f"the model's parameters and buffers differ from the traced model's ({how}). "
        "Pass a model of the traced architecture (only weight values may differ), "
        f"or capture again with this model.{lines}"
    )


def _subject(index: int, several: bool) -> Callable[[str], str]:
    """How messages name a submodule (by its name in module ``index``)."""
    if several:
        return lambda name: (
            f"module {'.'.join(part for part in (f'm{index}', name) if part)!r}"
        )
    return lambda name: f"module {name!r}" if name else "the model"


def _describe_mode_difference(
    index: int, module: torch.nn.Module, traced_modes: list[bool], several: bool
) -> str:
    # Error path only: name the first module whose mode differs.
    named = list(module.named_modules())
    if len(named) != len(traced_modes):
        whole = f"module 'm{index}'" if several else "the model"
        return (
            f"{whole} has {len(named)} modules (itself and its submodules), "
            f"but the traced one had {len(traced_modes)}: a module without parameters "
            "or buffers was added or removed. Pass a model of the traced architecture, "
            "or capture again with this model."
        )
    name, submodule, was_training = next(
        (name, m, was)
        for (name, m), was in zip(named, traced_modes)
        if m.training != was
    )
    now, then = ("eval", "training") if was_training else ("training", "eval")
    return (
        f"{_subject(index, several)(name)} ({type(submodule).__name__}) is in {now} "
        f"mode, but it was in {then} mode when the function was traced, and the "
        "graph took that mode's branches (batch or running statistics, dropout or "
        f"none). Put it back in {then} mode with "
        f".{'train' if was_training else 'eval'}(), or capture again with it in "
        f"{now} mode."
    )


def _describe_hook_difference(
    subject: Callable[[str], str] | None,
    module: torch.nn.Module | None,
    hooks: dict[str, dict[str, int]],
    traced_hooks: dict[str, dict[str, int]],
) -> str:
    # Error path only: name the first module and kind of hook that differs; without
    # a module, torch's global module hooks.
    name, kind, now, then = next(
        (name, kind, now, then)
        for name in [*traced_hooks, *hooks]
        for kind in _HOOK_KINDS
        if (now := hooks.get(name, {}).get(kind, 0))
        != (then := traced_hooks.get(name, {}).get(kind, 0))
    )
    if subject is None or module is None:
        where = "torch's global module hooks (register_module_"
        where += f"{_HOOK_KINDS[kind][:-1]}) include"
    else:
        where = f"{subject(name)} ({type(module.get_submodule(name)).__name__}) has"
    return (
        f"{where} {_hook_count(now, kind)} in this call, but "
        f"{_hook_count(then, kind)} when the function was traced: the graph has the "
        "hooks the traced call ran built in, and runs no other. Register the same "
        "hooks as at capture (remove others with their handle's remove()), or "
        "capture again with these."
    )


def _hook_count(count: int, kind: str) -> str:
    return f"{count or 'no'} {kind}{'' if count == 1 else 's'}"


# --- Storages shared among the graph's inputs ---------------------------------------
def _storage_pointer(value: object) -> int:
    """The data pointer of the storage ``value`` reads; 0 for none (not a tensor, or
    an empty storage). A DTensor holds no storage of its own: its local shard's."""
    if type(value) is not torch.Tensor:
        if not isinstance(value, torch.Tensor):
            return 0
        value = cast(torch.Tensor, getattr(value, "_local_tensor", value))
    return value.untyped_storage().data_ptr()


class _CheckedState:
    """The modules' tensors, in graph-input order, after the full check; and which of
    them share a storage, which each call's inputs are compared with."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        # Whether any is an inference tensor, which no in-place update may write
        # outside inference mode: fixed for the tensors the fast path vouches for.
        self.inference = any(map(torch.Tensor.is_inference, tensors))
        # Storage pointer -> first position using it; position -> that first position,
        # for the positions that share one.
        self.storage_owner: dict[int, int] = {}
        self.sharing: dict[int, int] = {}
        for position, tensor in enumerate(tensors):
            pointer = _storage_pointer(tensor)
            if not pointer:  # an empty storage: nothing to see through another
                continue
            owner = self.storage_owner.setdefault(pointer, position)
            if owner != position:
                self.sharing[position] = owner
                self.sharing[owner] = owner


def _newly_shared_positions(state: _CheckedState, leaves: list[object]) -> list[int]:
    """For a capture whose inputs shared no storage: the positions among the graph's
    inputs of the first group that shares one in this call; [] if none does."""
    # An empty storage (pointer 0) is no storage: nothing can be seen through it.
    pointers = list(map(_storage_pointer, leaves))
    used = [pointer for pointer in pointers if pointer]
    if (
        not state.sharing
        and len(set(used)) == len(used)
        and state.storage_owner.keys().isdisjoint(used)
    ):
        return []
    return _groups(_sharing(state, pointers))[0]


def _sharing(state: _CheckedState, pointers: list[int]) -> dict[int, int]:
    """Position -> first position sharing its storage, among the model's tensors and
    the leaves with these storage pointers, for the positions that share one."""
    sharing = dict(state.sharing)
    leaf_owners: dict[int, int] = {}
    for index, pointer in enumerate(pointers):
        if not pointer:
            continue
        position = len(state.tensors) + index
        owner = state.storage_owner.get(pointer)
        if owner is None:
            owner = leaf_owners.setdefault(pointer, position)
        if owner != position:
            sharing[position] = owner
            sharing[owner] = owner
    return sharing


def _groups(sharing: dict[int, int]) -> list[list[int]]:
    members: dict[int, list[int]] = {}
    for position, owner in sorted(sharing.items()):
        members.setdefault(owner, []).append(position)
    return list(members.values())


def _newly_shared(names: str) -> str:
    return (
        f"{names} share one storage in this call (the same tensor, or views of one), "
        "but did not at capture, and the graph may write through one of them and "
        "read another. Pass separate tensors (.clone() one of them), or capture "
        "again with this aliasing."
    )


def _same_layout(tensor: torch.Tensor, strides: tuple[int, ...]) -> bool:
    # A dim of size 0 or 1 is never stepped over, so its stride does not matter.
    return all(
        size <= 1 or got == want
        for size, got, want in zip(tensor.shape, tensor.stride(), strides)
    )


def _layout_message(what: str, tensor: torch.Tensor, strides: tuple[int, ...]) -> str:
    return (
        f"{what} has strides {tuple(tensor.stride())}, but the example had {strides}: "
        "the same shape in another memory layout (e.g. transposed or channels_last), "
        "which the inductor backend specialises on. Pass it in the example's layout "
        "(.contiguous() for a contiguous example), or capture with backend='eager'."
    )


# --- Inference tensors --------------------------------------------------------------
def _inference_write_problem(
    state: "_CheckedState",
    leaves: list[object],
    positions: list[int],
    state_names: list[str],
) -> str | None:
    """Why the graph cannot update one of its inputs in place (``positions``, among
    the module state then the leaves) outside inference mode: torch refuses an
    in-place update of an inference tensor there, eagerly as inside the graph, where
    earlier updates would already be made."""
    num_state = len(state.tensors)
    # The module state holds no inference tensor in almost every call: skip it then.
    first = 0 if state.inference else bisect.bisect_left(positions, num_state)
    for position in positions[first:]:
        if position < num_state:
            tensor: object = state.tensors[position]
        else:
            tensor = leaves[position - num_state]
        if isinstance(tensor, torch.Tensor) and tensor.is_inference():
            name = (
                f"the model's {state_names[position]!r}"
                if position < num_state
                else f"input leaf {position - num_state}"
            )
            return (
                f"{name} is an inference tensor (made inside torch.inference_mode()) "
                "that the function updates in place, which torch refuses outside "
                "inference mode, eagerly too. Call the artifact inside "
                "torch.inference_mode(), or make the model and inputs outside it (a "
                ".clone() made outside it is a normal tensor)."
            )
    return None


# --- The fast path for an unchanged model -------------------------------------------
# The full check walks every module and compares every tensor, which costs more than
# a small graph's run. What it established is remembered with signals that it still
# holds, each read in C: the same module objects; the version tag of each module's
# attribute, parameter, buffer and submodule dicts (any assignment or deletion there,
# a `training` flag included, changes one); each tensor's dtype, device, shape,
# strides and requires_grad (``.to()``, ``.data = ...`` and ``requires_grad_()``
# change those in place, torch's TensorGuards compares them); and each tensor's data
# pointer (``.data = ...`` with the same shape moves only that); and for the hooks,
# the id the next hook handle will take (registering any hook takes one) and the
# version tags of the dicts that held hooks (removing one changes its dict). A call
# that any signal fails gets the full check again.
_MEMBER_DICTS = attrgetter("__dict__", "_parameters", "_buffers", "_modules")
# The full check enumerates exactly those dicts' members, unless a module overrides
# how nn.Module enumerates them.
_ENUMERATORS = ("named_parameters", "named_buffers", "named_modules", "_named_members")
_DATA_PTR = torch.Tensor.data_ptr
_HOOK_DICTS = attrgetter(*[f"_{attribute}" for attribute in _HOOK_KINDS.values()])
try:
    from torch._C._dynamo.guards import TensorGuards, dict_version
except ImportError:  # internal to torch: without them, every call gets the full check
    _GUARDED = False
else:
    _GUARDED = True


class _Remembered:
    """A model that passed the full check, and how to tell it is unchanged since."""

    def __init__(self, modules: list[torch.nn.Module], state: _CheckedState) -> None:
        # The call's modules are held weakly, so that the artifact never keeps a model
        # alive; their submodules' member dicts are held while remembered, so that
        # their identities and version tags cannot be reused by other objects.
        self.module_refs = [weakref.ref(module, _forget) for module in modules]
        everything = [sub for module in modules for sub in module.modules()]
        self.dicts = [d for m in everything for d in _MEMBER_DICTS(m)]
        self.dicts += [d for m in everything for d in _HOOK_DICTS(m) if d]
        registry = vars(torch.nn.modules.module)
        self.dicts += [
            hooks
            for attribute in _HOOK_KINDS.values()
            if (hooks := registry[f"_global_{attribute}"])
        ]
        # Rebinding one of those globals changes the module's own dict.
        self.dicts.append(registry)
        self.next_handle_id = RemovableHandle.next_id
        self.versions = list(map(dict_version, self.dicts))
        self.state = state
        tensors = self.tensors = state.tensors
        # A tensor that keeps its data in another (a DTensor, in its local shard) is
        # watched through that one as well: by the dtensors part's
        # _RememberedShards, in the artifacts that take such tensors; every other
        # artifact refuses them before anything is remembered.
        remembered_shards = globals().get("_RememberedShards")
        self.shards: Any = (
            None if remembered_shards is None else remembered_shards(tensors)
        )
        shards = [] if self.shards is None else self.shards.local_tensors
        tensors = self.guarded = [*tensors, *shards]
        self.data_ptrs = list(map(_DATA_PTR, tensors))
        self.tensor_guard = cast(Any, TensorGuards)(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )

    def holds_for(self, modules: list[torch.nn.Module]) -> bool:
        if len(modules) != len(self.module_refs):
            return False
        for ref, module in zip(self.module_refs, modules):
            if ref() is not module:
                return False
        return (
            RemovableHandle.next_id == self.next_handle_id
            and list(map(dict_version, self.dicts)) == self.versions
            and bool(self.tensor_guard.check(*self.guarded))
            and list(map(_DATA_PTR, self.guarded)) == self.data_ptrs
            and (self.shards is None or self.shards.hold())
        )


_remembered: _Remembered | None = None


def _remembered_state(modules: list[torch.nn.Module]) -> _CheckedState | None:
    """The modules' checked state if they passed the full check before and nothing
    it relied on has changed since; otherwise None, and the full check must run."""
    remembered = _remembered
    if remembered is not None and remembered.holds_for(modules):
        return remembered.state
    return None


def _remember(
    modules: list[torch.nn.Module], tensors: list[torch.Tensor]
) -> _CheckedState:
    """The state of modules that just passed the full check, remembered if the
    signals can vouch for them: plain dicts (an OrderedDict reorders without a new
    version tag) and nn.Module's own enumeration."""
    global _remembered
    _remembered = None
    state = _CheckedState(tensors)
    if not _GUARDED:
        return state
    everything = [sub for module in modules for sub in module.modules()]
    if any(
        type(members) is not dict
        for members in chain.from_iterable(map(_MEMBER_DICTS, everything))
    ) or any(
        getattr(type(module), name) is not getattr(torch.nn.Module, name)
        for module in everything
        for name in _ENUMERATORS
    ):
        return state
    try:
        _remembered = _Remembered(modules, state)
    except Exception:  # a tensor TensorGuards cannot describe: no fast path for it
        _remembered = None
    return state


def _forget_checks() -> None:
    # The graph failed: the next call checks the model in full, taking nothing on
    # trust from this one.
    global _remembered
    _remembered = None


def _forget(dead: weakref.ref[torch.nn.Module]) -> None:
    # A remembered module was garbage collected: release what was held for it.
    global _remembered
    remembered = _remembered
    if remembered is not None and any(ref is dead for ref in remembered.module_refs):
        _remembered = None


# --- Python values the graph has built in -------------------------------------------
# make_fx builds every Python value the traced code read (a module's temperature, a
# config flag, a global) into the graph as a constant. The full check reads each one
# at its path and compares its repr; what it read through is remembered, so that a
# call on an unchanged model only confirms each link still holds the same object.
_PATH_STEP = re.compile(r"\.(\w+)|\[(-?\d+|'[^'\\\]]*')\]")
_ABSENT = object()
_UNCHECKED = object()
# Outside the module arguments' trees, which the fast path watches already: (dict,
# key, object) for each link that led to a value through a plain dict; the paths
# whose links are not all such dicts, read again; and each non-module argument a path
# starts from, held weakly where it can be.
_python_links: list[tuple[dict[Any, object], object, object]] = []
_python_rereads: list[tuple[str, object]] = []
_python_roots: list[tuple[int, Callable[[], object]]] = []


def _python_value(
    args: tuple[object, ...],
    path: str,
    links: list[tuple[Any, object, object] | None] | None,
) -> object:
    """The value at ``path`` (PYTHON_VALUES' syntax) in this call, _ABSENT where
    nothing is there, or _UNCHECKED for a path no call can check (the traced function's
    closure, a module this process has not imported). Each link read through a
    plain dict is added to ``links`` (a None entry for any other kind of link)."""
    head, _, accessors = path.partition(": ")
    if head.startswith("argument "):
        value: object = args[int(head.removeprefix("argument "))]
    elif head.startswith("global "):
        name, _, module = (
            head.removeprefix("global ").removesuffix(")").partition(" (module ")
        )
        namespace = sys.modules.get(module)
        if namespace is None or name not in vars(namespace):
            return _UNCHECKED
        value = vars(namespace)[name]
        if links is not None:
            links.append((vars(namespace), name, value))
    else:
        return _UNCHECKED
    # The fast path already watches the module arguments' trees (every module's member
    # dicts): a link out of one of their modules needs no watching of its own.
    in_model = isinstance(value, torch.nn.Module)
    for attribute, key in _PATH_STEP.findall(accessors):
        watched = in_model and isinstance(value, torch.nn.Module)
        holder: Any = getattr(value, "__dict__", None) if attribute else value
        member: object = attribute or (int(key) if key[0] != "'" else key[1:-1])
        try:
            value = getattr(value, attribute) if attribute else cast(Any, value)[member]
        except (AttributeError, LookupError, TypeError):
            return _ABSENT
        if links is not None and not watched:
            plain = type(holder) is dict and holder.get(member, _ABSENT) is value
            links.append((holder, member, value) if plain else None)
    return value


def _python_values_problem(
    args: tuple[object, ...], python_values: list[tuple[str, str]], names: list[str]
) -> str | None:
    """Read each of ``python_values`` (PYTHON_VALUES) in this call: what differs from
    the traced value (its argument named by ``names``, ARGUMENT_NAMES), or None when
    none does, having remembered what was read."""
    links: list[tuple[Any, object, object] | None] = []
    rereads: list[tuple[str, object]] = []
    roots: set[int] = set()
    for path, traced in python_values:
        path_links: list[tuple[Any, object, object] | None] = []
        value = _python_value(args, path, path_links)
        if value is _UNCHECKED:
            continue
        if value is _ABSENT or repr(value) != traced:
            return _describe_python_value(
                _python_value_place(path, names), value, traced
            )
        if None in path_links:
            rereads.append((path, value))
        links += path_links
        if path.startswith("argument "):
            position = int(path.removeprefix("argument ").partition(":")[0])
            if not isinstance(args[position], torch.nn.Module):
                roots.add(position)
    _python_links[:] = [link for link in links if link is not None]
    _python_rereads[:] = rereads
    _python_roots[:] = [(position, _held(args[position])) for position in roots]
    return None


def _held(value: object) -> Callable[[], object]:
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _python_values_hold(args: tuple[object, ...]) -> bool:
    """Whether what the last full check read the Python values through still holds
    the same objects."""
    for position, root in _python_roots:
        if args[position] is not root():
            return False
    for holder, key, value in _python_links:
        if holder.get(key, _ABSENT) is not value:
            return False
    for path, value in _python_rereads:
        if _python_value(args, path, None) is not value:
            return False
    return True


def _python_value_place(path: str, names: list[str]) -> str:
    # An argument's value as the traced function's code reads it: `model.config.flag`.
    head, _, accessors = path.partition(": ")
    if not head.startswith("argument "):
        return path
    return _argument(int(head.removeprefix("argument ")), names, accessors)


def _describe_python_value(path: str, value: object, traced: str) -> str:
    now = "missing" if value is _ABSENT else reprlib.repr(value)
    return (
        f"the Python value at {path} is {now} in this call, but it was {traced} when "
        "the function was traced, and the graph has that value built in. Set it "
        f"back to {traced}, or capture again with this value."
    )
