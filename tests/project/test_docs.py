"""The README and docs/ say what the code does: the commands they give are the ones
CI runs, the figures of the demo's report and of the real-size benchmark agree, and
the generated gallery and the documented way to regenerate the goldens are
current."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

from helpers.golden import CASES, runtime_parts, split_runtime

from precompile_gen.codegen.render import compose_runtime, render_artifact
from precompile_gen.tools.inspection import inspect_artifact
from precompile_gen.tools.report_text import format_report

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN = REPO_ROOT / "tests" / "golden"
README = REPO_ROOT / "README.md"
OVERVIEW = REPO_ROOT / "docs" / "index.md"


def _module(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of ``text`` in ``language`` ("" for a bare fence)."""
    blocks: list[tuple[str, list[str]]] = []
    open_block: tuple[str, list[str]] | None = None
    for line in text.splitlines():
        fence = line.strip()
        if open_block is None and fence.startswith("```"):
            open_block = (fence[3:], [])
        elif open_block is not None and fence == "```":
            blocks.append(open_block)
            open_block = None
        elif open_block is not None:
            open_block[1].append(line)
    return ["\n".join(lines) + "\n" for lang, lines in blocks if lang == language]


def test_readme_is_short() -> None:
    # What it is, the commands, use, the contract in short; the rest is in docs/.
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


def test_ci_runs_exactly_the_readmes_install_and_test_command() -> None:
    readme = README.read_text(encoding="utf-8")
    install_and_demo, install_and_test = _code_blocks(readme, "bash")[0].splitlines()
    assert install_and_demo == "python -m pip install . && precompile-gen demo"
    assert install_and_test.endswith("&& python -m pytest")
    ci = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert install_and_test in ci
    assert "python -m mkdocs build --strict" in "\n".join(ci)
    # The overview page gives the same two commands.
    overview = OVERVIEW.read_text(encoding="utf-8")
    assert [b.strip() for b in _code_blocks(overview, "bash")[:2]] == [
        install_and_demo,
        install_and_test,
    ]


def test_the_demo_report_is_the_same_run_everywhere() -> None:
    readme = README.read_text(encoding="utf-8")
    (report,) = [b for b in _code_blocks(readme, "") if b.startswith("backend")]
    assert report in OVERVIEW.read_text(encoding="utf-8")
    sizes = {
        name: int(size.replace(",", ""))
        for name, size in re.findall(
            r"^(artifact|cache) .*\(([\d,]+) bytes\)", report, re.M
        )
    }
    pair = sizes["artifact"] + sizes["cache"]
    distributed = (REPO_ROOT / "docs" / "guide" / "distributed.md").read_text("utf-8")
    assert (
        f"pair is {pair:,} bytes ({sizes['artifact']:,} of code, "
        f"{sizes['cache']:,} of cache" in " ".join(distributed.split())
    )
    assert f"S = {round(pair / 1000)} KB" in distributed


def test_gallery_is_generated_from_the_current_goldens() -> None:
    gallery = _module(REPO_ROOT / "scripts" / "gallery.py")
    page = (REPO_ROOT / gallery.PAGE).read_text(encoding="utf-8")
    assert page == gallery.render_page(REPO_ROOT), (
        f"{gallery.PAGE} differs from the goldens; run `python scripts/regenerate.py` "
        f"and commit {gallery.PAGE}"
    )
    # It shows both backends' artifacts and inspect output, taken from the goldens.
    assert "torch.ops.aten." in page and "async_compile.cpp_pybinding" in page
    assert page.count("precompile-gen inspect tests/golden/") == 2
    inductor = (GOLDEN / "inductor_inference.py").read_text(encoding="utf-8")
    inspected = format_report(inspect_artifact(inductor, "x"))
    assert inspected.splitlines()[1] in page  # "function   predict(...)"


def test_documented_golden_update_command_regenerates_the_goldens(
    tmp_path: Path,
) -> None:
    # The command scripts/regenerate.py runs, which docs/architecture.md documents, run
    # on a copy of the test tree so that the real goldens are never written by the
    # test suite. It runs for the two goldens the copy lacks or holds stale, and the
    # runtime parts: test_golden renders every golden already, and the CI's
    # ``regenerate.py --check`` runs the whole command.
    regenerate = _module(REPO_ROOT / "scripts" / "regenerate.py")
    command = " ".join(regenerate.GOLDEN_COMMAND)
    assert command == "python -m pytest tests/codegen/test_golden.py --update-goldens"
    architecture = (REPO_ROOT / "docs" / "architecture.md").read_text("utf-8")
    assert command in architecture and "python scripts/regenerate.py" in architecture
    # The copy runs under the project's pytest configuration, which puts the tests'
    # helpers (the copy's) in reach.
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    copy = tmp_path / "tests"
    (copy / "codegen").mkdir(parents=True)
    for name in ("conftest.py", "codegen/test_golden.py"):
        shutil.copy(REPO_ROOT / "tests" / name, copy / name)
    for folder in ("golden", "fixtures", "helpers"):
        shutil.copytree(REPO_ROOT / "tests" / folder, copy / folder)
    (copy / "golden" / "eager_inference.py").unlink()
    (copy / "golden" / "eager_train_step.py").write_text("stale\n", encoding="utf-8")
    result = subprocess.run(
        [
            sys.executable,
            *regenerate.GOLDEN_COMMAND[1:],
            "-k",
            "eager_inference or eager_train_step or runtime_part",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The missing and the stale golden are now exactly what test_golden compares
    # against (whether or not the committed goldens are current). The copy's cases
    # are the same module: their captures record their namedtuple and dataclass types
    # under the same import path (helpers.golden:Pair), which this process's
    # helpers.golden serves.
    assert sorted(p.stem for p in (copy / "golden").glob("*.py")) == sorted(CASES)
    for name in ("eager_inference", "eager_train_step"):
        case = CASES[name]
        written = (copy / "golden" / f"{name}.py").read_text(encoding="utf-8")
        golden, runtime = split_runtime(render_artifact(case()))
        assert written == golden, name
        parts = runtime_parts(golden)
        pinned = [copy / "golden" / "runtime" / f"{part}.py" for part in parts]
        texts = [path.read_text(encoding="utf-8") for path in pinned]
        assert compose_runtime(texts) == runtime


def test_the_readmes_real_size_table_is_the_guides_run() -> None:
    # Both quote one run of benchmarks/real_size_step.py: each README cell is the
    # artifact's ratio and figures from the guide's full table.
    guide = (REPO_ROOT / "docs" / "guide" / "performance.md").read_text("utf-8")
    readme = README.read_text(encoding="utf-8")
    rows = re.findall(
        r"^\| (.+?) — (time|peak[^|]*) \| [^|]+ \| ([\d.]+) (ms|MiB), 1\.00 \| "
        r"[^|]+ \| ([\d.]+) (?:ms|MiB), \*\*([\d.]+)\*\* \|$",
        guide,
        re.M,
    )
    assert len(rows) == 8
    cells: dict[str, list[str]] = {}
    for label, _, compiled, unit, ours, ratio in rows:
        cells.setdefault(label, []).append(f"{ratio} ({ours} vs {compiled} {unit})")
    for label, (time, peak) in cells.items():
        assert f"| {label} | {time} | {peak} |" in readme
