"""One data-parallel training step on 2 ranks, three ways.

    python benchmarks/data_parallel_step.py

Two spawned processes join a gloo group on this machine; each wraps the same model
in ``DistributedDataParallel`` and trains on its own batch with the demo's AdamW and
step (``demo.train_step``: zero_grad, loss, backward, step), which runs as

- **DDP eager**: the step as written, DDP's reducer averaging the gradients;
- **torch.compile**: ``torch.compile(step)`` of the same step on the DDP model
  (Dynamo splits the graph at DDP's buckets), warmed up first;
- **precompile_gen**: the inductor artifact of the step, the gradients averaged by
  the functional collectives in its graph, loaded with its cache.

Each system trains its own copy of the model. The ranks run the systems in the same
interleaved rounds (a collective waits for both), each round timing a few steps of
each system, and each system's time per step is the median over the rounds on rank 0.
All rows are measured in this one run, at one thread per rank.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import logging
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# The script's folder is on sys.path when it runs, as for every benchmark here.
from train_step import MODELS

import precompile_gen as pg
from precompile_gen.tools import demo

WORLD_SIZE = 2
ROUNDS = 20
SYSTEMS = ("DDP eager", "torch.compile", "precompile_gen")


def _steppers(
    make: Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]], rank: int
) -> dict[str, Callable[[], object]]:
    model, inputs, labels = make()
    # Each rank its own batch: shifted, so that the gradients differ per rank.
    inputs = inputs + rank
    step = demo.train_step
    reference = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=False)
    code, cache = pg.precompile(
        step, reference, demo.optimizer(reference), inputs, labels
    )
    runs: dict[str, Callable[..., object]] = {
        "DDP eager": step,
        "torch.compile": torch.compile(step),
        "precompile_gen": pg.load(code, cache),
    }
    steppers: dict[str, Callable[[], object]] = {}
    for system in SYSTEMS:
        own = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=False)
        one_step = functools.partial(
            runs[system], own, demo.optimizer(own), inputs, labels
        )
        for _ in range(3):  # torch.compile compiles here; optimizers create state
            one_step()
        steppers[system] = one_step
    return steppers


def _seconds_per_step(run: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat


def _rank(rank: int, port: int, out_dir: str) -> None:  # runs in a spawned process
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(out_dir, f"inductor-{rank}")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        rows = {}
        # The rows with the demo's AdamW, whose step the data-parallel runs take.
        adamw = [(label, make) for label, make, opt in MODELS if opt is demo.optimizer]
        for label, make in adamw:
            steppers = _steppers(make, rank)
            samples: dict[str, list[float]] = {system: [] for system in SYSTEMS}
            for round_index in range(ROUNDS):
                # The same order on every rank, starting with another system each
                # round, so that none always runs first.
                order = SYSTEMS[round_index % 3 :] + SYSTEMS[: round_index % 3]
                for system in order:
                    samples[system].append(_seconds_per_step(steppers[system], 3))
            rows[label] = {s: statistics.median(v) for s, v in samples.items()}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank,
            args=(_free_port(), out_dir),
            nprocs=WORLD_SIZE,
            start_method="spawn",
        )
        rows = json.loads(Path(out_dir, "rank0.json").read_text())
    print(
        f"{'model':<16}{'DDP eager ms':>14}{'torch.compile ms':>18}"
        f"{'precompile_gen ms':>19}{'vs compile':>12}{'vs eager':>10}"
    )
    for label, times in rows.items():
        ours = times["precompile_gen"]
        print(
            f"{label:<16}{times['DDP eager'] * 1e3:>14.2f}"
            f"{times['torch.compile'] * 1e3:>18.2f}{ours * 1e3:>19.2f}"
            f"{ours / times['torch.compile']:>12.2f}{ours / times['DDP eager']:>10.2f}"
        )


if __name__ == "__main__":
    main()
