"""Lower: ``TracedGraph`` -> ``CaptureResult``, turning the graph into source text.

eager: the graph's own fx code, run as-is. inductor: the module
``aot_autograd.compile_to_python`` generates (kernels plus AOTAutograd's prelude and
epilogue), whose compiled binaries go into the cache.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import operator
import os
import re
from collections.abc import Generator
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from precompile_gen.capture_result import (
    Backend,
    CaptureResult,
    CompiledGraph,
    EagerGraph,
    ImportRewrite,
    InductorGraph,
    InputStrides,
    KernelPayload,
    TensorLiteral,
)
from precompile_gen.capturing import data_parallel, graph_names, update_order
from precompile_gen.capturing.trace import TracedGraph
from precompile_gen.codegen import layout
from precompile_gen.lowering import (
    inductor_imports,
    inductor_module,
    kernel_builds,
    lowering_cache,
)
from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.errors import PrecompileError
from precompile_gen.tools import timings

# Inductor lowering swaps process-global compiler state; one lowering at a time, and
# not while a load executes an inductor artifact under a patched config.
_INDUCTOR_LOCK = kernel_binaries.TORCH_STATE_LOCK


def lower(traced: TracedGraph, backend: Backend) -> CaptureResult:
    """The capture as plain data: the convention as the trace recorded it, the graph
    as source text with the strides it depends on, and its kernels' payload. On
    inductor, an earlier capture's lowering of the same graph is reused
    (``lowering_cache``)."""
    entry = lowering_cache.key(traced) if backend == "inductor" else None
    kept = None if entry is None else lowering_cache.load(entry)
    if kept is not None:
        graph, payload = kept
    else:
        graph, payload = _lowered(traced, backend)
        if entry is not None:
            lowering_cache.store(entry, graph, payload)
    return CaptureResult(
        backend=backend, convention=traced.convention, graph=graph, payload=payload
    )


def _lowered(
    traced: TracedGraph, backend: Backend
) -> tuple[CompiledGraph, KernelPayload]:
    graph = _lower_graph(traced, backend)
    payload = KernelPayload(
        kernel_binaries=kernel_binaries.digests(graph.cache_artifact),
        kernel_sources=graph.kernel_sources,
        cache_artifact=graph.cache_artifact,
    )
    return _compiled_graph(traced, graph), payload


class _LoweredGraph(NamedTuple):
    """The graph as the artifact's source text, with what the backend made besides,
    and the compiled kernels the cache carries."""

    source: str
    backend_graph: EagerGraph | InductorGraph
    cache_artifact: dict[str, object] | None
    kernel_sources: dict[str, str]


def _lower_graph(traced: TracedGraph, backend: Backend) -> _LoweredGraph:
    if backend == "eager":
        source, imports, branches = _eager_graph(
            traced.gm, traced.convention.input_names
        )
        return _LoweredGraph(source, EagerGraph(imports, branches), None, {})
    options = _inductor_options(traced)
    with _quiet_cuda_home_guess():
        source, kernels = _inductor_graph(traced, options)
    source, rewritten_imports = _rewrite_imports(
        inductor_module.editable(inductor_module.without_cache_folder(source))
    )
    return _LoweredGraph(
        source=source,
        backend_graph=InductorGraph(
            rewritten_imports=rewritten_imports,
            positional_names=_positional_names(source, traced),
            emulate_precision_casts=options.get("emulate_precision_casts") is True,
            triton_kernels=kernels.triton_kernels,
            kernels=inductor_module.kernels(source),
            redefined_call=inductor_module.redefines_call(source),
        ),
        cache_artifact=kernels.payload,
        kernel_sources=kernels.kernel_sources,
    )


def _compiled_graph(traced: TracedGraph, graph: _LoweredGraph) -> CompiledGraph:
    return CompiledGraph(
        # Last: what lowering read from the source found it as Inductor wrote it.
        source=inductor_module.unpacked_one_per_line(graph.source),
        tensor_literals=[
            TensorLiteral(name, tensor.tolist(), str(tensor.dtype), str(tensor.device))
            for name, tensor in traced.constants
        ],
        input_strides=_layout_dependent(
            traced.example_strides, graph, traced.convention.mutated_inputs
        ),
        backend_graph=graph.backend_graph,
        local_shards=traced.local_shards,
    )


def _layout_dependent(
    strides: InputStrides, graph: _LoweredGraph, mutated_inputs: list[int]
) -> InputStrides:
    """The example's ``strides`` kept only where the compiled graph depends on them:
    on inductor, the inputs a kernel reads, which Inductor asserts, and those the
    graph updates in place. An input used for its shape alone, or not at all, may
    come in any layout. The eager graph, and an Inductor wrapper whose inputs are
    not the graph's one to one (AOTAutograd merges aliased inputs), keep every
    input's strides."""
    inductor = graph.backend_graph
    names = inductor.positional_names if isinstance(inductor, InductorGraph) else []
    if not names:
        return strides
    asserted = inductor_module.asserted_inputs(graph.source)
    return strides.replaced(
        [
            stride
            if names[position] in asserted or position in mutated_inputs
            else None
            for position, stride in enumerate(strides.flat())
        ]
    )


