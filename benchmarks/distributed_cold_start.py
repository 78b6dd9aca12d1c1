"""Distributed cold start: wall time until every rank has its first result, when one
rank compiles and sends the pair (``precompile_once``) and when every rank compiles.

    python benchmarks/distributed_cold_start.py

The built-in demo training step (a small CNN with BatchNorm), inductor backend, on a
gloo process group of spawned processes on this machine. Every rank has its own empty
``TORCHINDUCTOR_CACHE_DIR``, as a rank on another machine would, and one compile worker
(``TORCHINDUCTOR_COMPILE_THREADS=1``), which keeps the process count small and makes
the CPU-seconds column exact. The clock starts when every rank has joined the group
(a barrier) and stops at each rank's first result; the group row is the slowest rank.

Rows, each a fresh group of fresh processes:

- compile once, broadcast: ``precompile_once(...)`` (the pair goes through the group);
- compile once, shared folder: the same with ``cache_dir`` (a folder on this disk);
- every rank compiles: ``load(*precompile(...))`` on every rank at once; here the ranks
  share this machine's cores, as ranks on one multi-GPU node do;
- one rank alone: the same with a single rank, i.e. every rank compiling on its own
  machine, with no rank competing for cores.

All rows are measured in this one run; the ratios compare rows of that run.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

WORLD_SIZE = 4

MODES = {
    "compile once, broadcast": ("once", WORLD_SIZE),
    "compile once, shared folder": ("once-files", WORLD_SIZE),
    "every rank compiles": ("every", WORLD_SIZE),
    "one rank alone": ("every", 1),
}


def _cpu_seconds() -> float:
    """This process's CPU time plus that of the compilers it ran and waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _rank(
    rank: int, world_size: int, port: int, mode: str, out_dir: str
) -> None:  # runs in a spawned process
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(out_dir, f"inductor-{rank}")
    import logging

    import torch
    import torch.distributed as dist

    import precompile_gen as pg
    from precompile_gen.distributed import precompile_once
    from precompile_gen.tools import demo

    # load() warns before executing unsigned code; the benchmark made the code.
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )
    model, images, labels = demo.example()
    dist.barrier()
    start, cpu_start = time.time(), _cpu_seconds()
    payload_bytes = 0
    if mode == "every":
        python_code, cache = pg.precompile(demo.backward_step, model, images, labels)
        payload_bytes = len(python_code.encode("utf-8")) + len(cache)
        forward = pg.load(python_code, cache)
    else:
        forward = precompile_once(
            demo.backward_step,
            model,
            images,
            labels,
            src=0,
            cache_dir=os.path.join(out_dir, "shared") if mode == "once-files" else None,
        )
    forward(model, images, labels)
    result = {
        "start": start,
        "first_result": time.time(),
        "cpu_seconds": _cpu_seconds() - cpu_start,
        "payload_bytes": payload_bytes,
    }
    if mode == "every" and world_size > 1:
        # What precompile_once's broadcast of a pair this size costs on its own.
        size = torch.tensor([payload_bytes], dtype=torch.int64)
        dist.broadcast(size, src=0)
        payload = torch.zeros(int(size.item()), dtype=torch.uint8)
        dist.barrier()
        broadcast_start = time.perf_counter()
        dist.broadcast(payload, src=0)
        dist.barrier()
        result["broadcast_seconds"] = time.perf_counter() - broadcast_start
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _measure(mode: str, world_size: int, out_dir: Path) -> list[dict[str, float]]:
    import torch.multiprocessing as mp

    out_dir.mkdir()
    mp.start_processes(
        _rank,
        args=(world_size, _free_port(), mode, str(out_dir)),
        nprocs=world_size,
        start_method="spawn",
    )
    return [
        json.loads((out_dir / f"rank{rank}.json").read_text())
        for rank in range(world_size)
    ]


def main() -> None:
    # Read when torch's inductor config is imported, which a spawned process does
    # before running _rank; so set here, for the children to inherit.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    rows: dict[str, list[dict[str, float]]] = {}
    # The machine's 1-minute load average after each row: processes outside this
    # benchmark slow every row, and this says by how much they competed.
    load: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, (mode, world_size)) in enumerate(MODES.items()):
            print(f"measuring: {label} ({world_size} rank(s)) ...", file=sys.stderr)
            rows[label] = _measure(mode, world_size, Path(scratch, f"run{index}"))
            load[label] = os.getloadavg()[0]
    ranks = " ".join(f"{f'rank {rank}':>8}" for rank in range(WORLD_SIZE))
    print(
        f"{'seconds to first result':<28}{'all ranks':>10} {ranks}{'CPU s':>8}"
        f"{'load':>6}"
    )
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for label, results in rows.items():
        start = min(result["start"] for result in results)
        wall[label] = max(result["first_result"] for result in results) - start
        cpu[label] = sum(result["cpu_seconds"] for result in results)
        per_rank = " ".join(
            f"{result['first_result'] - result['start']:>8.2f}" for result in results
        )
        per_rank += " " * 9 * (WORLD_SIZE - len(results))
        print(
            f"{label:<28}{wall[label]:>10.2f} {per_rank}{cpu[label]:>8.1f}"
            f"{load[label]:>6.1f}"
        )
    every = rows["every rank compiles"]
    once, alone = "compile once, broadcast", "one rank alone"
    print()
    print(
        f"pair sent: {every[0]['payload_bytes']:,.0f} bytes (python_code + cache); "
        f"its gloo broadcast to {WORLD_SIZE - 1} ranks alone: "
        f"{1000 * every[0]['broadcast_seconds']:.1f} ms"
    )
    print(
        f"every rank compiles / compile once: wall "
        f"{wall['every rank compiles'] / wall[once]:.2f}x, CPU "
        f"{cpu['every rank compiles'] / cpu[once]:.2f}x; one rank alone / compile "
        f"once: wall {wall[alone] / wall[once]:.2f}x ({os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main()
