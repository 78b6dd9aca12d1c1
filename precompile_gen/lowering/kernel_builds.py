"""How a capture's kernels are built: to the same bytes wherever Inductor's cache
folder is, and wherever torch is installed.

Inductor writes each kernel's source into its cache folder and has the compiler
build it there, and three things carried a folder's path into the binary, so that
the same capture in another folder gave other binaries, other pins in the artifact
and another cache:

- line tables (``-g1``), which hold the paths of the source and of its build folder;
  the binaries are built without them (``aot_inductor.enable_line_tables``);
- ``__FILE__``, which a kernel's value checks (``TORCH_CHECK`` on an index's bounds)
  and torch's headers write into their error messages: it is made the file's name
  alone (``__FILE_NAME__``), where the compiler has that macro (gcc 12, clang 9),
  which also keeps torch's install path out of it;
- the file's name, which the compiler writes into the binary (its static
  initialiser's symbol): Inductor names each source by a key over its text and the
  compiler's command line, which holds torch's and Python's install paths. Under
  ``reproducible()`` the key is computed over the command line with those paths
  named instead (``$TORCH``, ``$PYTHON``) and torch's version added, so that the
  same torch installed in another folder builds the same files, while another
  torch sharing the cache folder still misses.

Lowering compiles under ``reproducible()``, and so does the kernel scan, which
finds each binary by the key Inductor computes from the same flags.

Triton's kernels for a GPU carry line tables that name the kernel's source file, in
Inductor's cache folder, in every form Triton keeps (the cubin included). The scan
builds each again without them (``triton_without_line_info``), from the source
Triton was given: Inductor's launcher keeps only the binary, so ``reproducible()``
records each kernel's source as Triton compiles it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Generator
from typing import Any
from unittest import mock

# Under the flags below, __FILE__ names the file alone; the compiler warns, without
# the first, that a builtin macro is redefined.
_FILE_NAME_FLAGS = ["Wno-builtin-macro-redefined", "D__FILE__=__FILE_NAME__"]


@contextlib.contextmanager
def reproducible() -> Generator[None]:
    """Inductor's C++ kernels, while the block runs, built as the module docstring
    says, and each Triton kernel's source recorded as Triton compiles it."""
    from torch._inductor import codecache, cpp_builder
    from torch._inductor import config as inductor_config

    flags = _FILE_NAME_FLAGS if _names_files(cpp_builder.get_cpp_compiler()) else []
    optimization_cflags = cpp_builder._get_optimization_cflags
    with (
        inductor_config.patch({"aot_inductor.enable_line_tables": False}),
        mock.patch.object(
            cpp_builder,
            "_get_optimization_cflags",
            _with_flags(optimization_cflags, flags),
        ),
        mock.patch.object(codecache, "write", _keyed_without_paths(codecache.write)),
        _triton_sources_recorded(),
    ):
        yield


def _with_flags(
    cflags: Callable[..., tuple[list[str], list[str]]], extra: list[str]
) -> Callable[..., tuple[list[str], list[str]]]:
    # Inductor's own optimisation flags, then ``extra``: part of the command line
    # Inductor keys each binary on.
    def with_flags(*args: Any, **kwargs: Any) -> tuple[list[str], list[str]]:
        compile_flags, link_flags = cflags(*args, **kwargs)
        return [*compile_flags, *extra], link_flags

    return with_flags


# The sources Inductor keys on its compiler's command line.
_KEYED_ON_COMMAND_LINE = frozenset({"main.cpp", "optimized.cpp"})


def _keyed_without_paths(
    write: Callable[..., tuple[str, str]],
) -> Callable[..., tuple[str, str]]:
    # ``write(content, extension, extra)`` names the file by a key over content and
    # extra; for C++ sources, extra is the command line.
    def keyed_write(
        content: Any, extension: str, extra: str = "", *args: Any, **kwargs: Any
    ) -> tuple[str, str]:
        if extension in _KEYED_ON_COMMAND_LINE:
            extra = _install_paths_named(extra)
        return write(content, extension, extra, *args, **kwargs)

    return keyed_write


def _install_paths_named(command_line: str) -> str:
    """``command_line`` with torch's and Python's install folders named, and torch's
    version added: what a kernel's file name is keyed on."""
    import torch

    for folder, name in _install_folders():
        command_line = command_line.replace(folder, name)
    return f"{command_line} torch=={torch.__version__} ({torch.version.git_version})"


@functools.cache
def _install_folders() -> tuple[tuple[str, str], ...]:
    import torch

    folders = {os.path.dirname(os.path.abspath(torch.__file__)): "$TORCH"}
    # Python's headers and library lie under its prefixes.
    for prefix in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix):
        folders.setdefault(prefix, "$PYTHON")
    # The longest first: torch's folder lies inside Python's.
    return tuple(sorted(folders.items(), key=lambda item: -len(item[0])))


