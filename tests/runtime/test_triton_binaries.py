"""The cache carries Triton's compiled kernels (on a GPU), pinned by the artifact.

No GPU is needed to test the pinning: Triton compiles for an explicit target without
a driver, so ``triton_binaries_child.py`` records, in a process of its own, the
payload a capture on an H100 (sm_90) carries for one kernel: Triton's cache folder
for it, cubin included. Loading and launching that cubin need the GPU
(``benchmarks/gpu_check.py``); what is checked here is everything before: what the
payload holds, what the artifact pins, where ``load`` writes it, and that Triton,
in a fresh process, finds it there and compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.processes import env_with_helpers
from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key

from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.errors import PrecompileError
from precompile_gen.tools import verify

CHILD = Path(__file__).with_name("triton_binaries_child.py")
# The kernel the child compiles, and its files in Triton's cache folder.
KERNEL = "add_one"
SUFFIXES = {".cubin", ".json", ".llir", ".ptx", ".source", ".ttgir", ".ttir"}


def _child(*arguments: str, **env: str) -> str:
    # Triton's folder is the one ``env`` names, never one this process inherited
    # (Inductor sets TRITON_CACHE_DIR process-wide when it builds a Triton kernel).
    environment = env_with_helpers()
    environment.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, str(CHILD), *arguments],
        capture_output=True,
        text=True,
        check=False,
        env={**environment, **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("triton_capture")
    payload = _record(folder)
    payload["capture_folder"] = str(folder)
    return payload


def _record(folder: Path, *launcher: str) -> dict[str, object]:
    """The payload a capture in ``folder`` (Inductor's and Triton's cache folders
    inside it) carries for the kernel."""
    _child(
        "record",
        str(folder / "payload.pt"),
        *launcher,
        TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"),
        TRITON_CACHE_DIR=str(folder / "triton"),
    )
    payload = torch.load(folder / "payload.pt", weights_only=True)
    assert isinstance(payload, dict)
    return payload


def _payload(recorded: dict[str, object]) -> dict[str, object]:
    """A fresh copy of the recorded payload, as a cache holds it."""
    payload = {k: v for k, v in recorded.items() if k != "capture_folder"}
    payload["files"] = dict(payload["files"])  # type: ignore[arg-type]
    payload["sha256"] = dict(payload["sha256"])  # type: ignore[arg-type]
    return payload


def _files(payload: dict[str, object]) -> dict[str, bytes]:
    files = payload["files"]
    assert isinstance(files, dict)
    return files


def test_the_payload_carries_tritons_cache_folder_for_the_kernel(
    recorded: dict[str, object],
) -> None:
    payload = _payload(recorded)
    files = _files(payload)
    folders = {name.rsplit("/", 1)[0] for name in files}
    assert len(folders) == 1
    (folder,) = folders
    assert folder.startswith("triton/0/")
    names = {name.rsplit("/", 1)[1] for name in files}
    assert names == {f"{KERNEL}{suffix}" for suffix in SUFFIXES} | {
        f"__grp__{KERNEL}.json"
    }
    # The cubin is a real GPU binary (an ELF object for sm_90).
    cubin = files[f"{folder}/{KERNEL}.cubin"]
    assert cubin.startswith(b"\x7fELF")
    assert b"sm_90" in files[f"{folder}/{KERNEL}.ptx"]
    # No file names the capturing machine's folders: the group's paths are
    # written at load, for the folder the files are written to.
    capture_folder = str(recorded["capture_folder"]).encode()
    assert not any(capture_folder in data for data in files.values())
    group = json.loads(files[f"{folder}/__grp__{KERNEL}.json"])
    assert set(group["child_paths"].values()) == {
        f"@TRITON_KERNEL_FOLDER@/{name}" for name in names - {f"__grp__{KERNEL}.json"}
    }
    # Said as well as carried: the kernel is a compiled one, not interpreted.
    assert payload["triton_kernels"] == [KERNEL]
    assert payload["triton_interpreted"] is False
    assert kernel_binaries.damaged(payload) is None


def test_the_artifact_pins_each_file_by_sha256(recorded: dict[str, object]) -> None:
    payload = _payload(recorded)
    pinned = kernel_binaries.digests(payload)
    assert pinned == {
        name: hashlib.sha256(data).hexdigest() for name, data in _files(payload).items()
    }
    assert kernel_binaries.unpinned(payload, pinned) is None


def test_two_cache_folders_give_the_same_files_and_name_neither(
    recorded: dict[str, object], tmp_path: Path
) -> None:
    # The kernel's source file lies in Inductor's cache folder, and line tables would
    # name it in every form Triton keeps, the cubin included. The second capture's
    # kernel is bound to a launcher that keeps no source, as Inductor's static
    # launcher does on a GPU.
    elsewhere = tmp_path / "another" / "capture"
    elsewhere.mkdir(parents=True)
    again = _record(elsewhere, "launcher")
    assert _files(again) == _files(_payload(recorded))
    assert again["sha256"] == recorded["sha256"]
    for folder in (str(recorded["capture_folder"]), str(elsewhere)):
        named = [
            name for name, data in _files(again).items() if folder.encode() in data
        ]
        assert not named, f"{named} name {folder}"
    assert any(name.endswith(".cubin") for name in _files(again))


def test_load_writes_the_folder_where_triton_finds_it_and_triton_compiles_nothing(
    recorded: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = _payload(recorded)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    pinned = kernel_binaries.digests(payload)
    # Triton kernels are found by Triton's key: KERNEL_SOURCES names none of them.
    assert kernel_binaries.prime(payload, pinned, {}) == {}
    root = tmp_path / "inductor" / "triton" / "0"
    (folder,) = root.iterdir()
    group = json.loads((folder / f"__grp__{KERNEL}.json").read_text())
    assert set(group["child_paths"].values()) == {
        str(folder / path.name)
        for path in folder.iterdir()
        if path.name != f"__grp__{KERNEL}.json"
    }
    # A fresh process asks Triton for the same kernel, for the same target: it is
    # a hit in the folder load wrote, so nothing compiles.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    report = json.loads(_child("compile", **env))
    assert report["cache_hit"] is True
    assert folder.name == triton_hash_to_path_key(report["hash"])
    # Without the payload's folder, the same request compiles.
    empty = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty")}
    assert json.loads(_child("compile", **empty))["cache_hit"] is False


def test_load_writes_into_triton_cache_dir_when_it_is_set(
    recorded: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = _payload(recorded)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    kernel_binaries.prime(payload, kernel_binaries.digests(payload), {})
    (folder,) = (tmp_path / "triton").iterdir()
    assert (folder / f"{KERNEL}.cubin").read_bytes().startswith(b"\x7fELF")
    assert not (tmp_path / "inductor").exists()


def test_a_triton_file_the_artifact_does_not_pin_is_never_written(
    recorded: dict[str, object],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    payload = _payload(recorded)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    pinned = kernel_binaries.digests(payload)
    cubin = next(name for name in pinned if name.endswith(".cubin"))
    # Another cubin, with a manifest to match: intact, but not the artifact's.
    files = _files(payload)
    files[cubin] = files[cubin] + b"\0"
    payload["sha256"] = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    assert kernel_binaries.damaged(payload) is None
    reason = kernel_binaries.unpinned(payload, pinned)
    assert reason is not None and cubin in reason and "not the one" in reason
    with caplog.at_level(logging.WARNING, logger="precompile_gen"):
        assert kernel_binaries.prime(payload, pinned, {}) is None
    assert "compiled from python_code instead" in caplog.text
    assert not any(tmp_path.iterdir())
    with pytest.raises(PrecompileError, match="altered after it was signed"):
        kernel_binaries.prime(payload, pinned, {}, signed=True)
    # Unlisted altogether: named as such.
    del pinned[cubin]
    reason = kernel_binaries.unpinned(_payload(recorded), pinned)
    assert reason is not None and "does not list" in reason


@pytest.mark.parametrize(
    "name",
    [
        "triton/0/../../escape.json",
        "triton/0/KEY/sub/add_one.cubin",
        "triton/0/C7VSYG6W3SNCUVKLOYNVOL6IZNQSYC46NDOWF5PKY5AVXKPIJOJA/../x.cubin",
        "triton/cuda/C7VSYG6W3SNCUVKLOYNVOL6IZNQSYC46NDOWF5PKY5AVXKPIJOJA/a.cubin",
        "/tmp/C7VSYG6W3SNCUVKLOYNVOL6IZNQSYC46NDOWF5PKY5AVXKPIJOJA/add_one.cubin",
    ],
)
def test_a_file_outside_tritons_cache_layout_is_refused(
    recorded: dict[str, object], name: str
) -> None:
    payload = _payload(recorded)
    _files(payload)[name] = b"data"
    payload["sha256"][name] = hashlib.sha256(b"data").hexdigest()  # type: ignore[index]
    reason = kernel_binaries.damaged(payload)
    assert reason is not None and "unexpected file" in reason


def test_a_tampered_triton_file_fails_its_digest(recorded: dict[str, object]) -> None:
    payload = _payload(recorded)
    files = _files(payload)
    name = next(name for name in files if name.endswith(".cubin"))
    files[name] = b"\x7fELF" + b"\0" * 16
    reason = kernel_binaries.damaged(payload)
    assert reason is not None and name in reason and "sha256" in reason


def test_a_triton_folder_that_cannot_be_written_is_named_with_the_fix(
    recorded: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = _payload(recorded)
    blocker = tmp_path / "triton"
    blocker.write_bytes(b"")  # a file where Triton's folder goes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker))
    with pytest.raises(PrecompileError) as info:
        kernel_binaries.prime(payload, kernel_binaries.digests(payload), {})
    message = str(info.value)
    assert f"into Triton's cache folder {blocker} (" in message
    assert "Set TRITON_CACHE_DIR to a folder this process can write to" in message
    assert blocker.read_bytes() == b""


def test_verify_counts_the_compiled_configurations_the_cache_carries(
    recorded: dict[str, object],
) -> None:
    payload = _payload(recorded)
    pinned = kernel_binaries.digests(payload)
    binaries = verify._check_binaries("", pinned, {}, payload)
    assert binaries["triton"] == {
        "kernels": [KERNEL],
        "interpreted": False,
        "folders": 1,
        "target": "cuda 90",
    }
    report = {
        "backend": "inductor",
        "code_hash": "0" * 64,
        "signature": "none",
        "kernel_binaries": binaries,
    }
    assert (
        "  triton           1 Triton kernel; 1 compiled configuration for cuda 90 in "
        "Triton's cache folders, found by Triton's key on such a GPU (another GPU or "
        "Triton compiles from source)\n"
    ) in verify.format_report(report, "code.py", "cache.bin")
