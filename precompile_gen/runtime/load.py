"""Load: check an ``(python_code, cache)`` pair, prime what the cache carries, exec.

The metadata is read from python_code's AST, never by executing it: executing the
inductor module would compile its kernels, the very work the cache is there to skip.
"""

from __future__ import annotations

import ast
import linecache
import logging
import os
from collections.abc import Callable
from typing import cast

import torch

from precompile_gen.capture_result import BACKENDS
from precompile_gen.metadata import METADATA_NAMES, OPTIONAL_METADATA
from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.cache import built_here, check_key, code_hash, read_cache
from precompile_gen.runtime.errors import PrecompileError, listed
from precompile_gen.runtime.metadata_types import Metadata

log = logging.getLogger(__name__)


def parse_metadata(python_code: str) -> Metadata:
    """The artifact's metadata constants, by name, read without executing anything."""
    if not isinstance(python_code, str):
        raise ValueError(
            f"python_code must be the artifact's text (a str), got "
            f"{type(python_code).__name__}."
        )
    return metadata_of(parse_artifact(python_code))


def parse_artifact(python_code: str, what: str = "python_code") -> ast.Module:
    """The artifact's syntax tree; PrecompileError naming ``what`` if it has none."""
    try:
        return ast.parse(python_code)
    # Deeply nested expressions make the parser give up with RecursionError or
    # MemoryError (its own stack guard), not SyntaxError.
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise PrecompileError(
            f"{what} is not valid Python ({type(error).__name__}: {error}); it is not "
            "a precompile_gen artifact, or it was truncated or edited. Pass the "
            "python_code returned by precompile() (or the file it wrote)."
        ) from error


def metadata_of(module: ast.Module) -> Metadata:
    """The metadata constants of a parsed artifact (see ``parse_metadata``)."""
    _reject_rebinding(module)
    found: dict[str, object] = {}
    for statement in module.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        if not isinstance(target, ast.Name) or target.id not in METADATA_NAMES:
            continue
        try:
            found[target.id] = ast.literal_eval(value)
        except (
            ValueError,
            TypeError,
            SyntaxError,
            MemoryError,
            RecursionError,
        ) as error:
            raise PrecompileError(
                f"the metadata constant {target.id} (line {statement.lineno}) is not a "
                "plain literal, so it cannot be read without executing python_code. "
                "Pass the python_code returned by precompile()."
            ) from error
    for name, default in OPTIONAL_METADATA.items():
        found.setdefault(name, default)
    missing = [name for name in METADATA_NAMES if name not in found]
    if missing:
        raise PrecompileError(
            f"python_code lacks {len(missing)} of the metadata constants: it is not a "
            "precompile_gen artifact, was made by another version of precompile_gen, "
            "or was truncated or edited. Pass the python_code returned by "
            "precompile() of this version (precompile again to regenerate it).\n"
            f"  missing {listed(missing)}"
        )
    if found["BACKEND"] not in BACKENDS:
        raise PrecompileError(
            f"python_code names the backend {found['BACKEND']!r}; expected one of "
            f"{list(BACKENDS)}. Pass the python_code returned by precompile()."
        )
    # The literals' types are the annotations' as far as precompile() wrote them;
    # the driver checks what it relies on when the artifact runs.
    return cast(Metadata, {name: found[name] for name in METADATA_NAMES})


def _reject_rebinding(module: ast.Module) -> None:
    """Each metadata constant must be bound exactly once, by its literal assignment;
    any other binding (chained, augmented, nested, imported) would make the values
    read here differ from those the executed artifact uses."""
    bindings: dict[str, list[int]] = {}
    for node in ast.walk(module):
        for name, line in _bound_names(node):
            if name in METADATA_NAMES:
                bindings.setdefault(name, []).append(line)
    for name, lines in bindings.items():
        if len(lines) > 1:
            times = "twice" if len(lines) == 2 else f"{len(lines)} times"
            raise PrecompileError(
                f"python_code assigns the metadata constant {name} {times} (lines "
                f"{lines}); an artifact assigns each exactly once. Pass the "
                "python_code returned by precompile()."
            )


