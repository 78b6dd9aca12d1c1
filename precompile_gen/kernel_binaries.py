"""The compiled kernels the inductor cache carries, and how a loader primes them.

Inductor's module compiles each C++ kernel on import unless its binary already sits in
``TORCHINDUCTOR_CACHE_DIR`` under inductor's own key: a hash of the kernel source and
its build flags (compiler, ISA, include paths). So the cache carries the binaries
under their keys, relative to the cache folder, and ``load`` writes them there before
executing the artifact.

Two details make a fresh cache folder really skip the compiler:

- With header precompilation on (inductor's default), loading a kernel first
  precompiles a ~150 MB header, even when the kernel's binary exists. The loader
  therefore executes the artifact with it off, and the binaries are recorded under the
  keys inductor computes in that configuration (``LOAD_CONFIG``).
- Picking the vector ISA compiles and runs small probe programs, and records each
  success as ``<key>.so`` plus an empty ``<key>.so.load_ok`` marker. The cache
  carries those probe binaries too, and priming adds their markers.

A binary is used only when the build fingerprint (torch, Python, compiler, CPU
capability, install paths) matches this machine and its sha256 matches the manifest;
otherwise the artifact compiles its kernels as it would without a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import shutil
import sysconfig
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from precompile_gen.errors import PrecompileError, describe_untrusted

log = logging.getLogger(__name__)

PAYLOAD_KIND = "inductor-cpp-kernels"

# Inductor configuration under which the binaries are keyed and loaded.
LOAD_CONFIG: dict[str, object] = {"cpp_cache_precompile_headers": False}

# Inductor keys are "c" + 51 base32 characters, stored in a folder named after
# characters 1-2: kernel binaries (``.main.so``) and ISA probe binaries (``.so``).
# Nothing else may be written from a cache.
_BINARY_PATH = re.compile(r"[a-z0-9]{2}/c[a-z0-9]{51}\.(main\.)?so")
_PROBE_MARKER = ".load_ok"

# torch's tracer (make_fx, fx's patcher) and inductor's compiler (config.patch,
# kernel compilation) keep process-wide state: capture, lowering, the kernel scan and
# executing an inductor artifact take turns on this lock.
TORCH_STATE_LOCK = threading.RLock()


def build_fingerprint() -> dict[str, str]:
    """What a kernel binary depends on besides its source."""
    import torch
    from torch._inductor import cpp_builder

    compiler = cpp_builder.get_cpp_compiler()
    fingerprint = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "compiler": cpp_builder.get_compiler_version_info(compiler),
        # Include and library paths are part of inductor's build flags, so of its keys.
        "torch_dir": os.path.dirname(torch.__file__),
        "python_include": sysconfig.get_paths()["include"],
    }
    # Plain str (torch.__version__ is a subclass), so the cache stays readable with
    # torch.load(weights_only=True).
    return {key: str(value) for key, value in fingerprint.items()}


def collect(graph_source: str) -> dict[str, object]:
    """The payload carrying every C++ kernel binary ``graph_source`` loads.

    Runs right after lowering, when the kernels are compiled: the module is executed
    twice in a scratch namespace (which only loads binaries), once as lowering keyed
    them and once under ``LOAD_CONFIG``, where each binary is copied to its load-time
    key. No kernel is compiled twice.
    """
    from torch._inductor import codecache, config

    lowered: dict[str, str] = {}
    with _recording_kernel_sources() as sources:
        _execute_module(graph_source)
    for source, path in sources:
        lowered[source] = path

    def link_lowered_binary(source: str, path: str) -> None:
        binary = _binary_path(path)
        if source in lowered and not os.path.exists(binary):
            shutil.copyfile(_binary_path(lowered[source]), binary)

    with (
        config.patch(LOAD_CONFIG),
        _recording_kernel_sources(link_lowered_binary) as load_sources,
    ):
        _execute_module(graph_source)
    root = Path(codecache.cache_dir())
    kernels = [Path(_binary_path(path)) for _, path in load_sources]
    # Probe results of any ISA check this machine has run: a few small files, and
    # the loader's inductor looks up the ones for its own flags.
    probes = [
        marker.with_suffix("")
        for marker in root.glob(f"??/*.so{_PROBE_MARKER}")
        if marker.with_suffix("").is_file()
    ]
    files = {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in [*kernels, *probes]
    }
    return {
        "kind": PAYLOAD_KIND,
        "build": build_fingerprint(),
        "files": files,
        "sha256": {
            name: hashlib.sha256(data).hexdigest() for name, data in files.items()
        },
    }


def digests(payload: dict[str, object] | None) -> dict[str, str]:
    """Each binary's sha256 by file key, as the artifact pins them ({} without)."""
    if payload is None:
        return {}
    manifest = payload["sha256"]
    assert isinstance(manifest, dict)
    return {str(name): str(digest) for name, digest in manifest.items()}


