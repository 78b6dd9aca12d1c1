"""A gloo group of spawned CPU ranks on localhost, each running one scenario.

Spawning costs an import of torch per rank (seconds on a small machine), so a test
starts one group and runs its whole scenario in it. Each rank writes what its
scenario returned to ``rank{N}.json``; ``run_ranks`` reads those files.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

# A hang shows up as the group's timeout (an error on the waiting rank) well before
# the test's own deadline (the spawned processes are killed and the test fails).
GROUP_TIMEOUT_S = 60


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    scenario: Callable[..., dict[str, Any]],
    *args: object,
) -> None:
    """The spawned process: join the group, run ``scenario``, write its result."""
    # A rank that dies in native code (an abort, a segfault) prints every thread's
    # Python stack first, so the test's captured output says where it was.
    faulthandler.enable(all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Each rank its own kernel cache folder, as on separate machines.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(out_dir, f"inductor-{rank}")
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        result = scenario(rank, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Gloo's threads now and then abort the process while the interpreter finalizes
    # ("terminate called without an active exception"), after the group is destroyed
    # and the result written; ending here, without finalizing, keeps that teardown
    # from failing a scenario that finished. An abort before this line still fails.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(
    world_size: int,
    out_dir: Path,
    scenario: Callable[..., dict[str, Any]],
    *args: object,
    deadline_s: float = 150,
) -> list[dict[str, Any] | None]:
    """Run ``scenario`` on ``world_size`` spawned ranks; each rank's result, or None
    for a rank that wrote none. Fails the test if a rank is still running after
    ``deadline_s``, or if one raised."""
    context = mp.start_processes(
        _rank_main,
        args=(world_size, _free_port(), str(out_dir), scenario, *args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    assert context is not None  # join=False returns the running processes
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() >= deadline:
                pytest.fail(f"a rank was still running after {deadline_s} s: it hangs")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    results: list[dict[str, Any] | None] = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results
