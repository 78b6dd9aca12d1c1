"""``CaptureResult``: the plain data that flows from capture to the renderer.

A few records, each built from plain ``str``/``int``/``list``/``tuple``/``dict`` values
(and the cache payload as ``bytes``), so a test can build one by hand and render it
without tracing anything. The artifact's flat metadata constants are derived from
them by the table in ``precompile_gen.metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from precompile_gen.runtime.errors import PrecompileValueError

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
# Per group of graph inputs that shared one storage at capture: each member's index
# among ``[*params, *buffers, *user_input_leaves]``, with its (storage offset, strides).
AliasGroup = dict[int, tuple[int, tuple[int, ...]]]
# A tensor literal's values, as ``tolist()`` gives them.
LiteralValues = bool | int | float | list["LiteralValues"]


class ModuleArgument(NamedTuple):
    """An ``nn.Module`` argument of the traced function."""

    position: int
    # The ``training`` flag of each of its ``modules()`` (itself first) at the call:
    # the trace took the branches of that mode (batch statistics or running ones,
    # dropout or none), so the driver holds the runtime model to it.
    training: list[bool]
    # How many hooks of each kind its modules had at the call, by module name ("" for
    # itself), for those that had any: the trace ran them, so their effect is built
    # into the graph, and a hook added since would not run. The driver holds the
    # runtime model to the same counts.
    hooks: dict[str, dict[str, int]]


class OptimizerStateTensor(NamedTuple):
    """One tensor of an optimizer's per-parameter state (``exp_avg``, ``step``, ...),
    a graph input the captured step updates in place."""

    # Index into the params of the parameter it belongs to.
    param: int
    key: str
    shape: tuple[int, ...]
    dtype: str
    device: str


class ParamGroup(NamedTuple):
    """One of an optimizer's ``param_groups`` as the trace saw it."""

    # Indices into the params of the group's parameters, in the group's order.
    params: list[int]
    # The group's values the trace built into the graph (flags, and the numbers
    # its step read as plain numbers), checked by value at every call.
    options: dict[str, object]
    # The dtype and device of the 0-dim tensor that carries the group's ``lr`` into
    # the graph at each call, so that a learning-rate schedule needs no recapture.
    lr: tuple[str, str]
    # The numbers the graph reads from the group at each call (betas, eps,
    # weight_decay, momentum...), in the order of the 1-D tensor of ``values_dtype``
    # that carries them: (key, None) for a number, (key, index) for one of a
    # tuple's. A schedule of any of them needs no recapture.
    values: list[tuple[str, int | None]]
    values_dtype: str
    # What those values decided about the step's structure, checked at every call:
    # (key, index, comparison, the number compared with, its outcome), such as
    # ("momentum", None, "ne", 0.0, True) for ``if momentum != 0``.
    guards: list[tuple[str, int | None, str, float, bool]]


class OptimizerArgument(NamedTuple):
    """A ``torch.optim`` optimizer argument of the traced function."""

    position: int
    # Its class, by its name in ``torch.optim``.
    name: str
    groups: list[ParamGroup]
    # Whether the function calls its ``step()`` (rather than only ``zero_grad()``).
    steps: bool
    # The state tensors the step reads and updates, graph inputs after the input
    # leaves, in this order; a parameter's are created as its first step would
    # create them when the runtime optimizer has none yet.
    state: list[OptimizerStateTensor]
    # What the first step fills a parameter's state with, by key, where not zeros:
    # a number, or "lr" for its group's lr at that step (a complex tensor gets the
    # complex number with both parts that value, as eager fills it).
    first_state: dict[str, float | str]


class SparseGradients(NamedTuple):
    """The parameters whose gradients are sparse (``nn.Embedding`` and
    ``nn.EmbeddingBag`` with ``sparse=True``): the graph returns the dense tensors
    their backward builds them from, and the driver builds them."""

    # Indices into the params, in the order ``source`` returns their gradients.
    params: list[int]
    # Where each goes among the graph's trailing gradient outputs (aligned with
    # ``grad_param_indices`` once inserted), in ascending order.
    positions: list[int]
    # How many of the graph's last outputs ``source`` takes.
    num_pieces: int
    # Black-formatted fx code of ``_sparse_gradients(*pieces) -> list``: the ops of
    # the backward that build the sparse tensors, run eagerly.
    source: str


