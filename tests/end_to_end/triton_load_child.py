"""Loads the pair DIR/code.py, DIR/cache.bin of one of ``helpers.triton_programs`` in
a fresh process, runs it STEPS times (or once per batch of its ``call_batches``)
under Triton's interpreter next to eager on an equal model, each call and eager's
under the same ``torch.manual_seed``; checks outputs, gradients and parameters (and,
for a training step, the optimizer's state) against eager's, and prints one JSON
line: the outputs, and whether the cache said its Triton kernels were interpreted.
Without DIR/cache.bin (a golden, which pins no binary) the artifact is loaded
without a cache, and the line holds the outputs alone.

    python triton_load_child.py PROGRAM DIR STEPS
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch
from helpers.triton_programs import PROGRAMS, at_batch
from torch import nn

import precompile_gen as pg
from precompile_gen.testing import triton_interpreter


def main(name: str, folder: Path, steps: int) -> None:
    program = PROGRAMS[name]
    cache_file = folder / "cache.bin"
    cache = cache_file.read_bytes() if cache_file.exists() else None
    compiled, reference = program.arguments(), program.arguments()
    batches = program.call_batches or (None,) * steps
    outputs = []
    with triton_interpreter():
        forward = pg.load((folder / "code.py").read_text(encoding="utf-8"), cache)
        for step, batch in enumerate(batches):
            if batch is not None:
                compiled = at_batch(compiled, batch)
                reference = at_batch(reference, batch)
            # A seed per call: a random op (dropout) draws afresh at each, as
            # eager's does under the same seed.
            torch.manual_seed(step)
            got = forward(*compiled)
            torch.manual_seed(step)
            want = program.fn(*reference)
            torch.testing.assert_close(got, want)
            assert isinstance(got, torch.Tensor)
            outputs.append(got.tolist())
    _check_state(compiled, reference)
    report: dict[str, object] = {"outputs": outputs}
    if cache is not None:
        payload = torch.load(io.BytesIO(cache), weights_only=True)["artifact"]
        report["triton_kernels"] = payload["triton_kernels"]
        report["triton_interpreted"] = payload["triton_interpreted"]
        report["files"] = len(payload["files"])
    print(json.dumps(report))


def _check_state(compiled: tuple[object, ...], reference: tuple[object, ...]) -> None:
    model, want = compiled[0], reference[0]
    assert isinstance(model, nn.Module) and isinstance(want, nn.Module)
    # The interpreter sums in NumPy's order and eager in its vector width's; AdamW
    # divides by the root of the squared gradients, which magnifies a last-bit
    # difference of a gradient near zero (one parameter of 8 moved 1.2e-5 after 3
    # steps on a 256-bit machine): a relative tolerance of 1e-4, 1e-5 absolute.
    for got, expected in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-4, atol=1e-5)
    if isinstance(compiled[1], torch.optim.Optimizer):
        assert isinstance(reference[1], torch.optim.Optimizer)
        got_state = compiled[1].state_dict()["state"]
        torch.testing.assert_close(got_state, reference[1].state_dict()["state"])


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
