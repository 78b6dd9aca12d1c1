"""``load``, ``parse_metadata`` and the cache envelope.

The cache is only an acceleration, so a cache that cannot be read degrades to a
warning; a readable cache made for another artifact is an error, because it means
the files were mixed up. The metadata is read by AST: nothing in python_code runs
before ``load`` says, in a warning, that it is about to execute it.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
import pickle
import random
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.utils._pytree as pytree
from helpers.stubs import stub_capture
from torch import nn

import precompile_gen as pg
from precompile_gen.capture_result import Backend
from precompile_gen.metadata import (
    METADATA_NAMES,
    REQUIRED_NAMES,
    metadata_constants,
)
from precompile_gen.runtime.cache import CACHE_FORMAT, CACHE_VERSION, build_cache


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def train_step(
    x: torch.Tensor, model: nn.Module, extras: dict[str, Any]
) -> dict[str, torch.Tensor]:
    out = model(x)
    loss = (out * extras["weight"]).sum() * extras["scale"]
    loss.backward()
    return {"loss": loss.detach(), "out": out.detach()}


def make_model() -> Net:
    torch.manual_seed(0)
    model = Net()
    # A frozen parameter stays in PARAM_NAMES but receives no gradient.
    model.bn.bias.requires_grad_(False)
    return model


def make_inputs() -> tuple[torch.Tensor, dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=generator)
    return x, {"weight": torch.randn(3, generator=generator), "scale": 2}


class Captured:
    def __init__(self) -> None:
        x, extras = make_inputs()
        self.code, self.cache = pg.precompile(
            train_step, x, make_model(), extras, backend="eager"
        )


@pytest.fixture(scope="module")
def captured() -> Captured:
    return Captured()


def read_envelope(cache: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(cache), weights_only=True)


def save(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def envelope_bytes(code: str, **overrides: object) -> bytes:
    fields: dict[str, object] = {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "backend": "eager",
        "code_hash": hashlib.sha256(code.encode("utf-8")).hexdigest(),
        "artifact": None,
    }
    fields.update(overrides)
    return save(fields)


def assert_runs_like_eager(forward: Callable[..., object]) -> None:
    """The loaded artifact gives eager's result, gradients and buffer updates."""
    x, extras = make_inputs()
    eager_model, compiled_model = make_model(), make_model()
    expected = train_step(x, eager_model, extras)
    got = cast(dict[str, torch.Tensor], forward(x, compiled_model, extras))
    torch.testing.assert_close(got, expected)
    for (name, ours), (_, theirs) in zip(
        compiled_model.named_parameters(), eager_model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
    assert compiled_model.lin.weight.grad is not None
    assert compiled_model.bn.bias.grad is None
    torch.testing.assert_close(
        dict(compiled_model.named_buffers()), dict(eager_model.named_buffers())
    )


def warnings_about(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and needle in r.getMessage()
    ]


def replace_line(code: str, pattern: str, replacement: str) -> str:
    new, count = re.subn(pattern, replacement, code, flags=re.MULTILINE)
    assert count == 1, f"{pattern!r} matched {count} lines"
    return new


# --- the cache envelope -------------------------------------------------------------


def test_cache_is_a_plain_envelope_readable_without_code(captured: Captured) -> None:
    envelope = read_envelope(captured.cache)
    assert type(envelope) is dict
    assert set(envelope) == {"format", "version", "backend", "code_hash", "artifact"}
    assert envelope["format"] == CACHE_FORMAT
    assert envelope["version"] == CACHE_VERSION
    assert envelope["backend"] == "eager"
    assert (
        envelope["code_hash"]
        == hashlib.sha256(captured.code.encode("utf-8")).hexdigest()
    )
    assert envelope["artifact"] is None


# --- parse_metadata -----------------------------------------------------------------


def test_parse_metadata_of_a_known_capture(captured: Captured) -> None:
    x, extras = make_inputs()
    in_spec = pytree.treespec_dumps(pytree.tree_flatten((x, extras))[1])
    result = train_step(x, make_model(), extras)
    out_spec = pytree.treespec_dumps(pytree.tree_flatten(result)[1])
    f32 = "torch.float32"

    meta = pg.parse_metadata(captured.code)

    assert meta == {
        "BACKEND": "eager",
        "MODULE_POSITIONS": [1],
        "NUM_POSITIONAL_ARGS": 3,
        # train_step's own parameter names, by position.
        "ARGUMENT_NAMES": ["x", "model", "extras"],
        # Net, lin and bn, all in training mode as constructed.
        "MODULE_TRAINING": [[True, True, True]],
        # No hooks on its modules, nor global module hooks.
        "MODULE_HOOKS": [{}],
        "GLOBAL_MODULE_HOOKS": {},
        "PARAM_NAMES": ["lin.weight", "lin.bias", "bn.weight", "bn.bias"],
        "BUFFER_NAMES": ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"],
        "PARAM_SHAPES": [(3, 4), (3,), (3,), (3,)],
        "BUFFER_SHAPES": [(3,), (3,), ()],
        "PARAM_DTYPES": [f32, f32, f32, f32],
        "BUFFER_DTYPES": [f32, f32, "torch.int64"],
        "PARAM_DEVICES": ["cpu"] * 4,
        "BUFFER_DEVICES": ["cpu"] * 3,
        "PARAM_REQUIRES_GRAD": [True, True, True, False],
        "BUFFER_REQUIRES_GRAD": [False, False, False],
        "GRAD_PARAM_INDICES": [0, 1, 2],
        "GRAD_RESETS": [],
        "IN_SPEC": in_spec,
        "OUT_SPEC": out_spec,
        # Leaves in call order: x, extras["weight"], then the int extras["scale"],
        # which is not a tensor and so has no shape, dtype or device.
        "USER_INPUT_SHAPES": [(5, 4), (3,), None],
        "USER_INPUT_DTYPES": [f32, f32, None],
        "USER_INPUT_DEVICES": ["cpu", "cpu", None],
        "USER_INPUT_BOUNDS": [None, None, None],
        "PARAM_STRIDES": [(4, 1), (1,), (1,), (1,)],
        "BUFFER_STRIDES": [(1,), (1,), ()],
        "USER_INPUT_STRIDES": [(4, 1), (1,), None],
        "USER_INPUT_SYMBOLS": [None, None, None],
        # The int extras["scale"] is built into the graph: calls must pass 2.
        "USER_INPUT_VALUES": [None, None, 2],
        # Emitted only by a capture with float arguments it computes with; its
        # absence reads as none.
        "NUMBER_INPUTS": {},
        # Emitted only by a capture with a path that skips its step.
        "STEP_RESETS": [],
        "SKIPPABLE_STEP": False,
        # Emitted only by a capture that indexes with its inputs; its absence reads
        # as none.
        "INDEX_CHECKS": [],
        "ALIASED_INPUTS": [],
        # The BatchNorm's running stats and batch count, which the step updates.
        "MUTATED_INPUTS": [4, 5, 6],
        # Emitted only by a capture whose inputs or result hold namedtuples or
        # dataclasses; its absence reads as none.
        "PYTREE_TYPES": [],
        # Emitted only by a capture with DTensor inputs; its absence reads as none.
        "DTENSORS": {},
        # Emitted only by an inductor capture with DTensors; likewise.
        "SHARD_INPUTS": {},
        "SHARD_OUTPUTS": {},
        "KERNEL_BINARIES": {},
        "KERNEL_SOURCES": {},
        # The BatchNorm's values the trace read and built into the graph.
        "PYTHON_VALUES": [
            ("argument 1: .bn.eps", "1e-05"),
            ("argument 1: .bn.momentum", "0.1"),
            ("argument 1: .bn.track_running_stats", "True"),
        ],
        # Emitted only with optimizer arguments; its absence reads as none.
        "OPTIMIZERS": [],
        # Emitted only by a function that returns t.item(); likewise.
        "SCALAR_OUTPUTS": [],
        # Emitted only by a capture with collectives or a DDP argument; likewise.
        "PROCESS_GROUPS": [],
        "DATA_PARALLEL": [],
        # Emitted only by a capture with sparse gradients; likewise.
        "SPARSE_GRADIENTS": [],
        "DEFERRED_STEPS": [],
    }
    assert list(meta) == list(METADATA_NAMES)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_parse_metadata_matches_the_rendered_capture(backend: Backend) -> None:
    cap = stub_capture(backend)
    assert pg.parse_metadata(pg.render_artifact(cap)) == metadata_constants(cap)


def test_parse_metadata_does_not_execute_the_code(
    captured: Captured, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "executed"
    # Set through monkeypatch so that whatever the side effect writes is undone.
    monkeypatch.setenv("PRECOMPILE_GEN_TEST_SIDE_EFFECT", "0")
    side_effect = (
        f"open({str(marker)!r}, 'w').close()\n"
        "import os\n"
        "os.environ['PRECOMPILE_GEN_TEST_SIDE_EFFECT'] = '1'\n"
    )
    code = side_effect + captured.code + "\n" + side_effect

    meta = pg.parse_metadata(code)

    assert meta["BACKEND"] == "eager"
    assert not marker.exists()
    assert os.environ["PRECOMPILE_GEN_TEST_SIDE_EFFECT"] == "0"
    # The side effect is live code: executing the text does trigger it.
    exec(compile(side_effect, "<side effect>", "exec"), {})
    assert marker.exists()
    assert os.environ["PRECOMPILE_GEN_TEST_SIDE_EFFECT"] == "1"


def test_parse_metadata_rejects_invalid_python(captured: Captured) -> None:
    with pytest.raises(pg.PrecompileError, match="not valid Python") as info:
        pg.parse_metadata("def broken(:\n" + captured.code)
    assert "precompile()" in str(info.value)


def test_parse_metadata_rejects_a_nul_byte(captured: Captured) -> None:
    with pytest.raises(pg.PrecompileError, match="not valid Python"):
        pg.parse_metadata(captured.code + "\x00")


def test_parse_metadata_names_a_missing_constant(captured: Captured) -> None:
    code = replace_line(captured.code, r"^NUM_POSITIONAL_ARGS: int = 3\n", "")
    with pytest.raises(pg.PrecompileError, match="NUM_POSITIONAL_ARGS") as info:
        pg.parse_metadata(code)
    message = str(info.value)
    assert "lacks" in message
    assert "precompile()" in message
    # Only the missing constant is named.
    assert "PARAM_NAMES" not in message


def test_parse_metadata_of_empty_text_counts_every_constant() -> None:
    with pytest.raises(pg.PrecompileError) as info:
        pg.parse_metadata("")
    message = str(info.value)
    required = list(REQUIRED_NAMES)
    first_line, _, rest = message.partition("\n")
    assert f"lacks {len(required)} of the metadata constants" in first_line
    assert "Pass the python_code returned by precompile()" in first_line
    # The first few are named, the rest counted, so the fix stays in view.
    assert rest == f"  missing {required[:3]} and {len(required) - 3} more", rest
    assert len(message) < 600, message


def test_parse_metadata_rejects_a_non_literal_constant(captured: Captured) -> None:
    code = replace_line(
        captured.code,
        r"^NUM_POSITIONAL_ARGS: int = 3$",
        'NUM_POSITIONAL_ARGS: int = len("abc")',
    )
    with pytest.raises(pg.PrecompileError, match="NUM_POSITIONAL_ARGS") as info:
        pg.parse_metadata(code)
    assert "not a plain literal" in str(info.value)
    assert "precompile()" in str(info.value)


@pytest.mark.parametrize(
    "extra",
    [
        'PARAM_NAMES = ["other"]',
        'PARAM_NAMES: list[str] = ["other"]',
        'PARAM_NAMES = OTHER = ["other"]',
        'PARAM_NAMES += ["other"]',
        # Bindings that are not ast.Name nodes.
        "try:\n    pass\nexcept Exception as PARAM_NAMES:\n    pass",
        "match 1:\n    case PARAM_NAMES:\n        pass",
        "match []:\n    case [*PARAM_NAMES]:\n        pass",
        "match {}:\n    case {**PARAM_NAMES}:\n        pass",
    ],
    ids=[
        "plain",
        "annotated",
        "chained",
        "augmented",
        "except-as",
        "match-capture",
        "match-star",
        "match-rest",
    ],
)
def test_parse_metadata_rejects_a_constant_assigned_twice(
    captured: Captured, extra: str
) -> None:
    # Executing such a file would use the second value, while a parse that kept the
    # first would describe another calling convention than the one that runs.
    code = captured.code + "\n" + extra + "\n"
    with pytest.raises(pg.PrecompileError, match="PARAM_NAMES") as info:
        pg.parse_metadata(code)
    assert "twice" in str(info.value)


def test_parse_metadata_rejects_an_unknown_backend(captured: Captured) -> None:
    code = replace_line(captured.code, r'^BACKEND: str = "eager"$', 'BACKEND = "tpu"')
    with pytest.raises(pg.PrecompileError, match="'tpu'") as info:
        pg.parse_metadata(code)
    assert "inductor" in str(info.value)
    assert "eager" in str(info.value)


@pytest.mark.parametrize("code", [None, b"BACKEND = 'eager'", 3, ["BACKEND"]])
def test_parse_metadata_rejects_a_non_str(code: Any) -> None:
    with pytest.raises(ValueError, match="str"):
        pg.parse_metadata(code)


# --- load: pairing errors -----------------------------------------------------------


def test_load_rejects_a_cache_from_another_precompile_call(captured: Captured) -> None:
    def other(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).relu()

    _, other_cache = pg.precompile(
        other, make_model(), torch.randn(5, 4), backend="eager"
    )
    with pytest.raises(pg.PrecompileError, match="do not belong together") as info:
        pg.load(captured.code, other_cache)
    assert "precompile()" in str(info.value)


def test_load_rejects_a_cache_made_by_another_backend(captured: Captured) -> None:
    cache = envelope_bytes(captured.code, backend="inductor")
    with pytest.raises(pg.PrecompileError, match="do not belong together") as info:
        pg.load(captured.code, cache)
    assert "'inductor'" in str(info.value)
    assert "'eager'" in str(info.value)


def test_load_accepts_a_hand_built_matching_envelope(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    forward = pg.load(captured.code, envelope_bytes(captured.code))
    assert warnings_about(caplog, "cache") == []
    assert_runs_like_eager(forward)


@pytest.mark.parametrize("cache", ["cache", bytearray(b"x"), memoryview(b"x")])
def test_load_rejects_a_non_bytes_cache(captured: Captured, cache: Any) -> None:
    # A path is accepted (tests/runtime/test_files.py); a str is never taken for one.
    with pytest.raises(ValueError, match="bytes") as info:
        pg.load(captured.code, cache)
    assert "or None to load without one" in str(info.value)


# --- load: an edited artifact -------------------------------------------------------


def _edited(code: str) -> str:
    # Each edit is a new artifact, which load has not warned about yet in this
    # process, whichever tests ran before.
    return code + f"\n# reviewed ({next(_edits)})\n"


_edits = itertools.count()


def test_a_cache_of_the_unedited_artifact_says_it_may_have_been_edited(
    captured: Captured,
) -> None:
    with pytest.raises(pg.PrecompileError, match="do not belong together") as info:
        pg.load(_edited(captured.code), captured.cache)
    message = str(info.value)
    assert "python_code was edited after precompile() wrote the pair" in message
    assert "load(python_code, None)" in message


def test_an_edited_artifact_loads_without_a_cache_and_without_cache_warnings(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    forward = pg.load(_edited(captured.code), None)
    assert_runs_like_eager(forward)
    # The one warning is that unsigned code runs; nothing about a cache.
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no signature" in warnings[0], warnings
    assert not any("cache" in w or "EOF" in w for w in warnings), warnings


def test_load_with_a_key_but_no_cache_is_refused(captured: Captured) -> None:
    with pytest.raises(ValueError, match="given a key but no cache") as info:
        pg.load(captured.code, None, key=b"secret")
    assert "leave out the key" in str(info.value)


def test_load_rejects_a_non_str_python_code(captured: Captured) -> None:
    with pytest.raises(ValueError, match="str"):
        pg.load(cast(Any, captured.code.encode()), captured.cache)


# --- load: caches that degrade to a warning -----------------------------------------


def _unreadable_caches(cache: bytes) -> dict[str, bytes]:
    return {
        "random": random.Random(0).randbytes(512),
        "truncated": cache[: len(cache) // 2],
        "empty": b"",
    }


@pytest.mark.parametrize("kind", ["random", "truncated", "empty"])
def test_load_warns_about_an_unreadable_cache_and_still_runs(
    captured: Captured, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    caplog.set_level(logging.WARNING)
    forward = pg.load(captured.code, _unreadable_caches(captured.cache)[kind])
    assert len(warnings_about(caplog, "cache cannot be read")) == 1
    assert_runs_like_eager(forward)


def test_a_corrupt_cache_is_named_as_such_with_the_fix(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    # A byte that is not UTF-8 where the pickle holds a string: torch.load fails
    # with a UnicodeDecodeError, whose codec detail says nothing about the file.
    corrupt = b"\x80\x02X\x02\x00\x00\x00\xff\xfe."
    caplog.set_level(logging.WARNING)
    forward = pg.load(captured.code, corrupt)
    (warning,) = warnings_about(caplog, "cache cannot be read")
    assert "it is not a file torch.save wrote" in warning
    assert "truncated or corrupted" in warning
    assert "write the pair again with precompile()" in warning
    assert "pass cache=None" in warning
    assert "codec" not in warning and "0xff" not in warning
    assert_runs_like_eager(forward)


@pytest.mark.parametrize(
    "envelope",
    [
        {"format": "someone_else", "version": 1, "backend": "eager"},
        {"format": CACHE_FORMAT, "version": CACHE_VERSION + 1, "backend": "eager"},
        {},
        [1, 2, 3],
        ("precompile_gen", 1),
        torch.zeros(3),
        None,
    ],
    ids=[
        "other-format",
        "other-version",
        "empty-dict",
        "list",
        "tuple",
        "tensor",
        "none",
    ],
)
def test_load_warns_about_a_foreign_envelope_and_still_runs(
    captured: Captured, caplog: pytest.LogCaptureFixture, envelope: object
) -> None:
    caplog.set_level(logging.WARNING)
    forward = pg.load(captured.code, save(envelope))
    assert len(warnings_about(caplog, "envelope")) == 1
    assert_runs_like_eager(forward)


class CreatesDirectory:
    """Unpickling this runs ``os.mkdir(path)``: a stand-in for any code a hostile
    pickle could run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("container", ["pickle", "torch.save"])
def test_load_does_not_run_a_pickle_payload_in_the_cache(
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    container: str,
) -> None:
    def payload(path: Path) -> bytes:
        if container == "pickle":
            return pickle.dumps(CreatesDirectory(path), protocol=2)
        return save(CreatesDirectory(path))

    # The payload is live: an unrestricted unpickler runs it.
    control = tmp_path / "control"
    if container == "pickle":
        pickle.loads(payload(control))
    else:
        torch.load(io.BytesIO(payload(control)), weights_only=False)
    assert control.is_dir()

    target = tmp_path / "payload_ran"
    caplog.set_level(logging.WARNING)
    forward = pg.load(captured.code, payload(target))

    assert not target.exists()
    assert len(warnings_about(caplog, "cache cannot be read")) == 1
    assert_runs_like_eager(forward)


def test_load_warns_about_an_artifact_payload_that_is_not_a_dict(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    forward = pg.load(captured.code, envelope_bytes(captured.code, artifact="text"))
    assert len(warnings_about(caplog, "not a dict")) == 1
    assert_runs_like_eager(forward)


# --- load: execution ----------------------------------------------------------------


def _load_records(
    caplog: pytest.LogCaptureFixture, level: int, needle: str
) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "precompile_gen.runtime.load"
        and r.levelno == level
        and needle in r.getMessage()
    ]


def test_an_unsigned_artifact_is_warned_about_once_per_process(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    edited = _edited(captured.code)
    for _ in range(3):
        assert_runs_like_eager(pg.load(edited, None))
    warnings = _load_records(caplog, logging.WARNING, "no signature vouches")
    assert len(warnings) == 1, warnings
    assert "said once per artifact and process" in warnings[0]
    assert "load only artifacts you produced or trust" in warnings[0]
    assert len(_load_records(caplog, logging.INFO, "warned about at its first")) == 2
    # Another artifact is warned about on its own.
    assert_runs_like_eager(pg.load(_edited(captured.code), None))
    assert len(_load_records(caplog, logging.WARNING, "no signature vouches")) == 2


def test_an_artifact_this_process_produced_is_logged_at_info(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert_runs_like_eager(pg.load(captured.code, captured.cache))
    assert_runs_like_eager(pg.load(captured.code, None))
    assert _load_records(caplog, logging.WARNING, "no signature") == []
    infos = _load_records(caplog, logging.INFO, "this process produced it")
    assert len(infos) == 2, caplog.records


def test_load_does_not_execute_before_the_pairing_check(
    captured: Captured, tmp_path: Path
) -> None:
    marker = tmp_path / "executed"
    code = f"open({str(marker)!r}, 'w').close()\n" + captured.code
    with pytest.raises(pg.PrecompileError, match="do not belong together"):
        pg.load(code, captured.cache)
    assert not marker.exists()


def test_loaded_forward_runs_like_eager(captured: Captured) -> None:
    assert_runs_like_eager(pg.load(captured.code, captured.cache))


def test_loaded_forward_accumulates_grads_across_calls(captured: Captured) -> None:
    forward = pg.load(captured.code, captured.cache)
    x, extras = make_inputs()
    eager_model, compiled_model = make_model(), make_model()
    for _ in range(2):
        train_step(x, eager_model, extras)
        forward(x, compiled_model, extras)
    for ours, theirs in zip(
        compiled_model.parameters(), eager_model.parameters(), strict=True
    ):
        torch.testing.assert_close(ours.grad, theirs.grad)


# --- tracebacks point into the artifact ---------------------------------------------


def _artifact_frames(error: BaseException) -> list[traceback.FrameSummary]:
    return [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename.startswith("<precompile_gen:")
    ]


def test_traceback_of_a_driver_error_shows_artifact_source(captured: Captured) -> None:
    forward = pg.load(captured.code, captured.cache)
    x, _ = make_inputs()
    with pytest.raises(pg.PrecompileError, match="positional arguments") as info:
        forward(x, make_model())
    frames = _artifact_frames(info.value)
    assert [f.name for f in frames][:2] == ["forward", "_split_arguments"]
    text = "".join(traceback.format_exception(info.value))
    assert "modules, leaves = _split_arguments(args)" in text
    assert "raise error_type(message)" in text
    # The line numbers are the artifact's own.
    lines = captured.code.splitlines()
    for frame in frames:
        assert frame.lineno is not None
        assert lines[frame.lineno - 1].strip() == frame.line


def test_traceback_of_an_error_raised_in_the_artifact_shows_its_line(
    captured: Captured,
) -> None:
    code = replace_line(
        captured.code,
        r"^(    )(modules, leaves = _split_arguments\(args\))$",
        r'\1raise ValueError("boom inside the artifact")\n\1\2',
    )
    forward = pg.load(code, build_cache(code, "eager", None))
    x, extras = make_inputs()
    with pytest.raises(ValueError, match="boom inside the artifact") as info:
        forward(x, make_model(), extras)
    text = "".join(traceback.format_exception(info.value))
    assert 'raise ValueError("boom inside the artifact")' in text
    (frame,) = _artifact_frames(info.value)
    assert frame.name == "forward"
    assert frame.lineno is not None
    assert code.splitlines()[frame.lineno - 1].strip() == frame.line


def test_an_artifact_of_another_version_is_named_as_such(captured: Captured) -> None:
    # An artifact written before a metadata constant was added lacks it.
    old = "\n".join(
        line
        for line in captured.code.splitlines()
        if not line.startswith("USER_INPUT_VALUES:")
    )
    with pytest.raises(pg.PrecompileError) as info:
        pg.load(old, captured.cache)
    message = str(info.value)
    first_line, _, rest = message.partition("\n")
    assert "lacks 1 of the metadata constants" in first_line
    assert "missing ['USER_INPUT_VALUES']" in rest
    assert "made by another version of precompile_gen" in message
    assert "precompile again to regenerate it" in message
