"""Cache: the envelope that pairs a cache with the artifact it accelerates.

The cache is a ``torch.save``d plain dict, so it is read with ``weights_only=True``
and reading it never runs code. It is only an acceleration: an envelope this version
cannot read is skipped with a warning, while one that is readable but belongs to
another artifact is an error, because it signals mixed-up files.

A pair produced with a key also carries a signature: an HMAC-SHA256 under that key
over python_code and the cache's payload (see ``signature``). ``load`` given the key
accepts the pair only with a matching signature, and then nothing is skipped with a
warning: an unreadable or unsigned cache is an error.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import struct
from collections.abc import Callable
from typing import Any

import torch

from precompile_gen.runtime.errors import PrecompileError, describe_untrusted

log = logging.getLogger(__name__)

CACHE_FORMAT = "precompile_gen"
CACHE_VERSION = 1

# Prefixed to what is signed, so a signature made for anything else under the same
# key (another tool, a future layout of this one) never verifies here.
_SIGNATURE_DOMAIN = "precompile_gen signature v1"


def code_hash(python_code: str) -> str:
    return hashlib.sha256(python_code.encode("utf-8", "surrogatepass")).hexdigest()


def check_key(key: object) -> bytes:
    """``key`` as a signing key; ValueError unless it is non-empty bytes."""
    if not isinstance(key, bytes) or not key:
        got = "empty bytes" if isinstance(key, bytes) else type(key).__name__
        raise ValueError(
            "key must be non-empty bytes (the secret the pair is signed with, e.g. "
            f"secrets.token_bytes(32)), got {got}."
        )
    return key


# The code hashes of the artifacts this process has built a cache for, that is,
# written with precompile(): load tells running one of those apart from running
# code from elsewhere, which only a signature can vouch for.
_built_here: set[str] = set()


def built_here(digest: str) -> bool:
    """Whether this process built the artifact whose code hash is ``digest``."""
    return digest in _built_here


def build_cache(
    python_code: str,
    backend: str,
    artifact: dict[str, object] | None,
    key: bytes | None = None,
) -> bytes:
    digest = code_hash(python_code)
    _built_here.add(digest)
    envelope: dict[str, object] = {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "backend": backend,
        "code_hash": digest,
        "artifact": artifact,
    }
    if key is not None:
        envelope["signature"] = signature(
            check_key(key), python_code=python_code, backend=backend, artifact=artifact
        )
    buffer = io.BytesIO()
    torch.save(envelope, buffer)
    return buffer.getvalue()


def signature(key: bytes, *, python_code: str, backend: str, artifact: object) -> bytes:
    """HMAC-SHA256 under ``key`` over everything ``load`` acts on.

    The signed message is a canonical encoding (see ``_feed_canonical``) of the list
    [domain, format, version, backend, sha256 of python_code, artifact payload]. It is
    computed from the decoded values, not from the envelope's bytes, because
    ``torch.save`` output is not canonical (zip metadata, record names). Raises
    TypeError for a payload holding anything but plain data.
    """
    mac = hmac.new(key, digestmod=hashlib.sha256)
    _feed_canonical(
        mac.update,
        [
            _SIGNATURE_DOMAIN,
            CACHE_FORMAT,
            CACHE_VERSION,
            backend,
            code_hash(python_code),
            artifact,
        ],
    )
    return mac.digest()


def _feed_canonical(update: Callable[[bytes], object], value: object) -> None:
    """Feed a canonical, unambiguous encoding of ``value`` to ``update``.

    Each value is a type tag, then a length or count where it has one, then its
    content; dict items go in key order. Only plain data is encoded: None, bool,
    int, float, str, bytes, list, tuple and dicts with str keys (what the payloads
    hold). Iterative, and every container is visited once, so a deeply nested,
    cyclic or shared-reference structure read from a hostile cache raises TypeError
    instead of recursing, looping or blowing up.
    """
    seen: set[int] = set()
    pending: list[object] = [value]
    while pending:
        item = pending.pop()
        # No value is both a container and a scalar: their layouts cannot combine.
        if isinstance(item, list | tuple | dict):
            update(_open_container(item, seen, pending))
        else:
            update(_scalar(item))


def _scalar(item: object) -> bytes:
    """The encoding of a value that is not a container."""
    if item is None:
        return b"N"
    if isinstance(item, bool):
        return b"T" if item else b"F"
    if isinstance(item, int):
        data = item.to_bytes((item.bit_length() + 8) // 8, "big", signed=True)
        return b"I" + _length(len(data)) + data
    if isinstance(item, float):
        return b"D" + struct.pack(">d", item)
    if isinstance(item, str):
        data = item.encode("utf-8", "surrogatepass")
        return b"S" + _length(len(data)) + data
    if isinstance(item, bytes):
        return b"B" + _length(len(item)) + item
    raise TypeError(f"a value of type {type(item).__name__}")


def _open_container(
    item: list[Any] | tuple[Any, ...] | dict[Any, Any],
    seen: set[int],
    pending: list[object],
) -> bytes:
    """A container's tag and count; its content goes onto ``pending``, last first."""
    if id(item) in seen:
        raise TypeError("a container referenced more than once")
    seen.add(id(item))
    if isinstance(item, dict):
        keys = list(item)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError("a dict with a key that is not a str")
        for k in sorted(keys, reverse=True):
            pending.extend((item[k], k))
        return b"M" + _length(len(keys))
    pending.extend(reversed(item))
    return (b"L" if isinstance(item, list) else b"U") + _length(len(item))


