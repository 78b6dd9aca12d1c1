"""Diff: two artifacts compared section by section, for reviewing template changes.

Each section (header, graph, metadata, driver) gets its own unified diff, with hunk
line numbers of the artifact files themselves. The metadata section is compared per
constant (values read by AST, as ``parse_metadata`` reads them), plus a diff of what
surrounds the values (comments, annotations). Kernel source strings can be summarised
to one line each, so a pull request shows that a kernel changed without its C++ or
Triton body. The runtime support section, the same text in every artifact of a
version with the same parts, shows as one line ("identical", its stamp in its title)
when both carry the same stamp and hold the text it stands for; only the rest of it
is ever diffed then.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
from dataclasses import dataclass

from precompile_gen.codegen.sections import Section, split_sections
from precompile_gen.runtime.load import parse_artifact
from precompile_gen.tools.inspection import (
    find_kernels,
    kernel_summary,
    section_statements,
)

# A constant whose value is not a literal still gets compared, by its source text.
_NOT_LITERAL = "<not a literal: {}>"


@dataclass(frozen=True)
class _View:
    """Lines to compare, each with the artifact line number it stands for."""

    lines: list[str]
    numbers: list[int]


@dataclass(frozen=True)
class _Artifact:
    name: str
    text: str
    module: ast.Module
    sections: dict[str, Section]


def diff_artifacts(
    a_text: str,
    b_text: str,
    a_name: str = "a",
    b_name: str = "b",
    *,
    summarize_kernels: bool = False,
    context: int = 3,
) -> tuple[str, bool]:
    """The section-by-section report, and whether the artifacts differ at all."""
    a = _read(a_text, a_name)
    b = _read(b_text, b_name)
    keys = list(a.sections) + [key for key in b.sections if key not in a.sections]
    out = [f"comparing {a_name} (a) with {b_name} (b), section by section"]
    differs = False
    for key in keys:
        if key not in b.sections or key not in a.sections:
            present, side = (a, "a") if key in a.sections else (b, "b")
            out.append(f"\n== {present.sections[key].label()}: only in {side}")
            differs = True
            continue
        sa, sb = a.sections[key], b.sections[key]
        label = (
            sa.label() if sa.label() == sb.label() else f"{sa.label()} -> {sb.label()}"
        )
        if key == "metadata":
            body = _metadata_diff(a, b, context)
        elif key == "runtime" and _same_known_text(sa, sb):
            va, vb = _collapsed_view(sa), _collapsed_view(sb)
            body = _unified(va, vb, a_name, b_name, context)
        else:
            va, vb = _plain_view(sa), _plain_view(sb)
            if key == "graph" and summarize_kernels:
                va, vb = _kernel_view(a, sa), _kernel_view(b, sb)
            body = _unified(va, vb, a_name, b_name, context)
        if sa.text == sb.text:
            out.append(f"\n== {label}: identical")
            continue
        differs = True
        if not body:
            # The compared views drop line endings and the metadata values' layout.
            body = ["  (differs only in line endings or in how values are wrapped)"]
        out.append(f"\n== {label}: {_summary(sa, sb)}")
        out.extend(body)
    if not differs:
        out.append("\nthe artifacts are identical")
    return "\n".join(out) + "\n", differs


def _same_known_text(a: Section, b: Section) -> bool:
    """Whether both runtime sections carry one stamp, and each holds the text its
    stamp stands for (an edited copy does not, and is diffed line by line)."""
    return (
        a.stamp is not None
        and a.stamp == b.stamp
        and all(
            hashlib.sha256(s.body.encode("utf-8")).hexdigest() == s.stamp
            for s in (a, b)
        )
    )


def _collapsed_view(section: Section) -> _View:
    """The runtime section with its known body as one line."""
    view = _plain_view(section)
    end = 3 + section.body.count("\n")
    collapsed = f"<the runtime support, sha256 {section.stamp}>"
    return _View(
        [*view.lines[:3], collapsed, *view.lines[end:]],
        [*view.numbers[:4], *view.numbers[end:]],
    )


def _read(text: str, name: str) -> _Artifact:
    sections = {section.key: section for section in split_sections(text)}
    return _Artifact(name, text, parse_artifact(text, name), sections)


def _summary(a: Section, b: Section) -> str:
    matcher = difflib.SequenceMatcher(None, a.lines, b.lines, autojunk=False)
    removed = added = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return f"{removed} line{'' if removed == 1 else 's'} removed, {added} added"


def _plain_view(section: Section) -> _View:
    return _View(
        [line.rstrip("\r\n") for line in section.lines],
        list(range(section.first_line, section.last_line + 1)),
    )


def _kernel_view(artifact: _Artifact, section: Section) -> _View:
    """The section with each kernel's source string replaced by a one-line summary."""
    kernels = find_kernels(section_statements(artifact.module, section))
    spans = {kernel.node.lineno: kernel for kernel in kernels}
    lines = artifact.text.splitlines()
    view = _View([], [])
    number = section.first_line
    while number <= section.last_line:
        kernel = spans.get(number)
        if kernel is None:
            view.lines.append(lines[number - 1])
            view.numbers.append(number)
            number += 1
            continue
        node = kernel.node
        end = node.end_lineno if node.end_lineno is not None else node.lineno
        # ast columns are UTF-8 byte offsets.
        first = lines[node.lineno - 1].encode("utf-8", "surrogatepass")
        last = lines[end - 1].encode("utf-8", "surrogatepass")
        before = first[: node.col_offset].decode("utf-8", "surrogatepass")
        after = last[node.end_col_offset or 0 :].decode("utf-8", "surrogatepass")
        view.lines.append(f"{before}{kernel_summary(kernel)!r}{after}")
        view.numbers.append(number)
        number = end + 1
    return view


