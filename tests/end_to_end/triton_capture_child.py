"""Precompiles one of ``helpers.triton_programs`` with Inductor's Triton kernels, run
by Triton's interpreter, and writes the pair as DIR/code.py and DIR/cache.bin.

    python triton_capture_child.py PROGRAM DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton reads it when it is imported, which creating an optimizer may do.
os.environ["TRITON_INTERPRET"] = "1"

from helpers.triton_programs import PROGRAMS

import precompile_gen as pg
from precompile_gen.testing import triton_interpreter


def main(program: str, folder: Path) -> None:
    chosen = PROGRAMS[program]
    with triton_interpreter():
        code, cache = pg.precompile(chosen.fn, *chosen.arguments(), backend="inductor")
    (folder / "code.py").write_text(code, encoding="utf-8")
    (folder / "cache.bin").write_bytes(cache)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
