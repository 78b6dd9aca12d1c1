"""The artifact's metadata constants (section 2), each declared once.

``CONSTANTS`` is the schema: per constant, in emission order, its name, the
annotation the artifact writes, the comment above it, where its value comes from
(a function of the capture's records) and, for a constant only some captures
emit, the value its absence means. Everything else follows from that one table:

- section 2 of the artifact: ``templates/metadata.py.j2`` renders the entries
  ``codegen.render.metadata_entries`` makes of it;
- ``parse_metadata`` requires ``REQUIRED_NAMES`` and fills ``OPTIONAL_METADATA``;
- ``precompile_gen/runtime_support/declarations.py`` (which the runtime support's
  parts are checked against) and ``precompile_gen/runtime/metadata_types.py`` (the
  type of what ``parse_metadata`` returns, which ``inspect`` reads) are written from
  it by ``scripts/regenerate.py`` (``declarations``, ``typed_dict``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from precompile_gen.capture_result import LocalShards

if TYPE_CHECKING:
    from precompile_gen.capture_result import (
        Backend,
        CallConvention,
        CaptureResult,
        InputStrides,
        KernelPayload,
    )


class Records(NamedTuple):
    """What a constant's value is read from: the capture's records, with the graph's
    input strides split by the records they belong to, and the DTensors whose local
    shards it takes and returns (none where it does not)."""

    backend: Backend
    convention: CallConvention
    payload: KernelPayload
    strides: InputStrides
    local_shards: LocalShards


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


# The default of a constant every artifact emits.
REQUIRED: object = _Required()


@dataclass(frozen=True)
class Constant:
    """One metadata constant of the artifact."""

    name: str
    # Its annotation as the artifact writes it ("Any" quoted: only the runtime
    # support imports it).
    annotation: str
    value: Callable[[Records], object]
    # The comment above it, filled to the line; "" where it shares the one above.
    # Where it depends on the backend, one text per backend.
    comment: str | dict[str, str] = ""
    # An optional constant's value where an artifact omits it: the capture has none
    # of what it records. The artifact emits it only where its value differs.
    default: object = REQUIRED
    # An optional constant emitted together with another one (of the same feature),
    # whatever its own value.
    shown_with: str | None = None

    @property
    def optional(self) -> bool:
        return self.default is not REQUIRED


def _optimizers(r: Records) -> list[dict[str, object]]:
    """Per optimizer argument, its record as one dict (see OPTIMIZERS' comment)."""
    state_strides = iter(r.strides.optimizer_state)
    return [
        {
            "position": optimizer.position,
            "class": optimizer.name,
            "steps": optimizer.steps,
            "groups": [
                {"params": g.params, "options": g.options, "lr": g.lr}
                | (
                    {"values": g.values, "values_dtype": g.values_dtype}
                    if g.values
                    else {}
                )
                | ({"guards": g.guards} if g.guards else {})
                for g in optimizer.groups
            ],
            # Each state tensor as (param, key, shape, dtype, device, stride).
            "state": [(*t, next(state_strides)) for t in optimizer.state],
            # Absent where every key starts as zeros.
            **({"first_state": optimizer.first_state} if optimizer.first_state else {}),
        }
        for optimizer in r.convention.optimizers
    ]


def _params(attribute: str) -> Callable[[Records], object]:
    return lambda r: [getattr(t, attribute) for t in r.convention.params]


def _buffers(attribute: str) -> Callable[[Records], object]:
    return lambda r: [getattr(t, attribute) for t in r.convention.buffers]


def _leaves(attribute: str) -> Callable[[Records], object]:
    return lambda r: [getattr(leaf, attribute) for leaf in r.convention.leaves]


CONSTANTS: tuple[Constant, ...] = (
    Constant("BACKEND", "str", lambda r: r.backend),
    Constant(
        "MODULE_POSITIONS",
        "list[int]",
        lambda r: [module.position for module in r.convention.modules],
        "Positions of the nn.Module arguments among the traced function's arguments.",
    ),
    Constant("NUM_POSITIONAL_ARGS", "int", lambda r: r.convention.num_positional_args),
    Constant(
        "ARGUMENT_NAMES",
        "list[str]",
        lambda r: r.convention.argument_names,
        "The traced function's own name for each positional argument, by position.",
    ),
    Constant(
        "MODULE_TRAINING",
        "list[list[bool]]",
        lambda r: [module.training for module in r.convention.modules],
        "Per module argument: the `training` flag of each of its modules() at the "
        "traced call (itself first). The graph took that mode's branches (BatchNorm "
        "statistics, dropout).",
    ),
    Constant(
        "MODULE_HOOKS",
        "list[dict[str, dict[str, int]]]",
        lambda r: [module.hooks for module in r.convention.modules],
        "Per module argument: how many hooks of each kind its modules had at the "
        'traced call, by module name ("" for itself); and how many global module '
        "hooks there were. The trace ran them, so the graph has their effect built "
        "in and runs no other hook.",
    ),
    Constant(
        "GLOBAL_MODULE_HOOKS",
        "dict[str, int]",
        lambda r: r.convention.global_module_hooks,
    ),
    Constant(
        "PYTHON_VALUES",
        "list[tuple[str, str]]",
        lambda r: [tuple(value) for value in r.convention.python_values],
        "The Python values the traced code read and built into the graph, each by "
        'its path ("argument 0: .config.flag", "global SCALE (module __main__)") '
        "with its repr then. Every call must bring the same; a global of a module "
        "this process has not imported, and the traced function's own closure "
        "variables, cannot be checked.",
        default=[],
    ),
    Constant(
        "PARAM_NAMES",
        "list[str]",
        _params("name"),
        "All modules' parameters, then all modules' buffers, in named_parameters() / "
        "named_buffers() order, each tensor once (a tied weight appears under its "
        "first name). With several modules each name is prefixed by the module's "
        'index: "m0.", "m1.", ...',
    ),
    Constant("BUFFER_NAMES", "list[str]", _buffers("name")),
    Constant("PARAM_SHAPES", "list[tuple[int, ...]]", _params("shape")),
    Constant("BUFFER_SHAPES", "list[tuple[int, ...]]", _buffers("shape")),
    Constant(
        "PARAM_STRIDES",
        "list[tuple[int, ...] | None]",
        lambda r: r.strides.params,
        {
            "inductor": "Strides of the example tensors where the compiled graph "
            "depends on them (each tensor its kernels read or update in place); None "
            "where it does not.",
            "eager": "Strides of the example tensors, for the record: the eager "
            "backend runs ATen's own kernels, which take any layout.",
        },
    ),
    Constant(
        "BUFFER_STRIDES",
        "list[tuple[int, ...] | None]",
        lambda r: r.strides.buffers,
    ),
    Constant("PARAM_DTYPES", "list[str]", _params("dtype")),
    Constant("BUFFER_DTYPES", "list[str]", _buffers("dtype")),
    Constant("PARAM_DEVICES", "list[str]", _params("device")),
    Constant("BUFFER_DEVICES", "list[str]", _buffers("device")),
    Constant(
        "PARAM_REQUIRES_GRAD",
        "list[bool]",
        _params("requires_grad"),
        "Which tensors required grad at capture; that decided which gradients the "
        "graph computes, so the runtime model's must be the same.",
    ),
    Constant("BUFFER_REQUIRES_GRAD", "list[bool]", _buffers("requires_grad")),
    Constant(
        "GRAD_PARAM_INDICES",
        "list[int]",
        lambda r: r.convention.grad_param_indices,
        "The k-th trailing gradient output of `call` belongs to "
        "PARAM_NAMES[GRAD_PARAM_INDICES[k]].",
    ),
    Constant(
        "GRAD_RESETS",
        "list[tuple[int, bool]]",
        lambda r: r.convention.grad_resets,
        "(index into PARAM_NAMES, set_to_none) for each parameter whose .grad the "
        "function reset with zero_grad(); each call resets them so before adding the "
        "gradients.",
    ),
    Constant(
        "SKIPPABLE_STEP",
        "bool",
        lambda r: r.convention.skippable_step,
        "A path through the function's branches on tensor values skips the step: the "
        "graph's last output says whether the call's path took it. Only where it did "
        "are the gradients added, the optimizers' steps finished and STEP_RESETS (the "
        "resets the skipping path does not make) applied.",
        default=False,
    ),
    Constant(
        "STEP_RESETS",
        "list[tuple[int, bool]]",
        lambda r: r.convention.step_resets,
        default=[],
        shown_with="SKIPPABLE_STEP",
    ),
    Constant(
        "IN_SPEC",
        "str | None",
        lambda r: r.convention.in_tree.spec,
        "Pytree specs (treespec_dumps) of the non-module arguments and of the "
        "result, each drawn above it as treespec_pprint draws it (* is a leaf). "
        "IN_SPEC is None when the input structure could not be serialised; it is "
        "then not checked.",
    ),
    Constant("OUT_SPEC", "str", lambda r: r.convention.out_spec),
    Constant(
        "PYTREE_TYPES",
        "list[str]",
        lambda r: r.convention.pytree_types,
        "The namedtuple and dataclass types in IN_SPEC and OUT_SPEC, by import path "
        '("module:qualname"), under which the specs name them: the driver imports '
        "each one when the artifact is loaded, so that a call returns the same types.",
        default=[],
    ),
    Constant(
        "USER_INPUT_SHAPES",
        "list[tuple[int | None, ...] | None]",
        _leaves("shape"),
        "Per flattened input leaf: shape (None for a dynamic dim), dtype and device, "
        "or None for a non-tensor leaf; and the declared {dim: (min, max)} of its "
        "dynamic dims.",
    ),
    Constant("USER_INPUT_DTYPES", "list[str | None]", _leaves("dtype")),
    Constant("USER_INPUT_DEVICES", "list[str | None]", _leaves("device")),
    Constant(
        "USER_INPUT_BOUNDS",
        "list[dict[int, tuple[int | None, int | None]] | None]",
        _leaves("bounds"),
    ),
    Constant(
        "USER_INPUT_STRIDES",
        "list[tuple[int, ...] | None]",
        lambda r: r.strides.leaves,
        "Per leaf: strides where the compiled graph depends on them (None for a "
        "non-tensor leaf, one with dynamic dims, or one the kernels never read), and "
        "the symbol of each dynamic dim; dims that share a symbol must have equal "
        "sizes.",
    ),
    Constant("USER_INPUT_SYMBOLS", "list[dict[int, str] | None]", _leaves("symbols")),
    Constant(
        "USER_INPUT_VALUES",
        "list[bool | int | float | str | None]",
        _leaves("value"),
        "Per leaf: the value of a bool, int, float or str leaf, built into the graph "
        "as a constant, so each call must pass the same; None for tensors and other "
        "values.",
    ),
    Constant(
        "NUMBER_INPUTS",
        "dict[int, str | None]",
        lambda r: {
            index: leaf.number_use
            for index, leaf in enumerate(r.convention.leaves)
            if leaf.number
        },
        "The float leaves the graph takes as numbers (0-dim float64 tensors), each "
        "with where the function used it as a Python value, which the graph keeps the "
        "example's of (USER_INPUT_VALUES holds it); None where it only computed with "
        "it.",
        default={},
    ),
    Constant(
        "INDEX_CHECKS",
        "list[tuple[tuple[int, ...], tuple, int, int, int | None, str]]",
        lambda r: [tuple(check) for check in r.convention.index_checks],
        "The indices the graph computes from input leaves alone (an embedding's ids, "
        "a loss's targets), each as (the leaves, the graph's ops that compute it from "
        'them, each (op, arguments, keywords) with {"leaf": k} and {"step": j} for '
        "its tensors, none when it is the leaf itself; low, high, a value allowed "
        "besides, what it indexes): every call must keep low <= value < high (or that "
        "value), as eager PyTorch requires, and is checked before the graph runs.",
        default=[],
    ),
    Constant(
        "ALIASED_INPUTS",
        "list[dict[int, tuple[int, tuple[int, ...]]]]",
        lambda r: r.convention.aliased_inputs,
        "Groups of graph inputs (indices into [*params, *buffers, *input leaves]) "
        "that shared one storage at capture, e.g. a tensor passed twice, each member "
        "with its (storage offset, strides) there. The graph was traced for exactly "
        "this aliasing.",
    ),
    Constant(
        "MUTATED_INPUTS",
        "list[int]",
        lambda r: r.convention.mutated_inputs,
        "The graph inputs (indices as in ALIASED_INPUTS) the graph updates in place: "
        "the caller's tensor must be the one updated, so it is never replaced by a "
        "copy.",
        default=[],
    ),
    Constant(
        "KERNEL_BINARIES",
        "dict[str, str]",
        lambda r: r.payload.kernel_binaries,
        "The compiled kernels this artifact accepts from a cache: file key (in "
        "inductor's cache folder) -> sha256. load() writes no other binary, whatever "
        "the cache brings.",
    ),
    Constant(
        "KERNEL_SOURCES",
        "dict[str, str]",
        lambda r: r.payload.kernel_sources,
        "Which binary is whose: the sha256 of each C++ kernel's source in section 1 "
        "-> the file key of its binary above. A kernel without one compiles from its "
        "source.",
    ),
    Constant(
        "OPTIMIZERS",
        'list[dict[str, "Any"]]',
        _optimizers,
        "Per optimizer argument: its position and class (in torch.optim); whether "
        "the function calls its step(); per param group the parameters it holds "
        "(indices into PARAM_NAMES), the values the step was traced with, which each "
        "call must keep, and the (dtype, device) of the lr tensor each call passes; "
        "and the (parameter index, key, shape, dtype, device, strides) of each state "
        "tensor (strides as the *_STRIDES constants have them), graph inputs after "
        "the input leaves, followed by one lr per group.",
        default=[],
    ),
    Constant(
        "DTENSORS",
        "dict[int, tuple[tuple[int, ...], tuple[str, ...]]]",
        lambda r: {
            position: tuple(layout)
            for position, layout in r.convention.dtensors.items()
        },
        "The graph inputs that were DTensors, by position among the module state and "
        "the input leaves (as in ALIASED_INPUTS): each one's mesh shape and "
        "placements, which every call must bring, and every other position a plain "
        "tensor.",
        default={},
    ),
    Constant(
        "SHARD_INPUTS",
        "dict[int, tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]]",
        lambda r: {
            position: tuple(shard) for position, shard in r.local_shards.inputs.items()
        },
        "The graph computes on local shards (Inductor compiles plain tensors; a "
        "fully_shard model's trace gathers its parameters from them): the graph "
        "inputs, by position (the module state, the input leaves, then the "
        "optimizers' state), whose local shard it takes, each with the process group "
        "of each mesh dim (by name), the placements its local ops and collectives "
        "were traced for, and the shape of the capturing rank's shard; and the graph "
        "outputs, by position, it returns the local shard of, each with the "
        "placements, global shape and strides of the DTensor the driver wraps it in.",
        default={},
    ),
    Constant(
        "SHARD_OUTPUTS",
        "dict[int, tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]]",
        lambda r: {
            position: tuple(shard) for position, shard in r.local_shards.outputs.items()
        },
        default={},
        shown_with="SHARD_INPUTS",
    ),
    Constant(
        "SCALAR_OUTPUTS",
        "list[int]",
        lambda r: r.convention.scalar_outputs,
        "Positions among the function's flat outputs of the Python numbers it "
        "returned with t.item(): the graph returns t, and the driver returns "
        "t.item().",
        default=[],
    ),
    Constant(
        "PROCESS_GROUPS",
        'list[dict[str, "Any"]]',
        lambda r: [group._asdict() for group in r.convention.process_groups],
        "The process groups the graph's collectives (and DistributedDataParallel "
        "arguments) use: the name the graph refers to each by, its backend and its "
        "global ranks. Every call must find the same groups (created in the same "
        "order, with the same ranks).",
        default=[],
    ),
    Constant(
        "DATA_PARALLEL",
        'list[dict[str, "Any"]]',
        lambda r: [argument._asdict() for argument in r.convention.data_parallel],
        "Per DistributedDataParallel argument: its position, the name of its process "
        "group and the options its gradients' all-reduce was captured with.",
        default=[],
    ),
    Constant(
        "SPARSE_GRADIENTS",
        "list[int]",
        lambda r: (
            []
            if r.convention.sparse_gradients is None
            else r.convention.sparse_gradients.params
        ),
        "Parameters (indices into PARAM_NAMES) whose gradients are sparse "
        "(nn.Embedding and nn.EmbeddingBag with sparse=True): the graph returns the "
        "dense tensors their backward builds them from, last, and the driver builds "
        "them and adds them to .grad.",
        default=[],
    ),
    Constant(
        "DEFERRED_STEPS",
        'list[dict[str, "Any"]]',
        lambda r: [
            {"position": step.position, "class": step.name, "params": step.params}
            for step in r.convention.deferred_steps
        ],
        "Per optimizer argument that steps parameters with sparse gradients: its "
        "position, class and those parameters, which the driver steps with it after "
        "the graph, once their gradients are on .grad (the graph's step leaves them "
        "out).",
        default=[],
    ),
)

# The constants by name, in emission order; those every artifact emits; and the
# value an omitted optional one means.
METADATA_NAMES: tuple[str, ...] = tuple(constant.name for constant in CONSTANTS)
REQUIRED_NAMES: tuple[str, ...] = tuple(
    constant.name for constant in CONSTANTS if not constant.optional
)
OPTIONAL_METADATA: dict[str, object] = {
    constant.name: constant.default for constant in CONSTANTS if constant.optional
}


def records(cap: CaptureResult) -> Records:
    """What ``cap``'s constants are read from."""
    graph = cap.graph
    return Records(
        cap.backend,
        cap.convention,
        cap.payload,
        graph.input_strides,
        graph.local_shards or LocalShards({}, {}),
    )


def metadata_constants(cap: CaptureResult) -> dict[str, object]:
    """Every metadata constant's value for ``cap``, by name, in emission order: what
    ``parse_metadata`` reads back from its artifact (an omitted optional constant as
    its default)."""
    found = records(cap)
    return {constant.name: constant.value(found) for constant in CONSTANTS}


def emitted(constants: dict[str, object]) -> list[Constant]:
    """The constants an artifact with these values emits: every required one, and
    each optional one whose value differs from its absence (or whose companion
    does)."""
    by_name = {constant.name: constant for constant in CONSTANTS}

    def differs(constant: Constant) -> bool:
        return constants[constant.name] != constant.default

    return [
        constant
        for constant in CONSTANTS
        if not constant.optional
        or differs(by_name[constant.shown_with or constant.name])
    ]


# --- Generated files --------------------------------------------------------------
# Both declare every constant with its annotation; scripts/regenerate.py writes them
# (and --check compares them) from this table.
DECLARATIONS = Path("precompile_gen/runtime_support/declarations.py")
_DECLARATIONS_BEGIN = "# Section 2: the calling-convention metadata"
_DECLARATIONS_END = "\n\n"
TYPES = Path("precompile_gen/runtime/metadata_types.py")


def _annotation(constant: Constant) -> str:
    # Only the artifact quotes Any: its runtime support imports it, after section 2.
    return constant.annotation.replace('"Any"', "Any")


def declarations(current: str) -> str:
    """The runtime parts' declarations (``DECLARATIONS``'s ``current`` text) with
    section 2's block written from ``CONSTANTS``; the rest is kept as it is."""
    begin = current.index(_DECLARATIONS_BEGIN)
    end = current.index(_DECLARATIONS_END, begin)
    block = [
        f"{_DECLARATIONS_BEGIN} (written from precompile_gen/metadata.py by",
        "# scripts/regenerate.py).",
        *(f"{constant.name}: {_annotation(constant)}" for constant in CONSTANTS),
    ]
    return current[:begin] + "\n".join(block) + current[end:]


def typed_dict() -> str:
    """The text of ``TYPES``: the ``Metadata`` type ``parse_metadata`` returns."""
    fields = [f"    {constant.name}: {_annotation(constant)}" for constant in CONSTANTS]
    return "\n".join(
        [
            '"""The type of what ``parse_metadata`` returns: each metadata constant '
            "by name,",
            "with its annotation. Written from ``precompile_gen/metadata.py`` by",
            '``scripts/regenerate.py``; do not edit."""',
            "",
            "from typing import Any, TypedDict",
            "",
            "",
            "class Metadata(TypedDict):",
            '    """An artifact\'s metadata constants (an omitted optional one as the',
            '    value its absence means)."""',
            "",
            *fields,
            "",
        ]
    )
