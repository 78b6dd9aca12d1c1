"""The layout helpers the artifact's generated lines share, held to black's."""

from __future__ import annotations

from precompile_gen.codegen import layout


def test_one_per_line_keeps_a_line_that_fits_and_splits_one_that_does_not() -> None:
    assert layout.one_per_line("f(", ["a", "b"], ")", "    ") == "    f(a, b)"
    names = [f"name_{i}" for i in range(20)]
    split = layout.one_per_line("def f(", names, "):", "").splitlines()
    assert split == ["def f(", *(f"    {name}," for name in names), "):"]
    text = "\n".join(split) + "\n    pass\n"
    assert layout.format_python(text) == text


def test_statement_blocks_are_the_runs_black_separates_with_a_blank_line() -> None:
    lines = ["import torch", "from torch import device", "inf = float('inf')", "x = 1"]
    blocks = layout.statement_blocks(lines)
    assert blocks == [lines[:2], lines[2:]]
    text = "\n\n".join("\n".join(block) for block in blocks) + "\n"
    assert layout.format_python(text).replace("'", '"') == text.replace("'", '"')
    assert layout.statement_blocks([]) == []
