"""The inductor cache carries the kernel binaries, so a fresh process with an empty
inductor cache folder reaches its first result without importing Inductor, let alone
running the compiler; a payload that does not fit the machine, or a kernel without a
binary, falls back to compiling, with a warning."""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.mlp_step import inputs, mlp, train_step
from helpers.processes import env_with_helpers

import precompile_gen as pg
from precompile_gen.runtime import kernel_binaries


@dataclass
class Pair:
    code: str
    cache: bytes
    envelope: dict[str, object]


@pytest.fixture(scope="module")
def pair() -> Pair:
    code, cache = pg.precompile(train_step, mlp(), *inputs())
    envelope = torch.load(io.BytesIO(cache), weights_only=True)
    return Pair(code, cache, envelope)


def _payload(pair: Pair) -> dict[str, object]:
    payload = pair.envelope["artifact"]
    assert isinstance(payload, dict)
    return payload


def _with_payload(pair: Pair, payload: object) -> bytes:
    envelope = {**pair.envelope, "artifact": payload}
    buffer = io.BytesIO()
    torch.save(envelope, buffer)
    return buffer.getvalue()


def _assert_matches_eager(forward: object) -> None:
    assert callable(forward)
    model, reference = mlp(), mlp()
    loss = forward(model, *inputs())
    expected = train_step(reference, *inputs())
    torch.testing.assert_close(loss, expected)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def _kernel_sources(code: str) -> list[str]:
    """The C++ source of each kernel the artifact compiles, as it spells it."""
    return re.findall(
        r"^\w+ = async_compile\.cpp_pybinding\(\[[^]]*\], r\'\'\'(.*?)\'\'\'\)",
        code,
        re.M | re.S,
    )


def _compiled_kernels(folder: Path, code: str) -> list[str]:
    """The C++ sources under ``folder`` that hold one of the artifact's kernels.

    Inductor writes the source of each kernel it compiles into its cache folder,
    and also, when it first picks a vector instruction set, one probe source per
    instruction set the CPU may have (more on a CPU with AVX-512 or AMX), some named
    like a kernel's: the kernels are told apart by their content.
    """
    kernels = [kernel.strip() for kernel in _kernel_sources(code)]
    return sorted(
        path.name
        for path in folder.rglob("*.cpp")
        if any(kernel in path.read_text(encoding="utf-8") for kernel in kernels)
    )


def test_payload_carries_each_kernel_binary_with_its_digest(pair: Pair) -> None:
    payload = _payload(pair)
    assert payload["kind"] == kernel_binaries.PAYLOAD_KIND
    files, digests = payload["files"], payload["sha256"]
    assert isinstance(files, dict) and isinstance(digests, dict)
    kernels = _kernel_sources(pair.code)
    assert kernels, "the artifact compiles C++ kernels"
    assert len(files) == len(kernels)
    for name, data in files.items():
        assert re.fullmatch(r"[a-z0-9]{2}/c[a-z0-9]{51}\.main\.so", name)
        assert data[:4] == b"\x7fELF"
    assert set(digests) == set(files)
    assert payload["build"] == kernel_binaries.build_fingerprint()
    # C++ kernels only: the payload says there is no Triton kernel it leaves out.
    assert payload["triton_kernels"] == []
    assert payload["triton_interpreted"] is False
    # The artifact says which binary is each kernel's, by its source's digest.
    sources = pg.parse_metadata(pair.code)["KERNEL_SOURCES"]
    assert isinstance(sources, dict)
    assert set(sources) == {hashlib.sha256(k.encode()).hexdigest() for k in kernels}
    assert sorted(sources.values()) == sorted(files)


FRESH_LOAD = Path(__file__).with_name("fresh_load_child.py")


@dataclass
class FreshLoad:
    binaries: dict[str, bytes]  # the inductor cache folder's afterwards, by name
    compiled: list[str]  # every C++ source written there, the artifact's or Inductor's
    compiled_kernels: list[str]  # those holding one of the artifact's kernels
    imported: list[str]  # Inductor and Dynamo, if the process imported them
    torch_dir: str


def _fresh_load(
    tmp_path: Path, code: str, cache: bytes, python: str = sys.executable
) -> FreshLoad:
    """Load and run the pair in a new interpreter with an empty inductor cache
    folder, checking its results against eager."""
    done = _load_in_fresh_process(tmp_path, code, cache, python)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    cache_dir = tmp_path / "inductor-cache"
    binaries = {
        path.relative_to(cache_dir).as_posix(): path.read_bytes()
        for path in cache_dir.rglob("*.so")
    }
    return FreshLoad(
        binaries,
        compiled=[path.name for path in cache_dir.rglob("*.cpp")],
        compiled_kernels=_compiled_kernels(cache_dir, code),
        imported=report["imported"],
        torch_dir=report["torch_dir"],
    )