def _bound_names(node: ast.AST) -> list[tuple[str, int]]:
    """The names ``node`` binds, each with its line."""
    names: list[tuple[str, int]] = []
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
        names.append((node.id, node.lineno))
    elif isinstance(node, ast.alias):
        bound = node.asname or node.name.partition(".")[0]
        names.append((bound, getattr(node, "lineno", 0)))
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        names.append((node.name, node.lineno))
    elif isinstance(node, ast.Global | ast.Nonlocal):
        names.extend((name, node.lineno) for name in node.names)
    # ``except E as NAME`` and match-case captures bind a bare name, not an
    # ast.Name node.
    elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar):
        if node.name is not None:
            names.append((node.name, node.lineno))
    elif isinstance(node, ast.MatchMapping) and node.rest is not None:
        names.append((node.rest, node.lineno))
    return names


def load(
    python_code: str | os.PathLike[str],
    cache: bytes | os.PathLike[str] | None,
    *,
    key: bytes | None = None,
) -> Callable[..., object]:
    """A callable with the traced function's positional signature.

    ``python_code`` is the artifact's text (a str is always text) or the path of its
    file; ``cache`` is the cache's bytes or the path of its file, or None to load
    without one (an edited artifact, whose cache no longer belongs to it: an inductor
    artifact's kernels then compile from the code). Raises PrecompileError when
    python_code is not an artifact or the cache belongs to another one; a cache that
    cannot be read is skipped with a warning. With ``key``, the pair must carry a
    signature made with that key, checked before anything from either file is
    executed or written.
    """
    if key is not None:
        check_key(key)
    text, filename = _artifact_text(python_code)
    if filename is None:
        _reject_a_path(text)
    metadata = parse_metadata(text)
    _check_cuda_here(metadata)
    backend = metadata["BACKEND"]
    if cache is None:
        if key is not None:
            raise ValueError(
                "load was given a key but no cache: the signature the key checks is "
                "in the cache. Pass the cache returned by precompile(..., key=...) "
                "with this python_code, or leave out the key to load unsigned code."
            )
        artifact = None
    else:
        cache_bytes = _cache_bytes(cache)
        artifact = read_cache(cache_bytes, python_code=text, backend=backend, key=key)
    signed = key is not None
    if backend != "inductor":
        return _execute(text, filename, signed=signed)
    kernel_binaries.check_cache_folder()
    binaries = None
    if artifact is not None:
        kernel_binaries.refuse_interpreted_elsewhere(artifact)
        binaries = kernel_binaries.prime(
            artifact,
            metadata["KERNEL_BINARIES"],
            metadata["KERNEL_SOURCES"],
            signed=signed,
        )
    # A kernel without a binary compiles through inductor's process-global compiler
    # state, as lowering does; the two take turns.
    with kernel_binaries.TORCH_STATE_LOCK:
        return _execute(text, filename, signed=signed, binaries=binaries or {})


def _check_cuda_here(metadata: Metadata) -> None:
    """Refuse, before anything executes, an artifact captured on CUDA where this
    process has no CUDA device: its first call could only fail, and an inductor
    artifact's kernels, built at load, would fail first with a raw Triton error."""
    devices = [
        device
        for listed_devices in (
            metadata["PARAM_DEVICES"],
            metadata["BUFFER_DEVICES"],
            metadata["USER_INPUT_DEVICES"],
        )
        for device in _listed(listed_devices)
        if isinstance(device, str) and device.startswith("cuda")
    ]
    if not devices or torch.cuda.is_available():
        return
    raise PrecompileError(
        f"python_code was captured for CUDA (its tensors were on {devices[0]!r}), "
        "but this machine has no CUDA device (torch.cuda.is_available() is False). "
        "Load it on a machine with a GPU, or capture again on CPU."
    )


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _reject_a_path(text: str) -> None:
    """Refuse a str that is a file's path rather than an artifact's text: an
    artifact is many lines, so a one-line str naming a file or a .py name is a
    path, and read as code it would only be refused for lacking every constant."""
    if "\n" in text or not (text.endswith(".py") or os.path.isfile(text)):
        return
    raise PrecompileError(
        "python_code is a str, which load reads as the artifact's text, but it is "
        f"the path {text!r}: pass pathlib.Path({text!r}) to load the file, or pass "
        "the file's text."
    )


