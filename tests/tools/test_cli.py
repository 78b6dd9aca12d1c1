"""The command line: every command through the installed ``precompile-gen`` console
script, then each command's details through ``cli.main`` in this process.

Inputs are the golden artifacts wherever possible (no compiling), plus one eager demo
run. A console-script process spends seconds importing torch, so those invocations
all run side by side in one test.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.golden import full_artifact
from helpers.stubs import (
    replace_backend_graph,
    replace_convention,
    stub_capture,
)

from precompile_gen.capture_result import InputLeaf, InputStrides, InputTree
from precompile_gen.codegen.render import render_artifact
from precompile_gen.codegen.sections import sections_by_key
from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.cache import build_cache
from precompile_gen.runtime.load import parse_artifact
from precompile_gen.tools.cli import main
from precompile_gen.tools.diff import diff_artifacts
from precompile_gen.tools.inspection import (
    find_kernels,
    inspect_artifact,
    section_statements,
)
from precompile_gen.tools.progress import Progress
from precompile_gen.tools.report_text import format_report

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN = REPO_ROOT / "tests" / "golden"
CLI = Path(sys.executable).with_name("precompile-gen")
COMMANDS = ("demo", "inspect", "verify", "diff")


def _golden(name: str) -> str:
    """The artifact a golden stands for, its runtime support included."""
    return full_artifact((GOLDEN / f"{name}.py").read_text(encoding="utf-8"))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``precompile-gen ARGS`` in this process: exit code, stdout, stderr."""
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's --help and usage errors
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line_error(
    code: int, stderr: str, command: str, expected_code: int, needle: str
) -> None:
    assert code == expected_code, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"precompile-gen {command}: error: "), lines[0]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in stderr


def _with_constant(code: str, name: str, value_source: str) -> str:
    """``code`` with the metadata constant ``name`` assigned ``value_source``."""
    for statement in parse_artifact(code).body:
        if (
            isinstance(statement, ast.AnnAssign | ast.Assign)
            and ast.unparse(
                statement.target
                if isinstance(statement, ast.AnnAssign)
                else statement.targets[0]
            )
            == name
            and statement.value is not None
        ):
            lines = code.splitlines(keepends=True)
            value = statement.value
            end = value.end_lineno or value.lineno
            # ast columns are UTF-8 byte offsets; the metadata section is ASCII.
            before = lines[value.lineno - 1][: value.col_offset]
            after = lines[end - 1][value.end_col_offset or 0 :]
            return "".join(
                [*lines[: value.lineno - 1], before, value_source, after, *lines[end:]]
            )
    raise AssertionError(f"no assignment to {name}")


def _pair(tmp_path: Path, name: str, code: str, cache: bytes) -> tuple[str, str]:
    artifact, cache_file = tmp_path / f"{name}.py", tmp_path / f"{name}.cache"
    artifact.write_text(code, encoding="utf-8")
    cache_file.write_bytes(cache)
    return str(artifact), str(cache_file)


# --- the console script -----------------------------------------------------------