class ProcessGroupRecord(NamedTuple):
    """A process group the graph's collectives (or a DDP argument) use, as the
    driver recognises it in the loading process."""

    # What the graph's collectives refer to it by.
    name: str
    backend: str
    # Its members' global ranks.
    ranks: list[int]


class DataParallelArgument(NamedTuple):
    """A DistributedDataParallel argument, with the options the graph's gradient
    reduction was built for."""

    position: int
    # The name of its process group (a ``ProcessGroupRecord``'s).
    group: str
    find_unused_parameters: bool
    bucket_cap_mb: float


class DeferredStep(NamedTuple):
    """An optimizer step the driver takes eagerly after the gradients are added:
    that of the parameters with sparse gradients, which the graph cannot update."""

    position: int
    # Its class, by its name in ``torch.optim``.
    name: str
    # Indices into the params of the parameters it steps, in the groups' order.
    params: list[int]


class DTensorLayout(NamedTuple):
    """How a DTensor graph input was sharded at capture: the graph replays its ops
    on the call's DTensors, which shard them as these did."""

    mesh_shape: tuple[int, ...]
    # Each mesh dim's placement, as its repr ("Shard(dim=0)", "Replicate()").
    placements: tuple[str, ...]


class ShardInput(NamedTuple):
    """A DTensor graph input whose local shard the graph takes (inductor, and a
    fully_shard model on either backend): the local ops and collectives it runs are
    those of this sharding, on a rank whose shard has this shape."""

    # The process group of each mesh dim, by name: the graph's collectives use them.
    mesh_groups: tuple[str, ...]
    placements: tuple[str, ...]
    # Ranks' shards differ where a dim does not divide by the mesh: the graph pads
    # and slices for the capturing rank's.
    local_shape: tuple[int, ...]


