"""Whole training steps at the sizes people train: time and peak memory.

    python benchmarks/real_size_step.py            # resnet18 and GPT-2 small
    python benchmarks/real_size_step.py --quick    # small configs, to try the script
    python benchmarks/real_size_step.py --profile  # where the time goes, by op

Two models with random weights (no download), each trained with AdamW inside the
step, as a user writes it:

- torchvision's resnet18, a batch of 8 images of 3x224x224, 1000 classes;
- GPT-2 small (124 M parameters, transformers' ``GPT2Config()`` with its dropout),
  a batch of 4 sequences of 128 tokens, next-token loss.

Each step runs as

- **eager**: the function as written;
- **torch.compile**: ``torch.compile(step)`` (the forward and backward as one
  AOTAutograd graph, the optimizer's update as another);
- **compiled autograd**: the same, with ``torch._dynamo.config.compiled_autograd``,
  which traces the backward at run time;
- **precompile_gen**: the inductor artifact of the step, loaded with its cache: one
  compiled graph for the whole step, no guards.

Time: each system trains its own copy of the model from the same weights on the
same batch, after warm-up steps (torch.compile compiles there); the systems' steps
are interleaved in rounds, each round starting with another system, and each time
is the median over the rounds, so that load from other processes, which slows
neighbouring steps alike, largely cancels.

Peak memory: each system runs in a fresh process of its own (the artifact loaded
from the pair this run wrote), with ``MALLOC_MMAP_THRESHOLD_`` fixed so that the
allocator hands a freed tensor's pages back at once. After the warm-up steps, the
resident set of the steady state (model, optimizer state, and the gradients the
step leaves) is read, the kernel's high-water mark is reset through
``/proc/self/clear_refs``, one step runs, and the peak is the high-water mark above
that steady state: what the step itself allocates at its busiest.

The ``leaves no gradient`` rows are GPT-2's step with ``zero_grad(set_to_none=True)``
after ``optimizer.step()``: the same update, but no gradient outlives the step, so
a system that runs each parameter's update as soon as its gradient is final never
holds all the gradients at once. With a batch of 4 sequences the activations the
backward starts with outweigh that; with one sequence the gradients decide the peak.

All numbers are ratios to torch.compile measured in this one run, at torch's default
thread count.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import precompile_gen as pg

SYSTEMS = ("eager", "torch.compile", "compiled autograd", "precompile_gen")
WARMUP = 3
# Bytes: allocations above this are mmapped, and unmapped when freed.
MMAP_THRESHOLD = 1 << 16
TARGET_TIME = 0.9
TARGET_MEMORY = 1.0

Step = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], object]


def classify_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def language_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    logits = model(x).logits
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    return loss.detach()


def language_step_leaving_no_gradient(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    logits = model(x).logits
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _resnet18(quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from torchvision.models import resnet18

    size, classes = (64, 10) if quick else (224, 1000)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(8, 3, size, size, generator=generator)
    return (
        resnet18(num_classes=classes),
        images,
        torch.randint(0, classes, (8,), generator=generator),
    )


def _gpt2(quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    # Without a cache the output holds no DynamicCache, which an artifact cannot
    # return; the computation is the same.
    config = GPT2Config(use_cache=False)
    if quick:
        config = GPT2Config(
            use_cache=False,
            n_layer=2,
            n_embd=64,
            n_head=2,
            vocab_size=1000,
            # The defaults name token 50256 of GPT-2's real vocabulary.
            bos_token_id=0,
            eos_token_id=0,
        )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=generator)
    return GPT2LMHeadModel(config), tokens[:, :-1], tokens[:, 1:]


def _gpt2_one_sequence(quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model, x, y = _gpt2(quick)
    return model, x[:1].clone(), y[:1].clone()


@dataclass(frozen=True)
class Case:
    label: str
    build: Callable[[bool], tuple[nn.Module, torch.Tensor, torch.Tensor]]
    step: Step


CASES = [
    Case("resnet18", _resnet18, classify_step),
    Case("GPT-2 small", _gpt2, language_step),
    Case("GPT-2, leaves no gradient", _gpt2, language_step_leaving_no_gradient),
    Case(
        "GPT-2, 1 seq., no gradient",
        _gpt2_one_sequence,
        language_step_leaving_no_gradient,
    ),
]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _model(case: Case, quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return case.build(quick)


def _run(system: str, case: Case, artifact: Path) -> Step:
    if system == "eager":
        return case.step
    if system == "precompile_gen":
        return pg.load(
            artifact.with_suffix(".py").read_text(),
            artifact.with_suffix(".cache").read_bytes(),
        )
    compiled = torch.compile(case.step)
    if system == "torch.compile":
        return compiled

    def with_compiled_autograd(
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> object:
        with torch._dynamo.config.patch(compiled_autograd=True):
            return compiled(model, optimizer, x, y)

    return with_compiled_autograd


def _stepper(
    system: str, case: Case, quick: bool, artifact: Path
) -> Callable[[], object]:
    model, x, y = _model(case, quick)
    model.train()
    optimizer = _optimizer(model)
    run = _run(system, case, artifact)

    def one_step() -> object:
        return run(model, optimizer, x, y)

    for _ in range(WARMUP):
        one_step()
    return one_step


def _write_artifact(case: Case, quick: bool, artifact: Path) -> None:
    model, x, y = _model(case, quick)
    code, cache = pg.precompile(case.step, model, _optimizer(model), x, y)
    artifact.with_suffix(".py").write_text(code)
    artifact.with_suffix(".cache").write_bytes(cache)


def _median_times(
    steppers: dict[str, Callable[[], object]], rounds: int
) -> dict[str, float]:
    samples: dict[str, list[float]] = {system: [] for system in steppers}
    order = list(steppers)
    gc.disable()
    try:
        for index in range(rounds):
            for system in order[index % len(order) :] + order[: index % len(order)]:
                start = time.perf_counter()
                steppers[system]()
                samples[system].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return {system: statistics.median(times) for system, times in samples.items()}


# Peak memory, in a process of its own.


def _status(field: str) -> int:
    """A ``/proc/self/status`` field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_above_steady(system: str, case: Case, quick: bool, artifact: Path) -> int:
    one_step = _stepper(system, case, quick, artifact)
    gc.collect()
    steady = _status("VmRSS")
    # 5 resets the high-water mark to the current resident set.
    Path("/proc/self/clear_refs").write_text("5")
    one_step()
    return _status("VmHWM") - steady


