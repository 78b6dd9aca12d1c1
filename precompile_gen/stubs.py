"""Stub rendering: every template rendered into an ordinary, type-checkable module.

The driver lives in templates, out of reach of a type checker. Rendering each backend's
artifact with typed placeholder metadata and a typed stand-in for the compiled graph
gives ``.py`` files that ``pyrefly check`` covers like any other code.
"""

from __future__ import annotations

from pathlib import Path

from precompile_gen.capture_result import Backend, CaptureResult, TensorLiteral
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
        module_positions=[0],
        num_positional_args=2,
        module_training=[[True]],
        param_names=["weight"],
        buffer_names=["running_mean"],
        param_shapes=[(4, 4)],
        buffer_shapes=[(4,)],
        param_strides=[(4, 1)],
        buffer_strides=[(1,)],
        param_dtypes=["torch.float32"],
        buffer_dtypes=["torch.float32"],
        param_devices=["cpu"],
        buffer_devices=["cpu"],
        param_requires_grad=[True],
        buffer_requires_grad=[False],
        grad_param_indices=[0],
        grad_resets=[(0, True)],
        in_spec=_INPUT_SPEC,
        out_spec=_FLAT_SPEC,
        user_input_shapes=[(None, 4)],
        user_input_dtypes=["torch.float32"],
        user_input_devices=["cpu"],
        user_input_bounds=[{0: (1, 64)}],
        user_input_strides=[None],
        user_input_symbols=[{0: "u0"}],
        user_input_values=[None],
        aliased_inputs=[{1: (0, (1,)), 2: (4, (4, 1))}],
        graph_source=_GRAPH_STUBS[backend],
        tensor_literals=[
            TensorLiteral("literal0", [0.5, float("-inf")], "torch.float32", "cpu")
        ],
        graph_imports=_EAGER_GRAPH_IMPORTS if eager else [],
        graph_in_spec=_FLAT_SPEC if eager else None,
        graph_out_spec=_FLAT_SPEC if eager else None,
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
