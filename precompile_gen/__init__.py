"""precompile_gen: capture a whole PyTorch computation ahead of time into a readable,
executable Python artifact plus a small cache.

    python_code, cache = precompile_gen.precompile(fn, model, *example_inputs)
    forward = precompile_gen.load(python_code, cache)
    out = forward(model, *inputs)
"""

# Each stage module is imported before its public function of the same name is
# bound here, so ``precompile_gen.capture`` / ``.load`` name the functions.
from precompile_gen.api import capture, precompile
from precompile_gen.capture_result import CaptureResult
from precompile_gen.errors import PrecompileError
from precompile_gen.load import load, parse_metadata
from precompile_gen.render import render_artifact

__all__ = [
    "CaptureResult",
    "PrecompileError",
    "capture",
    "load",
    "parse_metadata",
    "precompile",
    "render_artifact",
]
