"""The environment of a child process that runs one of the tests' scripts."""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent


def env_with_helpers(**extra: str) -> dict[str, str]:
    """This process's environment with the tests folder on PYTHONPATH, so that the
    child imports ``helpers`` as the tests do; precompile_gen it finds as this
    process did (installed, or through the PYTHONPATH it inherits)."""
    paths = [str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}
