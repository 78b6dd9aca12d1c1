"""The artifact outside the process that made it.

It must run in a fresh interpreter that never imports precompile_gen, and the same
capture must render the same bytes in any process (the golden files and reviewers'
diffs rely on that).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hand_built import hand_built_capture
from helpers.processes import TESTS_DIR, env_with_helpers
from helpers.small_net import example, train_step
from helpers.stubs import stub_capture

import precompile_gen as pg
from precompile_gen.metadata import metadata_constants

HERE = Path(__file__).parent
# Runs the artifact file against eager PyTorch, importing nothing from precompile_gen.
STANDALONE = HERE / "standalone_child.py"
# The error path without precompile_gen importable: the driver falls back to its own
# PrecompileError.
NO_PACKAGE = HERE / "no_package_child.py"
# Prints the sha256 of what its process renders for fixed inputs.
RENDER_HASHES = HERE / "render_hashes_child.py"


def standalone_env(**extra: str) -> dict[str, str]:
    """The tests folder (for helpers.small_net) as the only PYTHONPATH, as a user's
    script would have it; installed or not, precompile_gen must not be imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(TESTS_DIR), **extra}


def run_python(
    args: list[str], cwd: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=standalone_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def artifact_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, batch = example()
    code, _ = pg.precompile(train_step, model, batch, backend="eager")
    artifact = tmp_path_factory.mktemp("standalone") / "train_step_artifact.py"
    artifact.write_text(code, encoding="utf-8")
    return artifact


def test_artifact_runs_in_a_fresh_interpreter_without_precompile_gen(
    artifact_file: Path, tmp_path: Path
) -> None:
    result = run_python([str(STANDALONE), str(artifact_file)], tmp_path)
    assert result.stdout.strip().splitlines()[-1] == "STANDALONE-OK"


@pytest.mark.slow
def test_inductor_artifact_runs_in_a_fresh_interpreter_without_precompile_gen(
    tmp_path: Path,
) -> None:
    # Executed without load, nothing says where kernel binaries are: the rewritten
    # module hands every kernel to Inductor, which compiles it from the artifact.
    model, batch = example()
    code, _ = pg.precompile(train_step, model, batch)
    assert "AsyncCompile = _AsyncCompile" in code
    artifact = tmp_path / "inductor_artifact.py"
    artifact.write_text(code, encoding="utf-8")
    result = run_python(
        [str(STANDALONE), str(artifact)],
        tmp_path,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
    )
    assert result.stdout.strip().splitlines()[-1] == "STANDALONE-OK"
    assert list((tmp_path / "inductor-cache").rglob("*.main.cpp"))


def test_artifact_errors_without_precompile_gen_use_a_local_precompile_error(
    artifact_file: Path, tmp_path: Path
) -> None:
    result = run_python([str(NO_PACKAGE), str(artifact_file)], tmp_path)
    assert result.stdout.strip().splitlines()[-1] == "LOCAL-ERROR-OK"


def test_artifact_run_as_a_script_prints_how_to_call_it(
    artifact_file: Path, tmp_path: Path
) -> None:
    result = run_python(["-X", "importtime", str(artifact_file)], tmp_path)
    assert "defines forward()" in result.stdout
    assert "forward(model, x)" in result.stdout
    imported = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "precompile_gen" in line
    ]
    assert imported == []


def test_same_capture_renders_the_same_bytes_in_any_process(
    artifact_file: Path, tmp_path: Path
) -> None:
    # Two processes at once, with different hash seeds (str hashing, set order).
    children = [
        subprocess.Popen(
            [sys.executable, str(RENDER_HASHES)],
            cwd=tmp_path,
            env=env_with_helpers(PYTHONHASHSEED=seed),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("0", "4242")
    ]
    outputs = []
    for child in children:
        stdout, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, stdout + stderr
        outputs.append(stdout)
    first = dict(line.split() for line in outputs[0].strip().splitlines())
    second = dict(line.split() for line in outputs[1].strip().splitlines())
    assert set(first) == {"precompile", "stub-eager", "stub-inductor", "hand-built"}
    assert first == second

    def sha(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    # This process (with its own hash seed and import history) agrees too.
    assert first["precompile"] == sha(artifact_file.read_text(encoding="utf-8"))
    assert first["stub-eager"] == sha(pg.render_artifact(stub_capture("eager")))
    assert first["stub-inductor"] == sha(pg.render_artifact(stub_capture("inductor")))
    assert first["hand-built"] == sha(pg.render_artifact(hand_built_capture()))


def test_hand_built_capture_renders_its_own_metadata() -> None:
    cap = hand_built_capture()
    text = pg.render_artifact(cap)
    assert pg.parse_metadata(text) == metadata_constants(cap)
    assert "USER_INPUT_BOUNDS" in text
    assert "{0: (1, 64), 1: (None, 9)}" in text