def unpinned(payload: dict[str, object], pinned: object) -> str | None:
    """Why ``payload`` (an intact one) brings native code that ``pinned``, the
    artifact's KERNEL_BINARIES, does not name; None when every binary is named
    there with its digest."""
    files, manifest = payload["files"], payload["sha256"]
    assert isinstance(files, dict) and isinstance(manifest, dict)
    if not isinstance(pinned, dict):
        return "the artifact's KERNEL_BINARIES is not a dict of digests"
    for name in files:
        if name not in pinned:
            return (
                f"it brings the binary {describe_untrusted(name)}, which the "
                "artifact's KERNEL_BINARIES does not list"
            )
        if pinned[name] != manifest[name]:
            return (
                f"its binary {name} is not the one the artifact's KERNEL_BINARIES "
                f"pins (sha256 {describe_untrusted(manifest[name])}, pinned "
                f"{describe_untrusted(pinned[name])})"
            )
    return None


def check_cache_folder() -> None:
    """Fail clearly if TORCHINDUCTOR_CACHE_DIR names a folder that cannot be created.

    torch creates that folder when tracing or compiling first imports its compiler
    stack, and fails with a bare OSError deep inside the import if it cannot.
    """
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise PrecompileError(
            f"TORCHINDUCTOR_CACHE_DIR is {folder!r}, a folder that cannot be created "
            f"({error.strerror or error}); torch's tracer and compiler keep their "
            "files there. Set it to a folder this process can write to, or unset it."
        ) from error


def prime(payload: object, pinned: object, *, signed: bool = False) -> bool:
    """Write the payload's binaries into the inductor cache folder, if the artifact
    pins each of them (``pinned``: its KERNEL_BINARIES).

    Returns whether the artifact should be executed under ``loading_config()``;
    False (after a logged warning) when the payload cannot be used here. A signed
    pair whose cache brings a binary the artifact does not pin was tampered with:
    that is a PrecompileError.
    """
    reason = _unusable(payload)
    if reason is None:
        assert isinstance(payload, dict)
        reason = unpinned(payload, pinned)
        if reason is not None and signed:
            raise PrecompileError(
                f"the signed cache's kernel binaries are not the ones the artifact "
                f"names: {reason}. The pair was altered after it was signed, or "
                "signed as two files that do not belong together; precompile again."
            )
    if reason is not None:
        log.warning(
            "precompile_gen.load: not using the cache's compiled kernels: %s. The "
            "kernels are compiled from python_code instead (slower, same results).",
            reason,
        )
        return False
    from torch._inductor import codecache

    assert isinstance(payload, dict)
    # Named in the error if even creating the folder fails.
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "(its default location)"
    try:
        root = codecache.cache_dir()  # creates the folder
        for name, data in payload["files"].items():
            target = Path(root, name)
            _write_binary(target, data, probe=not name.endswith(".main.so"))
    except OSError as error:
        # Compiling from python_code instead would need to write there too.
        raise PrecompileError(
            f"cannot write the cache's kernel binaries into inductor's cache folder "
            f"{root} ({error.strerror or error}: {error.filename}); an "
            "inductor artifact loads its kernels from files there. Set "
            "TORCHINDUCTOR_CACHE_DIR to a folder this process can write to, and load "
            "again."
        ) from error
    return True