def test_console_script_runs_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not CLI.exists():
        pytest.fail(f"{CLI} is missing; install the package: pip install -e '.[dev]'")
    code = _golden("eager_train_step")
    step, cache = _pair(tmp_path, "step", code, build_cache(code, "eager", None))
    demo_dir = tmp_path / "demo"
    invocations = {
        "help": ["--help"],
        "demo": ["demo", "--backend", "eager", "--out", str(demo_dir)],
        "inspect": ["inspect", "tests/golden/eager_multi_module.py"],
        "verify": ["verify", step, cache],
        "diff": ["diff", "tests/golden/eager_inference.py", step],
        "diff error": ["diff", step, str(tmp_path / "missing.py")],
    }
    processes = {
        name: subprocess.Popen(
            [str(CLI), *args],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in invocations.items()
    }
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=600)
        results[name] = (process.returncode, stdout, stderr)

    rc, out, err = results["help"]
    assert rc == 0, err
    assert all(f"precompile-gen {command}" in out for command in COMMANDS)

    rc, out, err = results["demo"]
    assert rc == 0, err
    assert re.search(
        r"matches eager  2 steps with a learning-rate schedule \(losses "
        r"\d+\.\d{4}, \d+\.\d{4}\): 5 parameters and their grads, "
        r"15 optimizer state tensors, 3 buffers",
        out,
    )
    for stage in (
        "precompile",
        "  capture",  # precompile's own stages, from its timing records
        "    python values",  # and capture's passes, under it
        "    make_fx",
        "  render",
        "write the pair",
        "fresh process: start, imports",
        "fresh process: load + first call",
        "fresh process: compare with eager",
        "total",
    ):
        assert re.search(rf"^{re.escape(stage)}\s+\d+\.\d\d$", out, re.M), stage
    # stderr is not a terminal here: plain, timestamped lines, no carriage returns.
    assert "\r" not in err
    progress = err.splitlines()
    assert any(
        re.fullmatch(r"\[\s*\d+\.\d s\] precompiling train_step .* \.\.\.", line)
        for line in progress
    ), err
    assert any("comparing with eager: done in" in line for line in progress), err
    # The demo's pair is an ordinary one.
    demo_step, demo_cache = demo_dir / "train_step.py", demo_dir / "train_step.cache"
    assert _cli(capsys, "verify", str(demo_step), str(demo_cache))[0] == 0
    code, out, err = _cli(capsys, "inspect", str(demo_step))
    assert code == 0, err
    assert "train_step(model: nn.Module, optimizer: optim.AdamW, images, labels)" in out
    assert "15 tensors: step, exp_avg, exp_avg_sq" in out
    assert re.search(r"features\.1\.running_mean\s+buffer\s+\(8,\)", out)
    assert re.search(r"features\.0\.weight\s+parameter\s+\(8, 3, 3, 3\)", out)

    rc, out, err = results["inspect"]
    assert rc == 0, err
    assert "two_towers(encoder: nn.Module, batch, head: nn.Module)" in out

    rc, out, err = results["verify"]
    assert rc == 0, err
    assert out.startswith(f"ok: {step} and {cache} belong together")

    rc, out, err = results["diff"]
    assert rc == 1, err
    assert "~ NUM_POSITIONAL_ARGS:" in out

    rc, _, err = results["diff error"]
    # diff's 1 means "they differ", so its errors exit 2, as diff(1)'s do.
    _assert_one_line_error(rc, err, "diff", 2, "does not exist")


# --- help and errors --------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _cli(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: precompile-gen {command}")
    examples = out.split("examples:", 1)
    assert len(examples) == 2, f"{command} --help shows no examples"
    assert f"precompile-gen {command}" in examples[1]


def test_errors_are_one_line_with_a_non_zero_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _golden("eager_train_step")
    step, cache = _pair(tmp_path, "step", code, build_cache(code, "eager", None))
    missing = str(tmp_path / "missing.cache")
    edited = _with_constant(code, "PARAM_SHAPES", "[7]")
    edited_step, _ = _pair(tmp_path, "edited", edited, b"")
    resets = _with_constant(code, "GRAD_RESETS", "[(0, True, 1)]")
    resets_step, _ = _pair(tmp_path, "resets", resets, b"")
    cases = [
        (["inspect", "tests/fixtures/inductor_mlp_graph.txt"], "not a precompile_gen"),
        (["inspect", edited_step], "unexpected types or lengths"),
        (["inspect", resets_step], "unexpected types or lengths"),
        (["inspect", cache], "is not UTF-8 text"),
        (["verify", step, missing], "does not exist"),
        (["verify", cache, step], "is not UTF-8 text"),
        (["verify", step, cache, "--key-env", "PRECOMPILE_GEN_NO_SUCH_KEY"], "unset"),
    ]
    for args, needle in cases:
        result = _cli(capsys, *args)
        _assert_one_line_error(result[0], result[2], args[0], 1, needle)


