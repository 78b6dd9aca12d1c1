"""An artifact's sections, found by their title comments, for tools that read artifacts.

Each numbered section starts with the three-line title block that the templates'
``section_title`` macro renders::

    # ====...
    # 2. Calling-convention metadata
    # ====...

and everything before the first block is the header. Titles must be numbered 1, 2,
3, ... in order, so a look-alike comment inside the spliced graph (which sits between
titles 1 and 2) cannot start a section.

The last section, the runtime support, is the same text in every artifact of a
precompile_gen version with the same parts (which its title names); its title
carries that text's sha256 (its "stamp"), and its body is the text between the
title and the closing ``if __name__ == "__main__":`` block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from precompile_gen.runtime.errors import PrecompileError

_RULE = re.compile(r"# ={20,}")
_TITLE = re.compile(r"# (\d+)\. (\S.*)")
_STAMP = re.compile(r"\(sha256 ([0-9a-f]{64})\)$")
_MAIN_BLOCK = '\n\n\nif __name__ == "__main__":'

# Section keys by a word of their title; reviewers and JSON output use the keys.
_KEY_WORDS = (
    ("metadata", "metadata"),
    ("driver", "driver"),
    ("graph", "graph"),
    ("runtime", "runtime"),
)
REQUIRED_KEYS = ("graph", "metadata", "driver")


@dataclass(frozen=True)
class Section:
    """One section: ``lines`` are its text lines (with line ends), starting at 1-based
    line ``first_line`` of the artifact."""

    key: str
    number: int | None
    title: str
    first_line: int
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.lines)

    @property
    def last_line(self) -> int:
        return self.first_line + len(self.lines) - 1

    def label(self) -> str:
        return self.title if self.number is None else f"{self.number}. {self.title}"

    @property
    def stamp(self) -> str | None:
        """The sha256 the title gives for the section's body, if it gives one."""
        found = _STAMP.search(self.title)
        return found.group(1) if found else None

    @property
    def body(self) -> str:
        """The text after the title block, up to the closing ``__main__`` block."""
        text = "".join(self.lines[3:])
        end = text.rfind(_MAIN_BLOCK)
        return text if end < 0 else text[: end + 1]


def split_sections(python_code: str) -> list[Section]:
    """The header, then each numbered section, in artifact order.

    Raises PrecompileError when the text lacks the graph, metadata or driver section.
    """
    lines = python_code.splitlines(keepends=True)
    starts: list[tuple[int, int, str]] = []  # (0-based line, number, title)
    for index in range(len(lines) - 2):
        title = _TITLE.fullmatch(lines[index + 1].rstrip("\r\n"))
        if (
            title is not None
            and int(title.group(1)) == len(starts) + 1
            and _RULE.fullmatch(lines[index].rstrip("\r\n"))
            and _RULE.fullmatch(lines[index + 2].rstrip("\r\n"))
        ):
            starts.append((index, int(title.group(1)), title.group(2).strip()))
    header_end = starts[0][0] if starts else len(lines)
    sections = [Section("header", None, "Header", 1, tuple(lines[:header_end]))]
    bounds = [start for start, _, _ in starts] + [len(lines)]
    for (start, number, title), end in zip(starts, bounds[1:], strict=True):
        sections.append(
            Section(
                _key(number, title), number, title, start + 1, tuple(lines[start:end])
            )
        )
    missing = [key for key in REQUIRED_KEYS if key not in {s.key for s in sections}]
    if missing:
        raise PrecompileError(
            f"the file has no {' / '.join(missing)} section title (a '# N. Title' "
            "comment between two '# ====' lines), so it is not a precompile_gen "
            "artifact, or its section comments were edited. Pass a python_code "
            "written by precompile()."
        )
    return sections


def sections_by_key(python_code: str) -> dict[str, Section]:
    return {section.key: section for section in split_sections(python_code)}


def _key(number: int, title: str) -> str:
    # By the title's head: what follows its colon names other things (the runtime
    # support's parts, "captured_graph" among them).
    lowered = title.partition(":")[0].lower()
    for word, key in _KEY_WORDS:
        if word in lowered:
            return key
    return f"section{number}"
