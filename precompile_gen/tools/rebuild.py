"""``verify --rebuild``: compile an artifact's kernels again from its own text, in a
fresh folder, and check each binary the cache carries against the artifact's pins.

The capture built each kernel to the same bytes wherever its cache folder was
(``lowering/kernel_builds.py``), so a second party with the same toolchain gets
the pinned bytes: a cache whose binary is not what the kernel's source in the
artifact compiles to is caught even where its digest was pinned with it. C++
kernels are built as lowering built them; Triton kernels as Inductor's compile
workers build them, for the GPU target the kernel's source names, which needs
Triton's compiler but no GPU. Each kernel is reported as matching, differing (and
whether the toolchain differs from the one the cache records, which explains it),
not carried (the cache brings no binary for it), or not rebuilt (why). The compiles
run in a child process with cache folders of its own, so nothing the machine
compiled before stands in for them.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from precompile_gen.runtime.cache import read_envelope
from precompile_gen.runtime.errors import PrecompileError
from precompile_gen.runtime.load import parse_artifact, parse_metadata
from precompile_gen.tools.inspection import find_kernels, source_digest
from precompile_gen.tools.verify import verify_pair


def rebuild_report(python_code: str, cache: bytes) -> dict[str, Any]:
    """The pair verified as ``verify`` does, then each kernel whose binaries the cache
    carries rebuilt and compared with its pins, as JSON-ready data."""
    verify_pair(python_code, cache)
    metadata = parse_metadata(python_code)
    envelope, _ = read_envelope(cache)
    payload = (envelope or {}).get("artifact")
    payload = payload if isinstance(payload, dict) else {}
    pins: dict[str, str] = dict(metadata["KERNEL_BINARIES"] or {})  # type: ignore[arg-type]
    names: dict[str, str] = dict(metadata["KERNEL_SOURCES"] or {})  # type: ignore[arg-type]
    cpp = _cpp_kernels(python_code)
    triton = _triton_kernels(python_code)
    triton_pins = {name: _triton_pins(pins, name) for name in triton}
    carried = {name: source for name, source in triton.items() if triton_pins[name]}
    rebuilt = _rebuilt([(argtypes, source) for _, argtypes, source in cpp], carried)
    results = []
    for name, _, source in cpp:
        digest = source_digest(source)
        compared = _compare(names.get(digest), rebuilt["kernels"][digest], pins)
        results.append({"kernel": name, "kind": "C++", **compared})
    for name in triton:
        compared = _compare_triton(
            triton_pins[name], rebuilt["triton"].get(name), payload
        )
        results.append({"kernel": name, "kind": "Triton", **compared})
    recorded = payload.get("toolchain") or {}
    here = rebuilt["toolchain"]
    toolchain_differs = [k for k in sorted(recorded) if recorded[k] != here.get(k)]
    return {
        "kernels": results,
        "toolchain": {"recorded": recorded, "here": here, "differs": toolchain_differs},
    }


def _compare(
    pinned_name: str | None, rebuilt: dict[str, str], pins: dict[str, str]
) -> dict[str, str]:
    if "error" in rebuilt:
        return {"result": "cannot rebuild", "why": rebuilt["error"]}
    if pinned_name is None or pinned_name not in pins:
        return {
            "result": "not carried",
            "why": "the cache brings no binary for it: load compiles it",
        }
    if rebuilt["name"] != pinned_name:
        return {
            "result": "differs",
            "why": f"it builds as {rebuilt['name']}, the artifact pins {pinned_name}: "
            "another compile command (compiler, flags or install paths)",
        }
    if rebuilt["sha256"] != pins[pinned_name]:
        return {
            "result": "differs",
            "why": f"the rebuilt binary's sha256 is {rebuilt['sha256'][:16]}..., the "
            f"artifact pins {pins[pinned_name][:16]}...",
        }
    return {"result": "match", "why": ""}


def _compare_triton(
    pinned: dict[str, str],
    rebuilt: dict[str, Any] | None,
    payload: dict[str, Any],
) -> dict[str, str]:
    """A Triton kernel's rebuilt files (payload name -> sha256) against its pins."""
    if rebuilt is None:
        why = (
            "made for Triton's interpreter, which runs its source"
            if payload.get("triton_interpreted")
            else "the cache brings no compiled configuration for it: Triton compiles "
            "it at load"
        )
        return {"result": "not carried", "why": why}
    if "error" in rebuilt:
        return {"result": "cannot rebuild", "why": rebuilt["error"]}
    files: dict[str, str] = rebuilt["files"]
    missing = sorted(set(pinned) - set(files))
    if missing:
        return {
            "result": "differs",
            "why": f"the rebuild makes no {missing[0]} ({len(missing)} of the "
            f"{len(pinned)} pinned files): another Triton, assembler or target keys "
            "it elsewhere",
        }
    for name in sorted(pinned):
        if files[name] != pinned[name]:
            return {
                "result": "differs",
                "why": f"the rebuilt {name.rsplit('/', 1)[-1]}'s sha256 is "
                f"{files[name][:16]}..., the artifact pins {pinned[name][:16]}...",
            }
    return {"result": "match", "why": ""}