def _resolve_kernels(namespace: dict[str, object]) -> None:
    # The graph section only records its kernels, as it runs before the runtime
    # support that builds them exists; built here, they are imported (or compiled)
    # at load, and the first call runs them at once.
    resolve = namespace.get("_resolve_kernels")
    if callable(resolve):
        resolve(namespace)


def _artifact_text(python_code: object) -> tuple[str, str | None]:
    """The artifact's text, and the absolute path it was read from (None for text)."""
    if isinstance(python_code, str):
        return python_code, None
    if not isinstance(python_code, os.PathLike):
        raise ValueError(
            "python_code must be the artifact's text (a str) or the path of its file "
            f"(an os.PathLike such as pathlib.Path), got {type(python_code).__name__}."
        )
    path = os.path.abspath(os.fsdecode(os.fspath(python_code)))
    data = _read_file(path, "artifact")
    try:
        return data.decode("utf-8"), path
    except UnicodeDecodeError as error:
        raise PrecompileError(
            f"the artifact file {path} is not UTF-8 text (byte {error.start} is "
            f"{data[error.start : error.start + 1]!r}), so it is not a precompile_gen "
            "artifact, or it was corrupted. Pass the artifact_path precompile() wrote."
        ) from None


def _cache_bytes(cache: object) -> bytes:
    if isinstance(cache, bytes):
        return cache
    if not isinstance(cache, os.PathLike):
        raise ValueError(
            "cache must be the bytes returned by precompile() or the path of the file "
            "it wrote (an os.PathLike such as pathlib.Path), or None to load without "
            f"one, got {type(cache).__name__}."
        )
    return _read_file(os.path.abspath(os.fsdecode(os.fspath(cache))), "cache")


def _read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise PrecompileError(
            f"cannot read the {what} file {path} ({error.strerror or error}). Pass "
            f"the {what}_path that precompile() wrote, or the {what} itself."
        ) from error


# The code hashes of the unsigned artifacts this process has warned about: a
# program that loads one artifact per worker or per request needs the warning once,
# not a copy at every load that drowns its other warnings.
_warned: set[str] = set()


def _log_execution(digest: str, filename: str, *, signed: bool) -> None:
    if signed:
        log.info("precompile_gen.load: executing signed python_code %s.", filename)
    elif built_here(digest) or digest in _warned:
        log.info(
            "precompile_gen.load: executing unsigned python_code %s (%s).",
            filename,
            "this process produced it with precompile()"
            if built_here(digest)
            else "warned about at its first load",
        )
    else:
        _warned.add(digest)
        log.warning(
            "precompile_gen.load is executing python_code %s, which no signature "
            "vouches for (said once per artifact and process). An artifact is code: "
            "load only artifacts you produced or trust.",
            filename,
        )


def _execute(
    python_code: str,
    path: str | None,
    *,
    signed: bool,
    binaries: dict[str, str] | None = None,
) -> Callable[..., object]:
    full_digest = code_hash(python_code)
    digest = full_digest[:12]
    # Tracebacks through the artifact name this file and show its lines: the real
    # path when it was read from one, else a stable name for its text.
    filename = path if path is not None else f"<precompile_gen:{digest}>"
    _log_execution(full_digest, filename, signed=signed)
    # The text is registered with no modification time, which linecache takes as
    # "never re-read from disk": the lines shown stay those that were executed even
    # after the file is rewritten.
    linecache.cache[filename] = (
        len(python_code),
        None,
        python_code.splitlines(keepends=True),
        filename,
    )
    namespace: dict[str, object] = {"__name__": f"precompile_gen_artifact_{digest}"}
    if binaries is not None:
        # Read by the graph section: which kernels import their binary from where.
        namespace["__kernel_binaries__"] = binaries
    try:
        exec(compile(python_code, filename, "exec"), namespace)
        if binaries is not None:
            _resolve_kernels(namespace)
    except PrecompileError:
        raise  # already says what failed and how to fix it
    except Exception as error:
        raise PrecompileError(
            f"executing python_code failed ({type(error).__name__}: {error}). It may "
            "have been edited, or need a torch build it was not made for; produce it "
            "again with precompile()."
        ) from error
    forward = namespace.get("forward")
    if not callable(forward):
        raise PrecompileError(
            "python_code defines no forward() function; it is not a precompile_gen "
            "artifact. Pass the python_code returned by precompile()."
        )
    return forward
