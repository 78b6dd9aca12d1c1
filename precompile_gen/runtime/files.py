"""Files: write an artifact pair to disk so that no crash leaves a torn file.

Each file is written to a temporary file in its target's folder, flushed to disk, and
renamed over the target: a rename within one file system is atomic, so a reader (or a
process started after a crash) sees the old complete file or the new complete one.
Two files cannot be renamed at once, so between the two renames the folder holds a
mixed pair; ``load`` refuses it through the cache's ``code_hash`` ("the two files do
not belong together") instead of running code with a cache made for other code.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from precompile_gen.runtime.errors import PrecompileError

# Temporary files are hidden and named after their target; one left behind by a
# killed writer is never read, and may be deleted at any time.
TEMP_SUFFIX = ".tmp"


def write_pair(
    artifact_path: str | os.PathLike[str],
    cache_path: str | os.PathLike[str],
    python_code: str,
    cache: bytes,
) -> None:
    """Atomically replace the files at ``artifact_path`` and ``cache_path``.

    A process killed at any instant leaves each file either as it was or as written
    here. The cache is renamed into place first, and its folder synced before the
    artifact is renamed: so the first pair written to a folder never shows an artifact
    without its cache, and after a power loss the artifact is not newer on disk than
    its cache. A crash between the two renames leaves the old artifact with the new
    cache, which ``load`` refuses as a mixed pair; writing the pair again repairs it.
    """
    artifact, cache_file = check_pair_paths(artifact_path, cache_path)
    artifact_temp: Path | None = None
    cache_temp: Path | None = None
    cache_replaced = False
    try:
        # Bytes, not text mode: newline translation would change the text that the
        # cache's code_hash was computed over.
        artifact_temp = _write_temporary(artifact, python_code.encode("utf-8"))
        cache_temp = _write_temporary(cache_file, cache)
        os.replace(cache_temp, cache_file)
        cache_temp, cache_replaced = None, True
        _sync_folder(cache_file.parent)
        os.replace(artifact_temp, artifact)
        artifact_temp = None
        _sync_folder(artifact.parent)
    except OSError as error:
        if not cache_replaced:
            outcome = "The files already there are unchanged."
        elif artifact_temp is not None:
            outcome = (
                "The cache is the new one but the artifact is not: a mixed pair, "
                "which load refuses."
            )
        else:
            outcome = "Both files are written, but may not survive a power loss."
        raise PrecompileError(
            f"could not write the pair {artifact} and {cache_file}: "
            f"{error.strerror or error} ({error.filename or artifact.parent}). "
            f"{outcome} Free space or fix the folder's permissions, then write the "
            "pair again."
        ) from error
    finally:
        # Only reached with a temporary still in place when something failed.
        for leftover in (cache_temp, artifact_temp):
            if leftover is not None:
                leftover.unlink(missing_ok=True)


def check_pair_paths(
    artifact_path: str | os.PathLike[str], cache_path: str | os.PathLike[str]
) -> tuple[Path, Path]:
    """The two paths, once they name two files in existing, writable folders; checked
    before the (long) capture, so that a typo fails at once."""
    artifact, cache_file = Path(artifact_path), Path(cache_path)
    if os.path.abspath(artifact) == os.path.abspath(cache_file):
        raise ValueError(
            f"artifact_path and cache_path are the same file ({artifact}); pass two "
            "different paths, e.g. step.py and step.cache."
        )
    for argument, path in (("artifact_path", artifact), ("cache_path", cache_file)):
        folder = path.parent
        if path.is_dir():
            raise ValueError(
                f"{argument} {str(path)!r} is a folder; pass the path of a file in "
                f"it, e.g. {str(path / ('step' + _SUFFIXES[argument]))!r}."
            )
        if not folder.is_dir():
            raise ValueError(
                f"{argument} {str(path)!r} is in a folder that does not exist "
                f"({str(folder)!r}); create it first, e.g. with "
                f"os.makedirs({str(folder)!r}, exist_ok=True)."
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(
                f"{argument} {str(path)!r} is in a folder this process cannot write "
                f"to ({str(folder)!r}); pass a path in a writable folder."
            )
    return artifact, cache_file


_SUFFIXES = {"artifact_path": ".py", "cache_path": ".cache"}


def _write_temporary(target: Path, data: bytes) -> Path:
    """``data`` in a new file next to ``target``, flushed to disk."""
    # pid and a random token keep concurrent writers (processes or threads) apart.
    temporary = target.with_name(
        f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    )
    try:
        # "x": fail rather than share a file; created with the umask's permissions,
        # like the file it replaces would be.
        with open(temporary, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable: the rename is an entry in the folder."""
    if os.name != "posix":
        # Windows cannot open a folder for fsync; NTFS journals the rename itself.
        return
    descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