def format_rebuild(report: dict[str, Any]) -> str:
    kernels = report["kernels"]
    kinds = [
        kind for kind in ("C++", "Triton") if any(k["kind"] == kind for k in kernels)
    ]
    counted = ", ".join(
        f"{sum(k['kind'] == kind for k in kernels)} {kind}" for kind in kinds
    )
    lines = [
        f"rebuilt {len(kernels)} kernels from the artifact in a fresh folder"
        + (f" ({counted}):" if counted else ":")
    ]
    for kernel in kernels:
        why = f" ({kernel['why']})" if kernel["why"] else ""
        lines.append(f"  {kernel['result']:<15}{kernel['kernel']}{why}")
    toolchain = report["toolchain"]
    recorded = toolchain["recorded"]
    if not recorded:
        lines.append("  toolchain      the cache records none (made before it did)")
    elif toolchain["differs"]:
        for key in toolchain["differs"]:
            lines.append(
                f"  toolchain      {key}: recorded {recorded[key]!r}, here "
                f"{toolchain['here'].get(key)!r}"
            )
    else:
        built = [str(recorded.get("compiler_version"))]
        if "triton_target" in recorded:
            built.append(
                f"Triton {recorded.get('triton')} for {recorded['triton_target']}"
            )
        lines.append(f"  toolchain      the recorded one: {'; '.join(built)}")
    return "\n".join(lines) + "\n"


def matches(report: dict[str, Any]) -> bool:
    return all(k["result"] in ("match", "not carried") for k in report["kernels"])


def _cpp_kernels(python_code: str) -> list[tuple[str, list[str], str]]:
    """Each C++ kernel of section 1: its name, its argument types and its source."""
    kernels = []
    for kernel in find_kernels(parse_artifact(python_code).body):
        if kernel.kind != "cpp_pybinding":
            continue
        call = _call_of(python_code, kernel.name)
        argtypes = ast.literal_eval(call.args[0]) if call.args else []
        kernels.append((kernel.name, list(argtypes), kernel.source))
    return kernels


def _call_of(python_code: str, name: str) -> ast.Call:
    for statement in parse_artifact(python_code).body:
        if (
            isinstance(statement, ast.Assign)
            and isinstance(statement.targets[0], ast.Name)
            and statement.targets[0].id == name
            and isinstance(statement.value, ast.Call)
        ):
            return statement.value
    raise PrecompileError(f"the artifact defines no kernel {name!r}")


def _triton_kernels(python_code: str) -> dict[str, str]:
    """Each Triton kernel of section 1, by name: its module's source."""
    return {
        kernel.name: kernel.source
        for kernel in find_kernels(parse_artifact(python_code).body)
        if kernel.kind == "triton"
    }


