"""One FSDP2 training step on 2 ranks, three ways: time and peak memory per rank.

    python benchmarks/fully_shard_step.py

Two spawned processes join a gloo group on this machine. Each shards the same model,
16 ``Linear(1024, 1024)`` layers with ReLUs (64 MiB of parameters, 128 MiB more of
AdamW state before sharding), with ``fully_shard`` per layer and at the root, and
trains on its own batch with AdamW inside the step (zero_grad, loss, backward,
step), which runs as

- **FSDP2 eager**: the step as written, FSDP2's hooks gathering and reducing;
- **torch.compile**: ``torch.compile(step)`` of the same step, warmed up first;
- **precompile_gen**: the inductor artifact of the step (each rank captures its
  own), the all-gathers and reduce-scatters functional collectives in its graph.

Time: in one launch of both ranks, the systems run in the same interleaved rounds (a
collective waits for both ranks), each round starting with another system and timing
a few steps of each; a system's time per step is the median over the rounds on
rank 0. Each system trains its own copy of the model.

Peak memory: each system then runs in a launch of its own (the artifact loaded from
the pair its rank wrote), with ``MALLOC_MMAP_THRESHOLD_`` fixed so that the allocator
hands a freed tensor's pages back at once. After the warm-up steps, each rank reads
its resident set in the steady state (its shards of the model and the optimizer
state, and the gradient shards the step leaves), resets the kernel's high-water mark
through ``/proc/self/clear_refs``, runs one step, and reports the high-water mark
above that steady state: what the step allocates at its busiest, on that rank.

All numbers are measured in this one run, at one thread per rank.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import precompile_gen as pg

WORLD_SIZE = 2
LAYERS, WIDTH, BATCH = 16, 1024, 32
ROUNDS, STEPS_PER_ROUND, WARMUP = 10, 2, 3
SYSTEMS = ("FSDP2 eager", "torch.compile", "precompile_gen")
MMAP_THRESHOLD = 1 << 16

Step = Callable[..., torch.Tensor]


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _sharded_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers)
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return (
        torch.randn(BATCH, WIDTH, generator=generator),
        torch.randn(BATCH, WIDTH, generator=generator),
    )


def _pair_path(out_dir: str, rank: int) -> Path:
    return Path(out_dir, f"step-rank{rank}")


def _run(system: str, out_dir: str, rank: int) -> Step:
    if system == "FSDP2 eager":
        return train_step
    if system == "torch.compile":
        return torch.compile(train_step)
    pair = _pair_path(out_dir, rank)
    loaded = pg.load(
        pair.with_suffix(".py").read_text(), pair.with_suffix(".cache").read_bytes()
    )
    return cast(Step, loaded)


def _stepper(system: str, out_dir: str, rank: int) -> Callable[[], object]:
    model, opt = _sharded_model()
    x, y = _batch(rank)
    run = _run(system, out_dir, rank)

    def one_step() -> object:
        return run(model, opt, x, y)

    for _ in range(WARMUP):  # torch.compile compiles here; AdamW creates its state
        one_step()
    return one_step


def _capture(out_dir: str, rank: int) -> None:
    model, opt = _sharded_model()
    code, cache = pg.precompile(train_step, model, opt, *_batch(rank))
    pair = _pair_path(out_dir, rank)
    pair.with_suffix(".py").write_text(code)
    pair.with_suffix(".cache").write_bytes(cache)


def _times(out_dir: str, rank: int) -> dict[str, float]:
    _capture(out_dir, rank)
    steppers = {system: _stepper(system, out_dir, rank) for system in SYSTEMS}
    samples: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    for index in range(ROUNDS):
        # The same order on both ranks, starting with another system each round.
        for system in SYSTEMS[index % 3 :] + SYSTEMS[: index % 3]:
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                steppers[system]()
            samples[system].append((time.perf_counter() - start) / STEPS_PER_ROUND)
    return {system: statistics.median(times) for system, times in samples.items()}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak(system: str, out_dir: str, rank: int) -> int:
    one_step = _stepper(system, out_dir, rank)
    dist.barrier()
    steady = _status("VmRSS")
    # 5 resets the high-water mark to the current resident set.
    Path("/proc/self/clear_refs").write_text("5")
    one_step()
    return _status("VmHWM") - steady


def _rank(rank: int, port: int, out_dir: str, job: str) -> None:  # spawned
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(out_dir, f"inductor-{rank}")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=900),
    )
    try:
        result: object = (
            _times(out_dir, rank) if job == "time" else _peak(job, out_dir, rank)
        )
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{job}-rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(out_dir: str, job: str) -> list[object]:
    mp.start_processes(
        _rank,
        args=(_free_port(), out_dir, job),
        nprocs=WORLD_SIZE,
        start_method="spawn",
    )
    return [
        json.loads(Path(out_dir, f"{job}-rank{rank}.json").read_text())
        for rank in range(WORLD_SIZE)
    ]


def main() -> None:
    # Spawned ranks inherit it: set before any of them starts.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    with tempfile.TemporaryDirectory() as out_dir:
        times: Any = _launch(out_dir, "time")[0]
        peaks: dict[str, Any] = {s: _launch(out_dir, s) for s in SYSTEMS}
    print(
        f"FSDP2 step, {LAYERS} x Linear({WIDTH}, {WIDTH}) "
        f"({LAYERS * (WIDTH + 1) * WIDTH * 4 / 2**20:.0f} MiB of parameters), "
        f"batch {BATCH}, {WORLD_SIZE} gloo ranks, 1 thread each"
    )
    print(
        f"{'system':<16}{'ms / step':>10}{'vs compile':>12}"
        + "".join(f"{f'rank {r} peak MiB':>18}" for r in range(WORLD_SIZE))
        + f"{'vs FSDP2 eager':>16}"
    )
    for system in SYSTEMS:
        worst = max(
            peaks[system][r] / max(peaks["FSDP2 eager"][r], 1)
            for r in range(WORLD_SIZE)
        )
        print(
            f"{system:<16}{times[system] * 1e3:>10.1f}"
            f"{times[system] / times['torch.compile']:>12.2f}"
            + "".join(f"{peaks[system][r] / 2**20:>18.1f}" for r in range(WORLD_SIZE))
            + f"{worst:>16.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