@functools.cache
def _names_files(compiler: str) -> bool:
    """Whether ``compiler`` has the ``__FILE_NAME__`` macro, asked once."""
    try:
        done = subprocess.run(
            [compiler, "-E", "-P", "-x", "c++", "-"],
            input="__FILE_NAME__\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and "__FILE_NAME__" not in done.stdout


def toolchain() -> dict[str, str]:
    """What built the C++ kernels, for the cache to record and ``verify --rebuild`` to
    compare: the compiler and its version, the flags this module adds, the vector
    instruction set Inductor compiles for, and Triton's version where it is
    installed."""
    from torch._inductor import cpp_builder
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    compiler = cpp_builder.get_cpp_compiler()
    flags = _FILE_NAME_FLAGS if _names_files(compiler) else []
    return {
        "compiler": compiler,
        "compiler_version": _version(compiler),
        "line_tables": "off",
        "flags": " ".join(f"-{flag}" for flag in flags) or "none",
        "vec_isa": str(pick_vec_isa()) or "none",
        "triton": _triton_version(),
    }


@functools.cache
def _version(compiler: str) -> str:
    try:
        done = subprocess.run(
            [compiler, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({type(error).__name__})"
    return (done.stdout.splitlines() or ["unknown"])[0].strip()


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


# Triton's cache key holds the settings that change what it builds; this one changes
# only the line tables, and a loading process does not set it.
_LINE_INFO_SETTING = "TRITON_DISABLE_LINE_INFO"


# Each Triton kernel compiled under ``reproducible()`` in this process, by its hash:
# the source Triton was given and the metadata it wrote.
_TRITON_SOURCES: dict[str, tuple[Any, dict[str, Any]]] = {}


@contextlib.contextmanager
def _triton_sources_recorded() -> Generator[None]:
    try:
        from triton import knobs
    except ImportError:
        yield
        return
    previous = knobs.compilation.listener

    def listener(*, src: Any, metadata: dict[str, Any], **report: Any) -> None:
        _TRITON_SOURCES[str(metadata["hash"])] = (src, metadata)
        if previous is not None:
            previous(src=src, metadata=metadata, **report)

    knobs.compilation.listener = listener
    try:
        yield
    finally:
        knobs.compilation.listener = previous


def triton_without_line_info(compiled: Any) -> dict[str, bytes] | None:
    """The files of Triton's cache folder for ``compiled`` (a ``CompiledKernel``, or
    the launcher Inductor keeps in its place), built again from its source for its
    target and options without line tables, and keyed as ``compiled`` is: the
    metadata names ``compiled``'s hash and not the setting, which is what Triton
    writes for a build with line tables. None where neither the kernel nor the
    record holds its source."""
    import triton
    from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key
    from triton import knobs

    from precompile_gen.runtime.kernel_binaries import folder_files

    if compiled.hash in _TRITON_SOURCES:
        source, written_metadata = _TRITON_SOURCES[compiled.hash]
    elif hasattr(compiled, "src") and hasattr(compiled, "metadata"):
        source, written_metadata = compiled.src, compiled.metadata._asdict()
    else:
        return None
    # The options as Triton parsed them, which its metadata holds as JSON lists.
    metadata = {name: _tuples(value) for name, value in written_metadata.items()}
    with (
        tempfile.TemporaryDirectory() as scratch,
        knobs.cache.scope(),
        knobs.compilation.scope(),
    ):
        knobs.cache.dir = scratch
        knobs.compilation.disable_line_info = True
        again = triton.compile(source, target=metadata["target"], options=metadata)
        files = folder_files(os.path.join(scratch, triton_hash_to_path_key(again.hash)))
    for name, data in files.items():
        if name.endswith(".json") and not name.startswith("__grp__"):
            written = json.loads(data)
            written["hash"] = compiled.hash
            written.pop(_LINE_INFO_SETTING, None)
            files[name] = json.dumps(written).encode()
    return files


def build_triton_kernel(name: str, source: str) -> Any:
    """Kernel ``name`` of Inductor's module, built from its ``source`` as Inductor's
    compile workers build it: each configuration it may pick from, compiled for the
    GPU target its source names (only loading and launching a kernel need that GPU).
    Inductor's ``CachingAutotuner``, holding the compiled configurations."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    from torch._inductor.runtime.triton_helpers import skip_gpu_driver_setup

    _set_triton_ptxas_path()  # the assembler Inductor gives Triton, where torch has one
    with skip_gpu_driver_setup():
        kernel = getattr(PyCodeCache.load(source), name)
        kernel.precompile(warm_cache_only=True)
    return kernel


def record_triton_sources(kernels: dict[str, tuple[Any, str]]) -> None:
    """Record, for ``triton_without_line_info``, the sources of the compiled
    configurations of ``kernels`` (name -> Inductor's autotuner and its module's
    source) that Triton compiled in another process, as Inductor's compile workers
    do: each such kernel is built again here, in a scratch folder."""
    from triton import knobs

    for name, (kernel, source) in kernels.items():
        results = getattr(kernel, "compile_results", ())
        if all(result.kernel.hash in _TRITON_SOURCES for result in results):
            continue
        with tempfile.TemporaryDirectory() as scratch, knobs.cache.scope():
            knobs.cache.dir = scratch
            build_triton_kernel(name, source)


def triton_toolchain(files: dict[str, bytes]) -> dict[str, str]:
    """What built the Triton kernels among ``files`` (by payload name), as their
    metadata records it: the targets, and for NVIDIA's the assembler's release.
    Empty where there are none."""
    targets = set()
    for name, data in files.items():
        if name.startswith("triton/") and name.endswith(".json"):
            target = json.loads(data).get("target")
            if isinstance(target, dict):  # a kernel's metadata, not its group's
                targets.add(f"{target.get('backend')} {target.get('arch')}")
    if not targets:
        return {}
    built = {"triton_target": ", ".join(sorted(targets))}
    if any(target.startswith("cuda ") for target in targets):
        built["ptxas"] = _ptxas_release()
    return built


@functools.cache
def _ptxas_release() -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version

        text = get_ptxas_version()
    except Exception as error:  # no assembler here: the rebuild says so
        return f"unknown ({type(error).__name__})"
    lines = [line for line in text.splitlines() if "release" in line]
    return (lines or ["unknown"])[-1].strip()


def _tuples(value: object) -> object:
    if isinstance(value, list | tuple):
        return tuple(_tuples(item) for item in value)
    return value
