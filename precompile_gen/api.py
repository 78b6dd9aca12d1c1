"""The pipeline: trace -> lower -> ``CaptureResult`` -> render -> (code, cache)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from precompile_gen.capture_result import CaptureResult
from precompile_gen.capturing import global_modes
from precompile_gen.capturing.graph_inputs import function_name
from precompile_gen.capturing.trace import check_arguments, trace
from precompile_gen.codegen.render import render_artifact
from precompile_gen.lowering.lower import lower
from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.cache import build_cache, check_key
from precompile_gen.runtime.files import check_pair_paths, write_pair
from precompile_gen.tools import timings


def capture(
    fn: Callable[..., object],
    *example_inputs: object,
    backend: str = "inductor",
    tracer: str = "make_fx",
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> CaptureResult:
    """Trace ``fn(*example_inputs)`` and lower the graph; no artifact text yet."""
    checked = check_arguments(fn, backend, tracer)
    kernel_binaries.check_cache_folder()
    what = f"capture of {function_name(fn)!r} (backend {checked!r})"
    # make_fx and fx's patcher keep the current tracer in module globals, so two
    # traces on different threads corrupt each other; captures take turns.
    with (
        timings.recording(what),
        kernel_binaries.TORCH_STATE_LOCK,
        global_modes.capturing(),
    ):
        with timings.stage("capture"):
            traced = trace(
                fn, example_inputs, backend=checked, decompositions=decompositions
            )
        with timings.stage("lowering"), global_modes.lowering():
            return lower(traced, checked)


def precompile(
    fn: Callable[..., object],
    *example_inputs: object,
    backend: str = "inductor",
    tracer: str = "make_fx",
    decompositions: dict[Any, Callable[..., Any]] | None = None,
    artifact_path: str | os.PathLike[str] | None = None,
    cache_path: str | os.PathLike[str] | None = None,
    key: bytes | None = None,
) -> tuple[str, bytes]:
    """Capture ``fn(*example_inputs)``; return the artifact text and its cache.

    With ``artifact_path`` and ``cache_path``, the pair is also written to those
    files, atomically (see ``files.write_pair``). With ``key``, the cache carries an
    HMAC-SHA256 signature that ``load(..., key=key)`` requires.
    """
    # Checked before the (possibly long) capture, so a typo fails at once.
    if key is not None:
        check_key(key)
    if (artifact_path is None) != (cache_path is None):
        raise ValueError(
            "pass both artifact_path and cache_path, or neither: the two files are "
            "one pair, and load needs both."
        )
    if artifact_path is not None and cache_path is not None:
        check_pair_paths(artifact_path, cache_path)
    with timings.recording(
        f"precompile of {function_name(fn)!r} (backend {backend!r})"
    ):
        cap = capture(
            fn,
            *example_inputs,
            backend=backend,
            tracer=tracer,
            decompositions=decompositions,
        )
        with timings.stage("render"):
            python_code = render_artifact(cap)
        with timings.stage("cache"):
            cache = build_cache(
                python_code, cap.backend, cap.payload.cache_artifact, key=key
            )
    if artifact_path is not None and cache_path is not None:
        write_pair(artifact_path, cache_path, python_code, cache)
    return python_code, cache
