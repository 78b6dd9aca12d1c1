"""The rewrite of Inductor's imports: only import lines above the first kernel change,
each in one of the documented ways, and anything the rewrite cannot stand in for
keeps its import."""

from __future__ import annotations

import textwrap

import pytest
import torch

import precompile_gen as pg
from precompile_gen.lowering import inductor_imports

# As Inductor writes it with config.triton.autotune_at_compile_time: code in a string.
_AUTOTUNING_BLOCK = (
    'r"""\n'
    "Compile-time auto-tuning block: \n"
    "from torch._inductor.async_compile import AsyncCompile\n"
    "async_compile = AsyncCompile()\n"
    '"""\n'
)
_MODULE = (
    "import torch\n"
    + _AUTOTUNING_BLOCK
    + textwrap.dedent(
        """\
    from torch._inductor.hooks import run_intermediate_hooks
    from torch._inductor.runtime.runtime_utils import assert_tensor_metadata
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.select_algorithm import extern_kernels
    from torch._inductor.utils import maybe_profile

    async_compile = AsyncCompile()


    def call(args):
        buf = extern_kernels.mm(args[0], args[1])
        assert_tensor_metadata(buf, (2, 2), (2, 1), torch.float32)
        return maybe_profile(False)
    """
    )
)


def test_each_import_is_rewritten_as_documented() -> None:
    source, rewrites = inductor_imports.rewrite(_MODULE, {"mm": torch.mm})
    # Each with the stand-in the graph section defines for it.
    assert rewrites == [
        (inductor_imports.AUTOTUNING_BLOCK, "", ""),
        ("from torch._inductor.hooks import run_intermediate_hooks", "", ""),
        (
            "from torch._inductor.runtime.runtime_utils import assert_tensor_metadata",
            "assert_tensor_metadata = _assert_tensor_metadata",
            "_assert_tensor_metadata",
        ),
        (
            "from torch._inductor.async_compile import AsyncCompile",
            "AsyncCompile = _AsyncCompile",
            "_AsyncCompile",
        ),
        (
            "from torch._inductor.select_algorithm import extern_kernels",
            "extern_kernels = SimpleNamespace(mm=torch.mm)",
            "SimpleNamespace",
        ),
    ]
    # maybe_profile is used below, so its import stays; the auto-tuning block, a
    # string nothing reads, is dropped; nothing else changes.
    assert "from torch._inductor.utils import maybe_profile\n" in source
    assert "auto-tuning" not in source
    assert "from torch._inductor.async_compile import AsyncCompile" not in source
    rebuilt = _MODULE.replace(_AUTOTUNING_BLOCK, "")
    for original, replacement, _ in rewrites[1:]:
        index = rebuilt.rindex(original + "\n")
        new = replacement + "\n" if replacement else ""
        rebuilt = rebuilt[:index] + new + rebuilt[index + len(original) + 1 :]
    assert source == rebuilt


@pytest.mark.parametrize(
    ("kernel", "expression"),
    [
        (torch.addmm, "torch.addmm"),
        (torch.ops.aten.mm, "torch.ops.aten.mm"),
        (torch.ops.aten.mm.default, "torch.ops.aten.mm.default"),
    ],
)
def test_extern_kernels_are_named_as_torch_names_them(
    kernel: object, expression: str
) -> None:
    _, rewrites = inductor_imports.rewrite(_MODULE, {"mm": kernel})
    assert (
        "from torch._inductor.select_algorithm import extern_kernels",
        f"extern_kernels = SimpleNamespace(mm={expression})",
        "SimpleNamespace",
    ) in rewrites


def test_an_extern_kernel_that_is_not_torchs_keeps_the_import() -> None:
    def tuned_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    source, rewrites = inductor_imports.rewrite(_MODULE, {"mm": tuned_mm})
    assert "from torch._inductor.select_algorithm import extern_kernels\n" in source
    assert all("extern_kernels" not in rewrite.original for rewrite in rewrites)


def test_a_module_without_kernels_is_left_alone() -> None:
    module = "from torch._inductor.utils import maybe_profile\n\ndef call(args):\n"
    assert inductor_imports.rewrite(module, {}) == (module, [])


def test_the_stand_in_for_assert_tensor_metadata_checks_as_inductors_does() -> None:
    from helpers.stubs import stub_capture
    from torch._inductor.runtime.runtime_utils import assert_tensor_metadata

    namespace: dict[str, object] = {}
    exec(pg.render_artifact(stub_capture("inductor")), namespace)
    stand_in = namespace["_assert_tensor_metadata"]
    assert callable(stand_in)
    tensor = torch.zeros(2, 3)
    for check in (assert_tensor_metadata, stand_in):
        check(tensor, (2, 3), (3, 1), torch.float32, "op")  # passes
        check(None, (2, 3), (3, 1), torch.float32, "op")
        for size, stride, dtype in [
            ((2, 3), (3, 1), torch.float64),
            ((3, 2), (3, 1), torch.float32),
            ((2, 3), (1, 2), torch.float32),
        ]:
            with pytest.raises((AssertionError, RuntimeError)):
                check(tensor, size, stride, dtype, "op")
