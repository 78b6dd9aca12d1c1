"""The compiled kernels the inductor cache carries, and how a loader puts them in place.

Inductor's module compiles each C++ kernel on import unless it finds the binary in its
cache folder, under a key it computes with its compiler toolchain (importing which
takes seconds). The cache therefore carries each kernel binary, and the artifact pins
which binary belongs to which kernel: KERNEL_SOURCES maps the sha256 of a kernel's
source to the binary's file key, KERNEL_BINARIES maps that key to the binary's sha256.
``load`` writes the pinned binaries into inductor's cache folder and executes the
artifact with their paths; the artifact imports each kernel from its binary, and
hands any kernel without one to Inductor, which compiles it (see
``inductor_imports``). Nothing of Inductor is imported when every binary is there.

A binary is used only where it can run: the same torch and Python, on the same
machine architecture and CPU capability. The compiler and the install paths do not
matter to a binary that is imported directly, so a pair built in one virtualenv, or
on a machine with another compiler, loads its kernels in another.

Triton kernels on a GPU are compiled by Triton, which keeps each compiled kernel in a
folder of its cache named by a key over the kernel's source, its options, the
installed Triton and the GPU target: the binary (cubin or hsaco), its launch
metadata, and the intermediate forms. The payload carries those folders, as
``triton/<device>/<key>/<file>``, pinned in KERNEL_BINARIES like the C++ binaries;
``load`` writes them back into Triton's cache folder, where Triton's own lookup finds
them and compiles nothing. Triton computes the key itself, so a folder built for
another GPU or another Triton is simply not found there, and that kernel compiles
from its source in the artifact.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import os
import platform
import re
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from precompile_gen.runtime.errors import PrecompileError, describe_untrusted

log = logging.getLogger(__name__)

PAYLOAD_KIND = "inductor-cpp-kernels"

# Inductor keys are "c" + 51 base32 characters, stored in a folder named after
# characters 1-2; Triton's are 52 base32 characters (older Tritons: base64 or hex),
# each a folder of files named after the kernel, under a folder per device index
# ("None" for a kernel built for whichever device loads it). Nothing else may be
# written from a cache.
_BINARY_PATH = re.compile(
    r"[a-z0-9]{2}/c[a-z0-9]{51}\.main\.so"
    r"|triton/(?:\d{1,4}|None)/[A-Za-z0-9_-]{32,88}/\w{1,160}\.[a-z0-9]{1,8}"
)
# Triton's cache writes the absolute path of a kernel's folder into its metadata
# (``__grp__<kernel>.json`` lists the folder's files by path): the payload holds this
# in its place, and ``load`` writes the folder it writes them to.
_TRITON_FOLDER = b"@TRITON_KERNEL_FOLDER@"

# torch's tracer (make_fx, fx's patcher) and inductor's compiler (config.patch,
# kernel compilation) keep process-wide state: capture, lowering, the kernel scan and
# executing an inductor artifact take turns on this lock.
TORCH_STATE_LOCK = threading.RLock()


def build_fingerprint() -> dict[str, str]:
    """What a kernel binary needs of the process that imports it."""
    import torch

    fingerprint = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    # Plain str (torch.__version__ is a subclass), so the cache stays readable with
    # torch.load(weights_only=True).
    return {key: str(value) for key, value in fingerprint.items()}


class Collected(NamedTuple):
    """What the kernel scan finds in a lowered module."""

    # The cache's payload: every C++ kernel binary, and what it carries of the rest.
    payload: dict[str, object]
    # The artifact's KERNEL_SOURCES: each kernel source's sha256 -> its binary's key.
    kernel_sources: dict[str, str]
    # The names of the module's Triton kernels. Each compiles, or is interpreted,
    # from its source in the artifact, unless the payload carries Triton's cache
    # folder for it.
    triton_kernels: list[str]


def collect(graph_source: str, toolchain: dict[str, str]) -> Collected:
    """The payload carrying every kernel binary ``graph_source`` loads, the
    artifact's KERNEL_SOURCES and the module's Triton kernels.

    Runs right after lowering, when the kernels are compiled: the module is executed
    once more in a scratch namespace, which only loads binaries, and each C++
    kernel's source is paired with the binary inductor looks up for it. Each Triton
    kernel Triton compiled brings its cache folders (one per configuration Inductor
    may pick from at the first call).
    """
    from torch._inductor import codecache
    from torch._inductor.async_compile import AsyncCompile

    root = Path(codecache.cache_dir())
    sources: dict[str, str] = {}
    files: dict[str, bytes] = {}
    triton_kernels: dict[str, str] = {}  # each Triton kernel's name -> its source
    kernel_source: list[str] = []
    original_pybinding, original_write = AsyncCompile.cpp_pybinding, codecache.write
    original_triton = AsyncCompile.triton

    def recording_pybinding(self: Any, argtypes: list[str], source: str) -> Any:
        kernel_source[:] = [source]
        return original_pybinding(self, argtypes, source)

    def recording_triton(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        triton_kernels[name] = args[0]  # Inductor's module passes the source second
        return original_triton(self, name, *args, **kwargs)

    def recording_write(
        content: Any, extension: str, extra: str = "", *args: Any, **kwargs: Any
    ) -> Any:
        key, path = original_write(content, extension, extra, *args, **kwargs)
        if extension == "main.cpp" and kernel_source:
            source = kernel_source.pop()
            binary = Path(binary_path(path))
            name = binary.relative_to(root).as_posix()
            sources[hashlib.sha256(source.encode()).hexdigest()] = name
            files[name] = binary.read_bytes() if binary.is_file() else b""
        return key, path

    AsyncCompile.cpp_pybinding = recording_pybinding  # type: ignore[method-assign]
    AsyncCompile.triton = recording_triton  # type: ignore[method-assign]
    codecache.write = recording_write
    try:
        namespace: dict[str, object] = {"__name__": "precompile_gen_kernel_scan"}
        exec(compile(graph_source, "<precompile_gen:kernel-scan>", "exec"), namespace)
    finally:
        AsyncCompile.cpp_pybinding = original_pybinding  # type: ignore[method-assign]
        AsyncCompile.triton = original_triton  # type: ignore[method-assign]
        codecache.write = original_write
    # A kernel whose binary was not written (the scan found it some other way) is
    # left to compile at load.
    files = {name: data for name, data in files.items() if data}
    sources = {digest: name for digest, name in sources.items() if name in files}
    if triton_kernels and not _triton_interpreted():
        triton, toolchain = _compiled_triton(namespace, triton_kernels, toolchain)
        files.update(triton)
    payload = make_payload(files, list(triton_kernels), toolchain)
    return Collected(payload, sources, list(triton_kernels))


def _compiled_triton(
    namespace: dict[str, object], sources: dict[str, str], toolchain: dict[str, str]
) -> tuple[dict[str, bytes], dict[str, str]]:
    """The files of each compiled Triton kernel the module bound in ``namespace``
    (``sources``: each one's name and source), by payload name, and ``toolchain``
    with what built them."""
    from precompile_gen.lowering import kernel_builds

    built = {name: (namespace.get(name), source) for name, source in sources.items()}
    kernel_builds.record_triton_sources(built)
    files = triton_files(kernel for kernel, _ in built.values())
    return files, {**toolchain, **kernel_builds.triton_toolchain(files)}


def triton_files(kernels: Iterable[object]) -> dict[str, bytes]:
    """The files of Triton's cache folder for each compiled configuration of
    ``kernels`` (Inductor's ``CachingAutotuner``s, as its module binds them), by
    payload name, with each folder's path in their metadata replaced.

    Each configuration is built once more without line tables, which would name the
    kernel's source file in Inductor's cache folder, and filed under the key Triton
    computes for it in a loading process (``kernel_builds.triton_without_line_info``).
    """
    # The scan runs at capture, which has Triton's compiler.
    from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key

    from precompile_gen.lowering import kernel_builds

    files: dict[str, bytes] = {}
    for kernel in kernels:
        triton_meta = getattr(kernel, "triton_meta", None)
        if not isinstance(triton_meta, dict):
            continue  # not built as Inductor builds a Triton kernel: compiled at load
        device = str(triton_meta.get("device", 0))
        for result in getattr(kernel, "compile_results", ()):
            key = triton_hash_to_path_key(result.kernel.hash)
            built = kernel_builds.triton_without_line_info(result.kernel)
            if built is None:
                # Spelled as Triton spells it in the metadata.
                built = folder_files(os.path.join(triton_folder(device), key))
            for file_name, data in built.items():
                name = f"triton/{device}/{key}/{file_name}"
                if _BINARY_PATH.fullmatch(name):
                    files[name] = data
    return files


def folder_files(folder: str) -> dict[str, bytes]:
    """The files of one kernel's folder in Triton's cache, by name, with the folder's
    path in their metadata replaced."""
    files: dict[str, bytes] = {}
    for path in sorted(Path(folder).iterdir()) if os.path.isdir(folder) else []:
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".json":
                data = data.replace(folder.encode(), _TRITON_FOLDER)
            files[path.name] = data
    return files


def triton_folder(device: str) -> str:
    """Triton's cache folder for kernels of ``device`` (an index, or "None"), found
    as Inductor finds it: TRITON_CACHE_DIR if set, else ``triton/<device>`` in
    inductor's cache folder."""
    folder = os.environ.get("TRITON_CACHE_DIR")
    return folder if folder else os.path.join(kernel_folder(), "triton", device)


def make_payload(
    files: dict[str, bytes],
    triton_kernels: list[str],
    toolchain: dict[str, str] | None = None,
) -> dict[str, object]:
    """The cache's payload for kernel ``files`` (by payload name) and the module's
    Triton kernels, with this environment's build fingerprint and the ``toolchain``
    that built them (``kernel_builds.toolchain``), for a rebuild to compare with."""
    return {
        "kind": PAYLOAD_KIND,
        "build": build_fingerprint(),
        "toolchain": dict(toolchain or {}),
        "files": files,
        "sha256": {
            name: hashlib.sha256(data).hexdigest() for name, data in files.items()
        },
        # Said, not left to the manifest: the Triton kernels travel as source, in
        # the artifact, and on a GPU as Triton's cache folders in "files" too. Under
        # Triton's interpreter there is no binary to carry (it runs each kernel's
        # Python source with NumPy).
        "triton_kernels": list(triton_kernels),
        "triton_interpreted": bool(triton_kernels) and _triton_interpreted(),
    }


def refuse_interpreted_elsewhere(payload: object) -> None:
    """Refuse, before anything executes, a cache whose Triton kernels were made under
    Triton's interpreter where this process does not run them through it: Triton
    finds no backend for their CPU tensors, or, with TRITON_INTERPRET=1 alone and
    not the rest of the set-up, fails inside the first call."""
    if not isinstance(payload, dict) or payload.get("triton_interpreted") is not True:
        return
    testing = sys.modules.get("precompile_gen.testing")
    if testing is not None and testing.interpreting():
        return
    raise PrecompileError(
        "this pair was made under Triton's interpreter (its cache says so): its "
        "Triton kernels run on CPU tensors only through the interpreter, with NumPy. "
        "Load and call it inside precompile_gen.testing.triton_interpreter(), with "
        "TRITON_INTERPRET=1 set before torch is imported; or capture again without "
        "the interpreter, for C++ kernels on the CPU or Triton's on a GPU."
    )


def _triton_interpreted() -> bool:
    """Whether Triton runs its kernels through its interpreter in this process."""
    from triton import knobs

    return knobs.runtime.interpret


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


def kernel_folder() -> str:
    """Inductor's cache folder, found as inductor finds it (without importing it):
    TORCHINDUCTOR_CACHE_DIR if set, else ``torchinductor_<user>`` in the temp folder."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        user = re.sub(r'[\\/:*?"<>|]', "_", user)
        folder = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return os.path.abspath(folder)


def prime(
    payload: object, pinned: object, kernel_sources: object, *, signed: bool = False
) -> dict[str, str] | None:
    """Write the payload's binaries into inductor's cache folder, if the artifact pins
    each of them (``pinned``: its KERNEL_BINARIES).

    Returns what the artifact is executed with, ``{sha256 of a kernel's source: the
    path of its binary}`` for the kernels ``kernel_sources`` (its KERNEL_SOURCES)
    names; None (after a logged warning) when the payload cannot be used here. A
    signed pair whose cache brings a binary the artifact does not pin was tampered
    with: that is a PrecompileError.
    """
    reason = _unusable(payload, build_fingerprint())
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
    assert isinstance(payload, dict) and isinstance(kernel_sources, dict)
    files: dict[str, bytes] = payload["files"]
    root = kernel_folder()
    for name, data in files.items():
        target, data = _destination(root, name, data)
        try:
            _write_binary(target, data)
        except OSError as error:
            folder, variable = _folder_of(root, name)
            raise PrecompileError(
                f"cannot write the cache's kernel binaries into {folder} "
                f"({error.strerror or error}: {error.filename}); an inductor "
                f"artifact loads its kernels from files there. Set {variable} to a "
                "folder this process can write to, and load again."
            ) from error
    return {
        str(digest): os.path.join(root, name)
        for digest, name in kernel_sources.items()
        if name in files
    }


def _folder_of(root: str, name: str) -> tuple[str, str]:
    """The cache folder the payload's file ``name`` goes to, described, and the
    environment variable that moves it."""
    if not name.startswith("triton/"):
        return f"inductor's cache folder {root}", "TORCHINDUCTOR_CACHE_DIR"
    folder = triton_folder(name.split("/")[1])
    if os.environ.get("TRITON_CACHE_DIR"):
        return f"Triton's cache folder {folder}", "TRITON_CACHE_DIR"
    return f"Triton's cache folder {folder}", "TORCHINDUCTOR_CACHE_DIR"


def _destination(root: str, name: str, data: bytes) -> tuple[Path, bytes]:
    """Where the payload's file ``name`` goes, and what is written there: a C++
    binary under inductor's cache folder ``root``, a Triton file in Triton's, its
    folder's path restored in its metadata."""
    if not name.startswith("triton/"):
        return Path(root, name), data
    _, device, key, file = name.split("/")
    folder = os.path.join(triton_folder(device), key)
    if file.endswith(".json"):
        data = data.replace(_TRITON_FOLDER, folder.encode())
    return Path(folder, file), data


def _write_binary(target: Path, data: bytes) -> None:
    # A file already there is kept if it holds these very bytes, which a running
    # process may have imported; any other is replaced.
    try:
        if target.read_bytes() == data:
            return
    except OSError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: a concurrent loader never sees half a binary.
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


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
    its kind, its manifest, a file name outside inductor's binaries and Triton's
    cache folders, a digest."""
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


def binary_path(source_path: str) -> str:
    """The binary Inductor builds from the C++ source at ``source_path``."""
    return source_path.removesuffix(".cpp") + ".so"
