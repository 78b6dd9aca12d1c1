"""No function in the package, the artifact's runtime support, the tools or the
benchmarks is longer than 60 lines: a longer one is split into the steps it takes.
Ruff's C901, PLR0912 and PLR0915 bound their branches and statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("precompile_gen", "scripts", "benchmarks")
MOST_LINES = 60


def _sources() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))


def _too_long(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}() is {length} lines"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MOST_LINES
    ]


def test_the_checked_folders_hold_sources() -> None:
    assert all(any((ROOT / f).rglob("*.py")) for f in FOLDERS)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_longer_than_60_lines(path: Path) -> None:
    assert _too_long(path) == []
