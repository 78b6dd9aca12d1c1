"""``verify --rebuild``: the artifact's kernels compiled again from its own text, in a
fresh folder, match the binaries the cache carries, which the artifact pins; a
binary swapped for another and pinned again in a copy of the artifact passes plain
``verify``, and the rebuild names it. Both for C++ kernels and for Triton kernels
built for a GPU (an H100's, which Triton compiles for without one:
``h100_pair_child.py`` makes the pair a capture on an H100 writes)."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.processes import env_with_helpers
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


def tampered(python_code: str, cache: bytes, suffix: str = ".so") -> tuple[str, bytes]:
    """The pair with one binary's bytes changed (the first whose name ends with
    ``suffix``), its digest re-pinned in a copy of the artifact and in the cache:
    what someone who can write both files makes."""
    envelope = torch.load(io.BytesIO(cache), weights_only=True)
    payload = envelope["artifact"]
    name = next(name for name in sorted(payload["files"]) if name.endswith(suffix))
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


@pytest.fixture(scope="module")
def h100_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    folder = tmp_path_factory.mktemp("h100")
    environment = env_with_helpers()
    environment.pop("TRITON_CACHE_DIR", None)
    environment["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "kernels")
    child = Path(__file__).with_name("h100_pair_child.py")
    done = subprocess.run(
        [sys.executable, str(child), str(folder)],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return (folder / "step.py").read_text(encoding="utf-8"), (
        folder / "step.cache"
    ).read_bytes()


@pytest.mark.slow
def test_triton_kernels_for_a_gpu_rebuild_to_their_pins_but_a_swapped_cubin(
    h100_pair: tuple[str, bytes],
) -> None:
    # One rebuild (each takes seconds) of the pair with one cubin swapped and
    # pinned again: the kernels left alone match, that one differs.
    code, cache = tampered(*h100_pair, suffix=".cubin")
    verify_pair(code, cache)  # what plain verify checks, it passes
    report = rebuild.rebuild_report(code, cache)
    assert {k["kind"] for k in report["kernels"]} == {"Triton"}, report
    results = [k["result"] for k in report["kernels"]]
    assert results.count("differs") == 1 and results.count("match") >= 1, report
    differing = next(k for k in report["kernels"] if k["result"] == "differs")
    assert ".cubin's sha256 is" in differing["why"], differing
    assert not rebuild.matches(report)
    recorded = report["toolchain"]["recorded"]
    assert recorded["triton_target"] == "cuda 90"
    assert "release" in recorded["ptxas"]
    assert report["toolchain"]["differs"] == []
    assert "for cuda 90" in rebuild.format_rebuild(report)


def test_a_triton_kernel_the_rebuild_cannot_match_says_why() -> None:
    pins: dict[str, str] = {
        "triton/0/KEY/k.cubin": "a" * 64,
        "triton/0/KEY/k.json": "b" * 64,
    }
    missing = rebuild._compare_triton(
        pins, {"files": {"triton/0/OTHER/k.cubin": "a" * 64}}, {}
    )
    assert missing["result"] == "differs"
    assert "the rebuild makes no triton/0/KEY/k.cubin (2 of the 2" in missing["why"]
    assert "another Triton, assembler or target" in missing["why"]
    failed = rebuild._compare_triton(pins, {"error": "PTXASError: boom"}, {})
    assert failed == {"result": "cannot rebuild", "why": "PTXASError: boom"}
    interpreted = rebuild._compare_triton({}, None, {"triton_interpreted": True})
    assert interpreted["result"] == "not carried"
    assert "Triton's interpreter" in interpreted["why"]
    assert "Triton compiles it at load" in rebuild._compare_triton({}, None, {})["why"]
