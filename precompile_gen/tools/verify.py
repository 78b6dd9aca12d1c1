"""Verify: check that an artifact and a cache belong together, without executing either.

The checks are the ones ``load`` makes before it executes anything (metadata by AST,
the envelope's backend and code_hash, the signature when a key is given), made by the
same functions, plus what ``load`` only warns about: an unreadable envelope and
kernel binaries that fail their digest are errors here, because a verified pair
should load exactly as it was produced.
"""

from __future__ import annotations

from typing import Any

from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.cache import (
    check_envelope,
    check_key,
    code_hash,
    read_envelope,
)
from precompile_gen.runtime.errors import PrecompileError
from precompile_gen.runtime.load import parse_artifact, parse_metadata
from precompile_gen.tools.inspection import find_kernels, source_digest


def verify_pair(
    python_code: str, cache: bytes, key: bytes | None = None
) -> dict[str, Any]:
    """What was checked, as JSON-ready data; PrecompileError for the first problem."""
    metadata = parse_metadata(python_code)
    backend = metadata["BACKEND"]
    if key is not None:
        check_key(key)
    envelope, problem = read_envelope(cache)
    if envelope is None:
        raise PrecompileError(
            f"{problem}. load() would ignore it and compile from the artifact; write "
            "the pair again with this version's precompile()."
        )
    # The checks load() makes: a PrecompileError names a backend or code_hash
    # mismatch, or, with a key, a missing or wrong signature.
    payload = check_envelope(
        envelope, python_code=python_code, backend=backend, key=key
    )
    report: dict[str, Any] = {
        "backend": backend,
        "code_hash": code_hash(python_code),
        "signature": _signature_state(envelope, key),
        "kernel_binaries": None,
    }
    if backend == "inductor" and payload is not None:
        report["kernel_binaries"] = _check_binaries(
            python_code,
            metadata["KERNEL_BINARIES"],
            metadata["KERNEL_SOURCES"],
            payload,
        )
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
        lines += _binary_lines(binaries)
        lines += _triton_lines(binaries["triton"])
    elif report["backend"] == "inductor":
        lines.append("  kernel binaries  none: load compiles the kernels from source")
    return "\n".join(lines) + "\n"


def _binary_lines(binaries: dict[str, Any]) -> list[str]:
    """What the report says of the cache's binaries and the C++ kernels."""
    if not binaries["files"]:
        return ["  kernel binaries  none in the cache"] + (
            ["  kernels          no C++ kernel"] if not binaries["cpp_kernels"] else []
        )
    differing = binaries["differs_from_here"]
    if not binaries["cpp_kernels"] and not differing:
        # Triton's alone: where they load is a matter of the GPU (said below).
        here = "built by this torch and Python"
    elif not binaries["cpp_kernels"]:
        here = f"built by another ({', '.join(differing)} differ)"
    elif not differing:
        here = "they run here (same torch, Python, architecture and CPU capability)"
    else:
        here = (
            f"built elsewhere ({', '.join(differing)} differ): load compiles "
            "the kernels from source instead"
        )
    lines = [
        f"  kernel binaries  {binaries['files']} "
        f"file{'' if binaries['files'] == 1 else 's'}, "
        f"{binaries['bytes']:,} bytes, sha256 ok, each pinned by the artifact's "
        f"KERNEL_BINARIES; {here}"
    ]
    missing = binaries["without_binary"]
    if differing or not binaries["cpp_kernels"]:
        pass  # every kernel compiles, or the binaries are Triton's alone
    elif missing:
        lines.append(
            f"  kernels          {len(missing)} without a binary in the cache, "
            f"compiled at load: {', '.join(missing)}"
        )
    else:
        lines.append("  kernels          each C++ kernel has its binary in the cache")
    return lines


def _triton_lines(triton: dict[str, Any]) -> list[str]:
    kernels = triton["kernels"]
    if not kernels:
        return []
    count = f"{len(kernels)} Triton kernel{'' if len(kernels) == 1 else 's'}"
    if triton["interpreted"]:
        carried = "made for Triton's interpreter, which runs their source: no binary"
    elif triton["folders"]:
        target = f" for {triton['target']}" if triton["target"] else ""
        carried = (
            f"{triton['folders']} compiled configuration"
            f"{'' if triton['folders'] == 1 else 's'}{target} in Triton's cache "
            "folders, found by Triton's key on such a GPU (another GPU or Triton "
            "compiles from source)"
        )
    else:
        carried = "no compiled binary in the cache: Triton compiles them at load"
    return [f"  triton           {count}; {carried}"]


def _signature_state(envelope: dict[str, Any], key: bytes | None) -> str:
    if key is not None:
        return "valid under the given key"
    if envelope.get("signature") is not None:
        return "present, not checked (pass a key to check it)"
    return "none (the pair was not signed)"


def _cpp_kernels(python_code: str) -> list[Any]:
    return [
        kernel
        for kernel in find_kernels(parse_artifact(python_code).body)
        if kernel.kind == "cpp_pybinding"
    ]


def _kernels_without_binary(
    kernels: list[Any], sources: object, files: dict[str, bytes]
) -> list[str]:
    """The C++ ``kernels`` of the artifact that the cache brings no binary for (by
    KERNEL_SOURCES): load compiles those."""
    binaries = sources if isinstance(sources, dict) else {}
    return [
        kernel.name
        for kernel in kernels
        if binaries.get(source_digest(kernel.source)) not in files
    ]


def _check_binaries(
    python_code: str,
    pinned: dict[str, str],
    sources: dict[str, str],
    payload: object,
) -> dict[str, Any]:
    damage = kernel_binaries.damaged(payload)
    if damage is not None:
        raise PrecompileError(
            f"the cache's kernel binaries cannot be used: {damage}; the cache was "
            "damaged or made by another tool. Write the pair again with precompile()."
        )
    assert isinstance(payload, dict)
    foreign = kernel_binaries.unpinned(payload, pinned)
    if foreign is not None:
        raise PrecompileError(
            f"the cache's kernel binaries are not the ones the artifact names: "
            f"{foreign}. load() would not use them (and refuses a signed pair); "
            "write the pair again with precompile()."
        )
    files = payload["files"]
    here = kernel_binaries.build_fingerprint()
    cpp_kernels = _cpp_kernels(python_code)
    return {
        "files": len(files),
        "bytes": sum(len(data) for data in files.values()),
        "differs_from_here": kernel_binaries.differing_build(payload, here),
        "cpp_kernels": len(cpp_kernels),
        "without_binary": _kernels_without_binary(cpp_kernels, sources, files),
        "triton": {
            "kernels": list(payload.get("triton_kernels") or []),
            "interpreted": payload.get("triton_interpreted") is True,
            "target": str((payload.get("toolchain") or {}).get("triton_target", "")),
            # One folder per compiled configuration of a kernel.
            "folders": len(
                {name.rsplit("/", 1)[0] for name in files if name.startswith("triton/")}
            ),
        },
    }
