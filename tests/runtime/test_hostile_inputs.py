"""Hostile and broken input: a corpus and property-based fuzzing of ``parse_metadata``,
cache-envelope reading and ``load``.

Every case ends in ``PrecompileError``, or in the documented warn-and-continue path
for a cache that cannot be used, after which the artifact runs correctly. Never
another exception type, never a hang, and never code from the cache executed.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import io
import itertools
import logging
import os
import pickle
import signal
import struct
import zipfile
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.linear_step import example_input, linear_model, train_step
from helpers.stubs import stub_capture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import precompile_gen as pg
from precompile_gen.capture_result import BACKENDS
from precompile_gen.metadata import METADATA_NAMES
from precompile_gen.runtime import kernel_binaries
from precompile_gen.runtime.cache import (
    CACHE_FORMAT,
    CACHE_VERSION,
    build_cache,
    read_cache,
    signature,
)

# Mutated artifacts are compiled; their escape sequences and torch's notes about
# odd pickle protocols are expected noise here.
pytestmark = pytest.mark.filterwarnings(
    "ignore::SyntaxWarning", "ignore::DeprecationWarning", "ignore::UserWarning"
)

KEY = b"fuzzing key"

# Generated cases per property; together at least 10,000 (checked below). A case
# costs a few milliseconds, most of it Hypothesis drawing the case, except where
# load parses and executes the whole artifact (about 20 ms): those get fewer.
CASES = {
    "parse_metadata_section": 2600,
    "parse_metadata_artifact": 300,
    "cache_bytes": 2600,
    "envelope_values": 1600,
    "pickle_programs": 900,
    "kernel_payload": 900,
    "load_cache": 300,
    "load_code": 200,
    "load_code_recached": 150,
    "load_signed": 200,
    "pickle_payload": 200,
    "artifact_file": 150,
}


def test_the_fuzzing_generates_at_least_ten_thousand_cases() -> None:
    assert sum(CASES.values()) >= 10_000


# --- the subject --------------------------------------------------------------------


@dataclass(frozen=True)
class Subject:
    code: str
    cache: bytes
    signed_cache: bytes
    # Only the metadata assignments: parse_metadata's input at a tenth of the size.
    section: str
    inductor_code: str
    inductor_cache: bytes
    payload: dict[str, object]
    expected_loss: torch.Tensor
    expected_grad: torch.Tensor


@pytest.fixture(scope="module")
def subject() -> Subject:
    code, cache = pg.precompile(
        train_step, linear_model(), example_input(), backend="eager"
    )
    _, signed_cache = pg.precompile(
        train_step, linear_model(), example_input(), backend="eager", key=KEY
    )
    lines = code.splitlines(keepends=True)
    section = "".join(
        "".join(lines[statement.lineno - 1 : statement.end_lineno])
        for statement in ast.parse(code).body
        if isinstance(statement, ast.AnnAssign)
        and isinstance(statement.target, ast.Name)
        and statement.target.id in METADATA_NAMES
    )
    assert pg.parse_metadata(section) == pg.parse_metadata(code)
    inductor_code = pg.render_artifact(stub_capture("inductor"))
    payload = _stub_payload()
    model = linear_model()
    loss = train_step(model, example_input())
    assert model.weight.grad is not None
    return Subject(
        code=code,
        cache=cache,
        signed_cache=signed_cache,
        section=section,
        inductor_code=inductor_code,
        inductor_cache=build_cache(inductor_code, "inductor", payload),
        payload=payload,
        expected_loss=loss,
        expected_grad=model.weight.grad,
    )


def _stub_payload() -> dict[str, object]:
    name = "ab/c" + "a" * 51 + ".main.so"
    return {
        "kind": kernel_binaries.PAYLOAD_KIND,
        "build": kernel_binaries.build_fingerprint(),
        "files": {name: b"\x7fELF"},
        "sha256": {name: hashlib.sha256(b"\x7fELF").hexdigest()},
    }


def _assert_runs_correctly(subject: Subject, forward: Callable[..., object]) -> None:
    model = linear_model()
    torch.testing.assert_close(forward(model, example_input()), subject.expected_loss)
    torch.testing.assert_close(model.weight.grad, subject.expected_grad)


# --- running cases ------------------------------------------------------------------


class Hang(BaseException):
    """A case ran too long; BaseException so that no ``except Exception`` in the
    product swallows it."""


@contextlib.contextmanager
def _no_hang(seconds: float = 10.0) -> Generator[None]:
    if not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise Hang(f"a case ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Warnings(logging.Handler):
    """precompile_gen's warnings of the current case, each formatted as it is
    logged, so that a message that fails to format fails the case."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def about(self, needle: str) -> list[str]:
        return [message for message in self.messages if needle in message]


