"""Precompiles a small eager step, then loads the pair CODE and CACHE, in a process
whose TORCHINDUCTOR_CACHE_DIR cannot be created; prints, for each, "precompile" or
"load" and the PrecompileError's message on one line (or "no error").

    python unusable_cache_folder_child.py CODE CACHE
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import precompile_gen as pg


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def main(code: Path, cache: Path) -> None:
    calls: list[tuple[str, Callable[[], object]]] = [
        (
            "precompile",
            lambda: pg.precompile(
                predict, nn.Linear(3, 2), torch.randn(4, 3), backend="eager"
            ),
        ),
        ("load", lambda: pg.load(code, cache)),
    ]
    for what, call in calls:
        try:
            call()
            print(what, "no error")
        except pg.PrecompileError as error:
            print(what, str(error).replace("\n", " "))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
