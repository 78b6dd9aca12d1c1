"""``verify --rebuild``: the artifact's C++ kernels compiled again from its own text,
in a fresh folder, match the binaries the cache carries, which the artifact pins; a
binary swapped for another and pinned again in a copy of the artifact passes plain
``verify``, and the rebuild names it."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import precompile_gen as pg
from precompile_gen.runtime.cache import build_cache
from precompile_gen.tools import cli, rebuild
from precompile_gen.tools.verify import verify_pair


def classify_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


@pytest.fixture(scope="module")
def pair() -> tuple[str, bytes]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return pg.precompile(
        classify_step, model, torch.randn(5, 4), torch.randint(0, 3, (5,))
    )


def tampered(python_code: str, cache: bytes) -> tuple[str, bytes]:
    """The pair with one binary's bytes changed, its digest re-pinned in a copy of
    the artifact and in the cache: what someone who can write both files makes."""
    envelope = torch.load(io.BytesIO(cache), weights_only=True)
    payload = envelope["artifact"]
    name = sorted(payload["files"])[0]
    data = bytearray(payload["files"][name])
    data[-1] ^= 0xFF
    old, new = payload["sha256"][name], hashlib.sha256(data).hexdigest()
    payload["files"][name] = bytes(data)
    payload["sha256"][name] = new
    assert python_code.count(old) == 1
    code = python_code.replace(old, new)
    return code, build_cache(code, "inductor", payload)


@pytest.mark.slow
def test_the_rebuilt_kernels_match_their_pins(pair: tuple[str, bytes]) -> None:
    python_code, cache = pair
    report = rebuild.rebuild_report(python_code, cache)
    assert report["kernels"], "the artifact has no C++ kernel to rebuild"
    assert {k["result"] for k in report["kernels"]} == {"match"}, report
    assert rebuild.matches(report)
    toolchain = report["toolchain"]
    assert toolchain["differs"] == []
    assert set(toolchain["recorded"]) >= {"compiler", "compiler_version", "flags"}
    assert "match" in rebuild.format_rebuild(report)


@pytest.mark.slow
def test_a_swapped_binary_pinned_again_passes_verify_but_not_the_rebuild(
    pair: tuple[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, cache = tampered(*pair)
    verify_pair(code, cache)  # what plain verify checks, it passes
    report = rebuild.rebuild_report(code, cache)
    differing = [k for k in report["kernels"] if k["result"] == "differs"]
    assert len(differing) == 1, report
    assert "the rebuilt binary's sha256 is" in differing[0]["why"]
    assert not rebuild.matches(report)
    (tmp_path / "step.py").write_text(code, encoding="utf-8")
    (tmp_path / "step.cache").write_bytes(cache)
    status = cli.main(
        ["verify", "--rebuild", str(tmp_path / "step.py"), str(tmp_path / "step.cache")]
    )
    out = capsys.readouterr().out
    assert status == 1
    assert "ok: " in out and "differs" in out, out
