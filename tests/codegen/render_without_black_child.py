"""Renders both stub artifacts and prints whether black was imported.

python render_without_black_child.py
"""

from __future__ import annotations

import sys

import precompile_gen
from precompile_gen.codegen.stubs import stub_capture


def main() -> None:
    precompile_gen.render_artifact(stub_capture("eager"))
    precompile_gen.render_artifact(stub_capture("inductor"))
    print("black" in sys.modules)


if __name__ == "__main__":
    main()
