"""One whole training step (forward, backward, optimizer update) three ways.

    python benchmarks/train_step.py

For two models, the demo CNN and a small transformer encoder block, each with the
demo's AdamW (``demo.optimizer``), and the encoder block again with RMSprop
(centered, with momentum), the demo's step (``demo.train_step``)

    optimizer.zero_grad(); loss = ...; loss.backward(); optimizer.step()

runs as

- **eager**: the function as written;
- **torch.compile**: ``torch.compile(step)``, warmed up first (its compilation is not
  timed); Dynamo compiles the forward and backward as one AOTAutograd graph and the
  optimizer's update as another;
- **precompile_gen**: the inductor artifact of the step, loaded with its cache, one
  compiled graph for the whole step.

Each system trains its own copy of the model from the same weights on the same
batch. The three timings are interleaved in rounds of about 20 ms each, and each
system's time per step is the median over the rounds, so that load from other
processes, which slows neighbouring timings alike, largely cancels. All rows are
measured in this one run, at torch's default thread count.
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import precompile_gen as pg
from precompile_gen.tools import demo

ROUNDS = 40
SYSTEMS = ("eager", "torch.compile", "precompile_gen")
# The artifact's step against torch.compile's: at most this ratio.
TARGET = 1.05


class EncoderBlock(nn.Module):
    """A pre-norm transformer encoder block with a classification head."""

    def __init__(self, width: int = 64, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(
            width,
            heads,
            dim_feedforward=4 * width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(tokens).mean(dim=1))


def _encoder() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(8, 32, 64, generator=generator)
    return EncoderBlock(), tokens, torch.randint(0, 10, (8,), generator=generator)


def _rmsprop(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)


Example = Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]
MODELS: list[tuple[str, Example, MakeOptimizer]] = [
    ("demo CNN", demo.example, demo.optimizer),
    ("encoder block", _encoder, demo.optimizer),
    ("encoder, RMSprop", _encoder, _rmsprop),
]


def _steppers(
    make: Example, make_optimizer: MakeOptimizer
) -> dict[str, Callable[[], object]]:
    model, inputs, labels = make()
    step = demo.train_step
    code, cache = pg.precompile(step, model, make_optimizer(model), inputs, labels)
    artifact = pg.load(code, cache)
    compiled = torch.compile(step)
    runs: dict[str, Callable[..., object]] = {
        "eager": step,
        "torch.compile": compiled,
        "precompile_gen": artifact,
    }
    steppers: dict[str, Callable[[], object]] = {}
    for system in SYSTEMS:
        own = copy.deepcopy(model)
        one_step = functools.partial(
            runs[system], own, make_optimizer(own), inputs, labels
        )
        # Warm up: torch.compile compiles here, and every system creates its
        # optimizer state on its first step.
        for _ in range(3):
            one_step()
        steppers[system] = one_step
    return steppers


def _seconds_per_step(run: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat


def measure(make: Example, make_optimizer: MakeOptimizer) -> dict[str, float]:
    steppers = _steppers(make, make_optimizer)
    per_step = _seconds_per_step(steppers["eager"], 5)
    repeat = max(2, int(0.02 / per_step))
    samples: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    gc.disable()
    try:
        for round_index in range(ROUNDS):
            # Each round starts with another system, so none always runs first.
            order = SYSTEMS[round_index % 3 :] + SYSTEMS[: round_index % 3]
            for system in order:
                samples[system].append(_seconds_per_step(steppers[system], repeat))
    finally:
        gc.enable()
    return {system: statistics.median(values) for system, values in samples.items()}


def main() -> None:
    # load() warns before executing unsigned code; this script made the code itself.
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    print(
        f"{'model':<16}{'eager ms':>10}{'torch.compile ms':>18}"
        f"{'precompile_gen ms':>19}{'vs compile':>12}{'vs eager':>10}"
    )
    verdicts = []
    for label, make, make_optimizer in MODELS:
        times = measure(make, make_optimizer)
        ours = times["precompile_gen"]
        versus_compile = ours / times["torch.compile"]
        versus_eager = ours / times["eager"]
        print(
            f"{label:<16}{times['eager'] * 1e3:>10.2f}"
            f"{times['torch.compile'] * 1e3:>18.2f}{ours * 1e3:>19.2f}"
            f"{versus_compile:>12.2f}{versus_eager:>10.2f}"
        )
        compile_faster = times["torch.compile"] < times["eager"]
        verdicts.append(
            versus_compile <= TARGET and (versus_eager < 1 or not compile_faster)
        )
    print(
        f"\ntarget: precompile_gen / torch.compile <= {TARGET}, and faster than eager "
        "where torch.compile is: " + ("met" if all(verdicts) else "NOT met")
    )


if __name__ == "__main__":
    main()
