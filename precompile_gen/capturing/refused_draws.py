"""The random draws capture refuses: Python's ``random`` and NumPy's global
generator, whose number the trace would build into the graph, and a
``torch.Generator`` of the function's own (``generator=g``), which the artifact
could not follow the caller's seed with.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from precompile_gen.capturing import (
    data_dependent,
    refusals,
)
from precompile_gen.capturing.graph_inputs import function_name
from precompile_gen.runtime.errors import PrecompileError

# --- Python's and NumPy's generators ------------------------------------------------
_PYTHON_RNG = (
    "random",
    "uniform",
    "randint",
    "randrange",
    "choice",
    "choices",
    "sample",
    "shuffle",
    "gauss",
    "normalvariate",
    "betavariate",
    "gammavariate",
    "expovariate",
    "lognormvariate",
    "triangular",
    "vonmisesvariate",
    "paretovariate",
    "weibullvariate",
    "getrandbits",
    "randbytes",
    "binomialvariate",
)


@contextlib.contextmanager
def refusing_python_rng(fn: object) -> Generator[None]:
    """Refuse draws from Python's ``random`` and NumPy's global generator while ``fn``
    is traced: the trace would draw once and build the number into the graph, so
    every call of the artifact would reuse it. Their states are left as they were."""
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    targets: list[tuple[object, str, str]] = [
        (random, name, f"random.{name}")
        for name in _PYTHON_RNG
        if hasattr(random, name)
    ]
    if numpy is not None:
        targets += [
            (numpy.random, name, f"numpy.random.{name}")
            for name in dir(numpy.random.mtrand._rand)
            if not name.startswith("_")
            and name not in ("get_state", "set_state", "seed")
            and callable(getattr(numpy.random, name, None))
        ]
    with contextlib.ExitStack() as stack:
        for owner, name, label in targets:
            stack.enter_context(refusals.patched(owner, name, _refuser(fn, label)))
        try:
            yield
        finally:
            drew = random.getstate() != python_state
            random.setstate(python_state)
            if numpy is not None:
                drew = drew or not _same_numpy_state(
                    numpy.random.get_state(), numpy_state
                )
                numpy.random.set_state(numpy_state)
    if drew:
        raise _rng_error(fn, "Python's random module or NumPy's global generator", None)


def _same_numpy_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]


def _refuser(fn: object, label: str) -> Callable[..., object]:
    import torch._dynamo

    # Run, not traced, by the Dynamo pass: it reads the caller's frame.
    @torch._dynamo.disable
    def refuse(*args: object, **kwargs: object) -> object:
        raise _rng_error(fn, label, data_dependent.user_line(code=False))

    return refuse


def torch_generators(
    modules: Sequence[torch.nn.Module], leaves: Sequence[object]
) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The ``torch.Generator`` objects among the input leaves and the modules'
    attributes, each with its state, for a refused capture to restore: the trace
    draws from them before the graph shows that it did."""
    found = {id(leaf): leaf for leaf in leaves if isinstance(leaf, torch.Generator)}
    for module in modules:
        for submodule in module.modules():
            for value in vars(submodule).values():
                if isinstance(value, torch.Generator):
                    found[id(value)] = value
    return [(generator, generator.get_state()) for generator in found.values()]


def reject_torch_generators(
    gm: torch.fx.GraphModule,
    fn: object,
    generators: list[tuple[torch.Generator, torch.Tensor]],
) -> None:
    """Refuse a graph that draws from a ``torch.Generator`` of the function's own
    (``generator=g``): the graph holds a copy of that generator, which the eager
    artifact cannot name and the inductor artifact would draw from apart from the
    caller's seed."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(
            isinstance(arg, torch.fx.Node)
            and arg.op == "get_attr"
            and isinstance(getattr(gm, str(arg.target), None), torch.Generator)
            for arg in (*node.args, *node.kwargs.values())
        ):
            for generator, state in generators:
                generator.set_state(state)
            raise _generator_error(fn, node.target)


def _generator_error(fn: object, op: object) -> PrecompileError:
    name = function_name(fn)
    return refusals.refusal(
        f"{name!r} passes a torch.Generator to {op} (generator=). The artifact "
        "draws from torch's global generator only, as the call's torch.manual_seed "
        "sets it; a generator of its own would be built into the artifact and not "
        "follow the caller's. Leave out generator= (seed with torch.manual_seed "
        "before the call), or draw outside the function and pass the tensor in as "
        "an argument."
    )


def _rng_error(fn: object, generator: str, line: str | None) -> PrecompileError:
    where = f" at {line}" if line else ""
    name = function_name(fn)
    return refusals.refusal(
        f"{name!r} draws from {generator}{where}. The trace would draw once and "
        "build the number into the artifact, which would reuse it on every call. "
        "Draw with torch's generator instead (torch.rand, torch.distributions), which "
        "the artifact repeats, or draw outside the function and pass the value in "
        "as an argument."
    )
