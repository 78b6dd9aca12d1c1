"""The refusals capture raises from inside the user's code while Dynamo runs it.

Dynamo wraps what is raised while it compiles a frame, and appends to its message; a
refusal made here is marked on the instance (not by a subclass, so that a traceback
prints the public type), found again in the chain Dynamo raises, and raised as
written. ``patched`` swaps in the functions that watch or refuse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from precompile_gen.runtime.errors import PrecompileError

# This module's refusals (an effect, a Python or NumPy draw) are told apart from any
# other PrecompileError by a mark on the instance rather than by a subclass, so that
# the type a traceback prints is the public one. The mark keeps the message as
# written: Dynamo appends to the message of an error raised while it compiles.
_MARK = "_precompile_gen_refusal"


def refusal(message: str) -> PrecompileError:
    error = PrecompileError(message)
    setattr(error, _MARK, message)
    return error


def refusal_in(error: BaseException) -> PrecompileError | None:
    # Dynamo wraps what is raised while it compiles a frame. Only this module's
    # refusals end the capture here: any other the trace raises again, with the
    # caller's line, which a frame Dynamo inlined does not have.
    seen: BaseException | None = error
    while seen is not None:
        message = getattr(seen, _MARK, None)
        if isinstance(seen, PrecompileError) and isinstance(message, str):
            return refusal(message)
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def patched(owner: object, name: str, replacement: object) -> Generator[None]:
    """``owner.name`` is ``replacement`` while the block runs."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)
