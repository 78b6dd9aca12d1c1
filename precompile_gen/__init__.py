"""precompile_gen: capture a whole PyTorch computation ahead of time into a readable,
executable Python artifact plus a small cache.

    python_code, cache = precompile_gen.precompile(fn, model, *example_inputs)
    forward = precompile_gen.load(python_code, cache)
    out = forward(model, *inputs)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from precompile_gen.capture_result import CaptureResult
from precompile_gen.runtime.errors import PrecompileError, PrecompileIndexError
from precompile_gen.runtime.load import load, parse_metadata

if TYPE_CHECKING:
    from precompile_gen.api import capture, precompile
    from precompile_gen.codegen.render import render_artifact

# Capturing and rendering need the tracer, sympy and Jinja; a process that only loads
# artifacts never imports them, so they are imported on first use.
_LAZY = {
    "capture": "precompile_gen.api",
    "precompile": "precompile_gen.api",
    "render_artifact": "precompile_gen.codegen.render",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'precompile_gen' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "CaptureResult",
    "PrecompileError",
    "PrecompileIndexError",
    "capture",
    "load",
    "parse_metadata",
    "precompile",
    "render_artifact",
]
