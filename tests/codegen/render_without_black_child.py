"""Renders both stub artifacts and prints whether black was imported.

PYTHONPATH=tests python render_without_black_child.py
"""

from __future__ import annotations

import sys

from helpers.stubs import stub_capture

import precompile_gen


def main() -> None:
    precompile_gen.render_artifact(stub_capture("eager"))
    precompile_gen.render_artifact(stub_capture("inductor"))
    print("black" in sys.modules)


if __name__ == "__main__":
    main()
