"""Stub rendering: every template rendered into an ordinary, type-checkable module.

The driver lives in templates, out of reach of a type checker. Rendering each backend's
artifact with typed placeholder metadata and a typed stand-in for the compiled graph
gives ``.py`` files that ``pyrefly check`` covers like any other code.
"""

from __future__ import annotations

from pathlib import Path

from precompile_gen.capture_result import (
    Backend,
    CaptureResult,
    CompiledGraph,
    InputLeaf,
    ModuleArgument,
    StateTensor,
    TensorLiteral,
)
from precompile_gen.render import render_artifact

# Typed stand-ins for the spliced graph, which is the only part not from a template.
_GRAPH_STUBS: dict[Backend, str] = {
    "eager": (
        "def _graph_forward(self: object, flat: list[object]) -> list[object]:\n"
        "    return list(flat)\n"
    ),
    "inductor": (
        "def call(flat_inputs: list[object]) -> list[object]:\n"
        "    return list(flat_inputs)\n"
    ),
}

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

_LEAF_SPEC = '{"type": null, "context": null, "children_spec": []}'
_FLAT_SPEC = f"[1, {_LEAF_SPEC}]"
# One positional input: a tuple holding one leaf.
_INPUT_SPEC = (
    f'[1, {{"type": "builtins.tuple", "context": "null", "children_spec": '
    f"[{_LEAF_SPEC}]}}]"
)


def stub_capture(backend: Backend) -> CaptureResult:
    """A capture whose every metadata list is non-empty, so each template branch that
    depends on the data is rendered and checked."""
    eager = backend == "eager"
    return CaptureResult(
        backend=backend,
        fn_name="train_step",
        num_positional_args=2,
        modules=[ModuleArgument(position=0, training=[True])],
        params=[
            StateTensor("weight", (4, 4), (4, 1), "torch.float32", "cpu", True),
        ],
        buffers=[
            StateTensor("running_mean", (4,), (1,), "torch.float32", "cpu", False),
        ],
        grad_param_indices=[0],
        grad_resets=[(0, True)],
        in_spec=_INPUT_SPEC,
        out_spec=_FLAT_SPEC,
        leaves=[
            InputLeaf(
                shape=(None, 4),
                dtype="torch.float32",
                device="cpu",
                bounds={0: (1, 64)},
                symbols={0: "u0"},
                stride=None,
                value=None,
            )
        ],
        aliased_inputs=[{1: (0, (1,)), 2: (4, (4, 1))}],
        graph=CompiledGraph(
            source=_GRAPH_STUBS[backend],
            tensor_literals=[
                TensorLiteral("literal0", [0.5, float("-inf")], "torch.float32", "cpu")
            ],
            imports=_EAGER_GRAPH_IMPORTS if eager else [],
            in_spec=_FLAT_SPEC if eager else None,
            out_spec=_FLAT_SPEC if eager else None,
        ),
        kernel_binaries={"ab/c" + "0" * 51 + ".main.so": "0" * 64},
        cache_artifact=None,
    )


def write_stubs(out_dir: Path) -> list[Path]:
    """Write ``<backend>_artifact.py`` for each backend into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for backend in ("eager", "inductor"):
        path = out_dir / f"{backend}_artifact.py"
        path.write_text(render_artifact(stub_capture(backend)), encoding="utf-8")
        written.append(path)
    return written
