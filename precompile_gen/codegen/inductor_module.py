"""What a reader of Inductor's module needs at a glance, read from it once at lowering.

Inductor's generated module is spliced verbatim, but for its rewritten imports
(``inductor_imports``) and one line laid out for reading: the inner ``call``'s
unpacking of its inputs (``arg0_1, arg1_1, ... = args``), thousands of characters
on one line for a large model, one name a line. Lowering also records the module's
kernels (``KernelEntry``), which the graph section lists before the module, each
with the ATen ops Inductor says it computes and its size, so that a reviewer of a
long artifact finds what a change touched.
"""

from __future__ import annotations

import re

from precompile_gen.capture_result import KernelEntry
from precompile_gen.codegen.layout import LINE_LENGTH, one_per_line

# Inductor's inner ``call`` unpacks its inputs so.
_UNPACKED_INPUTS = re.compile(r"^( +)((?:arg\d+_1, )*arg\d+_1),? = args$", re.MULTILINE)
# A kernel, as Inductor's module defines it at its top level.
_KERNEL = re.compile(r"(\w+) = async_compile\.\w+\(")
# Inductor's comment on what a kernel (or a call of one) computes.
_ORIGINAL_ATEN = re.compile(
    r"# Topologically Sorted Source Nodes: .*Original ATen: \[(.*)\]$"
)
_CALL = re.compile(r"\s+(\w+)\(")
# AOTAutograd's code binding Inductor's ``call``, and a top-level ``def call``.
_INNER_CALL = re.compile(r"^_inner_call = call$", re.MULTILINE)
_CALL_DEFINITION = re.compile(r"^def call\(", re.MULTILINE)
# Inductor's comment naming the file a kernel was written to in its cache folder
# (TORCHINDUCTOR_CACHE_DIR): the folder, then the file's two parts, which are the
# kernel's own.
_KERNEL_PATH = re.compile(
    r"^(# kernel path: ).*/([a-z0-9]{2}/c[a-z0-9]+\.py)$", re.MULTILINE
)


def without_cache_folder(source: str) -> str:
    """``source`` with each kernel's file named within Inductor's cache folder, not
    at the capturing machine's path to it: the artifact's text, and so its hash,
    must not change with where that folder was."""
    return _KERNEL_PATH.sub(r"\1$TORCHINDUCTOR_CACHE_DIR/\2", source)


def unpacked_inputs(source: str) -> list[str]:
    """The names Inductor's inner ``call`` unpacks its inputs into, in order."""
    unpacked = _UNPACKED_INPUTS.search(source)
    return unpacked.group(2).split(", ") if unpacked else []


def redefines_call(source: str) -> bool:
    """Whether AOTAutograd's code binds Inductor's ``call`` as ``_inner_call`` and
    then defines the ``call`` the driver runs around it."""
    inner = _INNER_CALL.search(source)
    return inner is not None and bool(_CALL_DEFINITION.search(source, inner.end()))


def unpacked_one_per_line(source: str) -> str:
    """``source`` with the inner ``call``'s unpacking of its inputs one name a line,
    where it is longer than a line."""

    def wrapped(match: re.Match[str]) -> str:
        indent, names = match.group(1), match.group(2).split(", ")
        if len(match.group(0)) <= LINE_LENGTH:
            # As Inductor wrote it (a lone name keeps its trailing comma).
            return match.group(0)
        return one_per_line("(", names, ") = args", indent)

    return _UNPACKED_INPUTS.sub(wrapped, source)


def kernels(source: str) -> list[KernelEntry]:
    """The kernels ``source`` defines, in its order (each name once), each with the
    ATen ops of Inductor's comment before its definition (a Triton kernel) or before
    its call (a C++ kernel), and the lines its definition takes."""
    lines = source.splitlines()
    found: dict[str, KernelEntry] = {}
    ops: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        comment = _ORIGINAL_ATEN.match(line)
        if comment is not None:
            ops = _ops(comment.group(1))
        kernel = _KERNEL.match(line)
        if kernel is not None:
            end = _definition_end(lines, index)
            found.setdefault(
                kernel.group(1), KernelEntry(kernel.group(1), ops, end - index + 1)
            )
            ops, index = [], end
        index += 1
    return _with_called_ops(lines, found)


def _definition_end(lines: list[str], start: int) -> int:
    # A kernel's source is a triple-quoted string, closed at the start of a line.
    if not lines[start].endswith("'''"):
        return start
    for index in range(start + 1, len(lines)):
        if lines[index].startswith("'''"):
            return index
    return len(lines) - 1


def _with_called_ops(
    lines: list[str], found: dict[str, KernelEntry]
) -> list[KernelEntry]:
    # A C++ kernel's comment, where Inductor writes one, is in the code that calls
    # it: on the first call that follows, if that is of the kernel (an ATen call,
    # extern_kernels.*, has the comment to itself).
    for index, line in enumerate(lines):
        comment = _ORIGINAL_ATEN.match(line.strip())
        if comment is None:
            continue
        for following in lines[index + 1 :]:
            stripped = following.strip()
            if not stripped or stripped.startswith(("# ", "extern_kernels.")):
                break
            call = _CALL.match(following)
            name = call.group(1) if call is not None else ""
            if name in found and not found[name].aten_ops:
                found[name] = found[name]._replace(aten_ops=_ops(comment.group(1)))
                break
    return list(found.values())


def _ops(text: str) -> list[str]:
    return [op for op in text.split(", ") if op]
