# Runtime support for index checks: carried after the calls part
# (precompile_gen/runtime_support/calls.py) by every artifact whose graph indexes with
# values it takes from the input leaves, from its first "# ---" heading on. The lines
# above that heading are not carried: they import what the rest of the artifact defines,
# so that ruff and pyrefly check this part as a module of its own.
from precompile_gen.runtime_support.calls import _call_leaf_name
from precompile_gen.runtime_support.declarations import INDEX_CHECKS
from precompile_gen.runtime_support.support import PrecompileError

# isort: split

# --- Indices ------------------------------------------------------------------------
# An index out of range raises in eager ATen, but may abort the process inside a
# compiled kernel, after the graph has written part of its inputs: the indices the
# graph takes from the input leaves are checked before it runs (INDEX_CHECKS).
import functools
from typing import Any, NoReturn, cast

import torch


class PrecompileIndexError(PrecompileError, IndexError):
    """An index out of range (used when precompile_gen is absent): an IndexError, as
    eager raises, and a PrecompileError."""


def _fail_index(message: str) -> NoReturn:
    # As _fail: precompile_gen's own type where it is installed, imported only here.
    error_type: type[IndexError]
    try:
        from precompile_gen import PrecompileIndexError as error_type
    except ImportError:
        error_type = PrecompileIndexError
    raise error_type(message)


def _check_indices(args: tuple[object, ...], leaves: list[object]) -> None:
    for sources, steps, low, high, allowed, what in INDEX_CHECKS:
        problem = _index_problem(leaves, sources, steps, low, high, allowed)
        if problem is not None:
            names = " and ".join(_call_leaf_name(args, i) for i in sources)
            subject = f"the index the graph computes from {names}" if steps else names
            also = "" if allowed is None else f", or {allowed}"
            _fail_index(
                f"{subject} {problem}, outside {low} <= index < {high}{also}: pass "
                f"inputs that keep it in that range. The graph indexes with it "
                f"({what}), which eager PyTorch refuses too (IndexError); nothing "
                "has run."
            )


@functools.cache
def _aten_op(name: str) -> Any:
    # "slice.Tensor" -> torch.ops.aten.slice.Tensor, looked up once.
    op, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)


def _index_problem(
    leaves: list[object],
    sources: tuple[int, ...],
    steps: tuple[Any, ...],
    low: int,
    high: int,
    allowed: int | None,
) -> str | None:
    """How the index the graph computes from ``leaves`` (the one leaf of ``sources``
    itself, or the last of ``steps``) leaves [low, high), or None if every value is
    in it (or is ``allowed``)."""
    if any(type(leaves[source]) is not torch.Tensor for source in sources):
        return None  # a DTensor's shards are indexed per rank, by the graph
    index = (
        _replayed(leaves, steps) if steps else cast(torch.Tensor, leaves[sources[0]])
    )
    if index.numel() == 0 or index.is_floating_point() or index.dtype == torch.bool:
        return None
    smallest, largest = torch.aminmax(index)
    if low <= int(smallest) and int(largest) < high:
        return None
    outside = (index < low) | (index >= high)
    if allowed is not None:
        outside &= index != allowed
    where = outside.nonzero()
    if len(where) == 0:
        return None
    value = int(index[tuple(where[0].tolist())])
    at = f" at {tuple(where[0].tolist())}" if not steps else ""
    more = f" (and {len(where) - 1} more)" if len(where) > 1 else ""
    return f"holds {value}{at}{more}"


def _replayed(leaves: list[object], steps: tuple[Any, ...]) -> torch.Tensor:
    """The result of the graph's own ops ``steps`` on the input leaves: each refers
    to a leaf as {"leaf": k}, to an earlier step's result as {"step": j}."""
    results: list[Any] = []

    def value(argument: Any) -> Any:
        if type(argument) is tuple:
            return tuple(map(value, argument))
        if type(argument) is not dict:
            return argument
        if "leaf" in argument:
            return leaves[argument["leaf"]]
        if "step" in argument:
            return results[argument["step"]]
        return getattr(torch, argument["dtype"])

    for name, arguments, keywords in steps:
        keywords = {key: value(given) for key, given in keywords.items()}
        results.append(_aten_op(name)(*map(value, arguments), **keywords))
    return results[-1]
