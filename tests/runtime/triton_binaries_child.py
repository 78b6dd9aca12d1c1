"""Triton's compiler, for a GPU this machine need not have: records the payload a
capture on an H100 (sm_90) carries for one kernel, or compiles that kernel again and
says whether Triton found it in its cache.

    python triton_binaries_child.py record PAYLOAD   # torch.save's the payload there
    python triton_binaries_child.py record PAYLOAD launcher
                                    # the same, from a launcher that keeps no source
    python triton_binaries_child.py compile          # prints {"hash", "cache_hit"}

Triton compiles for an explicit target without a driver (LLVM and its bundled ptxas
run here); only loading and launching the cubin need the GPU. Both commands use the
kernel folders the environment names (TRITON_CACHE_DIR, or TORCHINDUCTOR_CACHE_DIR),
as a capturing or loading process does, and the kernel's source is a file in
Inductor's cache folder, as Inductor writes each Triton kernel.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from precompile_gen.lowering import kernel_builds
from precompile_gen.runtime import kernel_binaries

NAME = "add_one"
TARGET = GPUTarget("cuda", 90, 32)


SOURCE = """
import triton
import triton.language as tl


@triton.jit
def add_one(in_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(in_ptr + offsets, mask=mask) + 1.0, mask=mask)
"""


def kernel_module() -> ModuleType:
    """The kernel, imported from its file in Inductor's cache folder."""
    path = Path(kernel_binaries.kernel_folder()) / "ad" / f"{NAME}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SOURCE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled() -> triton.compiler.CompiledKernel:
    source = ASTSource(
        kernel_module().add_one,
        signature={
            "in_ptr": "*fp32",
            "out_ptr": "*fp32",
            "n": "i32",
            "BLOCK": "constexpr",
        },
        constexprs={"BLOCK": 128},
    )
    return triton.compile(source, target=TARGET)


def record(path: str, launcher: bool) -> None:
    # What Inductor's module binds a Triton kernel to, as far as the scan reads it:
    # a CachingAutotuner with its device and one compiled configuration, whose
    # kernel is Triton's, or Inductor's static launcher, which keeps its hash and
    # binary but not its source. A capture compiles under reproducible().
    with kernel_builds.reproducible():
        kernel = compiled()
        if launcher:
            kernel = SimpleNamespace(hash=kernel.hash)
        autotuner = SimpleNamespace(triton_meta={"device": 0}, compile_results=[])
        autotuner.compile_results.append(SimpleNamespace(kernel=kernel))
        files = kernel_binaries.triton_files([autotuner])
    toolchain = kernel_builds.triton_toolchain(files)
    torch.save(kernel_binaries.make_payload(files, [NAME], toolchain), path)


def compile_again() -> None:
    hits: list[bool] = []

    def listener(**report: object) -> None:
        hits.append(bool(report["cache_hit"]))

    knobs.compilation.listener = listener
    # Where Inductor points Triton when TRITON_CACHE_DIR is not set.
    knobs.cache.dir = kernel_binaries.triton_folder("0")
    kernel = compiled()
    print(json.dumps({"hash": kernel.hash, "cache_hit": hits == [True]}))


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], launcher=sys.argv[3:] == ["launcher"])
    else:
        compile_again()
