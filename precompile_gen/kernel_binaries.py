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
capability) matches this machine and its sha256 matches the manifest; otherwise the
artifact compiles its kernels as it would without a cache. The install paths of torch
and Python are part of inductor's keys but not of the binaries: when only they differ
(a pair built in one virtualenv, loaded in another), each kernel binary is placed
under the key inductor computes here (``_placing_moved_binaries``).
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
# An install path as the build fingerprint may record it: absolute, no whitespace.
_PLAIN_PATH = re.compile(r"/[^\s]*")

# torch's tracer (make_fx, fx's patcher) and inductor's compiler (config.patch,
# kernel compilation) keep process-wide state: capture, lowering, the kernel scan and
# executing an inductor artifact take turns on this lock.
TORCH_STATE_LOCK = threading.RLock()


# The fingerprint entries that say where torch and Python are installed. They are in
# the build command line, so in inductor's keys, but a binary built under other paths
# is the same binary: they may differ between the build and the load.
INSTALL_PATHS = ("torch_dir", "python_include", "python_libdir")


def build_fingerprint() -> dict[str, str]:
    """What a kernel binary depends on besides its source, and its install paths."""
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
        "python_libdir": sysconfig.get_config_var("LIBDIR") or "",
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

    def link_lowered_binary(source: str, _flags: str, path: str) -> None:
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


def prime(
    payload: object, pinned: object, *, signed: bool = False
) -> contextlib.AbstractContextManager[None] | None:
    """Write the payload's binaries into the inductor cache folder, if the artifact
    pins each of them (``pinned``: its KERNEL_BINARIES).

    Returns the context to execute the artifact in, under which inductor loads the
    binaries instead of compiling; None (after a logged warning) when the payload
    cannot be used here. A signed pair whose cache brings a binary the artifact does
    not pin was tampered with: that is a PrecompileError.
    """
    here = build_fingerprint()
    reason = _unusable(payload, here)
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
        return None
    from torch._inductor import codecache

    assert isinstance(payload, dict)
    files: dict[str, bytes] = payload["files"]
    moved = _moved_install_paths(payload, here)
    # Named in the error if even creating the folder fails.
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "(its default location)"
    try:
        root = codecache.cache_dir()  # creates the folder
        for name, data in files.items():
            probe = not name.endswith(".main.so")
            # A kernel binary's key names the install paths: when they moved, it is
            # placed under this environment's key as inductor asks for it. A probe's
            # key does not (compiler, ISA flags and torch version only).
            if probe or not moved:
                _write_binary(Path(root, name), data, probe=probe)
    except OSError as error:
        raise _unwritable(root, error) from error
    if moved:
        return _placing_moved_binaries(files, moved, root)
    return loading_config()


def _unwritable(root: str, error: OSError) -> PrecompileError:
    # Compiling from python_code instead would need to write there too.
    return PrecompileError(
        f"cannot write the cache's kernel binaries into inductor's cache folder "
        f"{root} ({error.strerror or error}: {error.filename}); an inductor artifact "
        "loads its kernels from files there. Set TORCHINDUCTOR_CACHE_DIR to a folder "
        "this process can write to, and load again."
    )


def _moved_install_paths(
    payload: dict[str, object], here: dict[str, str]
) -> dict[str, str]:
    """This environment's install paths (from ``here``, a ``build_fingerprint()``)
    that differ from the build's, each mapped to the build's path ({} when the pair
    is loaded where it was built)."""
    built = payload["build"]
    assert isinstance(built, dict)
    return {
        here[key]: built[key]
        for key in INSTALL_PATHS
        if built[key] != here[key] and here[key]
    }


@contextlib.contextmanager
def _placing_moved_binaries(
    files: dict[str, bytes], moved: dict[str, str], root: str
) -> Generator[None]:
    """Execute under ``loading_config``, writing each kernel binary under the key
    inductor computes here just before inductor looks for it.

    Inductor's key is a hash of the kernel's source and build command line. The
    command line the build had is this environment's with each moved install path
    replaced by the build's; if hashing the kernel source (read from the artifact)
    with it gives the key of a binary the cache carries, that binary was built from
    this very source with the same flags, and it is the one the artifact pins under
    that key. Kernels whose key is not found that way compile, as without a cache.
    """
    from torch._inductor import codecache

    as_built = re.compile(
        "|".join(map(re.escape, sorted(moved, key=len, reverse=True)))
    )
    missed: list[str] = []

    def place(source: str, extra: str, path: str) -> None:
        command = as_built.sub(lambda match: moved[match.group(0)], extra)
        key = codecache.get_hash(source.strip(), command)
        data = files.get(f"{key[1:3]}/{key}.main.so")
        if data is None:
            missed.append(path)
            return
        try:
            _write_binary(Path(_binary_path(path)), data, probe=False)
        except OSError as error:
            raise _unwritable(root, error) from error

    with loading_config(), _recording_kernel_sources(place):
        yield
    if missed:
        log.warning(
            "precompile_gen.load: the cache's compiled kernels were built under other "
            "install paths (%s here); %d of the artifact's kernels matched none of "
            "them with this environment's build flags and were compiled from "
            "python_code (slower, same results).",
            ", ".join(f"{here} was {built}" for here, built in moved.items()),
            len(missed),
        )


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


def _unusable(payload: object, here: dict[str, str]) -> str | None:
    """Why the payload's binaries must not be used in the environment ``here`` (a
    ``build_fingerprint()``), or None. (The envelope's code_hash, checked before,
    binds the payload to its artifact.)"""
    damage = damaged(payload)
    if damage is not None:
        return damage
    assert isinstance(payload, dict)
    built = payload.get("build")
    if not isinstance(built, dict):
        return "it records no build fingerprint"
    differing = [
        key for key in differing_build(payload, here) if key not in INSTALL_PATHS
    ]
    if differing:
        details = ", ".join(
            f"{key} {describe_untrusted(built.get(key))} (here {here[key]!r})"
            for key in differing
        )
        return f"they were built for a different environment: {details}"
    for key in INSTALL_PATHS:
        # Substituted into build command lines: a path, nothing that reads as flags.
        path = built.get(key)
        if path != here[key] and not (
            isinstance(path, str) and _PLAIN_PATH.fullmatch(path)
        ):
            return (
                f"its build fingerprint records the install path {key} as "
                f"{describe_untrusted(path)}, not a plain absolute path"
            )
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
    on_write: Callable[[str, str, str], None] | None = None,
) -> Generator[list[tuple[str, str]]]:
    """Record (source, path) of every C++ kernel source inductor writes to its cache.

    ``write`` is where inductor turns a kernel's source and build flags into its key
    and path, before it looks for the binary; ``on_write(source, build_flags, path)``
    runs at that point.
    """
    from torch._inductor import codecache

    recorded: list[tuple[str, str]] = []
    original = codecache.write

    def recording_write(
        content: Any, extension: str, extra: str = "", *args: Any, **kwargs: Any
    ) -> Any:
        key, path = original(content, extension, extra, *args, **kwargs)
        if extension == "main.cpp":
            recorded.append((content, path))
            if on_write is not None:
                on_write(content, extra, path)
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