@pytest.fixture(scope="module")
def warnings_seen() -> Generator[_Warnings]:
    # Thousands of expected warnings stay out of the test report.
    logger = logging.getLogger("precompile_gen")
    handler, propagate = _Warnings(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


@pytest.fixture
def code_parsed_once(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> Generator[None]:
    """For properties about the cache: load parses the subject's unchanged code once
    (parsing is most of a load's time, and is fuzzed on its own above)."""
    # The package's ``load`` attribute is the function; this is its module.
    load_module = importlib.import_module("precompile_gen.runtime.load")
    real = load_module.parse_metadata
    parsed = real(subject.code)

    def parse_metadata(python_code: str) -> dict[str, object]:
        if python_code is subject.code:
            return dict(parsed)
        return real(python_code)

    monkeypatch.setattr(load_module, "parse_metadata", parse_metadata)
    yield


def _fuzz(name: str, strategy: st.SearchStrategy[Any], check: Callable[[Any], None]):
    """Run ``check`` on CASES[name] generated cases, each under a hang guard."""
    count = 0

    @settings(
        max_examples=CASES[name],
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(strategy)
    def cases(case: Any) -> None:
        nonlocal count
        count += 1
        with _no_hang():
            check(case)

    cases()
    assert count >= CASES[name]


# Every way of skipping an unusable cache says this.
SKIPPED_CACHE = "ignoring it and compiling from python_code"


# --- mutating text ------------------------------------------------------------------

# Values a metadata constant must not be read from: not literals, or literals that
# make the parser or literal_eval give up.
HOSTILE_VALUES = [
    'len("abc")',
    '__import__("os").getpid()',
    "[1] * 3",
    'f"{1}"',
    "lambda: 0",
    "1 if True else 2",
    "{1, 2}",
    "{**{}}",
    "(yield)",
    "...",
    "None",
    'b"\\xff"',
    '"\\udcff"',
    "9" * 5000,
    "[" * 300 + "]" * 300,
    "1+" * 20000 + "1",
    "-" * 20000 + "1",
    "-" * 1500 + "1",
    "[" * 150 + "]" * 150,
    '"tpu"',
    '"inductor"',
    "1e999",
    "-0j",
    "()",
    '{"a": [1, (2, None)]}',
    "torch.float32",
    "PARAM_NAMES",
]

# Bindings of a metadata constant beyond its own assignment.
REBINDINGS = [
    "{name} = 1",
    "{name}: int = 1",
    "{name} += []",
    "for {name} in []:\n    pass",
    "import os as {name}",
    "def {name}():\n    pass",
    "class {name}:\n    pass",
    "({name} := 0)",
    "del {name}",
    "try:\n    pass\nexcept Exception as {name}:\n    pass",
    "match 0:\n    case {name}:\n        pass",
    "with open as {name}:\n    pass",
    "global {name}",
]

_any_char = st.characters(exclude_categories=())  # lone surrogates included
_junk = st.one_of(
    st.text(alphabet=_any_char, max_size=30),
    st.sampled_from(HOSTILE_VALUES),
    st.sampled_from(["\x00", "\ufeff", "\r", "\n\n", "\\", '"""', "#", "    "]),
)
_position = st.integers(0, 1 << 20)

_text_operation = st.one_of(
    st.tuples(st.just("truncate"), _position),
    st.tuples(st.just("delete"), _position, st.integers(1, 200)),
    st.tuples(st.just("insert"), _position, _junk),
    st.tuples(st.just("replace"), _position, st.integers(1, 40), _junk),
    st.tuples(st.just("bytes"), _position, st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("splice"), _position, _position, st.integers(1, 400)),
    st.tuples(
        st.just("metadata"),
        st.sampled_from(METADATA_NAMES),
        st.sampled_from(["delete", "value", "duplicate"]),
        st.sampled_from(HOSTILE_VALUES),
    ),
    st.tuples(
        st.just("rebind"), st.sampled_from(METADATA_NAMES), st.sampled_from(REBINDINGS)
    ),
)
text_mutations = st.lists(_text_operation, min_size=1, max_size=3)


def _mutate_text(text: str, operations: list[tuple[Any, ...]]) -> str:
    for kind, *args in operations:
        if isinstance(args[0], int):
            # Positions wrap around whatever length the text has reached.
            args[0] %= len(text) + 1
        text = _TEXT_EDITS[kind](text, *args)
    return text


def _bytes(text: str, where: int, data: bytes) -> str:
    # Non-UTF-8 bytes come back as lone surrogates: a str that no UTF-8 file
    # could hold.
    encoded = bytearray(text.encode("utf-8", "surrogatepass"))
    encoded[where : where + len(data)] = data
    return bytes(encoded).decode("utf-8", "surrogateescape")


def _splice(text: str, where: int, start: int, length: int) -> str:
    start %= len(text) + 1
    return text[:where] + text[start : start + length] + text[where:]


def _edit_metadata(text: str, name: str, edit: str, value: str) -> str:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith((f"{name}:", f"{name} =")):
            edited = {"delete": "", "value": f"{name} = {value}\n"}
            lines[i] = edited.get(edit, line + line)
            break
    return "".join(lines)


_TEXT_EDITS: dict[str, Callable[..., str]] = {
    "truncate": lambda text, where: text[:where],
    "delete": lambda text, where, n: text[:where] + text[where + n :],
    "insert": lambda text, where, junk: text[:where] + junk + text[where:],
    "replace": lambda text, where, n, junk: text[:where] + junk + text[where + n :],
    "bytes": _bytes,
    "splice": _splice,
    "metadata": _edit_metadata,
    "rebind": lambda text, name, template: (
        text + "\n" + template.format(name=name) + "\n"
    ),
}


def _check_metadata(python_code: str) -> None:
    try:
        meta = pg.parse_metadata(python_code)
    except pg.PrecompileError:
        return
    assert list(meta) == list(METADATA_NAMES)
    assert meta["BACKEND"] in BACKENDS


def test_fuzz_parse_metadata_of_a_mutated_metadata_section(subject: Subject) -> None:
    _fuzz(
        "parse_metadata_section",
        text_mutations,
        lambda ops: _check_metadata(_mutate_text(subject.section, ops)),
    )


def test_fuzz_parse_metadata_of_a_mutated_artifact(subject: Subject) -> None:
    _fuzz(
        "parse_metadata_artifact",
        text_mutations,
        lambda ops: _check_metadata(_mutate_text(subject.code, ops)),
    )


def test_fuzz_load_of_mutated_code_with_its_original_cache(
    subject: Subject, warnings_seen: _Warnings
) -> None:
    # Any change to the text changes its sha256, so the cache's code_hash check
    # refuses every mutant before anything runs.
    def check(case: tuple[list[tuple[Any, ...]], bool]) -> None:
        operations, signed = case
        code = _mutate_text(subject.code, operations)
        cache, key = (subject.signed_cache, KEY) if signed else (subject.cache, None)
        if code == subject.code:
            _assert_runs_correctly(subject, pg.load(code, cache, key=key))
            return
        with pytest.raises(pg.PrecompileError):
            pg.load(code, cache, key=key)

    _fuzz("load_code", st.tuples(text_mutations, st.booleans()), check)


def test_fuzz_load_of_mutated_code_with_a_matching_cache(
    subject: Subject, warnings_seen: _Warnings
) -> None:
    # With a cache made for the mutant, the mutant is executed: it either loads or
    # fails with PrecompileError, never with the exception its own code raised.
    def check(operations: list[tuple[Any, ...]]) -> None:
        code = _mutate_text(subject.code, operations)
        try:
            forward = pg.load(code, build_cache(code, "eager", None))
        except pg.PrecompileError:
            return
        assert callable(forward)

    _fuzz("load_code_recached", text_mutations, check)


# --- mutating cache bytes -----------------------------------------------------------


def _zip_with_pickle(cache: bytes, pickled: bytes) -> bytes:
    """``cache``'s torch.save archive with its pickle replaced: what torch.load
    reads after the zip container has been checked."""
    source = zipfile.ZipFile(io.BytesIO(cache))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info.filename)
            target.writestr(
                info.filename, pickled if info.filename.endswith("data.pkl") else data
            )
    return out.getvalue()


def _pickle_of(cache: bytes) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(cache))
    (name,) = [n for n in source.namelist() if n.endswith("data.pkl")]
    return source.read(name)


_byte_operation = st.one_of(
    st.tuples(st.just("truncate"), _position),
    st.tuples(st.just("overwrite"), _position, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), _position, st.integers(1, 64)),
    st.tuples(st.just("insert"), _position, st.binary(min_size=1, max_size=64)),
)