@pytest.mark.slow
def test_fresh_process_with_empty_cache_folder_compiles_nothing(
    pair: Pair, tmp_path: Path
) -> None:
    # Every binary the process used is one the cache carried: nothing was compiled,
    # and neither Inductor nor Dynamo was imported.
    loaded = _fresh_load(tmp_path, pair.code, pair.cache)
    assert loaded.imported == []
    assert loaded.compiled == []
    assert loaded.binaries == _payload(pair)["files"]


@pytest.mark.slow
def test_fresh_process_without_the_payload_compiles(pair: Pair, tmp_path: Path) -> None:
    # The control for the tests around it: without the binaries the kernels are
    # compiled.
    loaded = _fresh_load(tmp_path, pair.code, _with_payload(pair, None))
    assert loaded.imported == ["torch._dynamo", "torch._inductor"]
    # Each kernel is compiled from a source of its own; whatever else Inductor
    # compiled (its probes of the CPU's instruction sets) is not counted.
    assert len(loaded.compiled_kernels) == len(_kernel_sources(pair.code)) > 0
    assert loaded.binaries


@pytest.mark.slow
def test_another_environment_at_other_install_paths_compiles_nothing(
    pair: Pair, tmp_path: Path
) -> None:
    # The same installation reached through another folder, as from a second
    # virtualenv: torch and Python's headers are seen under other paths, which are
    # part of inductor's keys but not of the binaries, imported as they are.
    prefix = Path(sys.prefix)
    python = Path(sys.executable)
    if not python.is_relative_to(prefix):
        pytest.skip(f"the interpreter {python} is not inside sys.prefix {prefix}")
    if not Path(torch.__file__).is_relative_to(prefix):
        # A virtualenv over the system's packages: torch is not reached through it.
        pytest.skip(f"torch is installed outside sys.prefix {prefix}")
    other_prefix = tmp_path / "other-environment"
    other_prefix.symlink_to(prefix, target_is_directory=True)
    other_python = other_prefix / python.relative_to(prefix)
    loaded = _fresh_load(tmp_path, pair.code, pair.cache, str(other_python))
    assert loaded.torch_dir.startswith(str(other_prefix))
    assert loaded.imported == []
    assert loaded.compiled == []
    assert loaded.binaries == _payload(pair)["files"]