def _positional_names(graph_source: str, traced: TracedGraph) -> list[str]:
    """The names Inductor's inner ``call`` unpacks its inputs into, where they are the
    graph's inputs one to one; empty where they are not (AOTAutograd merges aliased
    inputs)."""
    names = inductor_module.unpacked_inputs(graph_source)
    if traced.convention.aliased_inputs or len(names) != len(traced.flat_args):
        return []
    return names


def _eager_graph(
    gm: torch.fx.GraphModule, input_names: list[str]
) -> tuple[str, list[str], list[str]]:
    """fx's code for the graph, its inputs named ``input_names`` (then for its
    torch.cond branches), the imports it needs and the branches' names."""
    # fx's code names its function ``forward``, which is the driver's public name, and
    # runs with fx's "custom builtins" (torch, device, inf, ...) injected into its
    # globals; the artifact imports them explicitly instead.
    from torch.fx.graph import _custom_builtins

    graph_names.name_inputs(gm, input_names)
    branches = _branch_sources(gm)
    source = _graph_function(gm, "_graph_forward")
    source += "".join(f"\n\n{code}" for _, code in branches)
    # Only those the code uses: with its inputs as parameters, it no longer unpacks
    # them with fx_pytree nor packs its result with pytree.
    imports = [
        builtin.import_str
        for name, builtin in _custom_builtins.items()
        if re.search(rf"\b{re.escape(name)}\b", source)
    ]
    return source, imports, [name for name, _ in branches]


def _graph_function(gm: torch.fx.GraphModule, name: str) -> str:
    code = gm.code.strip("\n").rstrip().replace("def forward(", f"def {name}(", 1)
    return _parameters_one_per_line(code) + "\n"


def _parameters_one_per_line(code: str) -> str:
    """fx's function with its signature one parameter a line, where it is longer
    than a line: a large model's runs to thousands of characters."""
    signature, newline, body = code.partition("\n")
    if len(signature) <= layout.LINE_LENGTH:
        return code
    header = ast.parse(signature + "\n    pass").body[0]
    assert isinstance(header, ast.FunctionDef)
    parameters = [ast.unparse(argument) for argument in header.args.args]
    return (
        layout.one_per_line(f"def {header.name}(", parameters, "):", "")
        + newline
        + body
    )


