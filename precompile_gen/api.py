"""The whole pipeline: capture -> ``CaptureResult`` -> render -> (code, cache)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from precompile_gen.cache import build_cache
from precompile_gen.capture import capture
from precompile_gen.render import render_artifact


def precompile(
    fn: Callable[..., object],
    *example_inputs: object,
    backend: str = "inductor",
    tracer: str = "make_fx",
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> tuple[str, bytes]:
    """Capture ``fn(*example_inputs)``; return the artifact text and its cache."""
    cap = capture(
        fn,
        *example_inputs,
        backend=backend,
        tracer=tracer,
        decompositions=decompositions,
    )
    python_code = render_artifact(cap)
    return python_code, build_cache(python_code, cap.backend, cap.cache_artifact)
