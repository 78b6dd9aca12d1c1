"""Where a line of a test's own function stands, as refusals name it."""

from __future__ import annotations

import inspect
from collections.abc import Callable


def line_of(fn: Callable[..., object], text: str) -> str:
    """``file:line`` of the line of ``fn`` that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + offset}"