class ShardOutput(NamedTuple):
    """A DTensor result whose local shard the compiled graph returns (inductor): the
    driver wraps it in a DTensor with this global layout on the call's mesh."""

    placements: tuple[str, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class LocalShards(NamedTuple):
    """A graph that computes on local shards (Inductor compiles plain tensors; a
    fully_shard model's trace gathers its parameters from them): the DTensor inputs
    it takes the shards of, by graph-input position, and the DTensor results it
    returns the shards of, by graph-output position."""

    inputs: dict[int, ShardInput]
    outputs: dict[int, ShardOutput]


class StateTensor(NamedTuple):
    """A parameter or buffer of the module arguments, lifted to a graph input."""

    # As the calling convention names it (``convention.module_state``).
    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    # Whether it required grad at capture: that decided which gradients the graph
    # computes, so the driver holds the runtime model to it.
    requires_grad: bool


class PythonValue(NamedTuple):
    """A plain Python value the traced code read and built into the graph (a module's
    ``temperature``, a config flag, a global), by where it was read."""

    # From a module argument ("argument 0: .blocks.2.attn.temperature"), a module's
    # globals ("global SCALE (module __main__)", then any accessors), or the traced
    # function's own closure ("closure variable scale of step"), which no call can
    # check: the artifact is not given the function.
    path: str
    # Its ``repr`` at capture: the driver compares the current value's ``repr``, which
    # tells 1 from 1.0 and True, and names enums and dtypes.
    value: str


class InputTree(NamedTuple):
    """The tree of the non-module arguments, as the trace flattened them."""

    # Its ``treespec_dumps`` (IN_SPEC), or None where it cannot be serialised: the
    # driver then checks the leaves only. As ``treespec_pprint`` draws it, for
    # people to read.
    spec: str | None
    structure: str | None
    # Whether it holds a dict, whose keys a call may pass in another order (only
    # where ``spec`` is not None: the driver checks no structure otherwise).
    holds_dicts: bool = False
    # Whether each argument is a leaf itself, not a container.
    flat: bool = False


class InputLeaf(NamedTuple):
    """One leaf of the flattened non-module arguments; a non-tensor leaf has no
    shape, dtype, device, bounds or symbols."""

    shape: Shape | None
    dtype: str | None
    device: str | None
    # Each dynamic dim's declared (min, max), and its symbol: dims with the same
    # symbol must have equal sizes.
    bounds: DimBounds | None
    symbols: dict[int, str] | None
    # The value of a bool, int, float or str leaf, which the trace built into the
    # graph, so the driver holds each call to it; None for the others.
    value: LeafValue | None
    # Whether it is a float the graph takes as a 0-dim float64 tensor (a number fn
    # computes with), and where fn used it as a Python value, which the graph keeps
    # the example's of (``value``); None where fn only computed with it.
    number: bool = False
    number_use: str | None = None


# One op of the computation of an index from the input leaves: the aten op and
# overload ("add.Tensor"), its arguments and keyword arguments, where a tensor is
# {"leaf": k} (input leaf k) or {"step": j} (step j's result), a dtype {"dtype": name}.
IndexStep = tuple[str, tuple[object, ...], dict[str, object]]


class IndexCheck(NamedTuple):
    """An index the graph computes from user-input leaves alone, which eager would
    refuse outside a range: the driver computes and checks it before the graph
    runs."""

    # The leaves it is computed from, and how: with no steps, it is the one leaf
    # itself; otherwise the last step's result.
    sources: tuple[int, ...]
    steps: tuple[IndexStep, ...]
    # Every value must satisfy low <= value < high, or equal ``allowed`` (a loss's
    # ignore_index).
    low: int
    high: int
    allowed: int | None
    # What the graph indexes with it ("embedding rows of the model's 'emb.weight'").
    what: str


class TensorLiteral(NamedTuple):
    """A tensor the traced function created from Python data (``torch.tensor(...)``):
    a constant of the program, written into the artifact's graph section and fed to
    the graph after the user-input leaves."""

    # The graph input it feeds (``literal0``, ...).
    name: str
    values: LiteralValues
    dtype: str
    device: str


class ImportRewrite(NamedTuple):
    """One import line of Inductor's module that lowering rewrote
    (``lowering.inductor_imports``)."""

    original: str
    # What replaces it ("" where it is dropped).
    replacement: str
    # The name the replacement binds that the graph section must define
    # ("_AsyncCompile", "_assert_tensor_metadata", "SimpleNamespace"); "" for none.
    stand_in: str


class KernelEntry(NamedTuple):
    """One kernel of Inductor's module, as the graph section lists it."""

    name: str
    # The ATen ops Inductor says it computes ("aten.addmm"), in Inductor's order.
    aten_ops: list[str]
    # The lines its definition takes in the module.
    lines: int


# Per graph input before the lrs (the module state, the input leaves, then the
# optimizers' state): the strides the compiled graph depends on, None where it does
# not (a non-tensor leaf, one with dynamic dims, or, on inductor, a tensor no kernel
# reads with its layout).
Strides = list[tuple[int, ...] | None]


@dataclass(frozen=True)
class CallConvention:
    """How the traced function was called, and what every call must match: the
    arguments, the module state, the inputs, the outputs, the Python values, the
    optimizers and the process groups. Trace fills it once; nothing in it depends
    on the backend that compiles the graph."""

    # --- The arguments -----------------------------------------------------------
    # The traced function's ``__name__``, shown in the artifact's header.
    fn_name: str
    num_positional_args: int
    # The traced function's own name for each positional argument (``x``; ``args_0``
    # for one its ``*args`` took; ``arg0`` where its signature cannot be read).
    argument_names: list[str]
    modules: list[ModuleArgument]
    # How many of torch's global module hooks of each kind were registered at the
    # call (``register_module_forward_hook`` and its kin): they ran for every module.
    global_module_hooks: dict[str, int]
    # --- The module state: graph inputs first, the parameters, then the buffers ---
    params: list[StateTensor]
    buffers: list[StateTensor]
    # --- The inputs ----------------------------------------------------------------
    in_tree: InputTree
    leaves: list[InputLeaf]
    # The name of each graph input, in graph-input order (``graph_names``): the
    # module state, the input leaves, the optimizers' state, lrs and values tensors,
    # then the tensor literals. The eager graph's parameters are named so.
    input_names: list[str]
    # The graph inputs that shared a storage at capture (a tensor passed twice, views
    # of one storage, a parameter also passed as an input): the graph is right only
    # for that aliasing, so the driver holds each call to it.
    aliased_inputs: list[AliasGroup]
    # --- The outputs -------------------------------------------------------------
    out_spec: str
    out_structure: str
    # The k-th trailing gradient output of the graph belongs to
    # ``params[grad_param_indices[k]]``.
    grad_param_indices: list[int]
    # Positions among the function's flat outputs of the ``t.item()`` values it
    # returned: the graph returns ``t``, and the driver returns ``t.item()``.
    scalar_outputs: list[int]
    # --- The Python values ---------------------------------------------------------
    # The Python values the trace read (module and config attributes, globals), each
    # built into the graph: the driver holds every call to them.
    python_values: list[PythonValue]
    # --- The optimizers ------------------------------------------------------------
    optimizers: list[OptimizerArgument]
    # (parameter index, set_to_none) for each parameter whose ``.grad`` the function
    # reset with zero_grad(): the driver resets the runtime model's the same way
    # before adding the harvested gradients, as the eager call would have.
    grad_resets: list[tuple[int, bool]]
    # --- The process groups --------------------------------------------------------
    # The process groups the graph's collectives (and DDP arguments) use: a call must
    # bring the same groups.
    process_groups: list[ProcessGroupRecord] = field(default_factory=list)
    # The DistributedDataParallel arguments.
    data_parallel: list[DataParallelArgument] = field(default_factory=list)
    # The graph inputs that were DTensors, by position (module state, then input
    # leaves), with their mesh shape and placements: the driver holds each call to
    # them, and every other position to a plain tensor.
    dtensors: dict[int, DTensorLayout] = field(default_factory=dict)
    # --- What only some captures have ----------------------------------------------
    # Sparse parameter gradients, built by the driver from the graph's last outputs,
    # and the optimizer steps it takes for them after the graph.
    sparse_gradients: SparseGradients | None = None
    deferred_steps: list[DeferredStep] = field(default_factory=list)
    # The namedtuple and dataclass types in ``in_spec`` and ``out_spec``, by import
    # path ("module:qualname"), each serialised under that path: the artifact
    # imports and registers them before reading the specs, so that it rebuilds the
    # same types.
    pytree_types: list[str] = field(default_factory=list)
    # The graph inputs (module state, then input leaves) the graph updates in place:
    # the driver copies an input leaf passed in another layout into the captured one,
    # except these, whose update the caller must see.
    mutated_inputs: list[int] = field(default_factory=list)
    # The indices the graph takes from user-input leaves, each with the range eager
    # holds it to: the driver checks them first, so that a bad index raises before
    # any op runs (a compiled kernel's own check may abort the process instead).
    index_checks: list[IndexCheck] = field(default_factory=list)
    # Whether a path through the branches on tensor values skips the step (an early
    # return before backward() on a bad batch): it computes no gradients and steps
    # no optimizer. The graph's last output then says whether the call's path took
    # the step, and the driver adds gradients and finishes optimizer steps only
    # where it did. ``step_resets``: the .grad resets of the step's path that the
    # skipping path does not make (those after the branch), applied only then.
    skippable_step: bool = False
    step_resets: list[tuple[int, bool]] = field(default_factory=list)
    # The branches on tensor values the graph holds (``capturing.branches``), each
    # as its user's line (file:line and code) and what the graph does there: a
    # torch.cond of both sides, or one side and an assertion that refuses a call
    # taking the other.
    value_branches: list[str] = field(default_factory=list)


class InputStrides(NamedTuple):
    """The strides of the graph's inputs before the lrs, by the records they belong
    to: each a tuple where the compiled graph depends on the example's layout, None
    where it does not (or for a non-tensor leaf)."""

    params: Strides
    buffers: Strides
    leaves: Strides
    optimizer_state: Strides

    def flat(self) -> Strides:
        """In graph-input order: the module state, the leaves, the optimizers' state."""
        return [*self.params, *self.buffers, *self.leaves, *self.optimizer_state]

    def replaced(self, flat: Strides) -> InputStrides:
        """The same records holding ``flat`` (in ``flat()``'s order) instead."""
        values = iter(flat)
        return InputStrides._make([next(values) for _ in strides] for strides in self)


@dataclass(frozen=True)
class EagerGraph:
    """What the eager backend's graph, fx's source, needs besides its text."""

    # The imports fx's generated code expects in scope.
    imports: list[str]
    # The torch.cond branches fx's code reads as ``self.<name>``, each defined in the
    # source as ``_graph_<name>(self, *operands)``.
    branches: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class InductorGraph:
    """What lowering found in, and made of, Inductor's module."""

    # The lines of Inductor's module that ``inductor_imports`` rewrote in the source,
    # each with its replacement ("" for a dropped line).
    rewritten_imports: list[ImportRewrite]
    # The names its inner ``call`` unpacks the graph inputs into (``arg0_1``, ...),
    # where they are the convention's ``input_names`` one to one (empty where
    # AOTAutograd merged inputs).
    positional_names: list[str] = field(default_factory=list)
    # Whether it rounds each float16 and bfloat16 op's result to its dtype, as eager
    # does, rather than once per fused kernel (its ``emulate_precision_casts``, on
    # for graphs that compute in those dtypes).
    emulate_precision_casts: bool = False
    # The names of the Triton kernels the source defines (GPU tensors, or CPU ones
    # with Inductor's ``cpu_backend="triton"``), in its order. Each is compiled, or
    # run by Triton's interpreter, from its source there, unless the cache carries
    # Triton's compiled kernel for it (on a GPU).
    triton_kernels: list[str] = field(default_factory=list)
    # Every kernel the source defines, in its order (its Triton ones and its C++
    # ones), which the graph section lists.
    kernels: list[KernelEntry] = field(default_factory=list)
    # AOTAutograd's code binds Inductor's inner ``call`` as ``_inner_call`` and
    # defines the ``call`` the driver runs around it.
    redefined_call: bool = False


@dataclass(frozen=True)
class CompiledGraph:
    """The compiled graph, spliced verbatim into the artifact, with what lowering
    found in it: the strides it depends on, and its backend's own record."""

    # Defines ``call(flat_inputs) -> list`` (inductor) or ``_graph_forward(self,
    # *inputs)`` (eager, wrapped into ``call`` by the eager graph template).
    source: str
    # Inputs of the graph after the user-input leaves, written out as literals.
    tensor_literals: list[TensorLiteral]
    input_strides: InputStrides
    # What the backend made besides the source: the one of the capture's backend.
    backend_graph: EagerGraph | InductorGraph
    # Where the graph computes on DTensors' local shards, which ones (None where it
    # takes and returns the DTensors themselves, or none).
    local_shards: LocalShards | None = None


@dataclass(frozen=True)
class KernelPayload:
    """The compiled kernels the cache carries (inductor), and what the artifact
    accepts of them; empty for eager."""

    # The native code the artifact accepts from a cache: each kernel binary's file
    # key (relative to inductor's cache folder) and sha256. A cache is only code
    # nobody reads; the artifact, which people review, decides what of it may run.
    kernel_binaries: dict[str, str] = field(default_factory=dict)
    # Which binary is whose: the sha256 of each C++ kernel's source (as the module
    # passes it to ``cpp_pybinding``) -> the file key of its binary.
    kernel_sources: dict[str, str] = field(default_factory=dict)
    # What the cache carries to skip compilation on reload (None for eager): plain
    # data that torch.load(weights_only=True) reads back.
    cache_artifact: dict[str, object] | None = None


@dataclass(frozen=True)
class CaptureResult:
    """What one capture produced: the calling convention trace recorded, the graph
    lowering compiled from it, and the kernels the cache carries."""

    backend: Backend
    convention: CallConvention
    graph: CompiledGraph
    payload: KernelPayload