def _triton_pins(pins: dict[str, str], name: str) -> dict[str, str]:
    """The pinned files of Triton kernel ``name``: its cache folders hold files named
    after it (``__grp__<name>.json`` lists them)."""
    return {
        path: digest
        for path, digest in pins.items()
        if path.startswith("triton/")
        and path.rsplit("/", 1)[-1].split(".")[0].removeprefix("__grp__") == name
    }


def _rebuilt(
    cpp: list[tuple[list[str], str]], triton: dict[str, str]
) -> dict[str, Any]:
    """The child's rebuild of the ``cpp`` kernels (argument types, source) and the
    ``triton`` ones (name -> source), in cache folders of its own."""
    with tempfile.TemporaryDirectory(prefix="precompile_gen-rebuild-") as folder:
        request = Path(folder) / "kernels.json"
        request.write_text(json.dumps({"cpp": cpp, "triton": triton}), encoding="utf-8")
        environment = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / "k"),
            "TRITON_CACHE_DIR": str(Path(folder) / "triton"),
        }
        done = subprocess.run(
            [sys.executable, "-m", "precompile_gen.tools.rebuild", str(request)],
            capture_output=True,
            text=True,
            env=environment,
            check=False,
        )
        if done.returncode != 0:
            raise PrecompileError(
                "the rebuild's compiler process failed: "
                f"{done.stderr.strip().splitlines()[-1:]}"
            )
        return json.loads(done.stdout.strip().splitlines()[-1])


def _rebuild_here(request: dict[str, Any]) -> dict[str, Any]:
    """In the child: compile each kernel as the capture did, and what each built."""
    from torch._inductor import config

    from precompile_gen.lowering import kernel_builds

    with kernel_builds.reproducible(), config.patch(compile_threads=1):
        cpp = _rebuild_cpp([(list(a), s) for a, s in request["cpp"]])
        triton = {
            name: _rebuild_triton(name, s) for name, s in request["triton"].items()
        }
    built: dict[str, bytes] = {}  # the Triton files, which record their target
    for kernel in triton.values():
        built.update(kernel.pop("built", {}))
    toolchain = {**kernel_builds.toolchain(), **kernel_builds.triton_toolchain(built)}
    return {"kernels": cpp, "triton": triton, "toolchain": toolchain}


def _rebuild_cpp(kernels: list[tuple[list[str], str]]) -> dict[str, dict[str, str]]:
    """Each C++ kernel built as the capture built it: its binary's file key and
    sha256, by the sha256 of its source."""
    from torch._inductor import codecache
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from precompile_gen.runtime.kernel_binaries import binary_path

    root = Path(codecache.cache_dir())
    written: list[str] = []
    original = codecache.write

    def recording(content: Any, extension: str, *args: Any, **kwargs: Any) -> Any:
        key, path = original(content, extension, *args, **kwargs)
        if extension == "main.cpp":
            written.append(path)
        return key, path

    results: dict[str, dict[str, str]] = {}
    codecache.write = recording
    try:
        for argtypes, source in kernels:
            written.clear()
            try:
                CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
                binary = Path(binary_path(written[-1]))
                data = binary.read_bytes()
            except Exception as error:  # reported per kernel; the others go on
                results[source_digest(source)] = {"error": _error(error)}
                continue
            results[source_digest(source)] = {
                "name": binary.relative_to(root).as_posix(),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
    finally:
        codecache.write = original
    return results


def _rebuild_triton(name: str, source: str) -> dict[str, Any]:
    """Triton kernel ``name`` built as the capture built it, for the target its
    source names: the files its cache folders hold, by payload name, with their
    sha256 (and, under "built", their bytes, for the toolchain they record)."""
    from precompile_gen.lowering import kernel_builds
    from precompile_gen.runtime import kernel_binaries

    try:
        kernel = kernel_builds.build_triton_kernel(name, source)
        built = kernel_binaries.triton_files([kernel])
    except Exception as error:  # reported per kernel; the others go on
        return {"error": _error(error)}
    files = {path: hashlib.sha256(data).hexdigest() for path, data in built.items()}
    return {"files": files, "built": built}


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error)[:200]}"


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    print(json.dumps(_rebuild_here(request)))
