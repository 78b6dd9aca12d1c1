"""Loads the inductor pair CODE and CACHE of the MLP training step in a fresh process,
checks one call against eager, and prints, as one JSON line, the loss, whether
Inductor or Dynamo was imported (compiling a kernel needs Inductor: a process that
never imported it compiled nothing) and where torch was imported from.

    python fresh_load_child.py CODE CACHE
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from helpers.mlp_step import inputs, mlp, train_step

import precompile_gen as pg


def main(code: Path, cache: Path) -> None:
    forward = pg.load(code.read_text(encoding="utf-8"), cache.read_bytes())
    model, reference = mlp(), mlp()
    loss = forward(model, *inputs())
    torch.testing.assert_close(loss, train_step(reference, *inputs()))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    assert isinstance(loss, torch.Tensor)
    report = {
        "loss": float(loss),
        "imported": sorted(
            name for name in ("torch._inductor", "torch._dynamo") if name in sys.modules
        ),
        "torch_dir": os.path.dirname(torch.__file__),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
