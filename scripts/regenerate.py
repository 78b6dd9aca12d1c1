"""Regenerate every generated file, or check that each is current.

    python scripts/regenerate.py           # rewrite each generated file from its source
    python scripts/regenerate.py --check   # exit 1, naming them, if any is out of date

The files, in order, since each is made from the one before:

0. precompile_gen/runtime_support/declarations.py (its section 2 block) and
   precompile_gen/runtime/metadata_types.py: the metadata constants' declarations,
   from the table in precompile_gen/metadata.py.
1. tests/fixtures/inductor_mlp_graph.txt: the canned Inductor module the inductor
   goldens splice (tests/fixtures/regenerate_inductor_graph.py). It is Inductor's
   output on this machine's vector instruction set, so it is made and checked only
   where Inductor picks the width it was made for, and skipped elsewhere with a note.
2. tests/fixtures/inductor_triton_mlp_graph.txt and
   inductor_triton_adamw_step_graph.txt: the canned Inductor modules with Triton
   kernels, of an inference and of a training step with AdamW inside
   (tests/fixtures/regenerate_inductor_triton_graph.py), made under Triton's
   interpreter in a child process each, with what depends on the machine replaced:
   made and checked everywhere.
3. tests/golden/*.py: the goldens, by ``GOLDEN_COMMAND``; checked by running
   tests/codegen/test_golden.py without the flag.
4. docs/gallery.md: excerpts of the goldens (scripts/gallery.py).

Everything runs on this checkout's code, whatever copy of precompile_gen is
installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_COMMAND = [
    "python",
    "-m",
    "pytest",
    "tests/codegen/test_golden.py",
    "--update-goldens",
]
FIXTURE_SCRIPT = ROOT / "tests" / "fixtures" / "regenerate_inductor_graph.py"
TRITON_FIXTURE_SCRIPT = (
    ROOT / "tests" / "fixtures" / "regenerate_inductor_triton_graph.py"
)


def _module(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _environment() -> dict[str, str]:
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def inductor_graph(check: bool) -> str | None:
    """Regenerate (or check) the canned Inductor module; what is wrong, or None."""
    fixtures = _module(FIXTURE_SCRIPT)
    bits = fixtures.vector_bits()
    if bits != fixtures.VECTOR_BITS:
        print(
            f"skipped {fixtures.FIXTURE.relative_to(ROOT)}: Inductor vectorises for "
            f"{bits} bits here, and it was made for {fixtures.VECTOR_BITS}"
        )
        return None
    return _fixture(fixtures.FIXTURE, fixtures.canned_graph(), check)


def inductor_triton_graph(check: bool) -> str | None:
    """Regenerate (or check) the canned Inductor modules with Triton kernels."""
    fixtures = _module(TRITON_FIXTURE_SCRIPT)
    problems = [
        problem
        for program, path in fixtures.FIXTURES.items()
        if (problem := _fixture(path, fixtures.canned_graph(program), check))
    ]
    return "; ".join(problems) or None


def _fixture(path: Path, wanted: str, check: bool) -> str | None:
    """Write (or compare) one canned module; what is wrong, or None."""
    current = path.read_text(encoding="utf-8") if path.exists() else None
    name = path.relative_to(ROOT)
    if wanted == current:
        print(f"{name} is up to date")
        return None
    if check:
        return f"{name} differs from what Inductor makes of its program here"
    path.write_text(wanted, encoding="utf-8")
    print(f"updated {name}")
    return None


def metadata_declarations(check: bool) -> str | None:
    """Regenerate (or check) the files that declare the metadata constants; what is
    wrong, or None."""
    from precompile_gen import metadata

    declarations = ROOT / metadata.DECLARATIONS
    problems = [
        _generated(
            declarations, metadata.declarations(declarations.read_text()), check
        ),
        _generated(ROOT / metadata.TYPES, metadata.typed_dict(), check),
    ]
    return "; ".join(problem for problem in problems if problem) or None


def _generated(path: Path, wanted: str, check: bool) -> str | None:
    """Write (or compare) one file written from precompile_gen/metadata.py."""
    name = path.relative_to(ROOT)
    if path.read_text(encoding="utf-8") == wanted:
        print(f"{name} is up to date")
        return None
    if check:
        return f"{name} differs from the table in precompile_gen/metadata.py"
    path.write_text(wanted, encoding="utf-8")
    print(f"updated {name}")
    return None


def goldens(check: bool) -> str | None:
    """Regenerate (or check) tests/golden/; what is wrong, or None."""
    command = [sys.executable, *GOLDEN_COMMAND[1:]]
    if check:
        command.remove("--update-goldens")
    done = subprocess.run(
        [*command, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode == 0:
        print("tests/golden/ is up to date" if check else "regenerated tests/golden/")
        return None
    print(done.stdout[-6000:], done.stderr[-2000:], file=sys.stderr)
    if check:
        return "tests/golden/ differs from what the templates render"
    raise SystemExit(f"{' '.join(GOLDEN_COMMAND)} failed (output above)")


def gallery(check: bool) -> str | None:
    """Regenerate (or check) docs/gallery.md; what is wrong, or None."""
    tool = _module(ROOT / "scripts" / "gallery.py")
    if tool.main(["--check"] if check else []) != 0:
        return f"{tool.PAGE} differs from the goldens' excerpts"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 if any generated file is out of date",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    stale = [
        problem
        for step in (
            metadata_declarations,
            inductor_graph,
            inductor_triton_graph,
            goldens,
            gallery,
        )
        if (problem := step(args.check)) is not None
    ]
    for problem in stale:
        print(f"out of date: {problem}", file=sys.stderr)
    if stale:
        print("run `python scripts/regenerate.py` and review the diff", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
