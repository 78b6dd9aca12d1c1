"""How a capture's C++ kernels are built: to the same bytes wherever Inductor's cache
folder is.

Inductor writes each kernel's source into its cache folder and has the compiler
build it there, and two things carried the folder's path into the binary, so that
the same capture in another folder gave other binaries, other pins in the artifact
and another cache:

- line tables (``-g1``), which hold the paths of the source and of its build folder;
  the binaries are built without them (``aot_inductor.enable_line_tables``);
- ``__FILE__``, which a kernel's value checks (``TORCH_CHECK`` on an index's bounds)
  and torch's headers write into their error messages: it is made the file's name
  alone (``__FILE_NAME__``), where the compiler has that macro (gcc 12, clang 9),
  which also keeps torch's install path out of it.

Lowering compiles under ``reproducible()``, and so does the kernel scan, which
finds each binary by the key Inductor computes from the same flags.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
from collections.abc import Callable, Generator
from typing import Any
from unittest import mock

# Under the flags below, __FILE__ names the file alone; the compiler warns, without
# the first, that a builtin macro is redefined.
_FILE_NAME_FLAGS = ["Wno-builtin-macro-redefined", "D__FILE__=__FILE_NAME__"]


@contextlib.contextmanager
def reproducible() -> Generator[None]:
    """Inductor's C++ kernels, while the block runs, built as the module docstring
    says."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder

    flags = _FILE_NAME_FLAGS if _names_files(cpp_builder.get_cpp_compiler()) else []
    optimization_cflags = cpp_builder._get_optimization_cflags
    with (
        inductor_config.patch({"aot_inductor.enable_line_tables": False}),
        mock.patch.object(
            cpp_builder,
            "_get_optimization_cflags",
            _with_flags(optimization_cflags, flags),
        ),
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