def _write_binary(target: Path, data: bytes, *, probe: bool) -> None:
    # A file already under this name is kept: the name is inductor's hash of the
    # kernel's source and build flags, so it holds an equivalent binary, which a
    # running process may have loaded.
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename: a concurrent loader never sees half a binary.
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            partial.write_bytes(data)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    if probe:
        # The marker records that the probe binary loaded on this machine.
        target.with_name(target.name + _PROBE_MARKER).touch()


@contextlib.contextmanager
def loading_config() -> Generator[None]:
    """Inductor configuration for executing an artifact whose kernels were primed."""
    from torch._inductor import config

    with TORCH_STATE_LOCK, config.patch(LOAD_CONFIG):
        yield


def _unusable(payload: object) -> str | None:
    """Why the payload's binaries must not be used here, or None. (The envelope's
    code_hash, checked before, binds the payload to its artifact.)"""
    damage = damaged(payload)
    if damage is not None:
        return damage
    assert isinstance(payload, dict)
    built = payload.get("build")
    if not isinstance(built, dict):
        return "it records no build fingerprint"
    here = build_fingerprint()
    differing = differing_build(payload, here)
    if differing:
        details = ", ".join(
            f"{key} {describe_untrusted(built.get(key))} (here {here[key]!r})"
            for key in differing
        )
        return f"they were built for a different environment: {details}"
    return None


def damaged(payload: object) -> str | None:
    """What makes ``payload`` other than an intact kernel-binary payload, or None:
    its kind, its manifest, a file name outside inductor's binaries, a digest."""
    if not isinstance(payload, dict) or payload.get("kind") != PAYLOAD_KIND:
        return "the payload is not a kernel-binary payload"
    files, digests = payload.get("files"), payload.get("sha256")
    if not isinstance(files, dict) or not isinstance(digests, dict):
        return "its file manifest is malformed"
    for name, data in files.items():
        if not isinstance(name, str) or not _BINARY_PATH.fullmatch(name):
            return f"it names an unexpected file {describe_untrusted(name)}"
        if not isinstance(data, bytes):
            return f"the binary {name} is not bytes"
        if hashlib.sha256(data).hexdigest() != digests.get(name):
            return f"the binary {name} does not match its sha256"
    return None


def differing_build(payload: dict[str, object], here: dict[str, str]) -> list[str]:
    """The entries of ``here`` (a ``build_fingerprint()``) that the payload's binaries
    were built with differently; all of them if it records no fingerprint."""
    built = payload.get("build")
    if not isinstance(built, dict):
        return list(here)
    return [key for key in here if built.get(key) != here[key]]


@contextlib.contextmanager
def _recording_kernel_sources(
    on_write: Callable[[str, str], None] | None = None,
) -> Generator[list[tuple[str, str]]]:
    """Record (source, path) of every C++ kernel source inductor writes to its cache.

    ``write`` is where inductor turns a kernel's source and build flags into its key
    and path, before it looks for the binary; ``on_write`` runs at that point.
    """
    from torch._inductor import codecache

    recorded: list[tuple[str, str]] = []
    original = codecache.write

    def recording_write(content: Any, extension: str, *args: Any, **kwargs: Any) -> Any:
        key, path = original(content, extension, *args, **kwargs)
        if extension == "main.cpp":
            recorded.append((content, path))
            if on_write is not None:
                on_write(content, path)
        return key, path

    codecache.write = recording_write
    try:
        yield recorded
    finally:
        codecache.write = original


def _execute_module(graph_source: str) -> None:
    namespace: dict[str, object] = {"__name__": "precompile_gen_kernel_scan"}
    exec(compile(graph_source, "<precompile_gen:kernel-scan>", "exec"), namespace)


def _binary_path(source_path: str) -> str:
    return source_path.removesuffix(".cpp") + ".so"
