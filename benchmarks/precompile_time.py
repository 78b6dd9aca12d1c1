"""Precompile wall time against torch.compile's first call, cold and warm.

    python benchmarks/precompile_time.py [--repeat N] [--programs demo,lm,...]

Each program is a whole training step with its optimizer inside, on CPU tensors:

- demo: the built-in demo (a small CNN with BatchNorm, AdamW);
- lm: a 4-block GPT-like language model (d=128, vocabulary 512, batch 8x64, AdamW);
- resnet18: torchvision's resnet18 (random weights, batch 2 of 64x64 images, SGD
  with momentum);
- gpt2: transformers' GPT-2 small (``GPT2Config()``, random weights, batch 1x64,
  AdamW).

Each measurement is one fresh process with a cache folder of its own
(``TORCHINDUCTOR_CACHE_DIR``): ``cold`` starts with it empty (a fresh machine),
``warm`` runs the same program again with the folder the cold run filled (the caches
a user keeps between runs). precompile_gen's time is ``precompile(...)``;
torch.compile's is its first call (compiling, then running the step once), which is
what a user waits for before the first step. Imports and the example are made before
the clock starts. The systems alternate, run by run, and each cell is the median of
``--repeat`` runs, all in this one run of the script. precompile_gen's time is split
into its stages from its own log line (``precompile_gen.tools.timings``), capture's
passes included: the Dynamo pass that records the Python values the step reads, the
make_fx trace, and the rest.

Targets: cold <= 0.8x and warm <= 1.0x torch.compile's first call.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SYSTEMS = ("precompile_gen", "torch.compile")
PROGRAMS = ("demo", "lm", "resnet18", "gpt2")
TARGETS = {"cold": 0.8, "warm": 1.0}


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    return loss.detach()


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class _LanguageModel(nn.Module):
    def __init__(self, vocabulary: int = 512, width: int = 128, blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(64, width))
        self.blocks = nn.Sequential(*(_Block(width) for _ in range(blocks)))
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids) + self.position[: ids.shape[1]]))


def _example(
    program: str,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if program == "demo":
        from precompile_gen.tools import demo

        model, images, labels = demo.example()
        return model, demo.optimizer(model), images, labels
    if program == "lm":
        model = _LanguageModel()
        ids = torch.randint(0, 512, (8, 65))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, ids[:, :-1], ids[:, 1:]
    if program == "resnet18":
        from torchvision.models import resnet18

        model = resnet18()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2,))
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(use_cache=False)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (1, 65))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, tokens[:, :-1], tokens[:, 1:]


def child(program: str, system: str) -> None:
    """One measurement, printed as JSON: seconds, and precompile_gen's stages."""
    import precompile_gen as pg
    from precompile_gen.tools import timings

    stages: dict[str, float] = {}

    class Stages(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stages.update(getattr(record, "stage_seconds", {}))

    timings.log.addHandler(Stages())
    timings.log.setLevel(logging.INFO)
    example = _example(program)
    run: Callable[[], object]
    if system == "precompile_gen":

        def run() -> object:
            return pg.precompile(_step, *example)

    else:
        compiled = torch.compile(_step)

        def run() -> object:
            return compiled(*example)

    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "stages": stages}))


def _measure(program: str, system: str, cache_dir: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", program, system],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{system} on {program} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--child", nargs=2, metavar=("PROGRAM", "SYSTEM"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    programs = args.programs.split(",")
    results: dict[tuple[str, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(args.repeat):
            for program in programs:
                # Alternate which system goes first, run by run.
                systems = SYSTEMS if run % 2 == 0 else SYSTEMS[::-1]
                for system in systems:
                    folder = Path(scratch) / f"{program}-{system}-{run}"
                    for when in ("cold", "warm"):
                        measured = _measure(program, system, folder)
                        results.setdefault((program, system, when), []).append(measured)
                        print(
                            f"  {program} {system} {when}: {measured['seconds']:.1f} s",
                            file=sys.stderr,
                            flush=True,
                        )
    _report(programs, results)


def _report(
    programs: list[str], results: dict[tuple[str, str, str], list[dict]]
) -> None:
    def median(program: str, system: str, when: str) -> float:
        return statistics.median(r["seconds"] for r in results[program, system, when])

    header = f"{'seconds':<16}{'precompile_gen':>16}{'torch.compile':>15}{'ratio':>8}"
    print(f"{header}  target")
    for program in programs:
        for when in ("cold", "warm"):
            ours, theirs = (median(program, s, when) for s in SYSTEMS)
            ratio = ours / theirs
            verdict = "met" if ratio <= TARGETS[when] else "NOT met"
            print(
                f"{program + ', ' + when:<16}{ours:>16.2f}{theirs:>15.2f}{ratio:>8.2f}"
                f"  <= {TARGETS[when]} {verdict}"
            )
    print("\nprecompile_gen by stage (median seconds):")
    for program in programs:
        for when in ("cold", "warm"):
            runs = results[program, "precompile_gen", when]
            stages = {
                name: statistics.median(r["stages"].get(name, 0.0) for r in runs)
                for name in runs[0]["stages"]
            }
            shown = ", ".join(f"{name} {s:.2f}" for name, s in stages.items())
            print(f"  {program}, {when}: {shown}")


if __name__ == "__main__":
    main()
