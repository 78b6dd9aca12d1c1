"""How the artifact's generated lines are laid out: black's style, in one place.

The templates emit code exactly as black (pinned version) formats it, and tests hold
them to it, so a render does not run black: black takes ~0.25 ms a line, and a large
model's metadata runs to thousands of lines. What the templates cannot lay out by
hand, because it depends on the capture, is laid out here, the way black lays it
out, at black's line length:

- a constant's value (``assignment``; tests compare it with black on thousands of
  values), and plain data as a literal (``literal``);
- comment text made safe and filled to the line (``comment_text``,
  ``comment_lines``), a table for a comment (``columns``), a section title's rule;
- a docstring's words (``docstring``), which black leaves where they are;
- a name list too long for one line, one name a line (``one_per_line``): Inductor's
  unpacking of its inputs, the eager graph's signature;
- module-level statements in the runs black separates with a blank line
  (``statement_blocks``): fx's imports and the names it binds.

``format_python`` runs black itself, with the same settings, for the few texts that
are formatted once when they are made (the sparse gradients' code) and for tests.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable

# Black's settings, fixed whatever black's defaults or the user's configuration
# files say.
LINE_LENGTH = 88


# Exact types only: a subclass (``torch.Size``, an ``IntEnum``) reprs into something
# that is not a literal, or not the same literal.
_LITERAL_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, dict)


def literal(value: object) -> str:
    """Render plain data as Python source that ``ast.literal_eval`` reads back equal.

    Deterministic: dict entries are sorted, so equal dicts render identically.
    """
    return _render(value, _repr_atom)


def _render(value: object, atom: Callable[[object], str]) -> str:
    if type(value) not in _LITERAL_TYPES:
        raise TypeError(
            f"cannot render a {type(value).__name__} as a Python literal: {value!r}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_render(v, atom) for v in value) + "]"
    if isinstance(value, tuple):
        items = [_render(v, atom) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(
                f"{_render(k, atom)}: {_render(v, atom)}"
                for k, v in _sorted_items(value)
            )
            + "}"
        )
    return atom(value)


def _sorted_items(value: dict[object, object]) -> list[tuple[object, object]]:
    return sorted(value.items(), key=lambda item: _sort_key(item[0]))


def _sort_key(key: object) -> tuple[int, int, str]:
    # Integer keys (the dims of USER_INPUT_BOUNDS) in numeric order; any other key
    # by its rendered text, which orders every mix of types.
    if isinstance(key, int) and type(key) is int:
        return (0, key, "")
    return (1, 0, literal(key))


def assignment(value: object, target: str, *, nonfinite: bool = False) -> str:
    """``target = value`` as black formats it: on one line if it fits, else split at
    the value's brackets, one element a line, recursively; a too-long atom in
    parentheses. With ``nonfinite``, an infinite or NaN float is written as
    ``float("inf")`` and the like (which ``ast.literal_eval`` cannot read back)."""
    atom = _nonfinite_black_atom if nonfinite else _black_atom
    return "\n".join(_layout(f"{target} = ", value, "", 0, top=True, atom=atom))


def _layout(
    head: str,
    value: object,
    tail: str,
    depth: int,
    *,
    top: bool,
    atom: Callable[[object], str],
) -> list[str]:
    indent = "    " * depth
    flat = _render(value, atom)
    if len(indent) + len(head) + len(flat) + len(tail) <= LINE_LENGTH:
        return [indent + head + flat + tail]
    if not isinstance(value, list | tuple | dict) or not value:
        # An atom that does not fit goes into parentheses on a line of its own: after
        # an annotated target always, after a plain one only if that makes it fit.
        wrapped = f"{indent}    {flat}"
        if top and (":" in head or len(wrapped) <= LINE_LENGTH):
            return [indent + head + "(", wrapped, indent + ")" + tail]
        return [indent + head + flat + tail]
    opening, closing = {list: "[]", tuple: "()", dict: "{}"}[type(value)]
    items: list[tuple[str, object]] = (
        [(_render(k, atom) + ": ", v) for k, v in _sorted_items(value)]
        if isinstance(value, dict)
        else [("", v) for v in value]
    )
    # Black gives each element a line of its own, with a trailing comma, where a
    # comma separates the elements; a lone element (but a 1-tuple) keeps no comma.
    comma = "," if len(items) > 1 or isinstance(value, tuple) else ""
    lines = [indent + head + opening]
    for item_head, item in items:
        lines += _layout(item_head, item, comma, depth + 1, top=False, atom=atom)
    lines.append(indent + closing + tail)
    return lines


def _check_finite(value: object) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"cannot render the non-finite float {value!r} as a literal")


def _repr_atom(value: object) -> str:
    _check_finite(value)
    return repr(value)


def _nonfinite_black_atom(value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f'float("{value}")'
    return _black_atom(value)


def _black_atom(value: object) -> str:
    _check_finite(value)
    text = repr(value)
    if isinstance(value, float):
        # Black drops the sign of a positive exponent: 1e+16 -> 1e16.
        return text.replace("e+", "e")
    if isinstance(value, str):
        singles, doubles = value.count("'"), value.count('"')
    elif isinstance(value, bytes):
        singles, doubles = value.count(b"'"), value.count(b'"')
    else:
        return text
    # repr quotes with ' (escaping each ' in the text) unless the text has a ' and no
    # ". Black prefers ", escaping each " instead, unless that takes more backslashes.
    if text.endswith('"') or doubles > singles:
        return text
    prefix = "b" if isinstance(value, bytes) else ""
    body = text[len(prefix) + 1 : -1].replace("\\'", "'").replace('"', '\\"')
    return f'{prefix}"{body}"'


def comment_text(text: str) -> str:
    """``text`` made safe for a one-line ``#`` comment: line breaks and other
    unprintable characters are escaped, so no name can end the comment and
    inject code into the artifact."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def comment_lines(text: str, indent: int = 0, lead: int = 0) -> list[str]:
    """``text`` made safe for comments (``comment_text``) and filled into ``#`` lines
    at ``indent``, to black's line length, ``lead`` more columns after the ``# ``."""
    prefix = " " * indent + "# " + " " * lead
    return textwrap.wrap(
        comment_text(text),
        width=LINE_LENGTH,
        initial_indent=prefix,
        subsequent_indent=prefix,
        break_on_hyphens=False,
        break_long_words=False,
    )


