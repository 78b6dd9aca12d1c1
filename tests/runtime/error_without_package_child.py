"""Calls the artifact file ARTIFACT with no arguments in a process where
``import precompile_gen`` raises ImportError, as if it were not installed; prints
the error's type name, whether it is a RuntimeError, its module, whether
precompile_gen is still unimportable, and its message, a line each.

    python error_without_package_child.py ARTIFACT
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(artifact: Path) -> None:
    # Makes `import precompile_gen` raise ImportError, as if not installed.
    sys.modules["precompile_gen"] = None  # type: ignore[assignment]
    namespace: dict[str, object] = {"__name__": "artifact"}
    exec(
        compile(artifact.read_text(encoding="utf-8"), str(artifact), "exec"), namespace
    )
    forward = namespace["forward"]
    assert callable(forward)
    try:
        forward()
    except Exception as error:
        print(type(error).__name__)
        print(isinstance(error, RuntimeError))
        print(type(error).__module__)
        print(sys.modules["precompile_gen"] is None)
        print(error)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
