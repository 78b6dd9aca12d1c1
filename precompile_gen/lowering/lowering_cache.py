"""Lowering's results kept between captures: a capture whose traced graph and
convention are those of an earlier one reuses its lowering, Inductor's compile
included, rather than running it again.

Lowering is a function of what the trace hands it and of what it runs on, so the key
is all of that:

- the traced graph: its code and its torch.cond branches', and each node's metadata
  besides what the inputs decide (object addresses left out), which Inductor may
  read;
- the tensors it was traced on (shape, strides, storage offset and sharing, dtype,
  device, ``requires_grad``), the values of its tensor literals, and the calling
  convention, strides and local shards the trace recorded;
- this precompile_gen's own code, torch's build, Python, the C++ toolchain and
  vector instruction set (``kernel_builds.toolchain``), Triton's version, Inductor's
  and AOTAutograd's configuration and the environment variables torch, Inductor and
  Triton read.

A change to any of these misses. What the key cannot see is not cached at all: a
graph traced on fakes (mark_unbacked dims), on DTensors, or over process groups, and
a graph that calls an op torch does not define (a library's or the user's own,
whose kernel and fake implementation are code the key does not hold).

Entries live in Inductor's cache folder, beside the kernels it compiles and its own
graph cache, whose trust they share: like Inductor's entries they are pickles, so a
folder others can write to is as unsafe for one as for the other. Set
``PRECOMPILE_GEN_LOWERING_CACHE=0`` (or ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``) to
lower every capture afresh.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import re
import sys
import tempfile
from pathlib import Path

import torch

from precompile_gen.capture_result import CompiledGraph, KernelPayload
from precompile_gen.capturing import data_parallel
from precompile_gen.capturing.trace import TracedGraph
from precompile_gen.lowering import kernel_builds
from precompile_gen.runtime import kernel_binaries

log = logging.getLogger(__name__)

# Bumped when an entry's layout changes; the package's digest covers the rest.
_FORMAT = 1
_ENVIRONMENT_PREFIXES = ("TORCH", "TRITON", "CUDA", "CC", "CXX", "CFLAGS", "LD")
# Where the cache folder is does not change what lowering makes (kernel_builds).
_FOLDER_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
# Node metadata derived from the inputs' metadata, which the key holds already.
_DERIVED_META = {"val", "tensor_meta", "example_value"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def enabled() -> bool:
    """Whether captures keep and reuse their lowering."""
    if os.environ.get("PRECOMPILE_GEN_LOWERING_CACHE", "1") == "0":
        return False
    return os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "0") != "1"


def key(traced: TracedGraph) -> str | None:
    """The key of ``traced``'s inductor lowering, or None where it is not cached."""
    if not enabled() or traced.local_shards is not None:
        return None
    if data_parallel.graph_groups(traced.gm) or not _torch_ops_only(traced.gm):
        return None
    tensors = _tensor_records(traced.flat_args)
    if tensors is None:
        return None
    digest = hashlib.sha256()
    for part in (
        f"precompile_gen lowering {_FORMAT}",
        _environment(),
        _graph_text(traced.gm),
        tensors,
        repr([(name, t.tolist(), t.dtype, t.device) for name, t in traced.constants]),
        repr(traced.convention),
        repr(traced.example_strides),
    ):
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


def load(entry: str) -> tuple[CompiledGraph, KernelPayload] | None:
    """The lowering kept under ``entry``, or None (a miss, or an entry unreadable)."""
    path = _folder() / f"{entry}.pickle"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        form, found, graph, payload = pickle.loads(data)
    except Exception as error:
        log.debug("lowering cache entry %s unreadable: %s", path, error)
        return None
    if (
        form != _FORMAT
        or found != entry
        or not isinstance(graph, CompiledGraph)
        or not isinstance(payload, KernelPayload)
    ):
        return None
    log.debug("lowering reused from %s", path)
    return graph, payload