def _mutate_bytes(data: bytes, operations: list[tuple[Any, ...]]) -> bytes:
    out = bytearray(data)
    for kind, position, *args in operations:
        where = position % (len(out) + 1)
        if kind == "truncate":
            del out[where:]
        elif kind == "overwrite":
            out[where : where + len(args[0])] = args[0]
        elif kind == "delete":
            del out[where : where + args[0]]
        else:
            out[where:where] = args[0]
    return bytes(out)


_byte_mutations = st.lists(_byte_operation, min_size=1, max_size=4)

# (which valid cache, mutate the archive or only its pickle, operations); or noise.
cache_bytes_cases = st.one_of(
    st.tuples(
        st.sampled_from(["cache", "signed_cache", "inductor_cache"]),
        st.sampled_from(["archive", "pickle"]),
        _byte_mutations,
    ),
    st.binary(max_size=2048),
)


def _cache_bytes(subject: Subject, case: Any) -> bytes:
    if isinstance(case, bytes):
        return case
    which, layer, operations = case
    cache = getattr(subject, which)
    if layer == "archive":
        return _mutate_bytes(cache, operations)
    return _zip_with_pickle(cache, _mutate_bytes(_pickle_of(cache), operations))


def _readable_envelope(cache: bytes) -> dict[str, Any] | None:
    """The envelope as an independent reading classifies it: a dict in our format
    and version, else None."""
    try:
        envelope = torch.load(io.BytesIO(cache), weights_only=True)
    except Exception:
        return None
    if (
        isinstance(envelope, dict)
        and type(envelope.get("format")) is str
        and envelope["format"] == CACHE_FORMAT
        and type(envelope.get("version")) is int
        and envelope["version"] == CACHE_VERSION
    ):
        return envelope
    return None


