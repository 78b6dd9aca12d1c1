"""The pipeline: capture -> lower -> ``CaptureResult`` -> render -> (code, cache)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from precompile_gen.cache import build_cache
from precompile_gen.capture_result import BACKENDS, Backend, CaptureResult
from precompile_gen.render import render_artifact


def capture(
    fn: Callable[..., object],
    *example_inputs: object,
    backend: str = "inductor",
    tracer: str = "make_fx",
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> CaptureResult:
    """Trace ``fn(*example_inputs)`` and lower it; no artifact text yet."""
    from precompile_gen.capture import trace
    from precompile_gen.lower import lower

    checked = _check_arguments(fn, backend, tracer)
    traced = trace(fn, example_inputs, backend=checked, decompositions=decompositions)
    return lower(traced, checked)


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


def _check_arguments(fn: object, backend: str, tracer: str) -> Backend:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}.")
    if tracer == "dynamo":
        raise NotImplementedError(
            "tracer='dynamo' is not implemented; use tracer='make_fx' (the default)."
        )
    if tracer != "make_fx":
        raise ValueError(f"tracer must be 'make_fx', got {tracer!r}.")
    if not callable(fn):
        raise ValueError(
            "fn must be callable (the computation to capture), got "
            f"{type(fn).__name__}."
        )
    return backend  # pyrefly: ignore[bad-return]
