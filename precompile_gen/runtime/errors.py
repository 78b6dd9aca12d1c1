"""The one exception type for contract violations, and how messages show values
read from untrusted input.

Kept free of torch imports: an emitted artifact imports this module lazily, on its
error path only, so that callers can catch the same type whether the error came from
capture, from ``load`` or from inside the artifact's driver.
"""

import reprlib
from collections.abc import Callable, Sequence
from typing import Any


class PrecompileError(RuntimeError):
    """A capture, load or runtime call broke the precompile contract.

    The message names what differed, what was expected and how to fix it.
    """


# Where torch.compiler.precompile rejects with a built-in type, the same rejection here
# is also of that type, so that a program's ``except ValueError`` (or
# ``except NotImplementedError``) keeps working as well as ``except PrecompileError``.


class PrecompileValueError(PrecompileError, ValueError):
    """A bad argument value (an unknown backend or tracer)."""


class PrecompileNotImplementedError(PrecompileError, NotImplementedError):
    """A feature the chosen backend or tracer does not provide."""


class PrecompileIndexError(PrecompileError, IndexError):
    """An index out of range, refused before the graph runs: a training loop's
    ``except IndexError`` catches it as it catches eager's."""


# A value read from a damaged or hostile cache can be huge or deeply nested, and repr
# could recurse through it; messages show such values bounded in length and depth.
_bounded_repr = reprlib.Repr()
_bounded_repr.maxlevel = 3
_bounded_repr.maxstring = _bounded_repr.maxother = 60
describe_untrusted = _bounded_repr.repr


def listed(
    items: Sequence[Any], show: Callable[[Any], str] = repr, limit: int = 3
) -> str:
    """``items`` as a message lists them: all of them when there are few, else the
    first ``limit`` and how many more, e.g. "['a', 'b', 'c'] and 43 more", so that
    a long list never buries a message's first line, the one that says what to do.
    The artifact's runtime support has its own copy (``_listed``), as it never
    imports precompile_gen."""
    if len(items) <= limit + 1:
        return "[" + ", ".join(map(show, items)) + "]"
    shown = ", ".join(map(show, items[:limit]))
    return f"[{shown}] and {len(items) - limit} more"