def _metadata_diff(a: _Artifact, b: _Artifact, context: int) -> list[str]:
    sa, sb = a.sections["metadata"], b.sections["metadata"]
    ca, cb = _constants(a, sa), _constants(b, sb)
    out: list[str] = []
    for name in [*ca, *(n for n in cb if n not in ca)]:
        if name not in cb:
            out.append(f"- {name} (removed): {ca[name]!r}")
        elif name not in ca:
            out.append(f"+ {name} (added): {cb[name]!r}")
        elif ca[name] != cb[name] or type(ca[name]) is not type(cb[name]):
            out.extend(_value_change(name, ca[name], cb[name]))
    if out:
        out.insert(0, "constants:")
    layout = _unified(_skeleton(a, sa), _skeleton(b, sb), a.name, b.name, context)
    if layout:
        out.append("comments and annotations (values shown as ...):")
        out.extend(layout)
    return out


def _value_change(name: str, old: object, new: object) -> list[str]:
    # Aligned lists (PARAM_*, USER_INPUT_*) read best element by element.
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            f"~ {name}[{index}]: {before!r} -> {after!r}"
            for index, (before, after) in enumerate(zip(old, new, strict=True))
            if before != after or type(before) is not type(after)
        ]
    return [f"~ {name}:", f"    - {old!r}", f"    + {new!r}"]


def _constants(artifact: _Artifact, section: Section) -> dict[str, object]:
    """Every constant the metadata section assigns, by name.

    Unlike ``parse_metadata`` this does not require the current set of constants:
    comparing an artifact from before a constant was added is a normal review case.
    """
    found: dict[str, object] = {}
    for statement in section_statements(artifact.module, section):
        target_value = _assignment(statement)
        if target_value is None:
            continue
        name, value = target_value
        try:
            found[name] = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            found[name] = _NOT_LITERAL.format(ast.unparse(value))
    return found


def _assignment(statement: ast.stmt) -> tuple[str, ast.expr] | None:
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
    ):
        return statement.targets[0].id, statement.value
    if (
        isinstance(statement, ast.AnnAssign)
        and isinstance(statement.target, ast.Name)
        and statement.value is not None
    ):
        return statement.target.id, statement.value
    return None


def _skeleton(artifact: _Artifact, section: Section) -> _View:
    """The metadata section with each constant's value replaced by ``...``, so that
    a changed value shows once, in the per-constant list, and not again here."""
    replaced: dict[int, tuple[int, str]] = {}
    for statement in section_statements(artifact.module, section):
        if _assignment(statement) is None:
            continue
        end = statement.end_lineno if statement.end_lineno is not None else 0
        if isinstance(statement, ast.AnnAssign):
            head = (
                f"{ast.unparse(statement.target)}: {ast.unparse(statement.annotation)}"
            )
        elif isinstance(statement, ast.Assign):
            head = ast.unparse(statement.targets[0])
        else:
            continue
        replaced[statement.lineno] = (end, f"{head} = ...")
    view = _View([], [])
    number = section.first_line
    while number <= section.last_line:
        if number in replaced:
            end, text = replaced[number]
            view.lines.append(text)
            view.numbers.append(number)
            number = end + 1
        else:
            view.lines.append(section.lines[number - section.first_line].rstrip("\r\n"))
            view.numbers.append(number)
            number += 1
    return view


def _unified(a: _View, b: _View, a_name: str, b_name: str, context: int) -> list[str]:
    """A unified diff whose hunk headers give the artifacts' own line numbers."""
    matcher = difflib.SequenceMatcher(None, a.lines, b.lines, autojunk=False)
    out: list[str] = []
    for group in matcher.get_grouped_opcodes(context):
        if not out:
            out += [f"--- {a_name}", f"+++ {b_name}"]
        i1, i2 = group[0][1], group[-1][2]
        j1, j2 = group[0][3], group[-1][4]
        out.append(f"@@ -{_range(a, i1, i2)} +{_range(b, j1, j2)} @@")
        for tag, k1, k2, m1, m2 in group:
            if tag == "equal":
                out.extend(" " + line for line in a.lines[k1:k2])
                continue
            out.extend("-" + line for line in a.lines[k1:k2])
            out.extend("+" + line for line in b.lines[m1:m2])
    return out


def _range(view: _View, start: int, stop: int) -> str:
    # As in diff -u: "line,count", where an empty range names the line before it.
    if start < len(view.numbers):
        first = view.numbers[start]
    else:
        first = (view.numbers[-1] + 1) if view.numbers else 1
    count = stop - start
    return f"{first - 1 if count == 0 else first},{count}"
