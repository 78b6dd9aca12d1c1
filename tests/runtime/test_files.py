"""On-disk pairs: ``precompile(..., artifact_path=, cache_path=)`` and ``load`` of
paths.

Each file is replaced atomically, so a writer killed at any instant leaves every file
complete (old or new); between the two renames the pair is mixed, and ``load``
refuses a mixed pair through the cache's code_hash instead of running it.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import random
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.linear_step import example_input, linear_model, train_step
from torch import nn

import precompile_gen as pg
from precompile_gen.runtime import files
from precompile_gen.runtime.cache import build_cache


def relu_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).relu().sum()
    loss.backward()
    return loss.detach()


STEPS = [train_step, relu_step]


@dataclass
class Pair:
    code: str
    cache: bytes


@pytest.fixture(scope="module")
def pairs() -> list[Pair]:
    return [
        Pair(*pg.precompile(step, linear_model(), example_input(), backend="eager"))
        for step in STEPS
    ]


def _assert_runs_like(step_index: int, forward: Any) -> None:
    model, reference = linear_model(), linear_model()
    torch.testing.assert_close(
        forward(model, example_input()), STEPS[step_index](reference, example_input())
    )
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)


def _belong_together_error() -> Any:
    return pytest.raises(pg.PrecompileError, match="do not belong together")


# --- writing and loading pairs ------------------------------------------------------


def test_precompile_writes_both_files_and_returns_the_pair(tmp_path: Path) -> None:
    artifact, cache = tmp_path / "step.py", tmp_path / "step.cache"
    code, cache_bytes = pg.precompile(
        train_step,
        linear_model(),
        example_input(),
        backend="eager",
        artifact_path=artifact,
        cache_path=str(cache),  # a str is a path here: the argument names a file
    )
    assert artifact.read_bytes() == code.encode("utf-8")
    assert cache.read_bytes() == cache_bytes
    # Nothing but the pair: no temporary file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.cache", "step.py"]
    _assert_runs_like(0, pg.load(artifact, cache))


def test_load_accepts_a_path_for_either_argument(
    pairs: list[Pair], tmp_path: Path
) -> None:
    artifact, cache = tmp_path / "step.py", tmp_path / "step.cache"
    files.write_pair(artifact, cache, pairs[0].code, pairs[0].cache)
    _assert_runs_like(0, pg.load(artifact, pairs[0].cache))
    _assert_runs_like(0, pg.load(pairs[0].code, cache))
    _assert_runs_like(0, pg.load(artifact, cache))


def test_load_treats_a_str_as_code_and_hints_at_a_path(
    pairs: list[Pair], tmp_path: Path
) -> None:
    artifact = tmp_path / "step.py"
    files.write_pair(artifact, tmp_path / "step.cache", pairs[0].code, pairs[0].cache)
    with pytest.raises(pg.PrecompileError) as info:
        pg.load(str(artifact), pairs[0].cache)
    message = str(info.value)
    # The hint is the whole message, not a postscript to a list of what the path,
    # read as code, lacks. (It names the path twice; how long that is depends on
    # where pytest put it.)
    hint = message.replace(str(artifact), "PATH")
    assert "\n" not in hint and len(hint) < 220, message
    assert "python_code is a str, which load reads as the artifact's text" in message
    assert f"pass pathlib.Path({str(artifact)!r}) to load the file" in message


def test_load_hints_at_a_path_for_a_py_name_that_is_no_file(pairs: list[Pair]) -> None:
    # Read as code, "out/model.py" is the valid expression out / model.py, which
    # lacks every metadata constant: the message says what it is instead.
    with pytest.raises(pg.PrecompileError) as info:
        pg.load("out/model.py", pairs[0].cache)
    assert str(info.value) == (
        "python_code is a str, which load reads as the artifact's text, but it is "
        "the path 'out/model.py': pass pathlib.Path('out/model.py') to load the "
        "file, or pass the file's text."
    )


def test_write_pair_keeps_text_byte_for_byte(tmp_path: Path) -> None:
    # Text mode would turn "\r\n" into "\n" on some platforms and break code_hash.
    code = "# line\r\nx = 'é'\r\n"
    files.write_pair(tmp_path / "a.py", tmp_path / "a.cache", code, b"\x00\xff")
    assert (tmp_path / "a.py").read_bytes() == code.encode("utf-8")
    assert (tmp_path / "a.cache").read_bytes() == b"\x00\xff"


@pytest.mark.parametrize("given", ["artifact_path", "cache_path"])
def test_precompile_needs_both_paths(tmp_path: Path, given: str) -> None:
    paths: dict[str, Any] = {given: tmp_path / "f"}
    with pytest.raises(ValueError, match="both artifact_path and cache_path"):
        pg.precompile(
            train_step, linear_model(), example_input(), backend="eager", **paths
        )
    assert not (tmp_path / "f").exists()


def test_precompile_rejects_one_file_for_both(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="same file"):
        pg.precompile(
            train_step,
            linear_model(),
            example_input(),
            backend="eager",
            artifact_path=tmp_path / "f",
            cache_path=tmp_path / "." / "f",
        )


def _never_traced(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the paths are checked before anything is traced")


@pytest.mark.parametrize(
    ("artifact", "cache", "argument", "problem", "fix"),
    [
        (
            "missing/step.py",
            "step.cache",
            "artifact_path",
            "in a folder that does not exist",
            "create it first, e.g. with os.makedirs(",
        ),
        (
            "step.py",
            "missing/step.cache",
            "cache_path",
            "in a folder that does not exist",
            "create it first, e.g. with os.makedirs(",
        ),
        (".", "step.cache", "artifact_path", "is a folder", "step.py'"),
        ("step.py", ".", "cache_path", "is a folder", "step.cache'"),
        (
            "step.py",
            "read-only/step.cache",
            "cache_path",
            "cannot write to",
            "pass a path in a writable folder",
        ),
    ],
)
def test_precompile_checks_the_paths_before_capture(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    artifact: str,
    cache: str,
    argument: str,
    problem: str,
    fix: str,
) -> None:
    if problem == "cannot write to":
        # Permissions do not bind every user (root writes anywhere), so the access
        # check answers "not writable" for the cache's folder instead.
        read_only = tmp_path / cache
        read_only.parent.mkdir()
        real_access = os.access

        def access(path: Any, mode: int) -> bool:
            return path != read_only.parent and real_access(path, mode)

        monkeypatch.setattr(files.os, "access", access)
    with pytest.raises(ValueError) as info:
        pg.precompile(
            _never_traced,
            linear_model(),
            example_input(),
            backend="eager",
            artifact_path=tmp_path / artifact,
            cache_path=tmp_path / cache,
        )
    message = str(info.value)
    assert message.startswith(f"{argument} "), message  # names the argument
    assert problem in message and fix in message, message
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_load_names_a_missing_file(pairs: list[Pair], tmp_path: Path) -> None:
    with pytest.raises(pg.PrecompileError, match="cannot read the artifact file"):
        pg.load(tmp_path / "missing.py", pairs[0].cache)
    with pytest.raises(pg.PrecompileError, match="cannot read the cache file") as info:
        pg.load(pairs[0].code, tmp_path / "missing.cache")
    assert str(tmp_path / "missing.cache") in str(info.value)
    with pytest.raises(pg.PrecompileError, match="cannot read the cache file"):
        pg.load(pairs[0].code, tmp_path)  # a folder


def test_load_rejects_an_artifact_file_that_is_not_utf8(
    pairs: list[Pair], tmp_path: Path
) -> None:
    artifact = tmp_path / "step.py"
    artifact.write_bytes(pairs[0].code.encode("utf-8")[:100] + b"\xff\xfe" + b"x = 1")
    with pytest.raises(pg.PrecompileError, match="not UTF-8") as info:
        pg.load(artifact, pairs[0].cache)
    assert "byte 100" in str(info.value)


@pytest.mark.parametrize("failing_fsync", [1, 2], ids=["artifact", "cache"])
def test_a_failed_write_leaves_the_previous_pair_and_no_temporary_file(
    pairs: list[Pair],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failing_fsync: int,
) -> None:
    artifact, cache = tmp_path / "step.py", tmp_path / "step.cache"
    files.write_pair(artifact, cache, pairs[0].code, pairs[0].cache)
    # The disk fills up while the artifact's (1) or the cache's (2) temporary file
    # is flushed.
    calls: list[int] = []
    real_fsync = os.fsync

    def fsync_fails(descriptor: int) -> None:
        calls.append(descriptor)
        if len(calls) == failing_fsync:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(descriptor)

    monkeypatch.setattr(files.os, "fsync", fsync_fails)
    with pytest.raises(pg.PrecompileError) as info:
        files.write_pair(artifact, cache, pairs[1].code, pairs[1].cache)
    monkeypatch.undo()
    message = str(info.value)
    assert "No space left on device" in message
    assert "The files already there are unchanged." in message
    assert "Free space or fix the folder's permissions" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.cache", "step.py"]
    _assert_runs_like(0, pg.load(artifact, cache))


@pytest.mark.parametrize(
    ("failing_fsync", "outcome", "artifact_index"),
    [
        # Syncing the folder after the cache's rename: a mixed pair.
        (3, "The cache is the new one but the artifact is not", 0),
        # Syncing it after the artifact's rename: the new pair, maybe not durable.
        (4, "Both files are written, but may not survive a power loss", 1),
    ],
)
def test_a_failed_folder_sync_says_which_files_changed(
    pairs: list[Pair],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failing_fsync: int,
    outcome: str,
    artifact_index: int,
) -> None:
    artifact, cache = tmp_path / "step.py", tmp_path / "step.cache"
    files.write_pair(artifact, cache, pairs[0].code, pairs[0].cache)
    calls: list[int] = []
    real_fsync = os.fsync

    def fsync_fails(descriptor: int) -> None:
        calls.append(descriptor)
        if len(calls) == failing_fsync:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(descriptor)

    monkeypatch.setattr(files.os, "fsync", fsync_fails)
    with pytest.raises(pg.PrecompileError) as info:
        files.write_pair(artifact, cache, pairs[1].code, pairs[1].cache)
    monkeypatch.undo()
    message = str(info.value)
    assert "Input/output error" in message and outcome in message, message
    assert "write the pair again" in message
    # What the message says is what is on disk, with no temporary file left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.cache", "step.py"]
    assert artifact.read_text(encoding="utf-8") == pairs[artifact_index].code
    assert cache.read_bytes() == pairs[1].cache


def test_a_crash_between_the_renames_leaves_a_pair_that_load_refuses(
    pairs: list[Pair], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    artifact, cache = tmp_path / "step.py", tmp_path / "step.cache"
    files.write_pair(artifact, cache, pairs[0].code, pairs[0].cache)
    renames: list[str] = []
    real_replace = os.replace

    def replace_then_die(source: Any, target: Any) -> None:
        renames.append(Path(target).name)
        if len(renames) == 2:
            raise KeyboardInterrupt  # stands in for the process being killed here
        real_replace(source, target)

    monkeypatch.setattr(files.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        files.write_pair(artifact, cache, pairs[1].code, pairs[1].cache)
    monkeypatch.undo()

    # The cache is renamed first, so the artifact on disk is the previous one.
    assert renames == ["step.cache", "step.py"]
    assert artifact.read_text(encoding="utf-8") == pairs[0].code
    assert cache.read_bytes() == pairs[1].cache
    with _belong_together_error():
        pg.load(artifact, cache)
    # Writing the pair again repairs it.
    files.write_pair(artifact, cache, pairs[1].code, pairs[1].cache)
    _assert_runs_like(1, pg.load(artifact, cache))


# --- fault injection ----------------------------------------------------------------

# Rewrites the pair in a loop until it is killed, starting without torch.
WRITER = Path(__file__).with_name("pair_writer_child.py")

KILLS = 250


def _pair_write_seconds(pairs: list[Pair], folder: Path) -> float:
    folder.mkdir()
    start = time.perf_counter()
    for i in range(10):
        pair = pairs[i % 2]
        files.write_pair(folder / "a.py", folder / "a.cache", pair.code, pair.cache)
    return (time.perf_counter() - start) / 10


def test_a_writer_killed_at_random_moments_never_leaves_a_torn_pair(
    pairs: list[Pair], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = importlib.util.find_spec("precompile_gen.runtime.files")
    assert spec is not None and spec.origin is not None
    sources: list[str] = []
    for i, pair in enumerate(pairs):
        (tmp_path / f"source{i}.py").write_bytes(pair.code.encode("utf-8"))
        (tmp_path / f"source{i}.cache").write_bytes(pair.cache)
        sources += [str(tmp_path / f"source{i}.py"), str(tmp_path / f"source{i}.cache")]
    # Kills land anywhere within the first few pair writes of each writer.
    window = 3 * _pair_write_seconds(pairs, tmp_path / "timing")
    folder = tmp_path / "pair"
    folder.mkdir()
    artifact, cache = folder / "step.py", folder / "step.cache"
    files.write_pair(artifact, cache, pairs[0].code, pairs[0].cache)
    codes = [pair.code for pair in pairs]
    caches = [pair.cache for pair in pairs]
    command = [sys.executable, "-S", str(WRITER), spec.origin, str(artifact)]
    command += [str(cache), *sources]
    rng = random.Random(0)
    outcomes = {"loaded": 0, "refused as mixed": 0}
    caplog.set_level(logging.ERROR)  # load's warning about executing code, each time
    for _ in range(KILLS):
        writer = subprocess.Popen(command, stdout=subprocess.PIPE)
        assert writer.stdout is not None
        assert writer.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0, window))
        writer.kill()
        writer.wait()
        writer.stdout.close()

        # Never torn: each file is exactly one of the versions written.
        code = artifact.read_bytes().decode("utf-8")
        assert code in codes
        assert cache.read_bytes() in caches
        which = codes.index(code)
        if cache.read_bytes() == caches[which]:
            _assert_runs_like(which, pg.load(artifact, cache))
            outcomes["loaded"] += 1
        else:
            with _belong_together_error():
                pg.load(artifact, cache)
            outcomes["refused as mixed"] += 1
    assert sum(outcomes.values()) == KILLS >= 200
    assert outcomes["loaded"] > 0
    # Only the pair and temporaries of killed writers, which nothing reads.
    leftovers = {p.name for p in folder.iterdir()} - {"step.py", "step.cache"}
    pattern = re.compile(r"\.step\.(py|cache)\.\d+\.[0-9a-f]{8}\.tmp")
    assert all(pattern.fullmatch(name) for name in leftovers), leftovers


# --- tracebacks name the artifact file ----------------------------------------------


def test_traceback_names_the_artifact_file_and_shows_the_executed_line(
    pairs: list[Pair], tmp_path: Path
) -> None:
    marker = "    modules, leaves = _split_arguments(args)\n"
    assert pairs[0].code.count(marker) == 1
    code = pairs[0].code.replace(
        marker, '    raise ValueError("boom in the file")\n' + marker
    )
    artifact, cache = tmp_path / "step.py", tmp_path / "step.cache"
    files.write_pair(artifact, cache, code, build_cache(code, "eager", None))
    forward = pg.load(artifact, cache)
    # Rewriting the file afterwards does not change what the traceback shows for
    # the code that was executed.
    files.write_pair(artifact, cache, pairs[1].code, pairs[1].cache)

    with pytest.raises(ValueError, match="boom in the file") as info:
        forward(linear_model(), example_input())

    frames = [
        frame
        for frame in traceback.extract_tb(info.value.__traceback__)
        if frame.filename == str(artifact)
    ]
    assert [frame.name for frame in frames] == ["forward"]
    (frame,) = frames
    assert frame.line == 'raise ValueError("boom in the file")'
    assert frame.lineno is not None
    assert code.splitlines()[frame.lineno - 1].strip() == frame.line
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{artifact}", line {frame.lineno}, in forward' in text
