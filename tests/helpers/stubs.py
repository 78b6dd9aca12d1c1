"""Stub rendering: every template rendered into an ordinary, type-checkable module.

The driver lives in templates, out of reach of a type checker. Rendering each backend's
artifact with typed placeholder metadata and a typed stand-in for the compiled graph
gives ``.py`` files that ``pyrefly check`` covers like any other code: once with every
driver feature on and once with every one off, so each branch of each template is
rendered and checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from precompile_gen.capture_result import (
    BACKENDS,
    Backend,
    CallConvention,
    CaptureResult,
    CompiledGraph,
    DataParallelArgument,
    DeferredStep,
    DTensorLayout,
    EagerGraph,
    ImportRewrite,
    IndexCheck,
    InductorGraph,
    InputLeaf,
    InputStrides,
    InputTree,
    KernelPayload,
    LocalShards,
    ModuleArgument,
    OptimizerArgument,
    OptimizerStateTensor,
    ParamGroup,
    ProcessGroupRecord,
    PythonValue,
    ShardInput,
    ShardOutput,
    SparseGradients,
    StateTensor,
    TensorLiteral,
)
from precompile_gen.codegen.layout import format_python
from precompile_gen.codegen.render import render_artifact
from precompile_gen.lowering import inductor_imports

# Typed stand-ins for the spliced graph, which is the only part not from a template.
_GRAPH_STUBS: dict[Backend, str] = {
    "eager": (
        "def _graph_forward(self: object, *flat: object) -> list[object]:\n"
        "    return list(flat)\n"
        "\n"
        "\n"
        "def _graph_true_graph_0(self: object, x: object) -> tuple[object]:\n"
        "    return (x,)\n"
    ),
    "inductor": (
        "AsyncCompile = _AsyncCompile\n"
        "extern_kernels = SimpleNamespace(addmm=torch.addmm)\n"
        "assert_tensor_metadata = _assert_tensor_metadata\n"
        "\n"
        "\n"
        "def _kernel() -> object:  # not called: it stands for Inductor's kernel code\n"
        "    async_compile = AsyncCompile()\n"
        '    kernel = async_compile.cpp_pybinding(["float*"], "source")\n'
        '    async_compile.triton("triton_poi_fused_0", "source", device_str="cpu")\n'
        "    async_compile.wait(globals())\n"
        "    return kernel\n"
        "\n"
        "\n"
        "def call(flat_inputs: list[object]) -> list[object]:\n"
        "    return list(flat_inputs)\n"
    ),
}
# Each rewrite the inductor stub's graph stands for (inductor_imports), so that every
# stand-in the graph section can define is rendered.
_REWRITTEN_IMPORTS = [
    ImportRewrite(
        "from torch._inductor.async_compile import AsyncCompile",
        "AsyncCompile = _AsyncCompile",
        "_AsyncCompile",
    ),
    ImportRewrite(
        "from torch._inductor.select_algorithm import extern_kernels",
        "extern_kernels = SimpleNamespace(addmm=torch.addmm)",
        "SimpleNamespace",
    ),
    ImportRewrite(
        "from torch._inductor.runtime.runtime_utils import assert_tensor_metadata",
        "assert_tensor_metadata = _assert_tensor_metadata",
        "_assert_tensor_metadata",
    ),
    ImportRewrite("from torch._inductor.hooks import run_intermediate_hooks", "", ""),
    ImportRewrite(inductor_imports.AUTOTUNING_BLOCK, "", ""),
]

# The imports fx's generated code relies on (torch.fx.graph._custom_builtins).
_EAGER_GRAPH_IMPORTS = [
    "from math import inf",
    "from math import nan",
    "NoneType = type(None)",
    "import torch",
    "from torch import device",
    "import torch.fx._pytree as fx_pytree",
    "import torch.utils._pytree as pytree",
]

# What the driver runs to build a sparse gradient (an nn.Embedding's backward).
_SPARSE_GRADIENTS_STUB = """\
def _sparse_gradients(piece0, piece1):
    sparse = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default(
        1, 1, [4, 4], piece0, piece1, dtype=torch.float32, layout=torch.sparse_coo,
        device=device(type="cpu"), pin_memory=None
    )
    return [sparse]
