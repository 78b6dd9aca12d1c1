"""A capturing script whose result type is its own (``__main__:Out``): precompiles,
writes the pair to CODE and CACHE, loads it here, where the type is defined, and
prints the artifact's PYTREE_TYPES.

    python main_type_capture_child.py CODE CACHE
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

import precompile_gen as pg


@dataclasses.dataclass
class Out:
    y: torch.Tensor


def predict(model: nn.Module, x: torch.Tensor) -> Out:
    return Out(model(x))


def main(code_path: Path, cache_path: Path) -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(3, 4)
    python_code, cache = pg.precompile(predict, model, x, backend="eager")
    code_path.write_text(python_code, encoding="utf-8")
    cache_path.write_bytes(cache)
    out = pg.load(python_code, cache)(model, x)
    assert type(out) is Out, type(out)
    torch.testing.assert_close(out.y, model(x))
    print(pg.parse_metadata(python_code)["PYTREE_TYPES"])


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
