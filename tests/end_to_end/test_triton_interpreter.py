"""Inductor's Triton kernels, for CPU tensors, run by Triton's interpreter
(``precompile_gen.testing.triton_interpreter``): an artifact whose section 1 holds
@triton.jit kernels, loaded in a fresh process and run against eager.

Capture runs in a process of its own as well: Triton must be imported with
``TRITON_INTERPRET=1`` already set, and this one imported it long before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.golden import GOLDEN_DIR, full_artifact
from helpers.processes import env_with_helpers

import precompile_gen as pg
from precompile_gen import testing
from precompile_gen.lowering import lower
from precompile_gen.tools import verify

HERE = Path(__file__).parent
STEPS = 2


def _run(script: str, *arguments: str, cache_dir: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(HERE / script), *arguments],
        capture_output=True,
        text=True,
        check=False,
        env=env_with_helpers(TORCHINDUCTOR_CACHE_DIR=str(cache_dir)),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _captured(program: str, folder: Path) -> Path:
    # Each process gets an empty kernel folder: the loading one compiles nothing it
    # could have found from the capture.
    _run("triton_capture_child.py", program, str(folder), cache_dir=folder / "capture")
    return folder


@pytest.fixture(scope="module")
def inference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _captured("inference", tmp_path_factory.mktemp("triton_inference"))


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _captured("training", tmp_path_factory.mktemp("triton_training"))


@pytest.fixture(scope="module")
def dropout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _captured("dropout", tmp_path_factory.mktemp("triton_dropout"))


@pytest.fixture(scope="module")
def unbacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _captured("unbacked", tmp_path_factory.mktemp("triton_unbacked"))


def _loaded(program: str, folder: Path) -> dict[str, object]:
    out = _run(
        "triton_load_child.py",
        program,
        str(folder),
        str(STEPS),
        cache_dir=folder / "load",
    )
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("program", ["inference", "training"])
def test_section_1_holds_the_triton_kernels_as_source(
    program: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(program)
    code = (folder / "code.py").read_text(encoding="utf-8")
    assert pg.parse_metadata(code)["BACKEND"] == "inductor"
    assert "@triton.jit" in code
    assert "Original ATen: [aten.native_layer_norm" in code
    # The graph section names every Triton kernel the module defines, as lowering
    # recorded them, and no C++ kernel is left.
    defined = [
        line.split(" = async_compile.triton(")[0]
        for line in code.splitlines()
        if " = async_compile.triton(" in line
    ]
    assert defined
    for name in defined:
        assert f"#   {name}\n" in code
        assert f"def {name}(" in code
    assert "async_compile.cpp_pybinding(" not in code


@pytest.mark.parametrize("program", ["inference", "training"])
def test_a_fresh_process_runs_the_artifact_as_eager_does(
    program: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(program)
    report = _loaded(program, folder)
    outputs = report["outputs"]
    assert isinstance(outputs, list) and len(outputs) == STEPS
    # The cache says it carries no Triton binary, rather than an empty manifest.
    assert report["triton_interpreted"] is True
    assert report["triton_kernels"]
    assert report["files"] == 0
    if program == "training":
        # The second step's loss is the updated model's, not a replay of the first.
        assert outputs[1] < outputs[0]


def test_the_training_golden_is_an_artifact_that_runs_as_eager_does(
    tmp_path: Path,
) -> None:
    # The golden's driver around its canned module, its runtime support restored and
    # loaded without a cache: its Triton kernels compile from their source, and each
    # step matches eager's, parameters and optimizer state included.
    golden = (GOLDEN_DIR / "inductor_triton_train_step.py").read_text("utf-8")
    (tmp_path / "code.py").write_text(full_artifact(golden), encoding="utf-8")
    outputs = _loaded("training", tmp_path)["outputs"]
    assert isinstance(outputs, list) and len(outputs) == STEPS
    assert outputs[1] < outputs[0]


def test_dropout_draws_the_mask_eager_draws_under_the_same_seed(
    dropout: Path,
) -> None:
    code = (dropout / "code.py").read_text(encoding="utf-8")
    # The mask is drawn by eager's own op (fallback_random), into a buffer a Triton
    # kernel allocated; the kernels only scale and mask around it.
    assert "torch.ops.aten.bernoulli_.float(" in code
    # The child checks each call against eager under seeds 0 and 1; the two calls
    # differing shows each drew a fresh mask.
    outputs = _loaded("dropout", dropout)["outputs"]
    assert isinstance(outputs, list)
    assert outputs[0] != outputs[1]


def test_an_unbacked_batch_dim_runs_at_batches_other_than_the_captured_one(
    unbacked: Path,
) -> None:
    code = (unbacked / "code.py").read_text(encoding="utf-8")
    assert 'Tensor "f32[u0, 8]' in code
    # Captured at batch 4; the child calls it at 3 and 7, each against eager.
    outputs = _loaded("unbacked", unbacked)["outputs"]
    assert isinstance(outputs, list)
    assert [len(rows) for rows in outputs] == [3, 7]


def test_triton_imported_without_the_interpreter_is_refused_with_the_fix() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.sum, InterpretedFunction):
        pytest.skip("this process imported Triton with TRITON_INTERPRET=1")
    refused = pytest.raises(
        pg.PrecompileError, match="Set TRITON_INTERPRET=1 in the env"
    )
    with refused, testing.triton_interpreter():
        pass


def test_libdevice_stand_in_names_what_it_lacks() -> None:
    with pytest.raises(AttributeError, match=r"libdevice\.nextafter has no stand-in"):
        _ = testing.InterpreterLibdevice().nextafter


def test_kernels_the_interpreter_cannot_run_name_the_context_that_runs_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What Inductor raises when libdevice's math is None under the interpreter.
    failure = RuntimeError(
        "Failed to run autotuning code block: AttributeError(\"'NoneType' object "
        "has no attribute 'type'\")"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    error = lower._triton_interpreter_error(failure)
    assert isinstance(error, pg.PrecompileError)
    assert "precompile_gen.testing.triton_interpreter()" in str(error)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert lower._triton_interpreter_error(failure) is None


@pytest.mark.parametrize("interpret", ["unset", "set alone"])
def test_a_pair_made_under_the_interpreter_is_refused_at_load_without_it(
    inference: Path, interpret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loaded where its kernels would not run through the interpreter as the context
    # sets it up: refused before anything executes, saying why and what to do.
    if interpret == "set alone":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    code = (inference / "code.py").read_text(encoding="utf-8")
    cache = (inference / "cache.bin").read_bytes()
    with pytest.raises(pg.PrecompileError) as caught:
        pg.load(code, cache)
    message = str(caught.value)
    for text in (
        "made under Triton's interpreter",
        "inside precompile_gen.testing.triton_interpreter()",
        "capture again without the interpreter",
    ):
        assert text in message, f"{text!r} not in the message: {message}"


def test_verify_says_the_triton_kernels_were_made_for_the_interpreter(
    inference: Path,
) -> None:
    code = (inference / "code.py").read_text(encoding="utf-8")
    cache = (inference / "cache.bin").read_bytes()
    report = verify.format_report(
        verify.verify_pair(code, cache), "code.py", "cache.bin"
    )
    kernels = code.count(" = async_compile.triton(")
    assert kernels > 0
    counted = f"{kernels} Triton kernel{'' if kernels == 1 else 's'}"
    assert (
        f"  triton           {counted}; made for Triton's interpreter, which runs "
        "their source: no binary"
    ) in report
    # And nothing beside it that says otherwise.
    assert "  kernel binaries  none in the cache\n" in report
    assert "  kernels          no C++ kernel\n" in report
    assert "0 files" not in report and "has its binary" not in report