"""

_BINARY = "ab/c" + "0" * 51 + ".main.so"

_LEAF_SPEC = '{"type": null, "context": null, "children_spec": []}'
_FLAT_SPEC = f"[1, {_LEAF_SPEC}]"
# One positional input: a tuple holding one leaf.
_INPUT_SPEC = (
    f'[1, {{"type": "builtins.tuple", "context": "null", "children_spec": '
    f"[{_LEAF_SPEC}]}}]"
)


# A tensor, then a dict of two leaves: the all-features capture's inputs.
_NESTED_INPUT_SPEC = (
    f'[1, {{"type": "builtins.tuple", "context": "null", "children_spec": '
    f'[{_LEAF_SPEC}, {{"type": "builtins.dict", "context": "[\\"x\\", '
    f'\\"scale\\"]", "children_spec": [{_LEAF_SPEC}, {_LEAF_SPEC}]}}]}}]'
)


# The stub capture's graph inputs: a parameter, a buffer, a leaf and a literal.
_INPUT_NAMES = ["p_weight", "b_running_mean", "x", "literal0"]


def _positional_names(count: int) -> list[str]:
    return [f"arg{i}_1" for i in range(count)]


def stub_capture(backend: Backend) -> CaptureResult:
    """A capture whose every metadata list is non-empty, so each template branch that
    depends on the data is rendered and checked."""
    eager = backend == "eager"
    return CaptureResult(
        backend=backend,
        convention=CallConvention(
            fn_name="train_step",
            num_positional_args=2,
            argument_names=["model", "x"],
            modules=[ModuleArgument(position=0, training=[True], hooks={})],
            global_module_hooks={},
            params=[StateTensor("weight", (4, 4), "torch.float32", "cpu", True)],
            buffers=[StateTensor("running_mean", (4,), "torch.float32", "cpu", False)],
            in_tree=InputTree(_INPUT_SPEC, "(*,)", flat=True),
            leaves=[
                InputLeaf(
                    shape=(None, 4),
                    dtype="torch.float32",
                    device="cpu",
                    bounds={0: (1, 64)},
                    symbols={0: "u0"},
                    value=None,
                )
            ],
            input_names=_INPUT_NAMES,
            aliased_inputs=[{1: (0, (1,)), 2: (4, (4, 1))}],
            out_spec=_FLAT_SPEC,
            out_structure="*",
            grad_param_indices=[0],
            scalar_outputs=[0],
            python_values=[],
            optimizers=[],
            grad_resets=[(0, True)],
        ),
        graph=CompiledGraph(
            source=_GRAPH_STUBS[backend],
            tensor_literals=[
                TensorLiteral("literal0", [0.5, float("-inf")], "torch.float32", "cpu")
            ],
            input_strides=InputStrides([(4, 1)], [(1,)], [None], []),
            backend_graph=EagerGraph(_EAGER_GRAPH_IMPORTS, ["true_graph_0"])
            if eager
            else InductorGraph(
                rewritten_imports=_REWRITTEN_IMPORTS,
                positional_names=_positional_names(len(_INPUT_NAMES)),
                triton_kernels=["triton_poi_fused_0"],
                # Covers the graph section's note on AOTAutograd's `call`.
                redefined_call=True,
            ),
        ),
        payload=KernelPayload(
            kernel_binaries={_BINARY: "0" * 64}, kernel_sources={"1" * 64: _BINARY}
        ),
    )


def replace_backend_graph(graph: CompiledGraph, **changes: Any) -> CompiledGraph:
    """``graph`` with ``changes`` made to its backend's record, those of its fields
    it has (``positional_names`` changes an inductor graph only)."""
    made = graph.backend_graph
    fields = {field.name for field in dataclasses.fields(made)}
    kept = {name: value for name, value in changes.items() if name in fields}
    return dataclasses.replace(graph, backend_graph=dataclasses.replace(made, **kept))


def replace_convention(cap: CaptureResult, **changes: Any) -> CaptureResult:
    """``cap`` with ``changes`` made to its convention."""
    return dataclasses.replace(
        cap, convention=dataclasses.replace(cap.convention, **changes)
    )


# The all-features capture's graph inputs: the state, the three leaves, the
# optimizer's momentum buffer, lr and values, and the literal.
_ALL_FEATURES_INPUT_NAMES = [
    "p_m0_weight",
    "b_m0_running_mean",
    "x",
    "extras_x",
    "extras_scale",
    "opt_m0_weight_momentum_buffer",
    "opt_group0_lr",
    "opt_group0_values",
    "literal0",
]


def all_features_capture(backend: Backend) -> CaptureResult:
    """``stub_capture`` with every driver feature on (``render.DriverFeatures``):
    two module arguments, an optimizer, a nested input (an input leaf in a fixed
    layout and a scalar besides) too."""
    stub = stub_capture(backend)
    conv = stub.convention
    capture = replace_convention(
        dataclasses.replace(stub, graph=_all_features_graph(stub.graph)),
        num_positional_args=5,
        argument_names=["encoder", "x", "head", "extras", "opt"],
        python_values=[
            PythonValue("argument 0: .blocks.2.temperature", "2.0"),
            PythonValue("global SCALE (module __main__)", "1.0"),
        ],
        modules=[
            *conv.modules,
            ModuleArgument(
                position=2, training=[False], hooks={"": {"forward pre-hook": 1}}
            ),
        ],
        optimizers=[_all_features_optimizer()],
        params=[conv.params[0]._replace(name="m0.weight")],
        buffers=[conv.buffers[0]._replace(name="m0.running_mean")],
        leaves=[
            *conv.leaves,
            InputLeaf((2, 4), "torch.float32", "cpu", None, None, None),
            # A float the graph takes as a number, and also compared.
            InputLeaf(
                None, None, None, None, None, 0.5, True, "step.py:7 (if scale > 1:)"
            ),
        ],
        input_names=_ALL_FEATURES_INPUT_NAMES,
        in_tree=InputTree(
            _NESTED_INPUT_SPEC, "(*, {'x': *, 'scale': *})", holds_dicts=True
        ),
        pytree_types=["inspect:FullArgSpec"],
        mutated_inputs=[1, 3],
        sparse_gradients=SparseGradients(
            params=[0],
            positions=[0],
            num_pieces=2,
            source=format_python(_SPARSE_GRADIENTS_STUB),
        ),
        deferred_steps=[DeferredStep(position=4, name="SGD", params=[0])],
        index_checks=[
            IndexCheck(
                (1,),
                (("slice.Tensor", ({"leaf": 1}, 1, 0, -1), {}),),
                0,
                50,
                -100,
                "loss classes",
            )
        ],
        # A branch on a value whose other side returns before the step.
        value_branches=["step.py:9 (if not torch.isfinite(loss):): both sides"],
        skippable_step=True,
        step_resets=[(0, True)],
    )
    return _distributed(capture)


def _all_features_optimizer() -> OptimizerArgument:
    """The all-features capture's SGD: momentum, so it steps with state."""
    return OptimizerArgument(
        position=4,
        name="SGD",
        groups=[
            ParamGroup(
                [0],
                {"dampening": 0.1},
                ("torch.float32", "cpu"),
                values=[("momentum", None), ("weight_decay", None)],
                values_dtype="torch.float64",
                guards=[("momentum", None, "ne", 0.0, True)],
            )
        ],
        steps=True,
        state=[
            OptimizerStateTensor(0, "momentum_buffer", (4, 4), "torch.float32", "cpu"),
        ],
        first_state={},
    )


