"""Distributed: precompile on one rank, send the pair to every rank, load it everywhere.

``precompile_once`` is a collective: every rank of the process group calls it, with
the same ``src``, ``group``, ``backend`` and ``cache_dir``. Rank ``src`` captures and
lowers ``fn``; no other rank runs it. Every rank then loads the same
``(python_code, cache)`` pair and returns the callable.

What crosses the group, all from ``src`` through ``torch.distributed.broadcast``:

1. an int64 header ``[kind, text_bytes, data_bytes]``;
2. unless both lengths are 0, one uint8 tensor holding ``text`` then ``data``:

   - ``PAIR``: text = python_code (UTF-8), data = the cache;
   - ``FILES`` (``cache_dir`` given): text = a JSON manifest naming the two files
     ``src`` wrote into the shared folder and their sha256 digests, data empty;
   - ``FAILED``: text = the source rank's error, data empty.

3. after loading, an ``all_reduce`` of one failure flag per rank, so that a rank that
   could not load makes every rank raise, instead of leaving the others to wait for it
   in the next collective of the training loop.

The pair is sent as raw bytes rather than with ``broadcast_object_list``: it already
is a str and bytes, so a length header carries it exactly, with nothing to unpickle on
the receiving ranks (unpickling can construct arbitrary objects before ``load`` has
checked anything) and no pickled copy of a payload that can reach megabytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from precompile_gen.api import precompile
from precompile_gen.capture_result import check_backend
from precompile_gen.capturing import dtensors, fully_sharded
from precompile_gen.runtime.cache import check_key, code_hash
from precompile_gen.runtime.errors import PrecompileError
from precompile_gen.runtime.files import write_pair
from precompile_gen.runtime.load import load

# Header kinds.
PAIR, FILES, FAILED = 0, 1, 2

# File names in cache_dir are built from this alphabet only, so a name can neither
# leave the folder nor collide with the hidden temporary files of files.write_pair.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def precompile_once(
    fn: Callable[..., object],
    *example_inputs: object,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    backend: str = "inductor",
    tracer: str = "make_fx",
    decompositions: dict[Any, Callable[..., Any]] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    name: str | None = None,
    key: bytes | None = None,
) -> Callable[..., object]:
    """Precompile ``fn`` on rank ``src`` only; return the loaded callable on every rank.

    ``src`` is a global rank, as in ``torch.distributed.broadcast``; ``group``
    defaults to the world group. ``example_inputs`` are used on ``src`` only (other
    ranks may pass their own batch or nothing). Without ``cache_dir`` the pair is
    broadcast through the group; with it, ``src`` writes the pair atomically into
    that folder, which every rank must see (a shared file system), and the other
    ranks read it from there. Files are named ``{name}.{digest}.py`` and
    ``{name}.{digest}.cache``, ``name`` defaulting to ``fn.__name__`` and
    ``digest`` identifying the pair, so concurrent jobs and successive versions never
    overwrite each other's files.

    With ``key`` (the same on every rank), ``src`` signs the cache and every rank
    refuses a pair whose signature does not verify, as ``load(..., key=key)`` does:
    what arrives through the group or a shared folder is checked before it runs.

    A failure on ``src`` raises PrecompileError on every rank, naming the source rank
    and the original error; so does a failure to load on any rank. The other ranks
    wait for ``src`` inside a collective, so the group's timeout
    (``init_process_group(timeout=...)``) must exceed the time to precompile.
    """
    check_backend(backend)
    if key is not None:
        check_key(key)
    stem = _file_stem(fn, name) if cache_dir is not None else None
    group_ranks = _group_ranks(src, group)
    device = _collective_device(group)
    precompile_here = functools.partial(
        precompile,
        backend=backend,
        tracer=tracer,
        decompositions=decompositions,
        key=key,
    )
    message, pair, failure = (
        _precompile_on_source(precompile_here, fn, example_inputs, cache_dir, stem)
        if dist.get_rank() == src
        else (None, None, None)
    )
    kind, text, data = _broadcast(message, src=src, group=group, device=device)
    if kind == FAILED:
        raise _source_failed(fn, src, text) from failure
    forward, local_error = _load_pair(pair, (kind, text, data), cache_dir, src, key)
    failed_ranks = _ranks_that_failed(local_error, group, group_ranks, device)
    if failed_ranks:
        raise _load_failed(fn, src, failed_ranks, local_error) from local_error
    assert forward is not None  # no rank failed, so this one loaded
    return forward


def _precompile_on_source(
    precompile_here: Callable[..., tuple[str, bytes]],
    fn: Callable[..., object],
    example_inputs: tuple[object, ...],
    cache_dir: str | os.PathLike[str] | None,
    stem: str | None,
) -> tuple[tuple[int, str, bytes], tuple[str, bytes] | None, Exception | None]:
    """What rank ``src`` sends (the pair, the files' manifest, or its failure), and
    the pair and the failure it keeps for itself."""
    pair: tuple[str, bytes] | None = None
    try:
        _reject_dtensors(example_inputs)
        pair = precompile_here(fn, *example_inputs)
        if cache_dir is None or stem is None:
            return (PAIR, *pair), pair, None
        return (FILES, _write_files(Path(cache_dir), stem, *pair), b""), pair, None
    except Exception as error:
        return (FAILED, f"{type(error).__name__}: {error}", b""), pair, error


def _source_failed(fn: object, src: int, reason: str) -> PrecompileError:
    return PrecompileError(
        f"precompile_once: precompiling {_describe(fn)} failed on source rank {src} "
        f"({reason}). Every rank of the group raises this error; the traceback is "
        f"chained to it on rank {src}. Fix the failure there and run again."
    )


def _load_pair(
    pair: tuple[str, bytes] | None,
    received: tuple[int, str, bytes],
    cache_dir: str | os.PathLike[str] | None,
    src: int,
    key: bytes | None,
) -> tuple[Callable[..., object] | None, Exception | None]:
    """This rank's pair loaded (its own on ``src``, else the one it received), or
    why it could not be: every rank learns of any rank's failure afterwards."""
    try:
        if pair is None:
            pair = _received_pair(*received, cache_dir, src)
        return load(*pair, key=key), None
    except Exception as error:
        return None, error


def _load_failed(
    fn: object, src: int, failed_ranks: list[int], local_error: Exception | None
) -> PrecompileError:
    here = (
        f" On this rank: {type(local_error).__name__}: {local_error}"
        if local_error is not None
        else f" See the error on rank {failed_ranks[0]} for the reason."
    )
    return PrecompileError(
        f"precompile_once: loading {_describe(fn)}, precompiled on source rank {src}, "
        f"failed on rank(s) {failed_ranks}; every rank of the group raises, so "
        f"that none waits for them in a later collective.{here}"
    )


def _reject_dtensors(example_inputs: tuple[object, ...]) -> None:
    modules = [a for a in example_inputs if isinstance(a, torch.nn.Module)]
    if fully_sharded.holds_sharded(modules):
        raise PrecompileError(
            "the example inputs hold a model sharded with fully_shard (FSDP2), "
            "which precompile_once cannot capture for every rank: the graph is "
            "traced on the source rank's own shards, and another rank's shards can "
            "differ in size (a dim that does not divide by the mesh size is padded "
            "on some ranks only), so its local ops and collectives would not be "
            "that rank's. Call precompile() on every rank (each traces its own "
            "shards; the trace itself communicates nothing), then load() the pair "
            "there."
        )
    if dtensors.holds_dtensors(example_inputs):
        raise PrecompileError(
            "the example inputs hold DTensors, which precompile_once cannot "
            "capture: tracing them runs DTensor's collectives, on the source rank "
            "alone, while the other ranks wait for its pair. Call precompile() on "
            "every rank (each rank traces its own shard, and the ranks run the "
            "collectives together), then load() the pair there."
        )


def _describe(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _file_stem(fn: object, name: str | None) -> str:
    """The caller's ``name`` checked, or one made from ``fn``'s name."""
    if name is not None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"name must be a plain file name of letters, digits, '_', '.' and "
                f"'-', not starting with '.' or '-', got {name!r}; it prefixes the "
                "pair's files in cache_dir."
            )
        return name
    made = re.sub(r"[^A-Za-z0-9_.-]", "_", getattr(fn, "__name__", "") or "")
    made = made.lstrip(".-")
    return made or "precompiled"


def _group_ranks(src: int, group: dist.ProcessGroup | None) -> list[int]:
    """The group's global ranks, after checking this process and ``src`` are in it."""
    if not dist.is_available() or not dist.is_initialized():
        raise PrecompileError(
            "precompile_once needs a torch.distributed process group, and none is "
            "initialised: call torch.distributed.init_process_group(...) on every "
            "rank first, or use precompile() + load() in a single process."
        )
    world = group if group is not None else dist.group.WORLD
    if world is None:
        raise PrecompileError(
            "precompile_once found no default process group: call "
            "torch.distributed.init_process_group(...) on every rank first."
        )
    ranks = dist.get_process_group_ranks(world)
    rank = dist.get_rank()
    if rank not in ranks:
        raise ValueError(
            f"this process (global rank {rank}) is not in the group, whose global "
            f"ranks are {ranks}; call precompile_once only on the group's ranks."
        )
    if src not in ranks:
        raise ValueError(
            f"src={src} is not a rank of the group, whose global ranks are {ranks}; "
            "src is a global rank, as in torch.distributed.broadcast."
        )
    return ranks


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: CPU when its backend can (gloo, or
    a ``cpu:`` entry of a mixed backend), else the current accelerator (NCCL)."""
    backend = dist.get_backend(group)
    if ":" in backend:
        device_types = [entry.split(":")[0] for entry in backend.split(",")]
    else:
        device_types = dist.Backend.backend_capability.get(backend, ["cpu"])
    if "cpu" in device_types:
        return torch.device("cpu")
    return torch.device(device_types[0], torch.accelerator.current_device_index())


def _broadcast(
    message: tuple[int, str, bytes] | None,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[int, str, bytes]:
    """``message`` from ``src`` (where it is not None) to every rank of the group."""
    header = torch.zeros(3, dtype=torch.int64, device=device)
    body = b""
    if message is not None:
        kind, text, data = message
        encoded = text.encode("utf-8", "surrogatepass")
        body = encoded + data
        header = torch.tensor(
            [kind, len(encoded), len(data)], dtype=torch.int64, device=device
        )
    try:
        dist.broadcast(header, src=src, group=group)
        kind, text_bytes, data_bytes = (int(value) for value in header.tolist())
        size = text_bytes + data_bytes
        if size == 0:
            return kind, "", b""
        if message is not None:
            tensor = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(device)
        else:
            tensor = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(tensor, src=src, group=group)
    except RuntimeError as error:
        raise _collective_failed(src, error) from error
    if message is None:
        body = tensor.cpu().numpy().tobytes()
    text = body[:text_bytes].decode("utf-8", "surrogatepass")
    return kind, text, body[text_bytes:]


def _collective_failed(src: int, error: RuntimeError) -> PrecompileError:
    reason = (str(error).strip().splitlines() or [""])[0]
    if dist.get_rank() == src:
        return PrecompileError(
            f"precompile_once: sending the precompiled pair from source rank {src} to "
            f"the group failed ({type(error).__name__}: {reason}); another rank died "
            "or timed out, see its log."
        )
    return PrecompileError(
        f"precompile_once: waiting for source rank {src}'s precompiled pair failed "
        f"({type(error).__name__}: {reason}). Either rank {src} died (see its log), "
        "or precompiling took longer than the process group's timeout: pass a larger "
        "timeout to torch.distributed.init_process_group(timeout=...)."
    )


def _write_files(folder: Path, stem: str, python_code: str, cache: bytes) -> str:
    """Write the pair into ``folder``; the JSON manifest the other ranks read it by."""
    code_digest = code_hash(python_code)
    cache_digest = hashlib.sha256(cache).hexdigest()
    pair_digest = hashlib.sha256(f"{code_digest}{cache_digest}".encode()).hexdigest()
    unique = f"{stem}.{pair_digest[:16]}"
    artifact, cache_file = f"{unique}.py", f"{unique}.cache"
    folder.mkdir(parents=True, exist_ok=True)
    write_pair(folder / artifact, folder / cache_file, python_code, cache)
    return json.dumps(
        {
            "artifact": artifact,
            "artifact_sha256": code_digest,
            "cache": cache_file,
            "cache_sha256": cache_digest,
        }
    )


def _received_pair(
    kind: int,
    text: str,
    data: bytes,
    cache_dir: str | os.PathLike[str] | None,
    src: int,
) -> tuple[str, bytes]:
    if kind == PAIR:
        if cache_dir is not None:
            raise PrecompileError(
                f"this rank passed cache_dir={os.fspath(cache_dir)!r} but source rank "
                f"{src} did not, so it sent the pair through the group instead of "
                "writing files. Pass the same cache_dir on every rank, or none."
            )
        return text, data
    if kind != FILES:
        raise PrecompileError(
            f"precompile_once received message kind {kind} from source rank {src}, "
            "which this version does not know; run the same precompile_gen version "
            "on every rank."
        )
    manifest = json.loads(text)
    if cache_dir is None:
        raise PrecompileError(
            f"source rank {src} wrote the pair into its cache_dir, but this rank "
            "passed no cache_dir, so it cannot find the files. Pass the same "
            "cache_dir (a folder every rank sees) on every rank, or none."
        )
    folder = Path(cache_dir)
    code = _read_checked(folder, manifest["artifact"], manifest["artifact_sha256"], src)
    cache = _read_checked(folder, manifest["cache"], manifest["cache_sha256"], src)
    return code.decode("utf-8", "surrogatepass"), cache


def _read_checked(folder: Path, file_name: str, sha256: str, src: int) -> bytes:
    path = folder / file_name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PrecompileError(
            f"{path} is not there, although source rank {src} wrote it into its "
            "cache_dir: cache_dir must be one folder that every rank sees (a shared "
            "file system), at the same path. Pass such a folder, or no cache_dir "
            "to send the pair through the process group."
        ) from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise PrecompileError(
            f"{path} differs from the file source rank {src} wrote (sha256 "
            "mismatch): cache_dir is not the same folder on every rank, or something "
            "else rewrote the file. Pass a folder that every rank sees and only "
            "precompile_once writes."
        )
    return data


def _ranks_that_failed(
    error: Exception | None,
    group: dist.ProcessGroup | None,
    group_ranks: list[int],
    device: torch.device,
) -> list[int]:
    """The global ranks whose load failed; every rank of the group learns the same."""
    flags = torch.zeros(len(group_ranks), dtype=torch.int32, device=device)
    if error is not None:
        flags[dist.get_rank(group)] = 1
    try:
        dist.all_reduce(flags, group=group)
    except RuntimeError as reduce_error:
        raise PrecompileError(
            "precompile_once: after loading, the ranks could not confirm to each "
            f"other that they all loaded ({type(reduce_error).__name__}: "
            f"{reduce_error}); a rank died or timed out, see its log."
        ) from (error or reduce_error)
    return [
        rank for rank, flag in zip(group_ranks, flags.tolist(), strict=True) if flag
    ]