def test_a_kernel_without_a_binary_compiles_alone(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A cache that lacks one kernel's binary: that kernel compiles from its source
    # in the artifact, the others are imported from theirs.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    payload = copy.deepcopy(_payload(pair))
    files, digests = payload["files"], payload["sha256"]
    assert isinstance(files, dict) and isinstance(digests, dict) and len(files) > 1
    missing = sorted(files)[0]
    del files[missing], digests[missing]
    forward = pg.load(pair.code, _with_payload(pair, payload))
    _assert_matches_eager(forward)
    # Inductor writes the source of each kernel it compiles into its cache folder;
    # the others' binaries are the cache's.
    assert len(_compiled_kernels(tmp_path, pair.code)) == 1
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data


def test_an_artifact_loaded_without_a_cache_compiles_its_kernels_quietly(
    pair: Pair,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # load(code, None) is how an edited artifact runs: its cache no longer belongs
    # to it. Every kernel compiles from the code, with no warning about a cache.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.WARNING)
    forward = pg.load(pair.code + "\n# reviewed\n", None)
    _assert_matches_eager(forward)
    assert len(_compiled_kernels(tmp_path, pair.code)) == len(
        _kernel_sources(pair.code)
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("cache" in w or "EOF" in w for w in warnings), warnings


def test_a_binary_that_cannot_be_imported_is_compiled_with_a_warning(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Executed with a binary that is no kernel module (as when a library it needs
    # is missing here), the artifact compiles that kernel instead, after a warning.
    # Executed other than by load, it builds its kernels at the first call: the
    # warning comes then, not while the module is executed.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    sources = pg.parse_metadata(pair.code)["KERNEL_SOURCES"]
    assert isinstance(sources, dict)
    digest = next(iter(sources))
    broken = tmp_path / "broken.main.so"
    broken.write_bytes(b"not a shared library")
    namespace: dict[str, object] = {"__kernel_binaries__": {digest: str(broken)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(pair.code, "<artifact>", "exec"), namespace)
    with pytest.warns(UserWarning, match="cannot be imported here"):
        _assert_matches_eager(namespace["forward"])


def _kernel_names(code: str) -> list[str]:
    return re.findall(r"^(\w+) = async_compile\.cpp_pybinding\(", code, re.M)


def test_load_builds_every_kernel_before_the_first_call(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The graph section only records its kernels; load builds them right after
    # executing it, so the first call runs them at once.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    forward = pg.load(pair.code, pair.cache)
    assert callable(forward)
    scope = forward.__globals__
    assert scope["_DEFERRED_KERNEL_SCOPES"] == []
    names = _kernel_names(pair.code)
    assert names
    for name in names:
        assert callable(scope[name])
        assert not isinstance(scope[name], scope["_DeferredKernel"])
    _assert_matches_eager(forward)


def test_an_artifact_executed_on_its_own_builds_its_kernels_at_the_first_call(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    namespace: dict[str, object] = {}
    exec(compile(pair.code, "<artifact>", "exec"), namespace)
    names = _kernel_names(pair.code)
    deferred = namespace["_DeferredKernel"]
    assert isinstance(deferred, type)
    assert all(isinstance(namespace[name], deferred) for name in names)
    _assert_matches_eager(namespace["forward"])
    assert namespace["_DEFERRED_KERNEL_SCOPES"] == []
    built = {name: namespace[name] for name in names}
    assert not any(isinstance(kernel, deferred) for kernel in built.values())
    # Built once: a later call runs the same kernels.
    _assert_matches_eager(namespace["forward"])
    assert all(namespace[name] is kernel for name, kernel in built.items())


def test_concurrent_first_calls_of_an_artifact_executed_on_its_own(pair: Pair) -> None:
    # Each thread's first call finds the kernels deferred; one builds them while the
    # others wait, and every call runs built kernels.
    namespace: dict[str, object] = {}
    exec(compile(pair.code, "<artifact>", "exec"), namespace)
    forward = namespace["forward"]
    assert callable(forward)
    # The models are built here: mlp() seeds torch's global generator, which the
    # threads would share.
    models = [mlp() for _ in range(4)]
    reference = mlp()
    expected = train_step(reference, *inputs())
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        losses = list(pool.map(lambda model: forward(model, *inputs()), models))
    assert namespace["_DEFERRED_KERNEL_SCOPES"] == []
    for loss, model in zip(losses, models, strict=True):
        torch.testing.assert_close(loss, expected)
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda p: p["build"].update(torch="0.0.0"), "different environment"),
        (lambda p: p["build"].update(cpu_capability="NEON"), "cpu_capability"),
        (lambda p: p["build"].update(python="3.0.0"), "python"),
        (lambda p: p.update(build="unknown"), "build fingerprint"),
        (lambda p: p.update(kind="other"), "not a kernel-binary payload"),
        (lambda p: p.update(files=[]), "manifest is malformed"),
    ],
    ids=["torch", "isa", "python", "no-fingerprint", "kind", "manifest"],
)
def test_unusable_payload_falls_back_to_compiling_with_a_warning(
    pair: Pair,
    tamper: object,
    reason: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    payload = copy.deepcopy(_payload(pair))
    assert callable(tamper)
    tamper(payload)
    caplog.set_level(logging.WARNING)
    forward = pg.load(pair.code, _with_payload(pair, payload))
    warnings = [
        r.getMessage() for r in caplog.records if "compiled kernels" in r.message
    ]
    assert len(warnings) == 1 and reason in warnings[0], warnings
    # Nothing from the rejected payload was written.
    assert not list(tmp_path.rglob("*.main.so"))
    _assert_matches_eager(forward)


def test_binary_that_does_not_match_its_digest_is_not_written(
    pair: Pair,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    payload = copy.deepcopy(_payload(pair))
    files = payload["files"]
    assert isinstance(files, dict)
    name = next(iter(files))
    data = files[name]
    assert isinstance(data, bytes)
    files[name] = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
    caplog.set_level(logging.WARNING)
    forward = pg.load(pair.code, _with_payload(pair, payload))
    assert any("does not match its sha256" in r.getMessage() for r in caplog.records), (
        caplog.text
    )
    assert not (tmp_path / name).exists()
    _assert_matches_eager(forward)


@pytest.mark.parametrize(
    "name",
    ["../../escaped.main.so", "/tmp/absolute.main.so", "ab/evil.py", "ab/c.main.so"],
)
def test_payload_cannot_write_outside_kernel_binaries(
    pair: Pair,
    name: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    cache_dir = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    payload = copy.deepcopy(_payload(pair))
    files, digests = payload["files"], payload["sha256"]
    assert isinstance(files, dict) and isinstance(digests, dict)
    files[name] = b"payload"
    digests[name] = hashlib.sha256(b"payload").hexdigest()
    caplog.set_level(logging.WARNING)
    pg.load(pair.code, _with_payload(pair, payload))
    assert any("unexpected file" in r.getMessage() for r in caplog.records)
    assert not any(
        p.read_bytes() == b"payload" for p in tmp_path.rglob("*") if p.is_file()
    )


def test_priming_writes_the_binaries_under_their_keys(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    payload = _payload(pair)
    metadata = pg.parse_metadata(pair.code)
    pinned, sources = metadata["KERNEL_BINARIES"], metadata["KERNEL_SOURCES"]
    assert isinstance(sources, dict)
    files = payload["files"]
    assert isinstance(files, dict)
    # A file already under one of the names, with other bytes, is replaced.
    stale = tmp_path / next(iter(files))
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"stale")
    binaries = kernel_binaries.prime(payload, pinned, sources)
    # The artifact is given each kernel's binary by its source's digest.
    assert binaries == {
        digest: str(tmp_path / name) for digest, name in sources.items()
    }
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    assert kernel_binaries.prime(payload, pinned, sources) == binaries


def test_kernel_folder_is_inductors(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert kernel_binaries.kernel_folder() == default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "relative/folder")
    assert kernel_binaries.kernel_folder() == os.path.abspath("relative/folder")


def test_load_leaves_inductor_config_as_it_was(pair: Pair) -> None:
    from torch._inductor import config

    before = config.save_config_portable()
    _assert_matches_eager(pg.load(pair.code, pair.cache))
    assert config.save_config_portable() == before


def test_a_kernel_binary_that_cannot_be_written_is_named_with_the_fix(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    files = _payload(pair)["files"]
    assert isinstance(files, dict)
    # A regular file where a binary's sub-folder goes: it cannot be created (a
    # read-only folder behaves alike, for any user but root).
    blocker = tmp_path / next(iter(files)).split("/")[0]
    blocker.write_bytes(b"")
    with pytest.raises(pg.PrecompileError) as info:
        pg.load(pair.code, pair.cache)
    message = str(info.value)
    assert f"inductor's cache folder {tmp_path}" in message
    assert (
        "Set TORCHINDUCTOR_CACHE_DIR to a folder this process can write to" in message
    )
    assert blocker.read_bytes() == b""
    assert not list(tmp_path.rglob("*.partial"))


UNUSABLE_CACHE_FOLDER = Path(__file__).with_name("unusable_cache_folder_child.py")


@pytest.mark.slow
def test_a_cache_folder_that_cannot_be_created_fails_clearly_in_a_fresh_process(
    pair: Pair, tmp_path: Path
) -> None:
    # In a fresh process torch creates TORCHINDUCTOR_CACHE_DIR while importing its
    # compiler stack, which tracing does too, and fails with a bare OSError if it
    # cannot; precompile and load say which folder and what to do instead.
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"")
    code, cache = tmp_path / "step.py", tmp_path / "step.cache"
    code.write_text(pair.code, encoding="utf-8")
    cache.write_bytes(pair.cache)
    done = subprocess.run(
        [sys.executable, str(UNUSABLE_CACHE_FOLDER), str(code), str(cache)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(blocked / "inductor")},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["precompile", "load"], done.stdout
    for line in lines:
        assert f"TORCHINDUCTOR_CACHE_DIR is {str(blocked / 'inductor')!r}" in line
        assert "Set it to a folder this process can write to" in line
    assert blocked.read_bytes() == b""


# --- The artifact decides which native code a cache may bring -----------------------

_HOSTILE_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark_loaded(void) {
    const char *path = getenv("PRECOMPILE_GEN_TEST_MARKER");
    FILE *file = path ? fopen(path, "w") : NULL;
    if (file) { fputs("loaded", file); fclose(file); }
}
"""
_KEY = b"precompile_gen trust test key"


@pytest.fixture(scope="module")
def hostile_binary(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A valid shared library that writes a marker file when it is loaded."""
    folder = tmp_path_factory.mktemp("hostile")
    source, binary = folder / "hostile.c", folder / "hostile.so"
    source.write_text(_HOSTILE_SOURCE, encoding="utf-8")
    subprocess.run(
        ["g++", "-x", "c", "-shared", "-fPIC", str(source), "-o", str(binary)],
        check=True,
        capture_output=True,
    )
    return binary.read_bytes()


def _with_binary(pair: Pair, name: str, data: bytes) -> dict[str, object]:
    """The pair's payload with ``data`` under ``name``, its manifest consistent."""
    payload = copy.deepcopy(_payload(pair))
    files, digests = payload["files"], payload["sha256"]
    assert isinstance(files, dict) and isinstance(digests, dict)
    files[name] = data
    digests[name] = hashlib.sha256(data).hexdigest()
    return payload


def _listed_name(pair: Pair) -> str:
    files = _payload(pair)["files"]
    assert isinstance(files, dict)
    return next(name for name in files if name.endswith(".main.so"))


_UNLISTED_NAME = "zz/c" + "z" * 51 + ".main.so"


def test_the_hostile_binary_runs_code_when_loaded(
    hostile_binary: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control for the tests below: loading it is observable.
    import ctypes

    library, marker = tmp_path / "control.so", tmp_path / "marker"
    library.write_bytes(hostile_binary)
    monkeypatch.setenv("PRECOMPILE_GEN_TEST_MARKER", str(marker))
    ctypes.CDLL(str(library))
    assert marker.read_text() == "loaded"


def test_artifact_pins_every_binary_its_cache_carries(pair: Pair) -> None:
    pinned = pg.parse_metadata(pair.code)["KERNEL_BINARIES"]
    assert pinned == _payload(pair)["sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["listed", "unlisted"])
def test_a_cache_cannot_bring_a_binary_the_artifact_does_not_pin(
    pair: Pair, hostile_binary: bytes, where: str, tmp_path: Path
) -> None:
    name = _listed_name(pair) if where == "listed" else _UNLISTED_NAME
    payload = _with_binary(pair, name, hostile_binary)
    expected = (
        "is not the one the artifact's KERNEL_BINARIES pins"
        if where == "listed"
        else "which the artifact's KERNEL_BINARIES does not list"
    )
    # Signed, the pair was tampered with: refused before anything is written or run.
    cache_dir = tmp_path / "signed-inductor-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        with pytest.raises(pg.PrecompileError) as caught:
            pg.load(pair.code, _cache_with(pair.code, payload, key=_KEY), key=_KEY)
    assert expected in str(caught.value) and "precompile again" in str(caught.value)
    assert not list(cache_dir.rglob("*.so"))
    # Unsigned, in a fresh process (nothing loaded yet): a warning, then the
    # kernels compile from the artifact's source and the results match eager.
    done = _load_in_fresh_process(tmp_path, pair.code, _cache_with(pair.code, payload))
    assert done.returncode == 0, done.stderr[-4000:]
    assert expected in done.stderr
    assert not (tmp_path / "marker").exists(), "the cache's binary was loaded"
    binaries = (tmp_path / "inductor-cache").rglob("*.so")
    assert not any(path.read_bytes() == hostile_binary for path in binaries)


@pytest.mark.slow
def test_a_binary_the_artifact_pins_is_loaded(
    pair: Pair, hostile_binary: bytes, tmp_path: Path
) -> None:
    # The control for the test above: pinned in the artifact, the same binary is
    # primed and loaded, so its marker shows whether a binary ran.
    name = _listed_name(pair)
    payload = _with_binary(pair, name, hostile_binary)
    digest = _payload(pair)["sha256"]
    assert isinstance(digest, dict)
    code = pair.code.replace(digest[name], hashlib.sha256(hostile_binary).hexdigest())
    assert code != pair.code
    _load_in_fresh_process(tmp_path, code, _cache_with(code, payload))
    assert (tmp_path / "marker").read_text() == "loaded"


def _cache_with(
    code: str, payload: dict[str, object], key: bytes | None = None
) -> bytes:
    from precompile_gen.runtime.cache import build_cache

    return build_cache(code, "inductor", payload, key=key)


def _load_in_fresh_process(
    tmp_path: Path, code: str, cache: bytes, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    """Load and run the pair in a new interpreter with an empty inductor cache
    folder (``tmp_path / "inductor-cache"``), and a marker path for a hostile
    binary to write to."""
    (tmp_path / "code.py").write_text(code, encoding="utf-8")
    (tmp_path / "cache.bin").write_bytes(cache)
    return subprocess.run(
        [
            python,
            str(FRESH_LOAD),
            str(tmp_path / "code.py"),
            str(tmp_path / "cache.bin"),
        ],
        capture_output=True,
        text=True,
        env=env_with_helpers(
            TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
            PRECOMPILE_GEN_TEST_MARKER=str(tmp_path / "marker"),
        ),
        check=False,
        timeout=600,
    )
