"""Low-precision steps on the inductor backend, rounded as eager rounds or not.

    python benchmarks/low_precision.py

A graph that computes in float16 or bfloat16 is compiled with Inductor's
``emulate_precision_casts``, which rounds each op's result to its dtype as eager
does, rather than once per fused kernel. This prints what that buys and costs:

- **difference**: a small MLP (Linear 32->64, GELU, LayerNorm, Linear 64->8) in
  each dtype takes three AdamW steps through the artifact, with and without the
  option, through ``torch.compile(step)`` and through the eager backend's
  artifact; the largest |parameter - eager's parameter| of each;
- **cost**: the step time of the artifact of a larger bfloat16 model (four
  Linear(512, 512) + GELU + LayerNorm blocks, batch 64) with and without it, each
  the median of interleaved rounds of about 50 ms, measured in this one run.

"Without" compiles with the option taken out of the lowering's Inductor options.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import statistics
import time
from collections.abc import Callable, Generator
from unittest import mock

import torch
from torch import nn
from torch.nn import functional as F

import precompile_gen as pg
from precompile_gen.lowering import lower

STEPS = 3
ROUNDS = 30
# float16's AdamW divides by sqrt(v) + eps, and its v underflows to zero for small
# gradients: eps=1e-8 rounds to zero there and every system gives NaN.
EPS = {torch.bfloat16: 1e-8, torch.float16: 1e-3}


def step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


@contextlib.contextmanager
def rounding(on: bool) -> Generator[None]:
    """Captures inside compile with the option as the lowering picks it, or without."""
    if on:
        yield
        return
    with mock.patch.object(lower, "_LOW_PRECISION", frozenset()):
        yield


def small(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)
    ).to(dtype)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=generator).to(dtype)
    return model, x, torch.randn(16, 8, generator=generator).to(dtype)


def large() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [
        layer
        for _ in range(4)
        for layer in (nn.Linear(512, 512), nn.GELU(), nn.LayerNorm(512))
    ]
    model = nn.Sequential(*blocks, nn.Linear(512, 8)).to(torch.bfloat16)
    x, y = torch.randn(64, 512), torch.randn(64, 8)
    return model, x.to(torch.bfloat16), y.to(torch.bfloat16)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    dtype = next(model.parameters()).dtype
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS.get(dtype, 1e-8))


def artifact(backend: str, on: bool, model: nn.Module, *batch: torch.Tensor):
    with rounding(on):
        code, cache = pg.precompile(step, model, adamw(model), *batch, backend=backend)
    return pg.load(code, cache)


def trained(run: Callable[..., object], dtype: torch.dtype) -> nn.Module:
    model, x, y = small(dtype)
    optimizer = adamw(model)
    for _ in range(STEPS):
        run(model, optimizer, x, y)
    return model


def largest_difference(model: nn.Module, reference: nn.Module) -> float:
    return max(
        (p.float() - q.float()).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


def differences(dtype: torch.dtype) -> dict[str, float]:
    reference = trained(step, dtype)
    model, x, y = small(dtype)
    runs: dict[str, Callable[..., object]] = {
        "inductor": artifact("inductor", False, model, x, y),
        "inductor, rounded": artifact("inductor", True, model, x, y),
        "eager backend": artifact("eager", True, model, x, y),
    }
    torch._dynamo.reset()
    runs["torch.compile"] = torch.compile(step)
    result = {
        name: largest_difference(trained(run, dtype), reference)
        for name, run in runs.items()
    }
    torch._dynamo.reset()
    return result


def _seconds_per_step(run: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat


def step_times() -> tuple[float, float]:
    """The large model's step time without the option and with it."""
    model, x, y = large()
    steppers = []
    for on in (False, True):
        run = artifact("inductor", on, model, x, y)
        own = copy.deepcopy(model)
        optimizer = adamw(own)
        steppers.append(lambda run=run, own=own, o=optimizer: run(own, o, x, y))
        for _ in range(3):
            steppers[-1]()
    repeat = max(2, int(0.05 / _seconds_per_step(steppers[0], 3)))
    samples: list[list[float]] = [[], []]
    gc.disable()
    try:
        for round_index in range(ROUNDS):
            # Each round starts with the other one, so neither always runs first.
            for which in (round_index % 2, 1 - round_index % 2):
                samples[which].append(_seconds_per_step(steppers[which], repeat))
    finally:
        gc.enable()
    return statistics.median(samples[0]), statistics.median(samples[1])


def main() -> None:
    # load() warns before executing unsigned code; this script made the code itself.
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    names = ("inductor", "inductor, rounded", "torch.compile", "eager backend")
    print(f"max |param - eager param| after {STEPS} AdamW steps")
    print(f"{'dtype':<10}" + "".join(f"{name:>19}" for name in names))
    for dtype in (torch.bfloat16, torch.float16):
        found = differences(dtype)
        print(f"{dtype!s:<10}" + "".join(f"{found[n]:>19.4g}" for n in names))
    without, with_option = step_times()
    print(
        f"\nbfloat16 step, 4x Linear(512, 512), batch 64: {without * 1e3:.2f} ms "
        f"unrounded, {with_option * 1e3:.2f} ms rounded, "
        f"ratio {with_option / without:.2f}"
    )


if __name__ == "__main__":
    main()