def _length(n: int) -> bytes:
    return n.to_bytes(8, "big")


def read_cache(
    cache: bytes, *, python_code: str, backend: str, key: bytes | None = None
) -> dict[str, object] | None:
    """The cache's artifact payload, or None when there is nothing usable to prime.

    Raises PrecompileError when the envelope is readable but was made for another
    artifact (different backend or code hash), and, when ``key`` is given, unless
    the envelope carries a signature that matches it.
    """
    envelope, problem = read_envelope(cache)
    if envelope is None:
        if key is not None:
            raise PrecompileError(
                f"load was given a key, but {problem}, so there is no signature to "
                "check. Pass the cache returned by precompile(..., key=...) together "
                "with this python_code."
            )
        log.warning(
            "precompile_gen.load: %s; ignoring it and compiling from python_code "
            "instead, which is slower but gives the same results. To load without "
            "compiling, write the pair again with precompile() and pass the cache it "
            "returns; to load without a cache and without this warning, pass "
            "cache=None.",
            problem,
        )
        return None
    artifact = check_envelope(
        envelope, python_code=python_code, backend=backend, key=key
    )
    if artifact is not None and not isinstance(artifact, dict):
        log.warning(
            "precompile_gen.load: the cache's artifact is a %s, not a dict; "
            "ignoring it and compiling from python_code instead.",
            type(artifact).__name__,
        )
        return None
    return artifact


def read_envelope(cache: bytes) -> tuple[dict[str, object], None] | tuple[None, str]:
    """The envelope, or None and why it cannot be used."""
    try:
        envelope = torch.load(io.BytesIO(cache), weights_only=True)
    except Exception as error:
        # torch's own message says what its unpickler choked on (a byte that is not
        # UTF-8, a missing zip directory) and may advise weights_only=False, which
        # would execute the file: the kind of failure is all that helps here.
        return None, (
            "the cache cannot be read: it is not a file torch.save wrote, or it was "
            "truncated or corrupted after it was written (torch.load failed with "
            f"{type(error).__name__})"
        )
    if (
        not isinstance(envelope, dict)
        or not _is(envelope.get("format"), CACHE_FORMAT)
        or not _is(envelope.get("version"), CACHE_VERSION)
    ):
        found = (
            (envelope.get("format"), envelope.get("version"))
            if isinstance(envelope, dict)
            else type(envelope).__name__
        )
        return None, (
            f"the cache is not a {CACHE_FORMAT} version {CACHE_VERSION} envelope "
            f"(found {describe_untrusted(found)})"
        )
    return envelope, None


def check_envelope(
    envelope: dict[str, object],
    *,
    python_code: str,
    backend: str,
    key: bytes | None = None,
) -> object:
    """The envelope's artifact payload, after checking that the envelope belongs to
    ``python_code`` (backend, code_hash) and, with ``key``, its signature."""
    found_backend = envelope.get("backend")
    if not _is(found_backend, backend):
        raise PrecompileError(
            f"the cache was made by the {describe_untrusted(found_backend)} backend "
            f"but python_code by the {backend!r} backend, so the two files do not "
            "belong together. Pass the cache returned with this python_code by the "
            "same precompile() call."
        )
    expected = code_hash(python_code)
    found_hash = envelope.get("code_hash")
    if not _is(found_hash, expected):
        shown = found_hash[:16] if isinstance(found_hash, str) else found_hash
        raise PrecompileError(
            "the cache belongs to another artifact: its code_hash "
            f"{describe_untrusted(shown)}... differs from sha256(python_code) "
            f"{expected[:16]}..., so the two files do not belong together. Either "
            "python_code was edited after precompile() wrote the pair, or the cache "
            "comes from another precompile() call. Pass the cache returned with "
            "this python_code by the same precompile() call; to run an edited "
            "artifact, load it without a cache: load(python_code, None) (an "
            "inductor artifact's kernels then compile from its code)."
        )
    artifact = envelope.get("artifact")
    if key is not None:
        _check_signature(envelope, key, python_code, backend, artifact)
    return artifact


def _check_signature(
    envelope: dict[str, object],
    key: bytes,
    python_code: str,
    backend: str,
    artifact: object,
) -> None:
    stored = envelope.get("signature")
    if stored is None:
        raise PrecompileError(
            "load was given a key, but the cache carries no signature: it was made "
            "without a key, or its signature was removed. Produce the pair with "
            "precompile(..., key=...) using this key."
        )
    try:
        expected = signature(
            key, python_code=python_code, backend=backend, artifact=artifact
        )
    except TypeError as error:
        raise PrecompileError(
            f"the cache's artifact payload holds {error}, which precompile never "
            "stores, so no signature can vouch for it. Produce the pair again with "
            "precompile(..., key=...)."
        ) from None
    # compare_digest: the time taken must not reveal how much of a guess matched.
    if not isinstance(stored, bytes) or not hmac.compare_digest(stored, expected):
        raise PrecompileError(
            "the cache's signature does not match this key: the pair was signed with "
            "another key, or python_code or the cache was changed after signing. "
            "Load only pairs produced by precompile(..., key=...) with this key."
        )


def _is(value: object, expected: str | int) -> bool:
    """``value == expected`` for a value read from an untrusted envelope, where ``==``
    could return a tensor (or anything else) rather than a bool."""
    return type(value) is type(expected) and value == expected
