"""The import lines of Inductor's module, rewritten so that loading needs no compiler.

Inductor's generated module imports a few helpers from ``torch._inductor`` at its top,
and importing any module of that package imports Inductor's compiler and Dynamo
(seconds), although a module whose kernel binaries are in place compiles nothing.
Lowering therefore rewrites those import lines, mechanically, and nothing else:

- ``from torch._inductor.async_compile import AsyncCompile`` binds ``AsyncCompile`` to
  the artifact's ``_AsyncCompile`` instead, which records each kernel for the runtime
  support's ``_resolve_kernels`` to build: it imports each C++ kernel from the binary
  ``precompile_gen.load`` put in place and hands every other kernel to Inductor's own
  AsyncCompile, imported only then; likewise
  ``assert_tensor_metadata`` (a fallback kernel's output check) is bound to the
  artifact's ``_assert_tensor_metadata``, which makes the same check;
- ``from torch._inductor.select_algorithm import extern_kernels`` (Inductor's table of
  the ATen functions its code calls) becomes a namespace of the members the module
  calls, each bound to the torch function or op it is; if one is anything else, the
  import stays;
- an import of names the module never uses again is dropped.

Inductor's compile-time auto-tuning block, a string of code (its own imports from
``torch._inductor`` among it) that only Inductor's compiler runs, and nothing in the
module reads, is dropped too, so that no line of the artifact names an import it
does not make.

Imports are only looked for above the first kernel (``async_compile = AsyncCompile()``),
outside strings, where Inductor writes them. ``SimpleNamespace`` is imported by the
artifact's graph section.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

import torch

from precompile_gen.capture_result import ImportRewrite

# The line after Inductor's imports, before its first kernel.
_IMPORTS_END = "\nasync_compile = AsyncCompile()\n"
# Inductor writes it as a raw string statement at the top of the module, with any
# triple quotes inside escaped, when config.triton.autotune_at_compile_time is on.
_AUTOTUNING_BLOCK = re.compile(
    r'^r"""\nCompile-time auto-tuning block: \n.*?\n"""\n', re.DOTALL | re.MULTILINE
)
# How the rewrites name the dropped block.
AUTOTUNING_BLOCK = 'r"""Compile-time auto-tuning block: ..."""'
# Imports bound to what the artifact's graph section defines instead, by (module,
# name): the section defines each stand-in a rewrite binds.
STAND_INS = {
    ("torch._inductor.async_compile", "AsyncCompile"): "_AsyncCompile",
    ("torch._inductor.runtime.runtime_utils", "assert_tensor_metadata"): (
        "_assert_tensor_metadata"
    ),
}


def rewrite(
    source: str, extern_kernels: Mapping[str, object]
) -> tuple[str, list[ImportRewrite]]:
    """``source`` with its imports from Inductor rewritten, and each rewrite
    (original line, replacement, "" for a dropped line, and the stand-in it binds).
    ``extern_kernels`` is Inductor's ``select_algorithm.extern_kernels`` table, by
    member name. The auto-tuning block, if any, is dropped first, and listed with
    ``AUTOTUNING_BLOCK`` as its original."""
    source, blocks = _AUTOTUNING_BLOCK.subn("", source, count=1)
    dropped = [ImportRewrite(AUTOTUNING_BLOCK, "", "")] if blocks else []
    imports = _import_block(source)
    if imports is None:
        return source, dropped
    body, end = imports
    head, rest = source[:end], source[end:]
    lines = head.split("\n")
    replacements: dict[int, tuple[str, str]] = {}
    for node in body:
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("torch._inductor")
            and node.lineno == node.end_lineno
        ):
            replacement = _replacement(node, rest, extern_kernels)
            if replacement is not None:
                replacements[node.lineno - 1] = replacement
    rewritten = [
        replacements[index][0] if index in replacements else line
        for index, line in enumerate(lines)
        if replacements.get(index, ("-", ""))[0] != ""
    ]
    rewrites = dropped + [
        ImportRewrite(lines[index], new, stand_in)
        for index, (new, stand_in) in sorted(replacements.items())
    ]
    return "\n".join(rewritten) + rest, rewrites


def _import_block(source: str) -> tuple[list[ast.stmt], int] | None:
    """The statements above the module's first kernel, and where they end. (The
    same line may also occur in a string above, where the text up to it does not
    parse.)"""
    end = source.find(_IMPORTS_END)
    while end >= 0:
        try:
            return ast.parse(source[:end]).body, end
        except SyntaxError:
            end = source.find(_IMPORTS_END, end + 1)
    return None


def _replacement(
    node: ast.ImportFrom, rest: str, extern_kernels: Mapping[str, object]
) -> tuple[str, str] | None:
    """What replaces the import ``node`` ("" to drop it) and the stand-in that
    binds; None to keep it."""
    bound = [alias.asname or alias.name for alias in node.names]
    stand_in = STAND_INS.get((node.module or "", node.names[0].name))
    if len(node.names) == 1 and stand_in is not None:
        return f"{bound[0]} = {stand_in}", stand_in
    if bound == ["extern_kernels"]:
        members = sorted(set(re.findall(r"\bextern_kernels\.(\w+)", rest)))
        expressions = [_torch_expression(extern_kernels.get(m)) for m in members]
        if None in expressions:
            return None
        fields = ", ".join(
            f"{m}={e}" for m, e in zip(members, expressions, strict=True)
        )
        return f"extern_kernels = SimpleNamespace({fields})", "SimpleNamespace"
    if any(re.search(rf"\b{re.escape(name)}\b", rest) for name in bound):
        return None
    return "", ""


def _torch_expression(kernel: object) -> str | None:
    """How the artifact names ``kernel`` without Inductor: ``torch.<name>`` for a
    torch function, ``torch.ops.<namespace>.<op>[.<overload>]`` for an op; None
    for anything else."""
    name = getattr(kernel, "__name__", None)
    if isinstance(name, str) and getattr(torch, name, None) is kernel:
        return f"torch.{name}"
    if isinstance(kernel, torch._ops.OpOverloadPacket):
        return f"torch.ops.{kernel._qualified_op_name.replace('::', '.')}"
    if isinstance(kernel, torch._ops.OpOverload):
        packet = kernel.overloadpacket._qualified_op_name.replace("::", ".")
        return f"torch.ops.{packet}.{kernel._overloadname}"
    return None
