"""A process that only loads and runs artifacts imports what that needs: not the
tracer's symbolic machinery, Inductor, Dynamo, Jinja or black, nor the parts of
precompile_gen that capture and render; for an inductor artifact whose kernel
binaries come with its cache, not Inductor either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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
)

_CHILD = """\
import json, sys
import torch
import precompile_gen as pg

def imported():
    return sorted(name for name in {capture_only!r} if name in sys.modules)

after_import = imported()
code = open({code!r}, encoding="utf-8").read()
forward = pg.load(code, open({cache!r}, "rb").read())
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
)
out = forward(model, torch.ones(3, 4))
try:
    forward(model, torch.ones(3, 5))  # the driver's error path
except pg.PrecompileError as error:
    rejected = str(error)
print(json.dumps({{
    "after_import": after_import,
    "after_load": imported(),
    "out": out.tolist(),
    "rejected": rejected,
}}))
"""


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_loading_an_artifact_imports_nothing_capture_needs(
    backend: str, tmp_path: Path
) -> None:
    # For inductor, with the cache: every kernel's binary is in it, so nothing of
    # Inductor's compiler (nor Dynamo, which it imports) is needed to run the graph.
    code, cache = pg.precompile(predict, _mlp(), torch.ones(3, 4), backend=backend)
    (tmp_path / "code.py").write_text(code, encoding="utf-8")
    (tmp_path / "cache.bin").write_bytes(cache)
    script = _CHILD.format(
        capture_only=CAPTURE_ONLY,
        code=str(tmp_path / "code.py"),
        cache=str(tmp_path / "cache.bin"),
    )
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor-cache")
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["after_import"] == []
    assert report["after_load"] == []
    # It did load and run: the result is eager's, and the error path ran.
    expected = predict(_mlp(), torch.ones(3, 4)).tolist()
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
