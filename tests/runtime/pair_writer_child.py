"""Rewrites the pair ARTIFACT and CACHE in a loop, with each (CODE, DATA) pair of
files in turn, until it is killed; prints "ready" before the first write.

    python -S pair_writer_child.py FILES_PY ARTIFACT CACHE CODE DATA [CODE DATA ...]

Run without site-packages (``-S``): it loads precompile_gen's files.py (FILES_PY)
and the error module next to it by path, so that it starts without importing torch,
which importing the precompile_gen package would.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(files_py: Path, artifact: str, cache: str, sources: list[str]) -> None:
    load("precompile_gen.runtime.errors", files_py.with_name("errors.py"))
    files = load("precompile_gen.runtime.files", files_py)
    pairs = []
    for code, data in zip(sources[::2], sources[1::2], strict=True):
        pairs.append((Path(code).read_bytes().decode("utf-8"), Path(data).read_bytes()))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    i = 0
    while True:
        files.write_pair(artifact, cache, *pairs[i % len(pairs)])
        i += 1


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])
