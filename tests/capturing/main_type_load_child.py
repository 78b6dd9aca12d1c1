"""A script that loads the pair CODE and CACHE, whose artifact names a type of the
capturing script's ``__main__``, which this one lacks; prints the refusal.

    python main_type_load_child.py CODE CACHE
"""

from __future__ import annotations

import sys
from pathlib import Path

import precompile_gen as pg


def main(code: Path, cache: Path) -> None:
    try:
        pg.load(code.read_text(encoding="utf-8"), cache.read_bytes())
    except pg.PrecompileError as error:
        print(error)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
