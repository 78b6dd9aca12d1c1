"""``CaptureResult``: the plain data that flows from capture to the renderer.

Everything the renderer needs is here as ``str``/``int``/``list``/``tuple``/``dict``
values (and the cache payload as ``bytes``), so a test can build one by hand and render
it without tracing anything. Field names match the artifact's metadata constants
(``param_names`` is emitted as ``PARAM_NAMES``, and so on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from precompile_gen.errors import PrecompileValueError

Backend = Literal["eager", "inductor"]
BACKENDS: tuple[Backend, ...] = ("inductor", "eager")


def check_backend(backend: str) -> Backend:
    """``backend`` as a ``Backend``; a ``ValueError`` (and ``PrecompileError``) unless
    it names one."""
    for known in BACKENDS:
        if backend == known:
            return known
    raise PrecompileValueError(
        f"backend must be one of {list(BACKENDS)}, got {backend!r}."
    )


# One shape per tensor leaf; a dynamic (mark_unbacked) dim is None.
Shape = tuple[int | None, ...]
# Per marked dim: the declared (min, max) sizes, either of which may be unset.
DimBounds = dict[int, tuple[int | None, int | None]]
# A non-tensor input leaf the artifact can check: the literal scalar types.
LeafValue = bool | int | float | str

# The artifact's metadata constants, in emission order. ``parse_metadata`` requires
# every one of them; ``CaptureResult.metadata`` yields them from the fields.
METADATA_NAMES: tuple[str, ...] = (
    "BACKEND",
    "MODULE_POSITIONS",
    "NUM_POSITIONAL_ARGS",
    "MODULE_TRAINING",
    "PARAM_NAMES",
    "BUFFER_NAMES",
    "PARAM_SHAPES",
    "BUFFER_SHAPES",
    "PARAM_STRIDES",
    "BUFFER_STRIDES",
    "PARAM_DTYPES",
    "BUFFER_DTYPES",
    "PARAM_DEVICES",
    "BUFFER_DEVICES",
    "PARAM_REQUIRES_GRAD",
    "BUFFER_REQUIRES_GRAD",
    "GRAD_PARAM_INDICES",
    "GRAD_RESETS",
    "IN_SPEC",
    "OUT_SPEC",
    "USER_INPUT_SHAPES",
    "USER_INPUT_DTYPES",
    "USER_INPUT_DEVICES",
    "USER_INPUT_BOUNDS",
    "USER_INPUT_STRIDES",
    "USER_INPUT_SYMBOLS",
    "USER_INPUT_VALUES",
    "ALIASED_INPUTS",
    "KERNEL_BINARIES",
)
# Per group of graph inputs that shared one storage at capture: each member's index
# among ``[*params, *buffers, *user_input_leaves]``, with its (storage offset, strides).
AliasGroup = dict[int, tuple[int, tuple[int, ...]]]
# A tensor literal's values, as ``tolist()`` gives them.
LiteralValues = bool | int | float | list["LiteralValues"]


class TensorLiteral(NamedTuple):
    """A tensor the traced function created from Python data (``torch.tensor(...)``):
    a constant of the program, written into the artifact's graph section and fed to
    the graph after the user-input leaves."""

    # The graph input it feeds (``literal0``, ...).
    name: str
    values: LiteralValues
    dtype: str
    device: str


@dataclass(frozen=True)
class CaptureResult:
    """What one capture produced: calling-convention metadata plus the graph text.

    The metadata fields are aligned lists: ``param_*`` with ``param_names``,
    ``buffer_*`` with ``buffer_names`` and ``user_input_*`` with the flattened user
    inputs. A ``None`` entry in a ``user_input_*`` list marks a non-tensor leaf.
    """

    backend: Backend
    # The traced function's ``__name__``, shown in the artifact's header.
    fn_name: str

    # Calling convention, emitted as the artifact's metadata constants.
    module_positions: list[int]
    num_positional_args: int
    # Per module argument, the ``training`` flag of each of its ``modules()`` (itself
    # first) at the call: the trace took the branches of that mode (batch statistics
    # or running ones, dropout or none), so the driver holds the runtime model to it.
    module_training: list[list[bool]]
    param_names: list[str]
    buffer_names: list[str]
    param_shapes: list[tuple[int, ...]]
    buffer_shapes: list[tuple[int, ...]]
    # The example tensors' strides where the compiled graph depends on them (the
    # inductor backend's kernels read the tensor); None where it does not.
    param_strides: list[tuple[int, ...] | None]
    buffer_strides: list[tuple[int, ...] | None]
    param_dtypes: list[str]
    buffer_dtypes: list[str]
    param_devices: list[str]
    buffer_devices: list[str]
    # Which tensors required grad at capture: it decided which gradients the graph
    # computes, so the driver holds the runtime model to it.
    param_requires_grad: list[bool]
    buffer_requires_grad: list[bool]
    grad_param_indices: list[int]
    # (parameter index, set_to_none) for each parameter whose ``.grad`` the function
    # reset with zero_grad(): the driver resets the runtime model's the same way
    # before adding the harvested gradients, as the eager call would have.
    grad_resets: list[tuple[int, bool]]
    # ``treespec_dumps`` of the user inputs, or None when that spec cannot be
    # serialised (the driver then skips the structure check).
    in_spec: str | None
    out_spec: str
    user_input_shapes: list[Shape | None]
    user_input_dtypes: list[str | None]
    user_input_devices: list[str | None]
    user_input_bounds: list[DimBounds | None]
    # Per leaf: strides (None for a non-tensor leaf, one with dynamic dims, or one
    # whose layout the compiled graph does not depend on), and each dynamic dim's
    # symbol; dims with the same symbol must have equal sizes.
    user_input_strides: list[tuple[int, ...] | None]
    user_input_symbols: list[dict[int, str] | None]
    # Per leaf: the value of a bool, int, float or str leaf, which the trace built
    # into the graph, so the driver holds each call to it; None for the others.
    user_input_values: list[LeafValue | None]
    # The graph inputs that shared a storage at capture (a tensor passed twice, views
    # of one storage, a parameter also passed as an input): the graph is right only
    # for that aliasing, so the driver holds each call to it.
    aliased_inputs: list[AliasGroup]

    # The compiled graph, spliced verbatim into the artifact. It defines
    # ``call(flat_inputs) -> list`` (inductor) or ``_graph_forward(self, flat)``
    # (eager, wrapped into ``call`` by the eager graph template).
    graph_source: str
    # Inputs of the graph after the user-input leaves, written out as literals.
    tensor_literals: list[TensorLiteral]
    # Eager only: the imports fx's generated code expects in scope, and the
    # ``treespec_dumps`` of the graph's own flat input/output specs.
    graph_imports: list[str]
    graph_in_spec: str | None
    graph_out_spec: str | None

    # The native code the artifact accepts from a cache: each kernel binary's file
    # key (relative to inductor's cache folder) and sha256. A cache is only code
    # nobody reads; the artifact, which people review, decides what of it may run.
    kernel_binaries: dict[str, str]

    # What the cache carries to skip compilation on reload (None for eager): plain
    # data that torch.load(weights_only=True) reads back.
    cache_artifact: dict[str, object] | None

    def metadata(self) -> dict[str, object]:
        """The metadata constants by artifact name, in emission order."""
        # Each constant is the field of the same name in lower case.
        return {name: getattr(self, name.lower()) for name in METADATA_NAMES}