def _all_features_graph(graph: CompiledGraph) -> CompiledGraph:
    # AOTAutograd merged aliased inputs: Inductor's are not the graph's. The
    # strides: the state, the leaves (one in a fixed layout), the momentum buffer.
    return replace_backend_graph(
        dataclasses.replace(
            graph,
            input_strides=InputStrides(
                [(4, 1)], [(1,)], [None, (4, 1), None], [(4, 1)]
            ),
        ),
        positional_names=[],
    )


def _distributed(capture: CaptureResult) -> CaptureResult:
    """``capture`` with a process group, a DDP argument and DTensor inputs."""
    # The eager backend replays DTensor ops (``on_shards_capture``: unless traced on
    # the local shards); inductor computes on shards.
    distributed = replace_convention(
        capture,
        process_groups=[ProcessGroupRecord("0", "gloo", [0, 1])],
        data_parallel=[DataParallelArgument(0, "0", False, 25.0)],
        dtensors={
            0: DTensorLayout((2,), ("Shard(dim=0)",)),
            2: DTensorLayout((2,), ("Replicate()",)),
        },
    )
    if capture.backend == "eager":
        return distributed
    return _on_shards(distributed)


def _on_shards(capture: CaptureResult) -> CaptureResult:
    shards = LocalShards(
        {
            0: ShardInput(("0",), ("Shard(dim=0)",), (1, 4)),
            2: ShardInput(("0",), ("Replicate()",), (2, 4)),
        },
        {0: ShardOutput(("Partial(sum)",), (2, 4), (4, 1))},
    )
    graph = dataclasses.replace(capture.graph, local_shards=shards)
    return dataclasses.replace(capture, graph=graph)


def on_shards_capture(backend: Backend) -> CaptureResult:
    """``all_features_capture`` traced on the local shards, as a fully_shard model's
    step is on either backend."""
    return _on_shards(all_features_capture(backend))


def no_features_capture(backend: Backend) -> CaptureResult:
    """An inference capture with every driver feature off: one module, one plain
    tensor input, nothing shared, marked or laid out."""
    stub = stub_capture(backend)
    conv = stub.convention
    graph = replace_backend_graph(
        dataclasses.replace(
            stub.graph,
            tensor_literals=[],
            input_strides=InputStrides([None], [None], [None], []),
        ),
        branches=[],
        positional_names=_positional_names(3),
    )
    return replace_convention(
        dataclasses.replace(stub, graph=graph),
        params=[conv.params[0]._replace(requires_grad=False)],
        grad_param_indices=[],
        grad_resets=[],
        scalar_outputs=[],
        leaves=[conv.leaves[0]._replace(shape=(2, 4), bounds=None, symbols=None)],
        input_names=_INPUT_NAMES[:3],
        aliased_inputs=[],
    )


STUBS: dict[str, Callable[[Backend], CaptureResult]] = {
    "all_features": all_features_capture,
    "no_features": no_features_capture,
    "on_shards": on_shards_capture,
}


def write_stubs(out_dir: Path) -> list[Path]:
    """Write ``<backend>_<variant>.py`` for each backend and each of ``STUBS`` into
    ``out_dir``: between them, every branch of every template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for backend in BACKENDS:
        for variant, make in STUBS.items():
            path = out_dir / f"{backend}_{variant}.py"
            path.write_text(render_artifact(make(backend)), encoding="utf-8")
            written.append(path)
    return written
