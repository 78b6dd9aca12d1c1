"""Verify: check that an artifact and a cache belong together, without executing either.

The checks are the ones ``load`` makes before it executes anything (metadata by AST,
the envelope's backend and code_hash, the signature when a key is given), made by the
same functions, plus what ``load`` only warns about: an unreadable envelope and
kernel binaries that fail their digest are errors here, because a verified pair
should load exactly as it was produced.
"""

from __future__ import annotations

import hashlib
import io
import reprlib
from typing import Any

import torch

from precompile_gen import kernel_binaries
from precompile_gen.cache import (
    CACHE_FORMAT,
    CACHE_VERSION,
    check_key,
    code_hash,
    read_cache,
)
from precompile_gen.errors import PrecompileError
from precompile_gen.load import parse_metadata

# Names read from a damaged or hostile cache can be huge; messages show them bounded.
_bounded_repr = reprlib.Repr()
_bounded_repr.maxstring = _bounded_repr.maxother = 80
_describe = _bounded_repr.repr


def verify_pair(
    python_code: str, cache: bytes, key: bytes | None = None
) -> dict[str, Any]:
    """What was checked, as JSON-ready data; PrecompileError for the first problem."""
    metadata = parse_metadata(python_code)
    backend = str(metadata["BACKEND"])
    envelope = _read_envelope(cache)
    payload = _check_pairing(cache, python_code, backend, key)
    report: dict[str, Any] = {
        "backend": backend,
        "code_hash": code_hash(python_code),
        "signature": _signature_state(envelope, key),
        "kernel_binaries": None,
    }
    if backend == "inductor" and payload is not None:
        report["kernel_binaries"] = _check_binaries(payload)
    return report


def format_report(report: dict[str, Any], artifact: str, cache: str) -> str:
    lines = [
        f"ok: {artifact} and {cache} belong together",
        f"  backend          {report['backend']} (the artifact's BACKEND and the "
        "cache's agree)",
        f"  code_hash        {report['code_hash'][:16]}... (sha256 of the artifact, "
        "recorded in the cache)",
        f"  signature        {report['signature']}",
    ]
    binaries = report["kernel_binaries"]
    if binaries is not None:
        here = (
            "built for this machine"
            if not binaries["differs_from_here"]
            else "built elsewhere ("
            + ", ".join(binaries["differs_from_here"])
            + " differ): load compiles the kernels from source instead"
        )
        lines.append(
            f"  kernel binaries  {binaries['files']} "
            f"file{'' if binaries['files'] == 1 else 's'}, "
            f"{binaries['bytes']:,} bytes, sha256 ok; {here}"
        )
    elif report["backend"] == "inductor":
        lines.append("  kernel binaries  none: load compiles the kernels from source")
    return "\n".join(lines) + "\n"


def _read_envelope(cache: bytes) -> dict[str, Any]:
    try:
        envelope = torch.load(io.BytesIO(cache), weights_only=True)
    except Exception as error:
        # torch's own message goes on to advise weights_only=False, which would
        # execute the file: only its first sentence is relevant here.
        reason = str(error).split(". ")[0].splitlines()[0] if str(error) else ""
        raise PrecompileError(
            f"the cache cannot be read ({type(error).__name__}: {reason}); it is "
            "not a precompile_gen cache, or it was truncated. load() would ignore it "
            "and compile from the artifact; write the pair again with precompile()."
        ) from error
    if (
        not isinstance(envelope, dict)
        or envelope.get("format") != CACHE_FORMAT
        or envelope.get("version") != CACHE_VERSION
    ):
        found = (
            f"format {envelope.get('format')!r}, version {envelope.get('version')!r}"
            if isinstance(envelope, dict)
            else f"a {type(envelope).__name__}"
        )
        raise PrecompileError(
            f"the cache is not a {CACHE_FORMAT} version {CACHE_VERSION} envelope "
            f"(found {found}); load() would ignore it. Write the pair again with "
            "this version's precompile()."
        )
    return envelope


def _check_pairing(
    cache: bytes, python_code: str, backend: str, key: bytes | None
) -> dict[str, object] | None:
    if key is not None:
        check_key(key)
    # The same checks load() makes: a PrecompileError names a backend or code_hash
    # mismatch, or, with a key, a missing or wrong signature.
    return read_cache(cache, python_code=python_code, backend=backend, key=key)


def _signature_state(envelope: dict[str, Any], key: bytes | None) -> str:
    if key is not None:
        return "valid under the given key"
    if envelope.get("signature") is not None:
        return "present, not checked (pass a key to check it)"
    return "none (the pair was not signed)"


def _check_binaries(payload: dict[str, object]) -> dict[str, Any]:
    files = payload.get("files")
    digests = payload.get("sha256")
    if (
        payload.get("kind") != kernel_binaries.PAYLOAD_KIND
        or not isinstance(files, dict)
        or not isinstance(digests, dict)
    ):
        raise PrecompileError(
            "the cache's payload is not a kernel-binary payload with a file manifest; "
            "it was damaged or made by another tool. Write the pair again with "
            "precompile()."
        )
    for name, data in files.items():
        if (
            not isinstance(name, str)
            or not isinstance(data, bytes)
            or hashlib.sha256(data).hexdigest() != digests.get(name)
        ):
            raise PrecompileError(
                f"the cache's kernel binary {_describe(name)} does not match its "
                "sha256; the cache was damaged. Write the pair again with precompile()."
            )
    built = payload.get("build")
    here = kernel_binaries.build_fingerprint()
    differs = [
        key
        for key in here
        if not isinstance(built, dict) or built.get(key) != here[key]
    ]
    return {
        "files": len(files),
        "bytes": sum(len(data) for data in files.values()),
        "differs_from_here": differs,
    }
