"""Torch's global modes around a capture: inference mode, grad mode, autocast.

The trace runs the function on copies of the example tensors and learns what it
updated in place from their version counters. Inference tensors have none, and a
copy made inside ``torch.inference_mode()`` is one; so the capture runs with inference
mode off (grad mode kept as the caller had it), which changes no value the graph
computes: inside inference mode, as outside it, the graph holds the same ops.

Autocast, by contrast, is part of what the graph computes: the trace records the
casts it inserts (an ``mm`` in bfloat16), so a capture inside ``torch.autocast``
holds its dtypes. Lowering then compiles that graph as it is, with autocast off, as
the driver runs it, whatever autocast state a call has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch

from precompile_gen.runtime.errors import PrecompileError


@contextlib.contextmanager
def capturing() -> Generator[None]:
    """Inference mode off for the whole capture, grad mode as the caller had it; and
    torch's generators left where they were: capture runs fn, which draws, but a
    capture is no call, and the caller's next draws must be what they would be."""
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=list(cuda)):
        if not torch.is_inference_mode_enabled():
            yield
            return
        # Leaving inference mode turns grad mode on; inside it, grad mode was off.
        with torch.inference_mode(False), torch.no_grad():
            yield


def lowering() -> contextlib.AbstractContextManager[object]:
    """Autocast off while the graph is compiled: the graph already holds the casts
    autocast made while it was traced, and AOTAutograd's trace of it must not
    apply them a second time."""
    return torch._C._DisableAutocast()


def check_backward(grad_enabled: bool, ran_backward: bool, fn_name: str) -> None:
    """Refuse a backward traced for a caller whose grad mode was off: eagerly, under
    ``torch.no_grad()`` or ``torch.inference_mode()``, that backward raises."""
    if grad_enabled or not ran_backward:
        return
    raise PrecompileError(
        f"{fn_name!r} runs a backward (parameters received gradients), but capture "
        "was called with grad mode off (inside torch.no_grad() or "
        "torch.inference_mode()), where the backward raises eagerly ('element 0 of "
        "tensors does not require grad'). Call precompile outside torch.no_grad() "
        "and torch.inference_mode(), and call the artifact there too."
    )