def _check_read_cache(
    cache: bytes, python_code: str, backend: str, warnings_seen: _Warnings
) -> None:
    """read_cache, without and with a key, classified exactly."""
    envelope = _readable_envelope(cache)
    paired = (
        envelope is not None
        and type(envelope.get("backend")) is str
        and envelope["backend"] == backend
        and type(envelope.get("code_hash")) is str
        and envelope["code_hash"] == hashlib.sha256(python_code.encode()).hexdigest()
    )
    warnings_seen.messages.clear()
    try:
        artifact = read_cache(cache, python_code=python_code, backend=backend)
    except pg.PrecompileError as error:
        assert envelope is not None and not paired
        assert "do not belong together" in str(error)
    else:
        if envelope is None:
            assert artifact is None
            assert len(warnings_seen.about(SKIPPED_CACHE)) == 1
        else:
            assert paired
            payload = envelope.get("artifact")
            if payload is None or isinstance(payload, dict):
                assert warnings_seen.messages == []
                assert artifact is not None or payload is None
            else:
                assert artifact is None
                assert len(warnings_seen.about("not a dict")) == 1
        if backend == "inductor" and artifact is not None:
            metadata = pg.parse_metadata(python_code)
            # The binaries' paths, or None: no raise.
            kernel_binaries.prime(
                artifact, metadata["KERNEL_BINARIES"], metadata["KERNEL_SOURCES"]
            )

    try:
        signed = read_cache(cache, python_code=python_code, backend=backend, key=KEY)
    except pg.PrecompileError:
        return
    # Accepted with a key: the signature is what signing these values gives.
    assert envelope is not None and paired
    expected = signature(
        KEY, python_code=python_code, backend=backend, artifact=envelope.get("artifact")
    )
    assert envelope.get("signature") == expected
    assert signed == envelope.get("artifact")


@pytest.fixture
def inductor_cache_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    folder = tmp_path_factory.mktemp("inductor-cache")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    return folder


def test_fuzz_reading_mutated_cache_bytes(
    subject: Subject, warnings_seen: _Warnings, inductor_cache_dir: Path
) -> None:
    def check(case: Any) -> None:
        cache = _cache_bytes(subject, case)
        inductor = isinstance(case, tuple) and case[0] == "inductor_cache"
        backend = "inductor" if inductor else "eager"
        code = subject.inductor_code if backend == "inductor" else subject.code
        _check_read_cache(cache, code, backend, warnings_seen)

    _fuzz("cache_bytes", cache_bytes_cases, check)