def _measure_peak(system: str, case: Case, quick: bool, artifact: Path) -> int:
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    command = [sys.executable, __file__, "--peak", system, case.label, str(artifact)]
    if quick:
        command.append("--quick")
    done = subprocess.run(
        command, env=environment, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{system} on {case.label} failed:\n{done.stderr}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak"])


def _report(label: str, times: dict[str, float], peaks: dict[str, int]) -> bool:
    base_time, base_peak = times["torch.compile"], peaks["torch.compile"]
    cells = [
        f"{times[s] * 1e3:8.0f} ms {times[s] / base_time:4.2f}x"
        f" {peaks[s] / 2**20:6.0f} MiB {peaks[s] / max(base_peak, 1):4.2f}x"
        for s in SYSTEMS
    ]
    print(f"{label:<27}" + " | ".join(cells), flush=True)
    ours = "precompile_gen"
    return (
        times[ours] / base_time <= TARGET_TIME
        and peaks[ours] / max(base_peak, 1) <= TARGET_MEMORY
    )


# Where the time goes: each op's self time, by what it is.

PROFILE_SYSTEMS = ("torch.compile", "precompile_gen")
CATEGORIES = (
    "convolutions, matmuls (ATen)",
    "fused kernels (Inductor)",
    "random draws (ATen)",
    "copies (ATen)",
    "other ops",
    "outside any op",
)


def _category(key: str) -> str:
    """The category of a profiler event's name; the kernel names are Inductor's
    (``cpp_fused_...``, prefixed with ``graph_N_`` in torch.compile's graphs)."""
    if "cpp_fused" in key:
        return CATEGORIES[1]
    if key.startswith("aten::") and any(
        name in key for name in ("mm", "convolution", "linear", "matmul")
    ):
        return CATEGORIES[0]
    if key in ("aten::bernoulli_", "aten::uniform_", "aten::normal_"):
        return CATEGORIES[2]
    if key == "aten::copy_":
        return CATEGORIES[3]
    return CATEGORIES[4]


Breakdown = dict[str, dict[str, float]]


def profile_step(case: Case, quick: bool, artifact: Path, steps: int = 3) -> Breakdown:
    """Milliseconds per step in each category, torch.compile's and the artifact's,
    with Inductor's kernels recording themselves (an artifact captured so)."""
    breakdown: Breakdown = {}
    for system in PROFILE_SYSTEMS:
        one_step = _stepper(system, case, quick, artifact)
        activities = [torch.profiler.ProfilerActivity.CPU]
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(steps):
                one_step()
        wall = (time.perf_counter() - start) / steps * 1e3
        times = dict.fromkeys(CATEGORIES, 0.0)
        for event in profile.key_averages():
            times[_category(event.key)] += event.self_cpu_time_total / steps / 1e3
        times[CATEGORIES[-1]] = wall - sum(times.values())
        breakdown[system] = times
    return breakdown


def _print_profile(label: str, breakdown: Breakdown) -> None:
    print(f"\n{label}: ms per step, by op (self time)")
    print(f"{'':<30}" + "".join(f"{system:>16}" for system in PROFILE_SYSTEMS))
    for category in CATEGORIES:
        print(
            f"{category:<30}"
            + "".join(f"{breakdown[s][category]:16.0f}" for s in PROFILE_SYSTEMS)
        )
    totals = [sum(breakdown[s].values()) for s in PROFILE_SYSTEMS]
    print(f"{'step (profiled)':<30}" + "".join(f"{t:16.0f}" for t in totals))


def profile_cases(quick: bool, folder: Path) -> None:
    from torch._inductor import config as inductor_config

    # Kernels that record themselves, in both systems' compiles.
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        for index, case in enumerate(CASES[:2]):
            artifact = folder / f"profiled{index}"
            _write_artifact(case, quick, artifact)
            _print_profile(case.label, profile_step(case, quick, artifact))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small configs")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--peak", nargs=3, metavar=("SYSTEM", "CASE", "ARTIFACT"))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="where each step's time goes, by op, for torch.compile and the artifact",
    )
    args = parser.parse_args()
    # load() warns before executing unsigned code; this script made the code itself.
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    cases = {case.label: case for case in CASES}
    if args.peak:
        system, label, artifact = args.peak
        peak = peak_above_steady(system, cases[label], args.quick, Path(artifact))
        print(json.dumps({"peak": peak}))
        return
    if args.profile:
        with tempfile.TemporaryDirectory() as folder:
            profile_cases(args.quick, Path(folder))
        return
    print(
        f"{'step':<27}"
        + " | ".join(f"{s + ': time, peak above steady':<34}" for s in SYSTEMS)
    )
    verdicts = []
    with tempfile.TemporaryDirectory() as folder:
        for index, case in enumerate(CASES):
            artifact = Path(folder) / f"step{index}"
            _write_artifact(case, args.quick, artifact)
            steppers = {
                system: _stepper(system, case, args.quick, artifact)
                for system in SYSTEMS
            }
            times = _median_times(steppers, args.rounds)
            del steppers
            gc.collect()
            peaks = {
                system: _measure_peak(system, case, args.quick, artifact)
                for system in SYSTEMS
            }
            verdicts.append(_report(case.label, times, peaks))
    print(
        f"\ntargets: precompile_gen / torch.compile <= {TARGET_TIME} in time and "
        f"<= {TARGET_MEMORY} in peak memory: " + ("met" if all(verdicts) else "NOT met")
    )


if __name__ == "__main__":
    main()