def section_rule(character: str) -> str:
    """A section title's rule, ``character`` repeated to the width the artifact's
    titles take: the line limit, less the comment's "# " and a margin."""
    return character * (LINE_LENGTH - 4)


def columns(rows: list[list[str]]) -> list[str]:
    """``rows`` as the lines of a table for a comment: each cell made safe for one
    (``comment_text``) and padded to its column's width, no trailing spaces."""
    cells = [[comment_text(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [
        "  ".join(
            cell.ljust(width) for cell, width in zip(row, widths, strict=True)
        ).rstrip()
        for row in cells
    ]


def format_python(source: str) -> str:
    """``source`` as black formats it, with the artifact's settings: what the
    templates' output must equal (tests and template authors use it)."""
    import black  # imported lazily: only rendering needs it, and it is slow to import

    mode = black.Mode(
        target_versions={black.TargetVersion.PY311},
        line_length=LINE_LENGTH,
    )
    return black.format_str(source, mode=mode)


def docstring(text: str, *, indent: int) -> list[str]:
    """``text`` as a docstring's lines at ``indent``, filled to black's line length:
    black leaves a docstring's words where they are, so this is where they go."""
    width = LINE_LENGTH - indent
    lines = textwrap.wrap(f'"""{text}', width=width, break_on_hyphens=False)
    if len(lines[-1]) + 3 <= width:
        lines[-1] += '"""'
    else:
        lines.append('"""')
    return lines


def one_per_line(opening: str, names: list[str], closing: str, indent: str) -> str:
    """``opening`` + the comma-separated ``names`` + ``closing`` at ``indent``, on
    one line where it fits; else as black splits it: one name a line, each with a
    trailing comma."""
    line = f"{indent}{opening}{', '.join(names)}{closing}"
    if len(line) <= LINE_LENGTH:
        return line
    lines = [f"{indent}{opening}", *(f"{indent}    {name}," for name in names)]
    return "\n".join([*lines, f"{indent}{closing}"])


def statement_blocks(lines: list[str]) -> list[list[str]]:
    """One-line module-level statements in the runs black separates with a blank
    line: after an import, before a statement that is not one."""
    blocks: list[list[str]] = []
    previous_import = False
    for line in lines:
        is_import = line.startswith(("import ", "from "))
        if not blocks or (previous_import and not is_import):
            blocks.append([])
        blocks[-1].append(line)
        previous_import = is_import
    return blocks