def test_fuzz_load_with_a_mutated_cache(
    subject: Subject,
    warnings_seen: _Warnings,
    code_parsed_once: None,
) -> None:
    def check(case: Any) -> None:
        cache = _cache_bytes(subject, case)
        warnings_seen.messages.clear()
        try:
            forward = pg.load(subject.code, cache)
        except pg.PrecompileError as error:
            assert "do not belong together" in str(error)
            return
        envelope = _readable_envelope(cache)
        skipped = envelope is None or not isinstance(
            envelope.get("artifact"), dict | None
        )
        assert len(warnings_seen.about(SKIPPED_CACHE)) == skipped
        # This process produced the code, so its execution is logged at INFO.
        assert warnings_seen.about("no signature vouches") == []
        _assert_runs_correctly(subject, forward)

    _fuzz("load_cache", cache_bytes_cases, check)


def test_fuzz_load_with_a_key_and_a_mutated_signed_cache(
    subject: Subject,
    warnings_seen: _Warnings,
    code_parsed_once: None,
) -> None:
    def check(operations: Any) -> None:
        layer, operations = operations
        cache = subject.signed_cache
        if layer == "archive":
            cache = _mutate_bytes(cache, operations)
        else:
            cache = _zip_with_pickle(
                cache, _mutate_bytes(_pickle_of(cache), operations)
            )
        warnings_seen.messages.clear()
        try:
            forward = pg.load(subject.code, cache, key=KEY)
        except pg.PrecompileError:
            assert warnings_seen.about("no signature vouches") == []
            return
        # Only a mutation that left every signed value intact can load.
        assert warnings_seen.messages == []
        _assert_runs_correctly(subject, forward)

    _fuzz(
        "load_signed",
        st.tuples(st.sampled_from(["archive", "pickle"]), _byte_mutations),
        check,
    )


# --- hostile envelope values --------------------------------------------------------

_tensors = st.builds(
    lambda n, dtype: torch.zeros(n, dtype=dtype),
    st.integers(0, 4),
    st.sampled_from([torch.float32, torch.int64, torch.bool, torch.uint8]),
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.complex_numbers(),
    st.text(alphabet=_any_char, max_size=20),
    st.binary(max_size=20),
    st.sampled_from([CACHE_FORMAT, CACHE_VERSION, "eager", "inductor", True]),
    _tensors,
    st.builds(torch.device, st.sampled_from(["cpu", "meta"])),
    st.sampled_from([torch.float32, torch.int8]),
)
_values = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.sets(st.one_of(st.integers(), st.text(max_size=4)), max_size=3),
        st.dictionaries(
            st.one_of(st.text(max_size=8), st.integers()), children, max_size=4
        ),
        st.builds(torch.Size, st.lists(st.integers(0, 9), max_size=3)),
    ),
    max_leaves=12,
)
_FIELDS = ["format", "version", "backend", "code_hash", "artifact", "signature"]
envelope_edits = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(_FIELDS), st.just("delete")),
        st.tuples(st.sampled_from([*_FIELDS, "extra"]), st.just("set"), _values),
    ),
    max_size=4,
)


def _edited_envelope(cache: bytes, edits: list[tuple[Any, ...]]) -> dict[str, Any]:
    envelope = torch.load(io.BytesIO(cache), weights_only=True)
    for field, action, *value in edits:
        if action == "delete":
            envelope.pop(field, None)
        else:
            envelope[field] = value[0]
    return envelope


