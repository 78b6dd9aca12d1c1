"""The built wheel: templates ship inside it, and an installed copy renders the same
text as the source tree, without the source tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch
from helpers.stubs import stub_capture
from torch import nn

import precompile_gen as pg
from precompile_gen.capture_result import Backend

REPO_ROOT = Path(__file__).resolve().parents[2]

# Run by the fresh venv's interpreter: reports where precompile_gen came from and what
# it renders, into the folder it is given.
RUNNER = Path(__file__).with_name("installed_wheel_child.py")


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).relu()


def child_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}
    }


def run(args: list[str | Path], cwd: Path) -> str:
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", dist, REPO_ROOT],
        cwd=dist,
    )
    (built,) = dist.glob("precompile_gen-*.whl")
    return built


@pytest.mark.slow
def test_wheel_ships_the_templates(wheel: Path) -> None:
    root = REPO_ROOT / "templates"
    sources = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix in (".j2", ".py") and p.is_file()
    )
    assert "driver/forward.py.j2" in sources
    with zipfile.ZipFile(wheel) as archive:
        shipped = {
            name: archive.read(name)
            for name in archive.namelist()
            if name.startswith("precompile_gen/templates/")
        }
    assert sorted(shipped) == [f"precompile_gen/templates/{name}" for name in sources]
    for name in sources:
        assert shipped[f"precompile_gen/templates/{name}"] == (root / name).read_bytes()


@pytest.mark.slow
def test_installed_wheel_renders_without_the_source_tree(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=tmp_path)
    python = venv / "bin" / "python"
    # --no-index: installing the local wheel must not reach for any package index.
    run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", wheel],
        cwd=tmp_path,
    )
    # torch, jinja2 and black come from this environment, which may itself be a venv
    # (whose packages --system-site-packages does not reach). A .pth line adds the
    # directory after the fresh venv's own site-packages, and only the directory: the
    # .pth files in it, such as the editable install's pointer to the source tree, are
    # not processed, so the installed wheel is the only precompile_gen in reach.
    # It is written after the install so pip never sees the outer precompile_gen.
    venv_site = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp_path,
    ).strip()
    outer_sites = dict.fromkeys(
        sysconfig.get_paths()[key] for key in ("purelib", "platlib")
    )
    (Path(venv_site) / "_outer_environment.pth").write_text(
        "".join(f"{site}\n" for site in outer_sites), encoding="utf-8"
    )

    out = tmp_path / "out"
    out.mkdir()
    run([python, RUNNER, out], cwd=tmp_path)

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    installed = Path(report["file"]).resolve()
    template_dir = Path(report["template_dir"]).resolve()
    assert installed.is_relative_to(venv.resolve()), report
    assert not installed.is_relative_to(REPO_ROOT), report
    assert template_dir == installed.parent / "templates", report
    assert sorted(p.name for p in template_dir.glob("*.j2")) == sorted(
        p.name for p in (REPO_ROOT / "templates").glob("*.j2")
    )
    assert (installed.parent / "runtime_support" / "support.py").read_bytes() == (
        REPO_ROOT / "precompile_gen" / "runtime_support" / "support.py"
    ).read_bytes()
    backends: tuple[Backend, ...] = ("eager", "inductor")
    for backend in backends:
        rendered = (out / f"stub_{backend}.py").read_text(encoding="utf-8")
        assert rendered == pg.render_artifact(stub_capture(backend))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    code, _ = pg.precompile(predict, model, torch.randn(3, 4), backend="eager")
    assert (out / "precompile.py").read_text(encoding="utf-8") == code
