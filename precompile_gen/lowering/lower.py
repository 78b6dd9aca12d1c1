"""Lower: ``TracedGraph`` -> ``CaptureResult``, turning the graph into source text.

eager: the graph's own fx code, run as-is. inductor: the module
``aot_autograd.compile_to_python`` generates (kernels plus AOTAutograd's prelude and
epilogue), whose compiled binaries go into the cache.
"""

from __future__ import annotations

import ast
import contextlib
import logging
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
from precompile_gen.capturing import data_parallel, graph_names
from precompile_gen.capturing.trace import TracedGraph
from precompile_gen.codegen import layout
from precompile_gen.lowering import (
    graph_rewrites,
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

    graph_rewrites.random_fills_in_eager_layout(traced.gm)
    graph_rewrites.scale_before_add(traced.gm)
    if graph_rewrites.convolutions_laid_out_channels_last(traced.gm):
        graph_rewrites.channels_last_once(traced.gm)
        graph_rewrites.weight_gradients_in_weight_layout(traced.gm)
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
