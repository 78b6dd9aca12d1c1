"""Precompiles a small classifier's training step with C++ kernels on the inductor
backend and writes the pair as DIR/code.py and DIR/cache.bin, in the Inductor cache
folder the environment names. Its loss checks its targets' bounds inside a kernel,
whose error message names the kernel's source file.

    python reproducible_capture_child.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import precompile_gen as pg


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    return loss.detach()


def main(folder: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    example = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    code, cache = pg.precompile(train_step, model, *example, backend="inductor")
    (folder / "code.py").write_text(code, encoding="utf-8")
    (folder / "cache.bin").write_bytes(cache)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
