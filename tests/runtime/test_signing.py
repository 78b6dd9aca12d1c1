"""Optional signing: ``precompile(..., key=)`` signs the pair with HMAC-SHA256, and
``load(..., key=)`` refuses a pair without a matching signature before executing or
writing anything from it."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import hmac
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.linear_step import example_input, linear_model, train_step
from helpers.stubs import stub_capture
from torch import nn

import precompile_gen as pg
from precompile_gen.capture_result import KernelPayload
from precompile_gen.runtime import cache as cache_module
from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.cache import build_cache, signature

KEY = b"precompile_gen test key"
OTHER_KEY = b"another key"


@pytest.fixture(scope="module")
def signed() -> tuple[str, bytes]:
    return pg.precompile(
        train_step, linear_model(), example_input(), backend="eager", key=KEY
    )


def _envelope(cache: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(cache), weights_only=True)


def _save(envelope: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(envelope, buffer)
    return buffer.getvalue()


def _assert_runs_like_eager(forward: Callable[..., object]) -> None:
    model, reference = linear_model(), linear_model()
    torch.testing.assert_close(
        forward(model, example_input()), train_step(reference, example_input())
    )
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)


def _unsigned_exec_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "no signature" in r.getMessage()
    ]


def _with_side_effect(code: str, marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()\n" + code


# --- a signed pair ------------------------------------------------------------------


def test_signed_cache_is_a_plain_envelope_with_an_hmac(
    signed: tuple[str, bytes],
) -> None:
    code, cache = signed
    envelope = _envelope(cache)
    assert set(envelope) == {
        "format",
        "version",
        "backend",
        "code_hash",
        "artifact",
        "signature",
    }
    assert isinstance(envelope["signature"], bytes)
    assert len(envelope["signature"]) == hashlib.sha256().digest_size
    expected = signature(KEY, python_code=code, backend="eager", artifact=None)
    assert hmac.compare_digest(envelope["signature"], expected)


def test_load_with_the_key_runs_without_the_unsigned_code_warning(
    signed: tuple[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    forward = pg.load(*signed, key=KEY)
    assert _unsigned_exec_warnings(caplog) == []
    assert any("executing signed python_code" in r.getMessage() for r in caplog.records)
    _assert_runs_like_eager(forward)
    # Without a key the same pair loads; nothing vouches for it, but this process
    # produced it, which is said at INFO rather than warned about.
    _assert_runs_like_eager(pg.load(*signed))
    assert _unsigned_exec_warnings(caplog) == []
    assert any("this process produced it" in r.getMessage() for r in caplog.records), (
        caplog.records
    )


def test_signed_pair_loads_from_files(tmp_path: Path) -> None:
    artifact, cache = tmp_path / "step.py", tmp_path / "step.cache"
    pg.precompile(
        train_step,
        linear_model(),
        example_input(),
        backend="eager",
        key=KEY,
        artifact_path=artifact,
        cache_path=cache,
    )
    _assert_runs_like_eager(pg.load(artifact, cache, key=KEY))
    with pytest.raises(pg.PrecompileError, match="signature does not match"):
        pg.load(artifact, cache, key=OTHER_KEY)


# --- refusals, before anything runs -------------------------------------------------


def test_wrong_key_is_refused_before_executing_anything(
    signed: tuple[str, bytes], tmp_path: Path
) -> None:
    marker = tmp_path / "executed"
    code = _with_side_effect(signed[0], marker)
    cache = build_cache(code, "eager", None, key=KEY)
    with pytest.raises(pg.PrecompileError, match="signature does not match") as info:
        pg.load(code, cache, key=OTHER_KEY)
    assert "another key" in str(info.value)
    assert not marker.exists()
    # The control: with the right key the code, side effect included, runs.
    pg.load(code, cache, key=KEY)
    assert marker.exists()


def test_unsigned_cache_is_refused_when_a_key_is_given(
    signed: tuple[str, bytes], tmp_path: Path
) -> None:
    marker = tmp_path / "executed"
    code = _with_side_effect(signed[0], marker)
    with pytest.raises(pg.PrecompileError, match="carries no signature") as info:
        pg.load(code, build_cache(code, "eager", None), key=KEY)
    assert "precompile(..., key=...)" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "cache",
    [b"", b"not a cache", _save({"format": "other"}), _save([1, 2])],
    ids=["empty", "garbage", "foreign", "list"],
)
def test_a_cache_that_cannot_be_checked_is_refused_when_a_key_is_given(
    signed: tuple[str, bytes], cache: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # Without a key such a cache is skipped with a warning; with one, skipping it
    # would run code nothing vouched for.
    caplog.set_level(logging.WARNING)
    with pytest.raises(pg.PrecompileError, match="given a key") as info:
        pg.load(signed[0], cache, key=KEY)
    assert "no signature to check" in str(info.value)
    assert _unsigned_exec_warnings(caplog) == []


def test_edited_code_with_a_matching_code_hash_is_refused(
    signed: tuple[str, bytes], tmp_path: Path
) -> None:
    # An attacker who can edit both files but lacks the key: the code_hash can be
    # made to match, the signature cannot.
    marker = tmp_path / "executed"
    code = _with_side_effect(signed[0], marker)
    envelope = _envelope(signed[1])
    envelope["code_hash"] = hashlib.sha256(code.encode()).hexdigest()
    with pytest.raises(pg.PrecompileError, match="changed after signing"):
        pg.load(code, _save(envelope), key=KEY)
    assert not marker.exists()


@pytest.mark.parametrize(
    "stored",
    ["a str", 0, None, [b"x"], torch.zeros(32, dtype=torch.uint8), b""],
    ids=["str", "int", "none", "list", "tensor", "empty"],
)
def test_a_malformed_signature_is_refused(
    signed: tuple[str, bytes], stored: object
) -> None:
    envelope = _envelope(signed[1])
    envelope["signature"] = stored
    with pytest.raises(pg.PrecompileError, match="signature"):
        pg.load(signed[0], _save(envelope), key=KEY)


def _stub_inductor_pair(key: bytes | None) -> tuple[str, dict[str, object], bytes]:
    name = "ab/c" + "a" * 51 + ".main.so"
    # The artifact pins the one binary its cache carries.
    pinned = {name: hashlib.sha256(b"\x7fELF binary").hexdigest()}
    code = pg.render_artifact(
        dataclasses.replace(
            stub_capture("inductor"), payload=KernelPayload(kernel_binaries=pinned)
        )
    )
    payload: dict[str, object] = {
        "kind": kernel_binaries.PAYLOAD_KIND,
        "build": kernel_binaries.build_fingerprint(),
        "files": {name: b"\x7fELF binary"},
        "sha256": {name: hashlib.sha256(b"\x7fELF binary").hexdigest()},
    }
    return code, payload, build_cache(code, "inductor", payload, key=key)


def test_a_tampered_payload_is_refused_before_priming_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    primed: list[object] = []
    monkeypatch.setattr(kernel_binaries, "prime", lambda p, *_, **__: primed.append(p))
    code, payload, cache = _stub_inductor_pair(KEY)
    envelope = _envelope(cache)
    # A binary swapped together with its digest still passes the payload's own
    # checks; only the signature tells.
    evil = copy.deepcopy(payload)
    (name,) = evil["files"]  # type: ignore[misc]
    evil["files"] = {name: b"\x7fELF evil"}
    evil["sha256"] = {name: hashlib.sha256(b"\x7fELF evil").hexdigest()}
    envelope["artifact"] = evil
    with pytest.raises(pg.PrecompileError, match="signature does not match"):
        pg.load(code, _save(envelope), key=KEY)
    with pytest.raises(pg.PrecompileError, match="signature does not match"):
        pg.load(code, cache, key=OTHER_KEY)
    assert primed == []
    assert not list(tmp_path.rglob("*.so"))
    # The control: the untampered pair reaches priming with its payload.
    pg.load(code, cache, key=KEY)
    assert primed == [payload]


def test_a_payload_holding_data_no_signature_covers_is_refused(
    signed: tuple[str, bytes],
) -> None:
    envelope = _envelope(signed[1])
    envelope["artifact"] = {"files": torch.zeros(2)}
    with pytest.raises(pg.PrecompileError, match="value of type Tensor"):
        pg.load(signed[0], _save(envelope), key=KEY)


# --- keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["secret", bytearray(b"secret"), b"", 42],
    ids=["str", "bytearray", "empty", "int"],
)
def test_a_key_must_be_non_empty_bytes(signed: tuple[str, bytes], key: Any) -> None:
    with pytest.raises(ValueError, match="non-empty bytes"):
        pg.load(*signed, key=key)
    traced: list[object] = []

    def recording_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        traced.append(x)
        return train_step(model, x)

    with pytest.raises(ValueError, match="non-empty bytes"):
        pg.precompile(
            recording_step, linear_model(), example_input(), backend="eager", key=key
        )
    assert traced == [], "the key is checked before the capture"


# --- what is signed -----------------------------------------------------------------


def _sign(artifact: object, code: str = "code", backend: str = "eager") -> bytes:
    return signature(KEY, python_code=code, backend=backend, artifact=artifact)


def test_signature_covers_code_backend_and_every_payload_value() -> None:
    payload = {"files": {"a": b"1", "b": b"2"}, "build": {"torch": "2.14.1"}}
    base = _sign(payload)
    assert _sign(copy.deepcopy(payload)) == base
    assert _sign(payload, code="code ") != base
    assert _sign(payload, backend="inductor") != base
    assert _sign({**payload, "files": {"a": b"1", "b": b"3"}}) != base
    assert _sign({**payload, "extra": None}) != base
    assert (
        signature(OTHER_KEY, python_code="code", backend="eager", artifact=payload)
        != base
    )


def test_canonical_encoding_is_order_free_and_unambiguous() -> None:
    assert _sign({"a": 1, "b": 2}) == _sign({"b": 2, "a": 1})
    assert _sign([1, 2]) != _sign((1, 2))
    assert _sign(["ab", "c"]) != _sign(["a", "bc"])
    assert _sign([b"ab"]) != _sign(["ab"])
    assert _sign([1]) != _sign([True]) != _sign([1.0])
    assert _sign([[1], 2]) != _sign([[1, 2]])
    assert _sign(2**100) != _sign(-(2**100))


def test_canonical_encoding_refuses_what_a_hostile_payload_could_hold() -> None:
    cyclic: list[object] = []
    cyclic.append(cyclic)
    shared: list[object] = [0]
    # A deeply nested value is encoded without recursion.
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    _sign(deep)
    for bad, reason in [
        (cyclic, "more than once"),
        ([shared, shared], "more than once"),
        ({1: "a"}, "not a str"),
        ({"a": torch.zeros(1)}, "Tensor"),
        ({"a": {1, 2}}, "set"),
    ]:
        with pytest.raises(TypeError, match=reason):
            _sign(bad)
    assert cache_module.check_key(KEY) is KEY