# --- inspect ----------------------------------------------------------------------


def test_inspect_shows_signature_state_inputs_output_graph_and_sections(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = "tests/golden/eager_multi_module.py"
    code, out, err = _cli(capsys, "inspect", str(REPO_ROOT / path))
    assert code == 0, err
    assert "two_towers(encoder: nn.Module, batch, head: nn.Module)" in out
    assert "backend    eager" in out
    assert "{'logits': *, 'features': *, 'count': *} (3 leaves)" in out
    assert re.search(
        r"m0\.1\.running_mean\s+buffer\s+\(6,\)\s+\(1,\)\s+torch.float32\s+cpu", out
    )
    assert re.search(r"m1\.weight\s+parameter\s+\(3, 6\)\s+\(6, 1\)", out)
    assert re.search(
        r"argument 1 \(`batch\['x'\]`\)\s+\(5, 4\)\s+-\s+\(4, 1\)"
        r"\s+torch.float32\s+cpu",
        out,
    )
    assert "kernels            none (the eager backend runs ATen operators)" in out
    assert "aten.native_batch_norm x1" in out
    for name in ("header", "1. graph", "2. metadata", "3. driver"):
        assert re.search(rf"^  {re.escape(name)}\s+\d+\s+\d+\s+[\d,]+$", out, re.M)

    code, out, err = _cli(capsys, "inspect", str(REPO_ROOT / path), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["fn_name"] == "two_towers"
    assert report["module_positions"] == [0, 2]
    assert [m["buffers"] for m in report["modules"]] == [3, 0]
    assert report["user_inputs"]["leaves"][0]["leaf"] == "argument 1 (`batch['x']`)"
    assert report["output"]["leaves"] == 3
    assert report["graph"]["kernels"] == []
    assert sum(report["graph"]["op_calls"].values()) > 0
    text = (GOLDEN / "eager_multi_module.py").read_text(encoding="utf-8")
    assert sum(s["bytes"] for s in report["sections"]) == len(text.encode())


def test_inspect_reports_harvested_grads_and_inductor_kernels() -> None:
    train = inspect_artifact(_golden("eager_train_step"))
    assert {s["grad"] for s in train["module_state"] if "grad" in s} == {"harvested"}
    assert train["output"]["harvested_grads"] == 4
    assert "plus 4 parameter gradients added to .grad" in format_report(train)

    inductor = inspect_artifact(_golden("inductor_inference"))
    assert inductor["backend"] == "inductor"
    kernels = inductor["graph"]["kernels"]
    assert kernels and {k["kind"] for k in kernels} == {"cpp_pybinding"}
    assert inductor["graph"]["kernel_kinds"] == {"cpp_pybinding": len(kernels)}
    assert inductor["graph"]["extern_kernel_calls"]
    # The golden pins no binary; pinned through KERNEL_SOURCES, a kernel shows its.
    assert [k["binary"] for k in kernels] == [None]
    assert "characters, no pinned binary)" in format_report(inductor)
    (kernel,) = find_kernels(ast.parse(_golden("inductor_inference")).body)
    digest = hashlib.sha256(kernel.source.encode()).hexdigest()
    name = "ab/c" + "a" * 51 + ".main.so"
    pinned = _golden("inductor_inference").replace(
        "KERNEL_SOURCES: dict[str, str] = {}",
        f"KERNEL_SOURCES: dict[str, str] = {{{digest!r}: {name!r}}}",
    )
    report = inspect_artifact(pinned)
    assert [k["binary"] for k in report["graph"]["kernels"]] == [name]
    assert f"characters, binary {name})" in format_report(report)


def test_inspect_shows_aliased_inputs_and_pinned_kernel_binaries() -> None:
    report = inspect_artifact(_golden("eager_literals_aliasing"))
    assert report["aliased_inputs"] == [["argument 1 (`x`)", "argument 2 (`y`)"]]
    text = format_report(report)
    assert (
        "aliased inputs: argument 1 (`x`), argument 2 (`y`) share one storage" in text
    )
    assert inspect_artifact(_golden("eager_inference"))["aliased_inputs"] == []
    # The inductor golden pins no binary; an artifact that pins one lists it.
    text = _golden("inductor_inference")
    assert "kernels always compile from source" in format_report(inspect_artifact(text))
    name, digest = "ab/c" + "a" * 51 + ".main.so", "f" * 64
    pinned = text.replace(
        "KERNEL_BINARIES: dict[str, str] = {}",
        f"KERNEL_BINARIES: dict[str, str] = {{{name!r}: {digest!r}}}",
    )
    report = inspect_artifact(pinned)
    assert report["kernel_binaries"] == [{"file": name, "sha256": digest}]
    assert f"{name}  sha256 {'f' * 16}..." in format_report(report)


def test_inspect_shows_the_mode_each_module_was_traced_in() -> None:
    text = _golden("eager_multi_module")
    assert [m["mode"] for m in inspect_artifact(text)["modules"]] == ["training"] * 2
    traced = "MODULE_TRAINING: list[list[bool]] = [[True, True, True, True], [True]]"
    assert traced in text
    edited = text.replace(
        traced,
        "MODULE_TRAINING: list[list[bool]] = [[True, False, True, True], [False]]",
    )
    report = inspect_artifact(edited)
    assert [m["mode"] for m in report["modules"]] == [
        "mixed (3 of 4 modules training)",
        "eval",
    ]
    # Argument, names, mode, hooks, parameters, buffers, elements.
    assert re.search(r"\n  2\s+m1\.\*\s+eval\s+0\s+2\s+0\s+21", format_report(report))


def test_inspect_counts_kernels_by_kind_from_code_not_strings() -> None:
    graph = '''\
r"""
Compile-time auto-tuning block (a string, not code):
fake = async_compile.triton('fake', 'x')
"""
triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', """
@triton.jit
def triton_poi_fused_0(in_ptr0, xnumel, XBLOCK: tl.constexpr):
    pass
""", device_str='cuda')
cpp_fused_1 = async_compile.cpp_pybinding(['float*'], r"""
extern "C" void kernel(float* in_out_ptr0) {}
""")
async_compile.wait(globals())


def call(flat_inputs):
    extern_kernels.mm(flat_inputs[0], flat_inputs[1])
    return [torch.ops.aten.relu.default(flat_inputs[0])]
'''
    stub = stub_capture("inductor")
    cap = dataclasses.replace(stub, graph=dataclasses.replace(stub.graph, source=graph))
    report = inspect_artifact(render_artifact(cap))
    assert [(k["name"], k["kind"]) for k in report["graph"]["kernels"]] == [
        ("triton_poi_fused_0", "triton"),
        ("cpp_fused_1", "cpp_pybinding"),
    ]
    assert report["graph"]["kernel_kinds"] == {"triton": 1, "cpp_pybinding": 1}
    assert report["graph"]["extern_kernel_calls"] == {"mm": 1}
    assert report["graph"]["op_calls"] == {"aten.relu": 1}


def test_inspect_shows_dynamic_dims_with_symbols_bounds_and_strides() -> None:
    stub = stub_capture("inductor")
    graph = replace_backend_graph(
        dataclasses.replace(
            stub.graph, input_strides=InputStrides([(4, 1)], [(1,)], [None, None], [])
        ),
        positional_names=[],
    )
    cap = replace_convention(
        dataclasses.replace(stub, graph=graph),
        input_names=["p_weight", "b_running_mean", "x", "y", "literal0"],
        leaves=[
            InputLeaf((None, 4), "torch.float32", "cpu", {0: (2, 64)}, {0: "u0"}, None),
            InputLeaf(
                (None,), "torch.int64", "cpu", {0: (None, None)}, {0: "u0"}, None
            ),
        ],
        in_tree=InputTree(None, None),
    )
    report = inspect_artifact(render_artifact(cap))
    first, second = report["user_inputs"]["leaves"]
    assert first["shape"] == ["u0", 4]
    assert first["dynamic"] == [{"dim": 0, "symbol": "u0", "min": 2, "max": 64}]
    assert second["dynamic"][0]["symbol"] == "u0"
    assert report["module_state"][0]["stride"] == [4, 1]
    text = format_report(report)
    assert re.search(r"leaf 0\s+\(u0, 4\)\s+2 <= u0 <= 64\s+-\s+torch.float32", text)
    assert re.search(r"leaf 1\s+\(u0,\)\s+u0 unbounded", text)
    assert "user inputs (structure not recorded)" in text


def test_inspect_verify_and_diff_never_execute_the_artifact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sentinel = tmp_path / "executed"
    text = _golden("eager_train_step")
    graph = sections_by_key(text)["graph"]
    lines = text.splitlines(keepends=True)
    # Right below the graph's section title: any execution runs it first.
    at = graph.first_line - 1 + 3
    payload = f"open({str(sentinel)!r}, 'w').write('ran')\nraise SystemExit(7)\n"
    poisoned = "".join([*lines[:at], payload, *lines[at:]])
    step, cache = _pair(
        tmp_path, "poisoned", poisoned, build_cache(poisoned, "eager", None)
    )
    assert _cli(capsys, "inspect", step)[0] == 0
    assert _cli(capsys, "verify", step, cache)[0] == 0
    code, out, _ = _cli(capsys, "diff", str(GOLDEN / "eager_train_step.py"), step)
    assert code == 1
    assert "+raise SystemExit(7)" in out
    assert not sentinel.exists()


# --- verify -----------------------------------------------------------------------


def test_verify_accepts_a_pair_and_names_each_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _golden("eager_train_step")
    other = _golden("eager_inference")
    step, cache = _pair(tmp_path, "step", code, build_cache(code, "eager", None))
    caches = {
        "other": build_cache(other, "eager", None),
        "inductor": build_cache(code, "inductor", None),
        "garbage": b"not a torch.save file",
    }
    for name, data in caches.items():
        (tmp_path / f"{name}.cache").write_bytes(data)
    result, out, err = _cli(capsys, "verify", step, cache)
    assert result == 0, err
    assert out.startswith(f"ok: {step} and {cache} belong together")
    assert "signature        none (the pair was not signed)" in out
    same_call = "Pass the cache returned with this python_code by the same"
    for name, needle, fix in [
        ("other", "code_hash", same_call),
        ("inductor", "'inductor' backend", same_call),
        ("garbage", "the cache cannot be read", "write the pair again"),
    ]:
        result, _, err = _cli(capsys, "verify", step, str(tmp_path / f"{name}.cache"))
        _assert_one_line_error(result, err, "verify", 1, needle)
        assert fix in err, err


def test_verify_checks_the_signature_with_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code = _golden("eager_inference")
    step, signed = _pair(
        tmp_path, "step", code, build_cache(code, "eager", None, key=b"right key")
    )
    unsigned = tmp_path / "unsigned.cache"
    unsigned.write_bytes(build_cache(code, "eager", None))
    (tmp_path / "right.key").write_bytes(b"right key")
    (tmp_path / "wrong.key").write_bytes(b"wrong key")
    monkeypatch.setenv("STEP_KEY", "right key")

    result, out, err = _cli(capsys, "verify", step, signed)
    assert result == 0, err
    assert "present, not checked" in out
    for key in (["--key-file", str(tmp_path / "right.key")], ["--key-env", "STEP_KEY"]):
        result, out, err = _cli(capsys, "verify", step, signed, *key)
        assert result == 0, err
        assert "signature        valid under the given key" in out
    result, _, err = _cli(
        capsys, "verify", step, signed, "--key-file", str(tmp_path / "wrong.key")
    )
    _assert_one_line_error(result, err, "verify", 1, "signature")
    result, _, err = _cli(
        capsys, "verify", step, str(unsigned), "--key-env", "STEP_KEY"
    )
    _assert_one_line_error(result, err, "verify", 1, "no signature")


def test_verify_checks_the_kernel_binaries_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "ab/c" + "a" * 51 + ".main.so"
    digest = hashlib.sha256(b"binary").hexdigest()
    # The golden pins no binary; this artifact pins the one its cache carries.
    unpinned_code = _golden("inductor_inference")
    code = unpinned_code.replace(
        "KERNEL_BINARIES: dict[str, str] = {}",
        f"KERNEL_BINARIES: dict[str, str] = {{{name!r}: {digest!r}}}",
    )
    assert code != unpinned_code
    payload: dict[str, object] = {
        "kind": kernel_binaries.PAYLOAD_KIND,
        "build": {},
        "files": {name: b"binary"},
        "sha256": {name: hashlib.sha256(b"binary").hexdigest()},
    }
    damaged: dict[str, object] = {**payload, "sha256": {name: "0" * 64}}
    # A file name load would refuse to write: outside inductor's binaries.
    escaping_name = "../../escaped.main.so"
    escaping: dict[str, object] = {
        **payload,
        "files": {escaping_name: b"binary"},
        "sha256": {escaping_name: hashlib.sha256(b"binary").hexdigest()},
    }
    step, cache = _pair(tmp_path, "step", code, build_cache(code, "inductor", payload))
    # Built with this environment's fingerprint: the binaries can run here.
    here: dict[str, object] = {**payload, "build": kernel_binaries.build_fingerprint()}
    for name_, data in [
        ("damaged", damaged),
        ("bare", None),
        ("escaping", escaping),
        ("here", here),
    ]:
        (tmp_path / f"{name_}.cache").write_bytes(build_cache(code, "inductor", data))

    result, out, err = _cli(capsys, "verify", step, cache)
    assert result == 0, err
    # Built for no known environment: load would compile from source instead.
    assert (
        "kernel binaries  1 file, 6 bytes, sha256 ok, each pinned by the artifact's "
        "KERNEL_BINARIES; built elsewhere (" in out
    )
    result, out, err = _cli(capsys, "verify", step, str(tmp_path / "here.cache"))
    assert result == 0, err
    assert "they run here (same torch, Python, architecture and CPU capability)" in out
    # KERNEL_SOURCES gives the artifact's one kernel no binary: it compiles at load.
    assert (
        "kernels          1 without a binary in the cache, compiled at load: "
        "cpp_fused_relu_0" in out
    )
    # The same pair, the kernel's binary named by KERNEL_SOURCES.
    (kernel,) = find_kernels(ast.parse(code).body)
    sourced = code.replace(
        "KERNEL_SOURCES: dict[str, str] = {}",
        f"KERNEL_SOURCES: dict[str, str] = "
        f"{{{hashlib.sha256(kernel.source.encode()).hexdigest()!r}: {name!r}}}",
    )
    sourced_step, sourced_cache = _pair(
        tmp_path, "sourced", sourced, build_cache(sourced, "inductor", here)
    )
    result, out, err = _cli(capsys, "verify", sourced_step, sourced_cache)
    assert result == 0, err
    assert "kernels          each C++ kernel has its binary in the cache" in out
    result, out, err = _cli(capsys, "verify", step, str(tmp_path / "bare.cache"))
    assert result == 0, err
    assert "kernel binaries  none: load compiles the kernels from source" in out
    result, _, err = _cli(capsys, "verify", step, str(tmp_path / "damaged.cache"))
    _assert_one_line_error(result, err, "verify", 1, "does not match its sha256")
    assert "Write the pair again with precompile()" in err
    result, _, err = _cli(capsys, "verify", step, str(tmp_path / "escaping.cache"))
    _assert_one_line_error(result, err, "verify", 1, "unexpected file")
    assert "Write the pair again with precompile()" in err
    # A binary the artifact does not pin: load would not use it.
    unpinned, cache = _pair(
        tmp_path,
        "unpinned",
        unpinned_code,
        build_cache(unpinned_code, "inductor", payload),
    )
    result, _, err = _cli(capsys, "verify", unpinned, cache)
    _assert_one_line_error(result, err, "verify", 1, "KERNEL_BINARIES does not list")
    assert "write the pair again with precompile()" in err


# --- diff -------------------------------------------------------------------------


def test_diff_compares_goldens_section_by_section(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = str(GOLDEN / "eager_inference.py"), str(GOLDEN / "eager_train_step.py")
    code, out, _ = _cli(capsys, "diff", a, a)
    assert code == 0
    assert out.rstrip().endswith("the artifacts are identical")
    code, out, _ = _cli(capsys, "diff", a, b)
    assert code == 1
    # Each driver lists what its capture needs: the training step's adds the
    # gradients' steps, and carries the runtime support's gradients part. The
    # metadata lists constants.
    assert re.search(
        r"^== 3\. Driver: validate the call, run the graph -> 3\. Driver: validate "
        r"the call, run the graph, scatter gradients: \d+ lines removed, \d+ added$",
        out,
        re.M,
    )
    assert "+    flat_outputs = _scatter_gradients(state, flat_outputs)" in out
    assert re.search(
        r"^== 4\. Runtime support: support \+ calls \+ captured_graph .* -> "
        r"4\. Runtime support: support \+ gradients \+ calls \+ captured_graph ",
        out,
        re.M,
    )
    assert re.search(r"^== 2\. Calling-convention metadata: ", out, re.M)
    assert "~ NUM_POSITIONAL_ARGS:\n    - 2\n    + 3" in out
    assert "~ GRAD_PARAM_INDICES:\n    - []\n    + [0, 1, 2, 3]" in out
    assert "-# Generated by precompile_gen from `predict`" in out
    # Hunk headers give the files' own line numbers.
    a_lines = Path(a).read_text(encoding="utf-8").splitlines()
    hunks = re.findall(r"^@@ -(\d+),\d+ \+\d+,\d+ @@\n(.*)$", out, re.M)
    assert hunks
    for start, first_line in hunks:
        if first_line.startswith(" "):
            assert a_lines[int(start) - 1] == first_line[1:]


def test_diff_shows_the_same_runtime_support_as_one_line() -> None:
    # Two captures whose features need the same parts.
    a, b = _golden("eager_inference"), _golden("eager_literals_aliasing")
    runtime = sections_by_key(a)["runtime"]
    out, differs = diff_artifacts(a, b)
    assert differs
    assert f"\n== {runtime.label()}: identical\n" in out
    # Only what follows the known text differs: the diff shows that, and the known
    # text as one line.
    note = 'print("traced function took'
    out, differs = diff_artifacts(a, a.replace(note, note + " (edited)"), context=9)
    assert differs
    assert f"<the runtime support, sha256 {runtime.stamp}>" in out
    assert "def _remembered_state(" not in out
    # A copy whose text is not the one its stamp names is diffed line by line.
    edited = a.replace("traced_modes, several)", "traced_modes, False)")
    assert edited != a
    out, differs = diff_artifacts(a, edited)
    assert differs
    assert re.search(r"^\+ +return _describe_mode_difference\(.*, False\)$", out, re.M)


def test_diff_shows_the_same_runtime_support_parts_as_one_line() -> None:
    # An artifact with the optimizers part carries one known text too; one with other
    # parts carries another stamp, and its runtime section is diffed.
    a = _golden("eager_optimizer_step")
    runtime = sections_by_key(a)["runtime"]
    note = 'print("traced function took'
    out, differs = diff_artifacts(a, a.replace(note, note + " (edited)"), context=9)
    assert differs
    assert f"<the runtime support, sha256 {runtime.stamp}>" in out
    assert "def checked_steps(" not in out
    out, differs = diff_artifacts(_golden("eager_train_step"), a)
    assert differs
    assert "\n+    def checked_steps(\n" in out


def test_diff_summarizes_kernel_bodies_on_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _golden("inductor_inference")
    module = parse_artifact(text)
    graph = sections_by_key(text)["graph"]
    kernel = find_kernels(section_statements(module, graph))[0]
    assert text.count(kernel.source) == 1
    changed = text.replace(kernel.source, kernel.source.replace("{", "{ ", 1))
    new = tmp_path / "new.py"
    new.write_text(changed, encoding="utf-8")
    (tmp_path / "old.py").write_text(text, encoding="utf-8")
    old = str(tmp_path / "old.py")
    full_code, full, _ = _cli(capsys, "diff", old, str(new))
    summary_code, summary, _ = _cli(
        capsys, "diff", "--summarize-kernels", old, str(new)
    )
    assert full_code == summary_code == 1
    body_line = next(line for line in kernel.source.splitlines() if "{" in line)
    assert f"-{body_line}" in full
    assert body_line not in summary
    summaries = re.findall(
        rf"^([-+]){kernel.name} = .*<cpp_pybinding kernel {kernel.name}: [\d,]+ "
        r"characters, sha256 ([0-9a-f]{12})>",
        summary,
        re.M,
    )
    assert [sign for sign, _ in summaries] == ["-", "+"]
    assert summaries[0][1] != summaries[1][1]


def test_diff_lists_constants_added_and_removed() -> None:
    new = _golden("eager_inference")
    module = parse_artifact(new)
    symbols = next(
        s
        for s in module.body
        if isinstance(s, ast.AnnAssign)
        and isinstance(s.target, ast.Name)
        and s.target.id == "USER_INPUT_SYMBOLS"
    )
    lines = new.splitlines(keepends=True)
    # An artifact from before USER_INPUT_SYMBOLS existed.
    old = "".join(lines[: symbols.lineno - 1] + lines[symbols.end_lineno or 0 :])
    out, differs = diff_artifacts(old, new, "old.py", "new.py")
    assert differs
    assert "+ USER_INPUT_SYMBOLS (added): [None]" in out
    assert "+USER_INPUT_SYMBOLS: list[dict[int, str] | None] = ..." in out


# --- progress -------------------------------------------------------------------


def test_progress_without_a_terminal_writes_log_lines() -> None:
    stream = io.StringIO()
    progress = Progress(stream)
    assert not progress.interactive
    with progress.stage("first"):
        pass
    with pytest.raises(ValueError), progress.stage("second"):
        raise ValueError("boom")
    lines = stream.getvalue().splitlines()
    assert [re.sub(r"^\[\s*\d+\.\d s\] ", "", line) for line in lines] == [
        "first ...",
        f"first: done in {progress.seconds['first']:.1f} s",
        "second ...",
        f"second: failed in {progress.seconds['second']:.1f} s",
    ]


def test_progress_on_a_terminal_draws_a_live_line() -> None:
    controller, terminal = pty.openpty()
    with os.fdopen(terminal, "w") as stream:
        progress = Progress(stream)
        assert progress.interactive
        with progress.stage("compiling"):
            time.sleep(0.35)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal side is closed and drained
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    text = shown.decode()
    frames = re.findall(r"\r\x1b\[K([|/\\-]) compiling \d+\.\d s", text)
    assert len(frames) >= 3, text
    assert len(set(frames)) >= 2, text
    assert "ok compiling: done in" in text
