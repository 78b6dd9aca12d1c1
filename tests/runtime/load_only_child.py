"""Loads and runs the inductor or eager pair CODE and CACHE on the MLP, as a process
that only loads artifacts, and prints, as one JSON line, which of the modules NAME...
were imported after ``import precompile_gen`` and after loading, the call's result
and the message of a call the driver refuses.

    python load_only_child.py CODE CACHE NAME...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from helpers.mlp_step import mlp

import precompile_gen as pg


def imported(names: list[str]) -> list[str]:
    return sorted(name for name in names if name in sys.modules)


def main(code: Path, cache: Path, names: list[str]) -> None:
    after_import = imported(names)
    forward = pg.load(code.read_text(encoding="utf-8"), cache.read_bytes())
    model = mlp()
    out = forward(model, torch.ones(3, 4))
    assert isinstance(out, torch.Tensor)
    try:
        forward(model, torch.ones(3, 5))  # the driver's error path
        rejected = None
    except pg.PrecompileError as error:
        rejected = str(error)
    report = {
        "after_import": after_import,
        "after_load": imported(names),
        "out": out.tolist(),
        "rejected": rejected,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