def _branch_sources(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """Each torch.cond branch in ``gm``, nested ones included, as (name, fx's code
    for it as ``_graph_<name>``). fx's code reads a branch as ``self.<name>``; the
    names are made unique across the nesting (``true_graph_0__false_graph_0``) so
    that one object can stand in for ``self`` in every graph."""
    branches: list[tuple[str, str]] = []

    def visit(module: torch.fx.GraphModule, prefix: str) -> None:
        for node in module.graph.find_nodes(op="get_attr"):
            branch = getattr(module, str(node.target))
            if isinstance(branch, torch.fx.GraphModule):
                name = prefix + str(node.target)
                _name_operands(branch, node)
                visit(branch, name + "__")
                branches.append((name, _graph_function(branch, f"_graph_{name}")))
                node.target = name
        module.recompile()

    visit(gm, "")
    return branches


def _name_operands(branch: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Name the inputs of a torch.cond branch (``node`` reads it) after the values
    of the enclosing graph that the cond passes it."""
    (cond,) = node.users
    operands = cond.args[3]
    assert isinstance(operands, (list, tuple))
    placeholders = list(branch.graph.find_nodes(op="placeholder"))
    names = [
        operand.name if isinstance(operand, torch.fx.Node) else placeholder.name
        for operand, placeholder in zip(operands, placeholders, strict=True)
    ]
    if names != [placeholder.name for placeholder in placeholders]:
        graph_names.name_inputs(branch, names)


def _rewrite_imports(graph_source: str) -> tuple[str, list[ImportRewrite]]:
    """Inductor's module with the imports that need its compiler rewritten
    (``inductor_imports``), resolving ``extern_kernels`` with Inductor's own table."""
    from torch._inductor.select_algorithm import extern_kernels

    return inductor_imports.rewrite(graph_source, vars(extern_kernels))


def _inductor_graph(
    traced: TracedGraph, options: dict[str, object]
) -> tuple[str, kernel_binaries.Collected]:
    """Inductor's module for the graph, compiled with ``options`` (which Inductor's
    FX graph cache keys on), with what the kernel scan found in it: its kernel
    binaries (the cache), kernel sources and Triton kernels."""
    from torch._functorch import aot_autograd
    from torch._inductor import config as inductor_config

    _random_fills_in_eager_layout(traced.gm)
    _scale_before_add(traced.gm)
    if _convolutions_laid_out_channels_last(traced.gm):
        _channels_last_once(traced.gm)
        _weight_gradients_in_weight_layout(traced.gm)
    try:
        # compile_to_python applies ``options`` to Inductor's compile only, after
        # AOTAutograd has decomposed the graph with the decompositions of the ambient
        # config; without fallback_random there, rand_like and friends become
        # Inductor's own random ops, which its fallback_random compile refuses.
        with (
            _INDUCTOR_LOCK,
            inductor_config.patch(fallback_random=True),
            kernel_builds.reproducible(),
        ):
            # torch's own cache bundle is dropped: it does not hold the kernel
            # binaries, which are what a fresh process would otherwise compile.
            graph_source, _ = aot_autograd.compile_to_python(
                traced.gm, traced.flat_args, options=options
            )
            with timings.stage("cache"):
                return graph_source, kernel_binaries.collect(
                    graph_source, kernel_builds.toolchain()
                )
    except PrecompileError:
        raise
    except Exception as error:
        raise _compile_error(error) from error


class _CudaHomeGuess(logging.Filter):
    # torch's extension loader logs, whenever Inductor asks it for the CUDA toolkit
    # on a machine without a GPU, that it guessed one: a line at every capture on
    # CPU that tells the user nothing about the capture.
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


@contextlib.contextmanager
def _quiet_cuda_home_guess() -> Generator[None]:
    """Keep the extension loader's guess of the CUDA toolkit out of the user's
    terminal while Inductor compiles, unless the user asked for torch's logs
    (``TORCH_LOGS``, or a level set on that logger)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if os.environ.get("TORCH_LOGS") or logger.level != logging.NOTSET:
        yield
        return
    quiet = _CudaHomeGuess()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _inductor_options(traced: TracedGraph) -> dict[str, object]:
    # Imports Inductor, which a capture for the eager backend need not.
    from precompile_gen.lowering import recompute

    # size_asserts bakes every input's layout into assert_size_stride, which the
    # driver turns into a clear error; the user's ambient config must not remove it.
    # For a dynamic capture, scalar_asserts keeps the range checks on the unbacked
    # sizes inside the compiled graph.
    dynamic = any(
        leaf.shape is not None and None in leaf.shape
        for leaf in traced.convention.leaves
    )
    # fallback_random draws random numbers (dropout masks) with eager's own ops, in
    # the graph's order: Inductor's own RNG kernels draw them in the order its
    # scheduler picks, so a seeded call would not give eager's masks.
    # The post-grad pass frees cheap activations between the forward and the
    # backward of a step captured whole, as torch.compile's partitioner does.
    options: dict[str, object] = {
        "size_asserts": True,
        "scalar_asserts": dynamic,
        "fallback_random": True,
        "post_grad_custom_post_pass": recompute.RecomputeFarReads(),
    }
    if data_parallel.graph_groups(traced.gm):
        # Inductor's locality pass moves each op next to its first user, but never a
        # collective next to its wait: every all-gather would be issued at the start,
        # every gathered parameter of a fully_shard model alive at once. The graph's
        # own order keeps each one between its gather and its last use.
        options["reorder_for_locality"] = False
    dtypes = _value_dtypes(traced.gm)
    if dtypes & _LOW_PRECISION:
        options["emulate_precision_casts"] = True
    if any(dtype.is_complex for dtype in dtypes):
        from torch._inductor import config as inductor_config

        # Added to, not replacing, the passes the user's config disables.
        ambient = inductor_config.disabled_passes
        options["disabled_passes"] = ",".join(
            filter(None, (ambient, _COMPLEX_UNSAFE_PASSES))
        )
    return options


# Inductor runs every complex op as an eager fallback, and a complex view is a
# fallback's output rather than a view of its base's buffer. Its reinplacing pass
# turns ``slice_scatter(base, src)`` into ``copy_(slice(base), src)`` when ``base``
# dies there, and the scheduler then knows only the slice to be written: a later
# read of the base through another view (``as_strided(base)``) may be scheduled
# before the write and read stale values. An ``irfft`` backward, which doubles the
# middle frequencies in place, lost them this way, with no error. Left functional,
# each complex scatter is one fallback that writes a buffer of its own.
_COMPLEX_UNSAFE_PASSES = "reinplace_inplaceable_ops"


# Eager rounds every float16 and bfloat16 op's result to its dtype; Inductor computes
# a fused chain of them in float32 and rounds once, which after a few AdamW steps
# leaves bfloat16 weights tens of units in the last place from eager's (0.02 on
# weights near 0.1). emulate_precision_casts rounds where eager rounds, at a
# measured cost in step time (benchmarks/low_precision.py); a graph without these
# dtypes is left as it is (on GPUs the option also turns off fused multiply-adds).
_LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})


def _value_dtypes(gm: torch.fx.GraphModule) -> set[torch.dtype]:
    """The dtypes of the graph's tensor values: inputs, intermediates and outputs."""
    return {
        value.dtype
        for node in gm.graph.nodes
        for value in pytree.tree_leaves(node.meta.get("val"))
        if isinstance(value, torch.Tensor)
    }


def _compile_error(error: Exception) -> PrecompileError:
    """The ``PrecompileError`` for Inductor's failure to compile the graph."""
    from torch._inductor.exc import InductorError
    from torch._inductor.standalone_compile import NoRunnableInductorModuleError

    if isinstance(error, NoRunnableInductorModuleError):
        return PrecompileError(
            "the inductor backend has nothing to compile: the function returns its "
            "inputs or Python constants unchanged. Return a computed tensor, or use "
            "backend='eager'."
        )
    if isinstance(error, InductorError):
        interpreted = _triton_interpreter_error(error)
        if interpreted is not None:
            return interpreted
        if "Unexpected output types" in str(error):
            return PrecompileError(
                "the inductor backend cannot return a float, complex or str next to "
                "computed tensors (int, bool and None are fine). Return tensors only, "
                "or use backend='eager'."
            )
        # Inductor's message runs to many lines; what to do comes first.
        return PrecompileError(
            "the inductor backend failed to compile the captured graph. Try "
            "backend='eager' to run the captured graph without compiling it.\n"
            + str(error).strip()
        )
    dynamic = _dynamic_output_error(error)
    if dynamic is not None:
        return dynamic
    # AOTAutograd re-traces the captured graph with its own decompositions, and
    # a layout they disagree on with eager's kernels fails there.
    first_line = (str(error).strip().splitlines() or [""])[0]
    return PrecompileError(
        "the inductor backend failed to compile the captured graph "
        f"({type(error).__name__}: {first_line}). Capture with Inductor's own "
        "decompositions (decompositions=torch._inductor.decomposition."
        "select_decomp_table()), or use backend='eager' to run the captured "
        "graph without compiling it."
    )


def _dynamic_output_error(error: Exception) -> PrecompileError | None:
    """The error for an op whose result's shape its inputs' values decide, which
    Inductor compiles only with sizes it can bound; None for any other."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    if not isinstance(error, DynamicOutputShapeException):
        return None
    return PrecompileError(
        f"the inductor backend cannot compile {error.func}: the shape of its result "
        "depends on the values of its inputs (the lengths a CTC loss is given, "
        "say), and Inductor has no kernel for it at sizes it cannot bound. Capture "
        "with backend='eager', which runs the captured ops as eager does, at each "
        "call's sizes."
    )


def _triton_interpreter_error(error: Exception) -> PrecompileError | None:
    """The error for Triton kernels that Triton's interpreter failed to run while
    Inductor tuned them, in a process not set up for it; None for any other."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if "Failed to run autotuning code block" not in str(error):
        return None
    return PrecompileError(
        "Inductor's Triton kernels failed under Triton's interpreter "
        "(TRITON_INTERPRET=1) while it tuned them. Capture and load inside "
        "precompile_gen.testing.triton_interpreter(), which gives the kernels the "
        "math library (libdevice) the interpreter lacks.\n" + str(error).strip()
    )


# ``add(x, y, alpha=a)`` and its in-place form, whose ``alpha`` Inductor's fusion of an
# ``mm`` and an ``add`` into one ``addmm`` drops: ``add(mm(a, b), p, alpha=0.1)``, an
# SGD step's weight decay on a gradient the graph has just computed, would become
# ``addmm(p, a, b)``.
_ADDS_WITH_ALPHA = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


def _scale_before_add(gm: torch.fx.GraphModule) -> None:
    """Rewrite ``add(x, y, alpha=a)`` as ``add(x, mul(y, a))``, which is how
    Inductor computes it anyway, so that no fusion can lose the scale."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target not in _ADDS_WITH_ALPHA or "alpha" not in node.kwargs:
            continue
        alpha = node.kwargs["alpha"]
        if alpha == 1 or not isinstance(node.args[1], torch.fx.Node):
            continue
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(
                torch.ops.aten.mul.Tensor, (node.args[1], alpha)
            )
        node.args = (node.args[0], scaled)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
        changed = True
    if changed:
        gm.recompile()


# Each convolution's 4-D operands, by position: convolution(input, weight, ...) and
# convolution_backward(grad_output, input, weight, ...).
_CONVOLUTION_OPERANDS = {
    torch.ops.aten.convolution.default: (0, 1),
    torch.ops.aten.convolution_backward.default: (1, 2),
}


def _convolutions_laid_out_channels_last(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor will lay this training step's convolutions out
    channels-last (its layout optimisation, which it decides on the whole graph)."""
    backward = torch.ops.aten.convolution_backward.default
    if not gm.graph.find_nodes(op="call_function", target=backward):
        return False
    from torch._inductor.graph import GraphLowering

    return GraphLowering.decide_layout_opt(gm, is_inference=False)


def _channels_last_once(gm: torch.fx.GraphModule) -> None:
    """Give each weight or activation that a training step's convolutions read
    one channels-last copy, which its forward and backward convolutions share.

    With convolutions in a training graph Inductor lays them out channels-last, and
    lowers each convolution, and each convolution backward, with a channels-last
    copy of every operand that is not one already. In one graph holding the whole
    step, the copies of one weight or activation are made side by side in the
    forward's kernels and all kept until the backward: two or three copies, where
    torch.compile's forward saves one for its backward. An activation's other
    readers read the copy too, so that the activation is laid out once."""
    graph = gm.graph
    position = {node: index for index, node in enumerate(graph.nodes)}
    writes = update_order.write_positions(graph)
    changed = False
    for operand in _convolution_operands(graph):
        # A reader after the tensor's memory is next written (the optimizer's
        # update of a weight) must read the written tensor.
        written = writes.get(operand, [])
        activation = operand.op != "placeholder"
        readers = [
            (reader, index)
            for reader, index in _plain_reads(operand, everyone=activation)
            if not any(position[operand] < p < position[reader] for p in written)
        ]
        if len(readers) < 2:
            continue
        first = min((reader for reader, _ in readers), key=position.__getitem__)
        with graph.inserting_before(first):
            copy = graph.call_function(
                torch.ops.aten.clone.default,
                (operand,),
                {"memory_format": torch.channels_last},
            )
        copy.meta["val"] = operand.meta["val"].clone(memory_format=torch.channels_last)
        for reader, index in readers:
            reader.update_arg(index, copy)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _weight_gradients_in_weight_layout(gm: torch.fx.GraphModule) -> None:
    """Hand each convolution weight's gradient to its readers in the weight's own
    layout, copied in a kernel of its own.

    A channels-last convolution backward returns the weight's gradient
    channels-last. Read so, an optimizer's update of a contiguous weight becomes a
    fused kernel that transposes in small tiles of the kernel's 3x3 positions, a few
    times slower than the same update on a gradient laid out like the weight plus
    the copy that lays it out (torch.compile's gradient accumulation makes that
    copy too)."""
    # Registers torch.ops.prims.inductor_force_stride_order.
    import torch._inductor.inductor_prims

    force_stride_order = torch.ops.prims.inductor_force_stride_order.default
    graph = gm.graph
    backward = torch.ops.aten.convolution_backward.default
    changed = False
    for node in graph.find_nodes(op="call_function", target=backward):
        weight = node.args[2]
        if _is_channels_last_copy(weight):
            weight = weight.args[0]
        layout = tuple(weight.meta["val"].stride())
        if not all(type(stride) is int for stride in layout):
            continue  # a dynamic capture's symbolic strides: Inductor's layout
        for gradient in list(node.users):
            if gradient.target is not operator.getitem or gradient.args[1] != 1:
                continue
            with graph.inserting_after(gradient):
                copy = graph.call_function(force_stride_order, (gradient, layout))
            copy.meta["val"] = force_stride_order(gradient.meta["val"], layout)
            gradient.replace_all_uses_with(
                copy, delete_user_cb=lambda user, copy=copy: user is not copy
            )
            changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _is_channels_last_copy(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a copy ``_channels_last_once`` made."""
    return (
        node.target is torch.ops.aten.clone.default
        and node.kwargs.get("memory_format") is torch.channels_last
    )


def _convolution_operands(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The 4-D tensors, not channels-last already, that the convolutions read."""
    operands: dict[torch.fx.Node, None] = {}
    for target, indices in _CONVOLUTION_OPERANDS.items():
        for node in graph.find_nodes(op="call_function", target=target):
            for index in indices:
                operand = node.args[index]
                value = getattr(operand, "meta", {}).get("val")
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() == 4
                    and not value.is_contiguous(memory_format=torch.channels_last)
                ):
                    operands[operand] = None
    return list(operands)


def _plain_reads(
    operand: torch.fx.Node, *, everyone: bool
) -> list[tuple[torch.fx.Node, int]]:
    """(reader, argument index) of each op that reads ``operand`` as a plain input,
    neither writing it nor returning a view of it: the convolutions, or with
    ``everyone`` every such op."""
    reads = []
    for reader in operand.users:
        target = reader.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        if not everyone and target not in _CONVOLUTION_OPERANDS:
            continue
        for index, (argument, value) in enumerate(
            zip(target._schema.arguments, reader.args, strict=False)
        ):
            if value is operand and argument.alias_info is None:
                reads.append((reader, index))
    return reads


def _random_fills_in_eager_layout(gm: torch.fx.GraphModule) -> None:
    """Give each tensor a random op fills in place (dropout's mask:
    ``empty_like(x).bernoulli_(p)``) the layout eager gives it.

    A fill draws its numbers in the order of the tensor's memory (and ``normal_``
    draws contiguous tensors by another algorithm), while eager's ``empty_like``
    keeps the layout of its input (a transposed attention output, say) and
    Inductor's lays the tensor out contiguously: the same seed would fill another
    mask. Inductor keeps the strides of ``empty_strided``, and hands the fallback
    kernels (uniform_, normal_, ...) tensors in them; ``bernoulli_`` it lowers to a
    fill of a contiguous copy, so that one fills a contiguous tensor shaped as
    eager's memory is, permuted back into the logical order. A ``zeros_like`` (or
    ``ones_like``, ``full_like``) that a fill overwrites is such an allocation too:
    the fill writes every element."""
    graph = gm.graph
    empties = [
        node
        for target in _ALLOCATIONS_LIKE
        for node in graph.find_nodes(op="call_function", target=target)
    ]
    position = {node: index for index, node in enumerate(graph.nodes)}
    changed = False
    for node in empties:
        value = _static_value(node)
        if value is None or not node.users:
            continue
        fill = min(node.users, key=position.__getitem__)
        if not (_fills_randomly(fill) and fill.args[0] is node):
            continue
        if fill.target in _FILLS_OF_A_CONTIGUOUS_COPY:
            changed |= _fill_in_memory_order(graph, node, fill, value)
        else:
            _allocate_strided(graph, node, value)
            changed = True
    for target, fill in _LIKE_OPS.items():
        for node in list(graph.find_nodes(op="call_function", target=target)):
            value = _static_value(node)
            if value is not None and node.kwargs.get("generator") is None:
                _fill_strided(graph, node, value, fill)
                changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _static_value(node: torch.fx.Node) -> torch.Tensor | None:
    # A dynamic capture's sizes are symbols, which a node cannot take as constants;
    # its random tensors keep Inductor's layout (README, "Random numbers").
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    if not all(type(n) is int for n in (*value.shape, *value.stride())):
        return None
    return value


# The ops that allocate a tensor in their input's layout, as eager's ``empty_like``.
_ALLOCATIONS_LIKE = (
    torch.ops.aten.empty_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.full_like.default,
)

# ``rand_like(x)`` is ``empty_like(x).uniform_(0, 1)`` in eager; Inductor calls it
# on x in the layout it chose for x, which need not be eager's. ``bernoulli(x, p)``
# fills a contiguous tensor in eager, and Inductor a copy of x in x's layout. Each
# maps to its fill and the fill's arguments where the op has none after x.
_LIKE_OPS = {
    torch.ops.aten.rand_like.default: (torch.ops.aten.uniform_.default, (0.0, 1.0)),
    torch.ops.aten.randn_like.default: (torch.ops.aten.normal_.default, (0.0, 1.0)),
    torch.ops.aten.bernoulli.p: (torch.ops.aten.bernoulli_.float, ()),
}


def _fill_strided(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    value: torch.Tensor,
    fill: tuple[torch._ops.OpOverload, tuple[float, ...]],
) -> None:
    target, arguments = fill
    strided = _empty_strided(graph, node, value)
    with graph.inserting_before(node):
        filled = graph.call_function(target, (strided, *(node.args[1:] or arguments)))
    filled.meta = dict(node.meta)
    node.replace_all_uses_with(filled)
    graph.erase_node(node)


# The in-place random ops Inductor lowers to a fill of a contiguous copy of their
# input, whatever its strides.
_FILLS_OF_A_CONTIGUOUS_COPY = (torch.ops.aten.bernoulli_.float,)


def _allocate_strided(
    graph: torch.fx.Graph, node: torch.fx.Node, value: torch.Tensor
) -> None:
    strided = _empty_strided(graph, node, value)
    node.replace_all_uses_with(strided)
    graph.erase_node(node)


def _empty_strided(
    graph: torch.fx.Graph, node: torch.fx.Node, value: torch.Tensor
) -> torch.fx.Node:
    """An uninitialised tensor like ``value``, in its strides, before ``node``."""
    with graph.inserting_before(node):
        strided = graph.call_function(
            torch.ops.aten.empty_strided.default,
            (list(value.shape), list(value.stride())),
            {"dtype": value.dtype, "device": value.device},
        )
    strided.meta = dict(node.meta)
    return strided


def _fill_in_memory_order(
    graph: torch.fx.Graph, node: torch.fx.Node, fill: torch.fx.Node, value: torch.Tensor
) -> bool:
    order = _memory_order(value)
    if order is None or order == sorted(order):
        return False
    with graph.inserting_before(node):
        base = graph.call_function(
            torch.ops.aten.empty.memory_format,
            ([value.shape[dim] for dim in order],),
            {"dtype": value.dtype, "device": value.device},
        )
    fill.args = (base, *fill.args[1:])
    inverse = sorted(range(len(order)), key=order.__getitem__)
    with graph.inserting_after(fill):
        mask = graph.call_function(torch.ops.aten.permute.default, (fill, inverse))
    for user in list(fill.users):
        if user is not mask:
            user.replace_input_with(fill, mask)
    node.replace_all_uses_with(mask)
    graph.erase_node(node)
    return True


def _fills_randomly(node: torch.fx.Node) -> bool:
    # An in-place op that draws from the generator: bernoulli_, uniform_, normal_...
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    first = target._schema.arguments[0] if target._schema.arguments else None
    return (
        torch.Tag.nondeterministic_seeded in target.tags
        and first is not None
        and first.alias_info is not None
        and first.alias_info.is_write
    )


def _memory_order(value: torch.Tensor) -> list[int] | None:
    """The dims of a dense tensor from the outermost in memory to the innermost, or
    None where its layout is no permutation of a contiguous one."""
    order = sorted(
        range(value.dim()), key=lambda dim: (-value.stride(dim), -value.shape[dim])
    )
    expected = 1
    for dim in reversed(order):
        if value.shape[dim] != 1 and value.stride(dim) != expected:
            return None
        expected *= value.shape[dim]
    return order
