"""Load: check an ``(python_code, cache)`` pair, prime what the cache carries, exec.

The metadata is read from python_code's AST, never by executing it: executing the
inductor module would compile its kernels, the very work the cache is there to skip.
"""

from __future__ import annotations

import ast
import linecache
import logging
from collections.abc import Callable

from precompile_gen import kernel_binaries
from precompile_gen.cache import code_hash, read_cache
from precompile_gen.capture_result import BACKENDS, METADATA_NAMES
from precompile_gen.errors import PrecompileError

log = logging.getLogger(__name__)


def parse_metadata(python_code: str) -> dict[str, object]:
    """The artifact's metadata constants, by name, read without executing anything."""
    if not isinstance(python_code, str):
        raise ValueError(
            f"python_code must be the artifact's text (a str), got "
            f"{type(python_code).__name__}."
        )
    try:
        module = ast.parse(python_code)
    except (SyntaxError, ValueError) as error:
        raise PrecompileError(
            f"python_code is not valid Python ({type(error).__name__}: {error}); it "
            "is not a precompile_gen artifact, or it was truncated or edited. Pass the "
            "python_code returned by precompile()."
        ) from error
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
    missing = [name for name in METADATA_NAMES if name not in found]
    if missing:
        raise PrecompileError(
            f"python_code lacks the metadata constants {missing}; it is not a "
            "precompile_gen artifact, or it was truncated or edited. Pass the "
            "python_code returned by precompile()."
        )
    if found["BACKEND"] not in BACKENDS:
        raise PrecompileError(
            f"python_code names the backend {found['BACKEND']!r}; expected one of "
            f"{list(BACKENDS)}. Pass the python_code returned by precompile()."
        )
    return {name: found[name] for name in METADATA_NAMES}


def _reject_rebinding(module: ast.Module) -> None:
    """Each metadata constant must be bound exactly once, by its literal assignment;
    any other binding (chained, augmented, nested, imported) would make the values
    read here differ from those the executed artifact uses."""
    bindings: dict[str, list[int]] = {}
    for node in ast.walk(module):
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
        for name, line in names:
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


def load(python_code: str, cache: bytes) -> Callable[..., object]:
    """A callable with the traced function's positional signature.

    Raises PrecompileError when python_code is not an artifact or the cache belongs
    to another one; a cache that cannot be read is skipped with a warning.
    """
    metadata = parse_metadata(python_code)
    if not isinstance(cache, bytes):
        raise ValueError(
            f"cache must be the bytes returned by precompile(), got "
            f"{type(cache).__name__}."
        )
    backend = str(metadata["BACKEND"])
    artifact = read_cache(cache, python_code=python_code, backend=backend)
    if (
        artifact is not None
        and backend == "inductor"
        and kernel_binaries.prime(artifact)
    ):
        with kernel_binaries.loading_config():
            return _execute(python_code)
    return _execute(python_code)


def _execute(python_code: str) -> Callable[..., object]:
    digest = code_hash(python_code)[:12]
    filename = f"<precompile_gen:{digest}>"
    log.warning(
        "precompile_gen.load is executing python_code %s, which no signature vouches "
        "for. An artifact is code: load only artifacts you produced or trust.",
        filename,
    )
    # Registered so tracebacks through the artifact show its source lines.
    linecache.cache[filename] = (
        len(python_code),
        None,
        python_code.splitlines(keepends=True),
        filename,
    )
    namespace: dict[str, object] = {"__name__": f"precompile_gen_artifact_{digest}"}
    try:
        exec(compile(python_code, filename, "exec"), namespace)
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
