"""Run by a fresh venv's interpreter with the built wheel installed: writes what
precompile_gen renders (both stubs, an eager precompile) into OUT, and, in
OUT/report.json, where precompile_gen and its templates came from.

    python installed_wheel_child.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import precompile_gen as pg
import precompile_gen.codegen.render

# The tests' helpers, for the hand-built capture; precompile_gen is not there.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from helpers.stubs import stub_capture


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).relu()


def main(out: Path) -> None:
    for backend in ("eager", "inductor"):
        text = pg.render_artifact(stub_capture(backend))
        (out / f"stub_{backend}.py").write_text(text, encoding="utf-8")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    code, cache = pg.precompile(predict, model, x, backend="eager")
    (out / "precompile.py").write_text(code, encoding="utf-8")
    torch.testing.assert_close(pg.load(code, cache)(model, x), predict(model, x))
    report = {
        "file": pg.__file__,
        "template_dir": str(precompile_gen.codegen.render.template_dir()),
        "sys_path": sys.path,
    }
    (out / "report.json").write_text(json.dumps(report), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
