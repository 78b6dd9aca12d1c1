"""Cache: the envelope that pairs a cache with the artifact it accelerates.

The cache is a ``torch.save``d plain dict, so it is read with ``weights_only=True``
and reading it never runs code. It is only an acceleration: an envelope this version
cannot read is skipped with a warning, while one that is readable but belongs to
another artifact is an error, because it signals mixed-up files.
"""

from __future__ import annotations

import hashlib
import io
import logging

import torch

from precompile_gen.errors import PrecompileError

log = logging.getLogger(__name__)

CACHE_FORMAT = "precompile_gen"
CACHE_VERSION = 1


def code_hash(python_code: str) -> str:
    return hashlib.sha256(python_code.encode("utf-8", "surrogatepass")).hexdigest()


def build_cache(
    python_code: str, backend: str, artifact: dict[str, object] | None
) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {
            "format": CACHE_FORMAT,
            "version": CACHE_VERSION,
            "backend": backend,
            "code_hash": code_hash(python_code),
            "artifact": artifact,
        },
        buffer,
    )
    return buffer.getvalue()


def read_cache(
    cache: bytes, *, python_code: str, backend: str
) -> dict[str, object] | None:
    """The cache's artifact payload, or None when there is nothing usable to prime.

    Raises PrecompileError when the envelope is readable but was made for another
    artifact (different backend or code hash).
    """
    try:
        envelope = torch.load(io.BytesIO(cache), weights_only=True)
    except Exception as error:
        log.warning(
            "precompile_gen.load: the cache cannot be read (%s: %s); ignoring it and "
            "compiling from python_code instead, which is slower but gives the same "
            "results.",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        return None
    if (
        not isinstance(envelope, dict)
        or envelope.get("format") != CACHE_FORMAT
        or envelope.get("version") != CACHE_VERSION
    ):
        found = (
            (envelope.get("format"), envelope.get("version"))
            if isinstance(envelope, dict)
            else type(envelope).__name__
        )
        log.warning(
            "precompile_gen.load: the cache is not a %s version %d envelope (found "
            "%r); ignoring it and compiling from python_code instead.",
            CACHE_FORMAT,
            CACHE_VERSION,
            found,
        )
        return None
    if envelope.get("backend") != backend:
        raise PrecompileError(
            f"the cache was made by the {envelope.get('backend')!r} backend but "
            f"python_code by the {backend!r} backend, so the two files do not belong "
            "together. Pass the cache returned with this python_code by the same "
            "precompile() call."
        )
    expected = code_hash(python_code)
    if envelope.get("code_hash") != expected:
        raise PrecompileError(
            "the cache belongs to another artifact: its code_hash "
            f"{str(envelope.get('code_hash'))[:16]}... differs from "
            f"sha256(python_code) {expected[:16]}..., so the two files do not belong "
            "together. Pass the cache returned with this python_code by the same "
            "precompile() call."
        )
    artifact = envelope.get("artifact")
    if artifact is not None and not isinstance(artifact, dict):
        log.warning(
            "precompile_gen.load: the cache's artifact is a %s, not a dict; "
            "ignoring it and compiling from python_code instead.",
            type(artifact).__name__,
        )
        return None
    return artifact
