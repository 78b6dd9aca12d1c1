"""What lowering reads from, and lays out in, Inductor's module: its kernels with
their ATen ops and sizes, its inputs' names, whether AOTAutograd redefines ``call``,
and long signature lines one name a line."""

from __future__ import annotations

import ast

import torch
from helpers.golden import FIXTURE_DIR
from torch import nn

import precompile_gen as pg
from precompile_gen.capture_result import KernelEntry
from precompile_gen.codegen import layout
from precompile_gen.lowering import inductor_module


def test_the_kernels_of_a_module_of_triton_kernels() -> None:
    source = (FIXTURE_DIR / "inductor_triton_adamw_step_graph.txt").read_text("utf-8")
    kernels = inductor_module.kernels(source)
    # Each once, though the module repeats them in its auto-tuning block.
    names = [kernel.name for kernel in kernels]
    assert len(names) == len(set(names)) == 8
    first = kernels[0]
    assert first.name == "triton_per_fused_gelu_native_layer_norm_0"
    assert first.aten_ops == ["aten.native_layer_norm", "aten.gelu"]
    # The definition, from its line to the line that closes its source.
    lines = source.splitlines()
    start = lines.index(f"{first.name} = async_compile.triton('{first.name}', '''")
    assert lines[start + first.lines - 1].startswith("'''")
    assert all(kernel.aten_ops for kernel in kernels)


def test_a_cpp_kernel_takes_the_ops_of_the_comment_on_its_call() -> None:
    source = "\n".join(
        [
            "cpp_fused_add_0 = async_compile.cpp_pybinding(['float*'], r'''",
            "void kernel(float* p) {}",
            "''')",
            "cpp_fused_mul_1 = async_compile.cpp_pybinding(['float*'], r'''",
            "''')",
            "def call(args):",
            "    # Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]",
            "    buf0 = empty((2,))",
            "    cpp_fused_add_0(buf0)",
            "    # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]",
            "    extern_kernels.mm(buf0, buf0)",
            "    cpp_fused_mul_1(buf0)",
        ]
    )
    # The second kernel's call follows an ATen call's comment, which is not its.
    assert inductor_module.kernels(source) == [
        KernelEntry("cpp_fused_add_0", ["aten.add"], 3),
        KernelEntry("cpp_fused_mul_1", [], 2),
    ]


def test_a_long_unpacking_of_the_inputs_is_one_name_a_line() -> None:
    names = [f"arg{i}_1" for i in range(40)]
    source = f"    def call(self, args):\n        {', '.join(names)} = args\n"
    wrapped = inductor_module.unpacked_one_per_line(source)
    assert wrapped.splitlines()[1:] == [
        "        (",
        *(f"            {name}," for name in names),
        "        ) = args",
    ]
    assert ast.parse("class A:\n" + wrapped)
    short = "    def call(self, args):\n        arg0_1, arg1_1 = args\n"
    assert inductor_module.unpacked_one_per_line(short) == short


def test_a_long_eager_graph_signature_is_one_parameter_a_line() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)])
    cap = pg.capture(lambda m, x: m(x), model, torch.randn(1, 2), backend="eager")
    lines = cap.graph.source.splitlines()
    assert lines[0] == "def _graph_forward("
    assert lines[1:4] == ["    self,", "    p_0_weight,", "    p_0_bias,"]
    assert max(map(len, lines[: lines.index("):")])) <= layout.LINE_LENGTH
    namespace: dict[str, object] = {}
    exec(pg.render_artifact(cap), namespace)
    forward = namespace["forward"]
    assert callable(forward)
    x = torch.randn(1, 2)
    torch.testing.assert_close(forward(model, x), model(x))


def test_the_inputs_names_and_the_redefined_call_are_read_from_the_module() -> None:
    source = (FIXTURE_DIR / "inductor_mlp_graph.txt").read_text("utf-8")
    assert inductor_module.unpacked_inputs(source) == [f"arg{i}_1" for i in range(5)]
    # AOTAutograd's code binds Inductor's call as _inner_call and defines the call
    # the driver runs; Inductor's module alone does not.
    assert inductor_module.redefines_call(source)
    inner = source[: source.index("_inner_call = call")]
    assert not inductor_module.redefines_call(inner)
    assert inductor_module.unpacked_inputs("def call(args):\n    pass\n") == []


def test_the_inputs_whose_layout_the_module_asserts_are_read_from_it() -> None:
    # A training step with AdamW inside: single and grouped asserts, over every input.
    source = (FIXTURE_DIR / "inductor_triton_adamw_step_graph.txt").read_text("utf-8")
    asserted = inductor_module.asserted_inputs(source)
    assert {"arg7_1", "arg1_1", "arg6_1", "arg0_1", "arg26_1", "arg8_1"} <= asserted
    assert asserted == set(inductor_module.unpacked_inputs(source))
    # An inference MLP: two grouped asserts.
    mlp = (FIXTURE_DIR / "inductor_mlp_graph.txt").read_text("utf-8")
    assert inductor_module.asserted_inputs(mlp) == {f"arg{i}_1" for i in range(5)}
    assert inductor_module.asserted_inputs("def call(args):\n    pass\n") == set()


def test_a_kernels_file_is_named_within_the_cache_folder() -> None:
    # As Inductor writes it above each Triton kernel: the folder is the capturing
    # machine's, the two parts after it the kernel's own.
    source = (
        "import torch\n"
        "# kernel path: /home/ada/.cache/inductor/os/"
        "cosvydfpoiemcm7wlbzxkd3765r37ozbekfep7kokjyl3liguuec.py\n"
        "# Topologically Sorted Source Nodes: [gelu], Original ATen: [aten.gelu]\n"
        "x = '# kernel path: /home/ada/elsewhere.py'\n"
    )
    assert inductor_module.without_cache_folder(source) == (
        "import torch\n"
        "# kernel path: $TORCHINDUCTOR_CACHE_DIR/os/"
        "cosvydfpoiemcm7wlbzxkd3765r37ozbekfep7kokjyl3liguuec.py\n"
        "# Topologically Sorted Source Nodes: [gelu], Original ATen: [aten.gelu]\n"
        "x = '# kernel path: /home/ada/elsewhere.py'\n"
    )
