"""Where a line of a test's own function stands, as refusals name it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path


def line_of(fn: Callable[..., object], text: str) -> str:
    """``file:line`` of the line of ``fn`` that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + offset}"


def portable_line_of(fn: Callable[..., object], text: str) -> str:
    """``line_of`` as the artifact's text names it: the file relative to the
    working directory (the suite runs from the checkout)."""
    path, _, line = line_of(fn, text).rpartition(":")
    return f"{Path(path).relative_to(Path.cwd()).as_posix()}:{line}"