def _save(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_fuzz_reading_envelopes_with_hostile_values(
    subject: Subject, warnings_seen: _Warnings, inductor_cache_dir: Path
) -> None:
    def check(case: Any) -> None:
        which, edits = case
        backend = "inductor" if which == "inductor_cache" else "eager"
        code = subject.inductor_code if backend == "inductor" else subject.code
        cache = _save(_edited_envelope(getattr(subject, which), edits))
        _check_read_cache(cache, code, backend, warnings_seen)

    _fuzz(
        "envelope_values",
        st.tuples(
            st.sampled_from(["cache", "signed_cache", "inductor_cache"]),
            envelope_edits,
        ),
        check,
    )


# Pickle opcodes the weights-only unpickler knows, and some it must refuse; a
# program of them replaces the envelope's pickle inside a valid archive.
_X = b"X"


def _unicode(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return _X + struct.pack("<I", len(data)) + data


_opcodes = st.one_of(
    # One-byte opcodes: containers, MARK, APPEND(S), SETITEM(S), TUPLE*, None, bools,
    # FROZENSET, REDUCE, BUILD, NEWOBJ, STOP.
    st.sampled_from([bytes([c]) for c in b"]})(aesutN\x88\x89\x85\x86\x87\x8fRb\x81."]),
    st.builds(lambda i: b"q" + bytes([i]), st.integers(0, 3)),
    st.builds(lambda i: b"h" + bytes([i]), st.integers(0, 3)),
    st.builds(lambda i: b"J" + struct.pack("<i", i), st.integers(-(2**31), 2**31 - 1)),
    st.builds(lambda i: b"K" + bytes([i]), st.integers(0, 255)),
    st.builds(lambda f: b"G" + struct.pack(">d", f), st.floats()),
    st.builds(_unicode, st.sampled_from([*_FIELDS, CACHE_FORMAT, "eager", "x"])),
    st.builds(_unicode, st.text(alphabet=_any_char, max_size=8)),
    st.sampled_from(
        [
            b"c__builtin__\nexec\n",
            b"cos\nsystem\n",
            b"ccollections\nOrderedDict\n",
            b"ctorch._utils\n_rebuild_tensor_v2\n",
            b"cbuiltins\nset\n",
            b"ctorch\nSize\n",
            b"Q",
            b"\x94",
        ]
    ),
)
pickle_programs = st.lists(_opcodes, max_size=40).map(
    lambda ops: b"\x80\x02" + b"".join(ops) + b"."
)


def test_fuzz_reading_pickle_programs(
    subject: Subject, warnings_seen: _Warnings
) -> None:
    def check(program: bytes) -> None:
        cache = _zip_with_pickle(subject.cache, program)
        _check_read_cache(cache, subject.code, "eager", warnings_seen)

    _fuzz("pickle_programs", pickle_programs, check)


# --- hostile kernel payloads --------------------------------------------------------

_payload_edit = st.one_of(
    st.tuples(
        st.just("field"),
        st.sampled_from(["kind", "build", "files", "sha256", "extra"]),
        _values,
    ),
    st.tuples(st.just("drop"), st.sampled_from(["kind", "build", "files", "sha256"])),
    st.tuples(
        st.just("file"),
        st.one_of(
            st.sampled_from(
                [
                    "../../escaped.main.so",
                    "/tmp/absolute.main.so",
                    "ab/evil.py",
                    "ab/c" + "b" * 51 + ".so",
                ]
            ),
            st.text(alphabet=_any_char, max_size=60),
            st.integers(),
            st.tuples(st.integers(), st.integers()),
        ),
        _values | st.binary(max_size=16),
        st.booleans(),  # give it its true sha256
    ),
    st.tuples(
        st.just("build"),
        st.sampled_from(["torch", "python", "machine", "cpu_capability", "new"]),
        _values,
    ),
)


def _edited_payload(payload: dict[str, Any], edits: list[tuple[Any, ...]]) -> object:
    payload = {
        key: dict(value) if isinstance(value, dict) else value
        for key, value in payload.items()
    }
    for kind, *args in edits:
        if kind == "field":
            payload[args[0]] = args[1]
        elif kind == "drop":
            payload.pop(args[0], None)
        elif kind == "file":
            name, data, true_digest = args
            files, digests = payload.get("files"), payload.get("sha256")
            if isinstance(files, dict):
                files[name] = data
            if isinstance(digests, dict) and true_digest and isinstance(data, bytes):
                digests[name] = hashlib.sha256(data).hexdigest()
        else:
            build = payload.get("build")
            if isinstance(build, dict):
                build[args[0]] = args[1]
    return payload


def _deep_list(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


def test_fuzz_priming_hostile_kernel_payloads(
    subject: Subject, warnings_seen: _Warnings, inductor_cache_dir: Path
) -> None:
    # Straight to prime (what load calls after the pairing check), so values no
    # pickle round trip would keep, such as 100,000-deep nesting, are covered too.
    deep = _deep_list(100_000)
    metadata = pg.parse_metadata(subject.inductor_code)
    pinned, sources = metadata["KERNEL_BINARIES"], metadata["KERNEL_SOURCES"]
    assert isinstance(pinned, dict) and pinned and isinstance(sources, dict)

    def check(case: Any) -> None:
        edits, nest_deeply = case
        payload = _edited_payload(subject.payload, edits)
        if nest_deeply and isinstance(payload, dict):
            field, _, entry = nest_deeply.partition(".")
            container = payload.get(field) if entry else payload
            if isinstance(container, dict):
                container[entry or field] = deep
        files = payload.get("files") if isinstance(payload, dict) else None
        binaries = kernel_binaries.prime(payload, pinned, sources)
        if binaries is not None:
            assert isinstance(files, dict)
            for name, data in files.items():
                # Only what the artifact pins is ever written, and it is what is
                # there afterwards.
                assert pinned.get(name) == hashlib.sha256(data).hexdigest()
                assert (inductor_cache_dir / name).read_bytes() == data
            # The artifact is given only binaries the artifact itself names.
            assert set(binaries) <= set(sources)

    _fuzz(
        "kernel_payload",
        st.tuples(
            st.lists(_payload_edit, min_size=1, max_size=3),
            st.sampled_from(
                [None, "build", "files", "kind", "sha256", "build.torch", "files.x"]
            ),
        ),
        check,
    )


# --- pickle payloads in the cache never run -----------------------------------------


class RunsCode:
    """Unpickling this runs ``os.mkdir(path)``: a stand-in for any code a hostile
    pickle could run, with a side effect a test can look for."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return (os.mkdir, (self.path,))


def _place_payload(
    subject: Subject, where: str, payload: RunsCode
) -> dict[str, Any] | RunsCode:
    if where == "whole":
        return payload
    envelope = torch.load(io.BytesIO(subject.signed_cache), weights_only=True)
    if where == "nested":
        envelope["artifact"] = {"files": {"ab/x": [1, (payload,)]}}
    else:
        envelope[where] = payload
    return envelope


def test_fuzz_pickle_payloads_in_the_cache_never_run(
    subject: Subject,
    warnings_seen: _Warnings,
    tmp_path_factory: pytest.TempPathFactory,
    code_parsed_once: None,
) -> None:
    folder = tmp_path_factory.mktemp("payloads")
    counter = itertools.count()

    # The payload is live: an unrestricted unpickler runs it.
    control = folder / "control"
    pickle.loads(pickle.dumps(RunsCode(str(control))))
    assert control.is_dir()

    def check(case: Any) -> None:
        where, container, protocol, depth = case
        marker = folder / f"ran{next(counter)}"
        obj: object = _place_payload(subject, where, RunsCode(str(marker)))
        for _ in range(depth):
            wrapper: list[object] = [obj]
            obj = wrapper
        if container == "pickle":
            cache = pickle.dumps(obj, protocol=protocol)
        else:
            buffer = io.BytesIO()
            torch.save(obj, buffer, pickle_protocol=max(protocol, 2))
            cache = buffer.getvalue()
        warnings_seen.messages.clear()
        forward = pg.load(subject.code, cache)
        assert len(warnings_seen.about("cache cannot be read")) == 1
        _assert_runs_correctly(subject, forward)
        with pytest.raises(pg.PrecompileError, match="given a key"):
            read_cache(cache, python_code=subject.code, backend="eager", key=KEY)
        assert not marker.exists()

    _fuzz(
        "pickle_payload",
        st.tuples(
            st.sampled_from(
                ["whole", "artifact", "code_hash", "signature", "format", "nested"]
            ),
            st.sampled_from(["pickle", "torch.save"]),
            st.integers(0, pickle.HIGHEST_PROTOCOL),
            st.integers(0, 50),  # lists around it
        ),
        check,
    )
    assert list(folder.iterdir()) == [control]


# --- artifact files -----------------------------------------------------------------


def test_fuzz_load_of_a_broken_artifact_file(
    subject: Subject,
    warnings_seen: _Warnings,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    artifact = tmp_path_factory.mktemp("artifact") / "step.py"
    original = subject.code.encode("utf-8")

    def check(case: Any) -> None:
        data = case if isinstance(case, bytes) else _mutate_bytes(original, case)
        artifact.write_bytes(data)
        if data == original:
            _assert_runs_correctly(subject, pg.load(artifact, subject.cache))
            return
        with pytest.raises(pg.PrecompileError):
            pg.load(artifact, subject.cache)

    _fuzz(
        "artifact_file",
        st.one_of(_byte_mutations, st.binary(max_size=512)),
        check,
    )


# --- corpus -------------------------------------------------------------------------


def _raw_envelope_pickle(subject: Subject, **fields: bytes) -> bytes:
    """A hand-written protocol-2 pickle of the eager envelope, each field's value
    given as pickle opcodes: structures torch.save itself could not write."""
    values = {
        "format": _unicode(CACHE_FORMAT),
        "version": b"K" + bytes([CACHE_VERSION]),
        "backend": _unicode("eager"),
        "code_hash": _unicode(hashlib.sha256(subject.code.encode()).hexdigest()),
        "artifact": b"N",
        # Present, so that a load with a key checks a signature over the artifact.
        "signature": _unicode("not a signature"),
        **fields,
    }
    items = b"".join(_unicode(name) + value for name, value in values.items())
    return b"\x80\x02}(" + items + b"u."


_DEPTH = 100_000


def _shared_references(levels: int) -> bytes:
    """[L1, ..., L<levels>] where L<i+1> = [L<i>, L<i>]: a few hundred bytes that
    name 2**levels paths to the innermost list."""
    program = b"](]q\x00"
    for i in range(levels):
        program += b"]h%cah%caq%c" % (i, i, i + 1)
    return program + b"e"


HOSTILE_STRUCTURES = {
    # [[[...]]], 100,000 deep: the unpickler builds it without recursion.
    "deep": b"]" * _DEPTH + b"a" * (_DEPTH - 1),
    # A list that contains itself.
    "cyclic": b"]q\x00h\x00a",
    "shared": _shared_references(60),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_STRUCTURES))
def test_corpus_hostile_structures_as_the_artifact_payload(
    subject: Subject, kind: str, warnings_seen: _Warnings
) -> None:
    program = _raw_envelope_pickle(subject, artifact=HOSTILE_STRUCTURES[kind])
    cache = _zip_with_pickle(subject.cache, program)
    envelope = torch.load(io.BytesIO(cache), weights_only=True)
    assert isinstance(envelope["artifact"], list)
    warnings_seen.messages.clear()
    with _no_hang():
        # Without a key: an artifact that is not a dict is skipped, with a warning.
        _assert_runs_correctly(subject, pg.load(subject.code, cache))
        assert len(warnings_seen.about("not a dict")) == 1
        # With a key: the signature is computed over it without recursing, looping
        # or walking shared references again, and the pair is refused.
        reason = "does not match" if kind == "deep" else "referenced more than once"
        with pytest.raises(pg.PrecompileError, match=reason):
            pg.load(subject.code, cache, key=KEY)


@pytest.mark.parametrize("field", ["format", "version", "backend", "code_hash"])
@pytest.mark.parametrize("kind", sorted(HOSTILE_STRUCTURES))
def test_corpus_hostile_structures_in_checked_fields_give_short_messages(
    subject: Subject, field: str, kind: str, warnings_seen: _Warnings
) -> None:
    program = _raw_envelope_pickle(subject, **{field: HOSTILE_STRUCTURES[kind]})
    cache = _zip_with_pickle(subject.cache, program)
    warnings_seen.messages.clear()
    with _no_hang():
        if field in ("format", "version"):
            _assert_runs_correctly(subject, pg.load(subject.code, cache))
            (message,) = warnings_seen.about("envelope")
            assert len(message) < 1000
        else:
            with pytest.raises(pg.PrecompileError, match="do not belong") as info:
                pg.load(subject.code, cache)
            assert len(str(info.value)) < 1000


def test_corpus_a_deep_payload_in_the_kernel_fingerprint(
    subject: Subject, warnings_seen: _Warnings, inductor_cache_dir: Path
) -> None:
    payload = _edited_payload(subject.payload, [])
    assert isinstance(payload, dict) and isinstance(payload["build"], dict)
    payload["build"]["torch"] = _deep_list(_DEPTH)
    warnings_seen.messages.clear()
    metadata = pg.parse_metadata(subject.inductor_code)
    assert (
        kernel_binaries.prime(
            payload, metadata["KERNEL_BINARIES"], metadata["KERNEL_SOURCES"]
        )
        is None
    )
    (message,) = warnings_seen.messages
    assert "different environment" in message and len(message) < 2000
    assert not list(inductor_cache_dir.rglob("*.so"))


@pytest.mark.parametrize(
    "text",
    [
        "x = " + "1+" * 100_000 + "1",
        "x = " + "-" * 100_000 + "1",
        "x = " + "9" * 5000,
        "x = '\udcff'",
        "\ufeffx = 1",
        "BACKEND = " + "[" * 100 + "]" * 100,
    ],
    ids=["deep-binop", "deep-unary", "huge-int", "surrogate", "bom", "nested"],
)
def test_corpus_text_the_parser_gives_up_on(text: str) -> None:
    with _no_hang(), pytest.raises(pg.PrecompileError):
        pg.parse_metadata(text)