def store(entry: str, graph: CompiledGraph, payload: KernelPayload) -> None:
    """Keep a lowering under ``entry``. Keeping it is never worth failing the
    capture for: a folder that cannot be written, or a lowering that cannot be
    pickled, is skipped (and no partial entry is left)."""
    folder = _folder()
    written: Path | None = None
    try:
        data = pickle.dumps((_FORMAT, entry, graph, payload))
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as out:
            written = Path(out.name)
            out.write(data)
        written.replace(folder / f"{entry}.pickle")
    except Exception as error:
        log.debug("lowering cache entry not written to %s: %s", folder, error)
        if written is not None:
            with contextlib.suppress(OSError):
                written.unlink()


def _folder() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "precompile_gen" / "lowering"


# The op namespaces whose kernels and shapes torch's build decides (which the key
# holds); an op of another library's, or the user's (torch.library), has its
# implementation and fake kernel in code the key does not see.
_TORCH_NAMESPACES = frozenset(
    {"aten", "prims", "higher_order", "_c10d_functional", "c10d_functional", "_dtensor"}
)


def _torch_ops_only(gm: torch.fx.GraphModule) -> bool:
    """Whether every op the graph (and its branches) calls is torch's own."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            namespace = getattr(target, "namespace", None)
            if namespace is not None:
                if namespace not in _TORCH_NAMESPACES:
                    return False
            elif not getattr(target, "__module__", "").startswith(_TORCH_MODULES):
                return False
    return True


# Functions a graph calls that are not ops: Python's operators (getitem on a
# result's tuple) and torch's own Python functions.
_TORCH_MODULES = ("_operator", "operator", "torch.", "builtins")


def _tensor_records(flat_args: list[object]) -> str | None:
    """The metadata of the tensors the graph was traced on, with which of them
    share a storage; None where one is not a plain tensor (a fake, a DTensor)."""
    storages: dict[int, int] = {}
    records = []
    for arg in flat_args:
        if not isinstance(arg, torch.Tensor):
            records.append(repr(arg))
            continue
        if type(arg) not in (torch.Tensor, torch.nn.Parameter) or arg.is_sparse:
            return None
        storage = arg.untyped_storage().data_ptr()
        if arg.device.type == "cuda":
            # Inductor compiles for the device it traced on.
            properties = torch.cuda.get_device_properties(arg.device)
            records.append(repr((properties.name, properties.major, properties.minor)))
        records.append(
            repr(
                (
                    tuple(arg.shape),
                    arg.stride(),
                    arg.storage_offset(),
                    storages.setdefault(storage, len(storages)),
                    arg.dtype,
                    arg.device,
                    arg.requires_grad,
                    arg.is_conj(),
                    arg.is_neg(),
                )
            )
        )
    return "\n".join(records)


def _graph_text(gm: torch.fx.GraphModule) -> str:
    """The graph's code and its branches', then each node's metadata."""
    parts = []
    for name, module in gm.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        parts.append(f"# {name}\n{module.code}")
        for node in module.graph.nodes:
            meta = {k: v for k, v in node.meta.items() if k not in _DERIVED_META}
            parts.append(_ADDRESS.sub("", f"{node.name}: {meta!r}"))
    return "\n".join(parts)


@functools.cache
def _package_digest() -> str:
    """The sha256 of this precompile_gen's code: lowering is part of it."""
    package = Path(__file__).parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode("utf-8"))
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _environment() -> str:
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    variables = sorted(
        (name, value)
        for name, value in os.environ.items()
        if name.startswith(_ENVIRONMENT_PREFIXES) and name not in _FOLDER_VARIABLES
    )
    return _ADDRESS.sub(
        "",
        repr(
            (
                _package_digest(),
                # What a kernel binary needs of the process, and on top torch's and
                # Python's own builds, which one version number may name twice.
                sorted(kernel_binaries.build_fingerprint().items()),
                torch.version.git_version,
                sys.version,
                sorted(kernel_builds.toolchain().items()),
                sorted(inductor_config.save_config_portable().items()),
                sorted(functorch_config.save_config_portable().items()),
                # What Inductor reads of torch's own settings.
                torch.get_default_dtype(),
                torch.get_float32_matmul_precision(),
                torch.are_deterministic_algorithms_enabled(),
                variables,
            )
        ),
    )
