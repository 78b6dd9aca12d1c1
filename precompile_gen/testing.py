"""Running Inductor's Triton kernels on a machine without a GPU.

Inductor writes Triton kernels for CUDA tensors; for CPU tensors it writes C++ unless
told otherwise. :func:`triton_interpreter` tells it otherwise, and runs the Triton
kernels it writes through Triton's interpreter (``TRITON_INTERPRET=1``), which
executes them with NumPy. That is slow, but it shows, and tests, the artifact a GPU
capture makes on any machine::

    from precompile_gen.testing import triton_interpreter

    with triton_interpreter():
        python_code, cache = precompile_gen.precompile(fn, model, x)
    # section 1 of python_code holds @triton.jit kernels

    with triton_interpreter():          # in the process that loads it, too
        forward = precompile_gen.load(python_code, cache)
        out = forward(model, x)

Nothing here is imported by loading (``precompile_gen.runtime``) or by an artifact:
an artifact's Triton kernels run as they are on a GPU; this module only sets up a
process to run them without one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import Any

from precompile_gen.runtime.errors import PrecompileError

# Inductor's kernels import their math as ``libdevice`` from here (rsqrt, erf, pow).
_HELPERS = "torch._inductor.runtime.triton_helpers"
# Each kernel's source calls set_driver_to_cpu(), which warns that no CPU backend of
# Triton is installed: under the interpreter none is needed.
_NO_CPU_BACKEND = "Could not find an active CPU backend"


@contextlib.contextmanager
def triton_interpreter() -> Generator[None]:
    """Inside it, Inductor compiles CPU tensors' graphs to Triton kernels, and Triton
    runs its kernels through its interpreter.

    It sets, and restores on exit: ``TRITON_INTERPRET=1``; Inductor's
    ``cpu_backend = "triton"`` (and one compile thread, so that kernels compile in
    this process, under this environment); the two questions torch asks Triton's
    active GPU driver about its target, answered for the interpreter; and the math
    library Inductor's kernels call (``libdevice``), for the interpreter's.

    Triton reads ``TRITON_INTERPRET`` when it is imported: enter this before
    anything imports it (Dynamo, Inductor, creating an optimizer), or set the
    variable before Python starts; otherwise this raises PrecompileError saying so.
    Triton functions made inside stay interpreted after it exits.
    """
    global _entered
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environment("TRITON_INTERPRET", "1"))
        _check_interpreter_on()
        from torch._inductor import config as inductor_config

        stack.enter_context(
            inductor_config.patch(cpu_backend="triton", compile_threads=1)
        )
        stack.enter_context(_triton_target())
        stack.enter_context(_interpreter_libdevice())
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=_NO_CPU_BACKEND)
        _entered += 1
        try:
            yield
        finally:
            _entered -= 1


# How many triton_interpreter() blocks are open (they nest).
_entered = 0


def interpreting() -> bool:
    """Whether this process runs Triton kernels through the interpreter as
    :func:`triton_interpreter` sets it up: ``load`` refuses a pair made so
    elsewhere, whose kernels nothing else runs."""
    return _entered > 0


@contextlib.contextmanager
def _environment(name: str, value: str) -> Generator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _check_interpreter_on() -> None:
    """Triton decides at ``@triton.jit`` whether a function is interpreted, and its
    own library (``tl.sum``, ``tl.sigmoid``) is decorated when ``triton.language``
    is imported: imported without ``TRITON_INTERPRET=1``, those stay compiled
    functions, which an interpreted kernel cannot call."""
    if "triton.language" not in sys.modules:
        return
    import triton.language as tl
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction

    if knobs.runtime.interpret and isinstance(tl.sum, InterpretedFunction):
        return
    raise PrecompileError(
        "triton_interpreter() cannot turn on Triton's interpreter: Triton was "
        "imported before TRITON_INTERPRET=1 was set (torch imports it with Dynamo "
        "or Inductor, and when an optimizer is created), so its own functions are "
        "compiled ones, which interpreted kernels cannot call. Set "
        "TRITON_INTERPRET=1 in the environment before starting Python (or in "
        "os.environ before importing torch)."
    )


@contextlib.contextmanager
def _triton_target() -> Generator[None]:
    """torch asks Triton's active driver for its target (a backend, and a hash for
    cache keys); without a GPU there is no active driver to ask, and the
    interpreter needs no target."""
    import torch.utils._triton as torch_triton

    answers: dict[str, Callable[[], Any]] = {
        "triton_backend": lambda: "cuda",
        "triton_hash_with_backend": lambda: "interpreter",
    }
    with _attributes(torch_triton, answers):
        yield


@contextlib.contextmanager
def _interpreter_libdevice() -> Generator[None]:
    """The interpreter stands in for ``triton.language`` and its ``math`` during a
    kernel's run, but not for ``libdevice``, whose functions are left as externs of
    a GPU library and come back as None there: a kernel that calls
    ``libdevice.rsqrt`` fails with "'NoneType' object has no attribute 'type'"."""
    import importlib

    helpers = importlib.import_module(_HELPERS)
    with _attributes(helpers, {"libdevice": InterpreterLibdevice()}):
        yield


@contextlib.contextmanager
def _attributes(owner: object, values: Mapping[str, object]) -> Generator[None]:
    previous = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(owner, name, value)


class InterpreterLibdevice:
    """``libdevice`` for Triton's interpreter: each function from ``triton.language.
    math``, looked up at each call (the interpreter replaces them while a kernel
    runs), and the few Inductor's kernels call that it lacks, written with it."""

    def __getattr__(self, name: str) -> Any:
        import triton.language as tl

        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(tl.math, name)
        except AttributeError:
            raise AttributeError(
                f"libdevice.{name} has no stand-in under Triton's interpreter "
                "(precompile_gen.testing.InterpreterLibdevice); the kernel needs a GPU."
            ) from None

    @staticmethod
    def pow(x: Any, y: Any) -> Any:
        import triton.language as tl

        # x ** y for x > 0, as the kernels Inductor writes for a float power need it
        # (Adam's bias correction, a norm's square root).
        return tl.math.exp(y * tl.math.log(x))

    @staticmethod
    def tanh(x: Any) -> Any:
        import triton.language as tl

        return 2.0 / (1.0 + tl.math.exp(-2.0 * x)) - 1.0

    @staticmethod
    def isnan(x: Any) -> Any:
        return x != x

    @staticmethod
    def isinf(x: Any) -> Any:
        return (x == float("inf")) | (x == float("-inf"))
