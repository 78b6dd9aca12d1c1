"""A process that only loads and runs artifacts imports what that needs: not the
tracer's symbolic machinery, Inductor, Dynamo, Jinja or black, nor the parts of
precompile_gen that capture and render; for an inductor artifact whose kernel
binaries come with its cache, not Inductor either."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.mlp_step import mlp
from helpers.processes import env_with_helpers
from torch import nn

import precompile_gen as pg

CAPTURE_ONLY = (
    "sympy",
    "torch._dynamo",
    "torch._inductor",
    "torch._functorch.aot_autograd",
    "jinja2",
    "black",
    # Of this package, a loading process imports runtime/ (and the package's
    # __init__ and capture_result) only.
    "precompile_gen.api",
    "precompile_gen.capturing",
    "precompile_gen.codegen",
    "precompile_gen.tools",
    "precompile_gen.testing",
)

CHILD = Path(__file__).with_name("load_only_child.py")


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_loading_an_artifact_imports_nothing_capture_needs(
    backend: str, tmp_path: Path
) -> None:
    # For inductor, with the cache: every kernel's binary is in it, so nothing of
    # Inductor's compiler (nor Dynamo, which it imports) is needed to run the graph.
    code, cache = pg.precompile(predict, mlp(), torch.ones(3, 4), backend=backend)
    paths = [str(tmp_path / "code.py"), str(tmp_path / "cache.bin")]
    (tmp_path / "code.py").write_text(code, encoding="utf-8")
    (tmp_path / "cache.bin").write_bytes(cache)
    # This process's environment: the child finds precompile_gen as this process did.
    env = env_with_helpers(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    done = subprocess.run(
        [sys.executable, str(CHILD), *paths, *CAPTURE_ONLY],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["after_import"] == []
    assert report["after_load"] == []
    # It did load and run: the result is eager's, and the error path ran.
    expected = predict(mlp(), torch.ones(3, 4)).tolist()
    torch.testing.assert_close(torch.tensor(report["out"]), torch.tensor(expected))
    assert "has shape (3, 5)" in report["rejected"]


def test_capture_functions_are_bound_on_first_use() -> None:
    # Lazily imported, yet the package's names are the functions. The capturing
    # stage's subpackage is not named `capture`: importing it (as the tools do) would
    # bind that name on the package to the subpackage, shadowing the function.
    import precompile_gen.capturing.trace  # noqa: F401  (imported for its binding)

    assert callable(pg.capture) and pg.capture.__module__ == "precompile_gen.api"
    assert callable(pg.precompile) and callable(pg.render_artifact)
    assert callable(pg.load) and pg.load.__module__ == "precompile_gen.runtime.load"
