"""Stub rendering keeps the driver type-checked although it lives in templates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.stubs import STUBS, write_stubs

from precompile_gen.capture_result import BACKENDS
from precompile_gen.codegen.features import FEATURES, driver_features
from precompile_gen.codegen.layout import format_python
from precompile_gen.codegen.render import (
    RUNTIME_PARTS,
    environment,
    runtime_support_dir,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_stubs_cover_every_template() -> None:
    # The stubs render artifact.py.j2; that reaches every template below (each
    # backend's graph and driver), and a new template must be added here (and so to
    # what stubs render). The runtime support's parts are carried verbatim, and also
    # checked by ruff and pyrefly as the plain modules they are.
    shared = {
        "artifact.py.j2",
        "header.py.j2",
        "macros.py.j2",
        "metadata.py.j2",
        "main.py.j2",
        "tensor_literals.py.j2",
    }
    backends = {f"{b}_{part}.py.j2" for b in BACKENDS for part in ("graph", "driver")}
    driver = {"driver/forward.py.j2", "driver/sparse_gradients.py.j2"}
    assert set(environment().list_templates()) == shared | backends | driver


def test_backend_conditionals_live_only_in_the_backends_own_templates() -> None:
    # The shared concern templates hold what every backend's driver does; what only
    # one backend does is in its own <backend>_driver.py.j2.
    shared = (REPO_ROOT / "templates" / "driver").glob("*.j2")
    for path in shared:
        assert "cap.backend" not in path.read_text(encoding="utf-8"), path.name


def test_runtime_support_is_a_module_ruff_and_pyrefly_check() -> None:
    # No template logic: the text every artifact carries is the files', so the
    # project's checks read them directly (they are precompile_gen's modules).
    for part in RUNTIME_PARTS:
        source = runtime_support_dir() / f"{part}.py"
        text = source.read_text(encoding="utf-8")
        assert "{{" not in text and "{%" not in text and "{#" not in text
        assert format_python(text) == text
        compile(text, str(source), "exec")
        checks = (["ruff", "check"], ["pyrefly", "check", "-c", "pyproject.toml"])
        for command in checks:
            result = subprocess.run(
                [sys.executable, "-m", *command, str(source)],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                check=False,
            )
            assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_render_each_driver_feature_both_on_and_off() -> None:
    # Every branch of every driver template is rendered in some stub.
    features = [
        driver_features(make(backend))
        for backend in BACKENDS
        for make in STUBS.values()
    ]
    for feature in FEATURES:
        values = {getattr(f, feature.name) for f in features}
        assert values == {True, False}, feature.name


def test_stubs_script_writes_black_formatted_modules(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "stubs.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(Path(line).name for line in done.stdout.splitlines()) == sorted(
        f"{b}_{v}.py" for b in BACKENDS for v in STUBS
    )
    written = sorted(p.name for p in tmp_path.glob("*.py"))
    assert written == sorted(f"{b}_{v}.py" for b in BACKENDS for v in STUBS)
    for path in tmp_path.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        compile(text, str(path), "exec")
        # The whole stub is template output, so black must leave it unchanged.
        assert format_python(text) == text


def test_stubs_script_refuses_a_file_for_its_folder(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "stubs"
    not_a_folder.write_text("", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "stubs.py"), str(not_a_folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and not done.stdout
    for text in (f"{not_a_folder} is a file, not a folder", "pass a folder"):
        assert text in done.stderr, done.stderr
    assert not_a_folder.read_text(encoding="utf-8") == ""


def test_pyrefly_finds_no_errors_in_stubs(tmp_path: Path) -> None:
    write_stubs(tmp_path)
    files = [str(p) for p in sorted(tmp_path.glob("*.py"))]
    result = subprocess.run(
        [sys.executable, "-m", "pyrefly", "check", "-c", "pyproject.toml", *files],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "0 errors" in report


def test_pyrefly_catches_a_type_error_in_a_stub(tmp_path: Path) -> None:
    # Guards the check above against passing vacuously (e.g. the lax preset).
    write_stubs(tmp_path)
    bad = tmp_path / "eager_all_features.py"
    bad.write_text(
        bad.read_text(encoding="utf-8") + "\nmodule_state(3)\n", encoding="utf-8"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pyrefly", "check", "-c", "pyproject.toml", str(bad)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "bad-argument-type" in result.stdout + result.stderr


def test_runtime_declarations_are_the_artifacts_names() -> None:
    # The parts are checked against runtime_support/declarations.py; each name it
    # declares must be what an artifact defines under that name, with the same
    # annotation.
    import ast

    from precompile_gen import render_artifact

    def annotations(text: str) -> dict[str, str]:
        return {
            node.target.id: ast.unparse(node.annotation)
            for node in ast.parse(text).body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }

    declared = annotations(
        (runtime_support_dir() / "declarations.py").read_text("utf-8")
    )
    defined: dict[str, str] = {}
    for backend in BACKENDS:
        for make in STUBS.values():
            defined.update(annotations(render_artifact(make(backend))))
    assert declared.keys() <= defined.keys()
    for name, annotation in declared.items():
        # The artifact quotes Any, which only the runtime support imports.
        assert defined[name].replace("'Any'", "Any") == annotation, name
