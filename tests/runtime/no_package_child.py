"""Calls the artifact file ARTIFACT wrongly in a process where importing
precompile_gen fails: the driver raises its own PrecompileError; prints
LOCAL-ERROR-OK.

    python no_package_child.py ARTIFACT
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

from helpers.small_net import example


class Block(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname.split(".")[0] == "precompile_gen":
            raise ImportError("precompile_gen is blocked in this process")
        return None


def main(artifact_path: Path) -> None:
    sys.meta_path.insert(0, Block())
    model, _ = example()
    artifact: dict[str, object] = {"__name__": "artifact"}
    exec(artifact_path.read_text(encoding="utf-8"), artifact)
    forward = artifact["forward"]
    assert callable(forward)
    try:
        forward(model)
    except RuntimeError as error:
        assert type(error).__name__ == "PrecompileError", type(error)
        assert type(error).__module__ == "artifact", type(error).__module__
        assert "positional arguments" in str(error), str(error)
        assert "precompile_gen" not in sys.modules
        print("LOCAL-ERROR-OK")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
