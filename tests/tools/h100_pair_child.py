"""The pair a capture of the Triton training step on an H100 (sm_90) writes, made
without one: the golden Triton artifact's kernels, moved to the H100, compiled by
Inductor's own compile worker in a worker process (as its compile pool does on a
GPU machine), and carried and pinned by the capture's own functions.

    python h100_pair_child.py FOLDER   # writes FOLDER/step.py and FOLDER/step.cache

Triton compiles for an explicit target without a driver (LLVM and its bundled
ptxas run here); only loading and launching the cubins need the GPU, so the pair is
for ``verify`` and ``verify --rebuild``, not for ``load``. The kernels' folders are
the ones the environment names (TRITON_CACHE_DIR, or TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import functools
import multiprocessing
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from torch._inductor.codecache import _load_triton_kernel_from_source
from torch._inductor.runtime.compile_tasks import _worker_compile_triton

from precompile_gen.lowering import kernel_builds
from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.cache import build_cache
from precompile_gen.runtime.load import parse_artifact
from precompile_gen.tools.inspection import find_kernels

GOLDEN = Path(__file__).parents[1] / "golden" / "inductor_triton_train_step.py"
# What Inductor writes into a kernel's source for an H100.
H100 = (
    "DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, "
    "major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, "
    "max_threads_per_block=1024, warp_size=32)"
)
_CPU = re.compile(r"DeviceProperties\(type='cpu'[^)]*\)")


def on_h100(python_code: str) -> str:
    """The artifact's kernels as Inductor writes them for an H100."""
    python_code = _CPU.sub(H100, python_code)
    python_code = python_code.replace("set_driver_to_cpu()", "set_driver_to_gpu()")
    return python_code.replace("device_str='cpu'", "device_str='cuda'")


def compiled(kernels: dict[str, str]) -> dict[str, object]:
    """Each kernel compiled as Inductor's compile pool compiles it: in a worker
    process, and sent back to this one."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        futures = {
            name: pool.submit(
                _worker_compile_triton,
                functools.partial(_load_triton_kernel_from_source, name, source),
                {},
                {},
            )
            for name, source in kernels.items()
        }
        return {name: future.result()[0] for name, future in futures.items()}


def write_pair(folder: Path) -> None:
    python_code = on_h100(GOLDEN.read_text(encoding="utf-8"))
    kernels = {
        kernel.name: kernel.source
        for kernel in find_kernels(parse_artifact(python_code).body)
        if kernel.kind == "triton"
    }
    built = compiled(kernels)
    # What the capture's kernel scan does with them (kernel_binaries.collect).
    with kernel_builds.reproducible():
        kernel_builds.record_triton_sources(
            {name: (built[name], source) for name, source in kernels.items()}
        )
        files = kernel_binaries.triton_files(built.values())
    toolchain = {**kernel_builds.toolchain(), **kernel_builds.triton_toolchain(files)}
    payload = kernel_binaries.make_payload(files, list(kernels), toolchain)
    pins = "KERNEL_BINARIES: dict[str, str] = {}"
    assert python_code.count(pins) == 1
    python_code = python_code.replace(
        pins, f"KERNEL_BINARIES: dict[str, str] = {payload['sha256']!r}"
    )
    (folder / "step.py").write_text(python_code, encoding="utf-8")
    (folder / "step.cache").write_bytes(build_cache(python_code, "inductor", payload))


if __name__ == "__main__":
    write_pair(Path(sys.argv[1]))
