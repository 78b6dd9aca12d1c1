"""Render every template into type-checkable modules.

    python scripts/stubs.py OUT_DIR
    python -m pyrefly check -c pyproject.toml OUT_DIR/*.py

Each backend's artifact is rendered with typed placeholder metadata and a typed
stand-in for the compiled graph (``tests/helpers/stubs.py``), once with every driver
feature on, once with every one off, and once with every one on and the graph on
DTensors' local shards: between them, every branch of every template.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for the stubs (created)")
    args = parser.parse_args(argv)
    # This checkout's code and its tests' helpers, whatever copy is installed.
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from helpers.stubs import write_stubs

    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(
            f"{args.out_dir} is a file, not a folder: pass a folder for the stubs "
            "(one that does not exist yet is created)."
        )
    for path in write_stubs(args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
