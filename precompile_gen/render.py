"""Render: ``CaptureResult`` -> artifact text, through the templates only.

The templates are rendered with a one-line marker where the compiled graph goes; black
formats that (small) text, and the graph is spliced in afterwards. So black never sees
the graph, the graph never passes through Jinja, and the cost of a huge graph is one
string copy.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jinja2

from precompile_gen.capture_result import CaptureResult

# A comment line survives black unchanged at module level; it is replaced by the graph.
GRAPH_MARKER = "# <precompile_gen: compiled graph>"

# Fixed so that the same capture renders the same bytes whatever black's defaults or
# the user's configuration files say.
BLACK_LINE_LENGTH = 88


def template_dir() -> Path:
    """Where the templates are: inside an installed wheel, or at the source root."""
    packaged = Path(__file__).parent / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).parent.parent / "templates"


# Exact types only: a subclass (``torch.Size``, an ``IntEnum``) reprs into something
# that is not a literal, or not the same literal.
_LITERAL_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, dict)


def literal(value: object) -> str:
    """Render plain data as Python source that ``ast.literal_eval`` reads back equal.

    Deterministic: dict entries are sorted, so equal dicts render identically.
    """
    if type(value) not in _LITERAL_TYPES:
        raise TypeError(
            f"cannot render a {type(value).__name__} as a Python literal: {value!r}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"cannot render the non-finite float {value!r} as a literal")
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        items = [literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, dict):
        rendered = sorted(
            (_sort_key(k), literal(k), literal(v)) for k, v in value.items()
        )
        return "{" + ", ".join(f"{k}: {v}" for _, k, v in rendered) + "}"
    return repr(value)


def _sort_key(key: object) -> tuple[int, int, str]:
    # Integer keys (the dims of USER_INPUT_BOUNDS) in numeric order; any other key
    # by its rendered text, which orders every mix of types.
    if isinstance(key, int) and type(key) is int:
        return (0, key, "")
    return (1, 0, literal(key))


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["literal"] = literal
    return env


def format_python(source: str) -> str:
    import black  # imported lazily: only rendering needs it, and it is slow to import

    mode = black.Mode(
        target_versions={black.TargetVersion.PY311},
        line_length=BLACK_LINE_LENGTH,
    )
    return black.format_str(source, mode=mode)


def render_artifact(cap: CaptureResult) -> str:
    """The artifact's text for ``cap``; the same capture always gives the same bytes."""
    skeleton = (
        environment()
        .get_template("artifact.py.j2")
        .render(cap=cap, graph_marker=GRAPH_MARKER)
    )
    formatted = format_python(skeleton)
    if formatted.count(GRAPH_MARKER) != 1:
        raise RuntimeError("artifact.py.j2 must place the graph marker exactly once")
    before, after = formatted.split(GRAPH_MARKER)
    # Two blank lines on each side, as black would put around a top-level def.
    return (
        before.rstrip("\n")
        + "\n\n\n"
        + cap.graph_source.strip("\n")
        + "\n\n\n"
        + after.lstrip("\n")
    )
