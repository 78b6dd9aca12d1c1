"""Renderer scaling: render_artifact on huge graphs, against hashing and writing them.

    python benchmarks/render_scaling.py

Real captures produce graph modules of hundreds of MB. For synthetic graph sources of
1, 10 and 100 MB (the canned Inductor module of tests/fixtures, repeated), this
compares ``render_artifact`` with the least any consumer of the text must do with it:
sha256 the same bytes and write them to a file. Times are the best of three (the
templates are loaded before); the peak is what tracemalloc sees ``render_artifact``
allocate beyond its input, in a separate run. All rows are measured in this one run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import precompile_gen as pg

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
# The hand-built capture the tests render, from their helpers package.
sys.path.insert(0, str(TESTS_DIR))
from helpers.stubs import stub_capture  # noqa: E402

FIXTURE = TESTS_DIR / "fixtures" / "inductor_mlp_graph.txt"
SIZES_MB = (1, 10, 100)
TIME_TARGET = 3.0
MEMORY_TARGET = 3.0


def _best_of(runs: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def _graph(megabytes: int) -> str:
    chunk = FIXTURE.read_text(encoding="utf-8")
    return chunk * (megabytes * 2**20 // len(chunk) + 1)


def main() -> None:
    base = stub_capture("inductor")
    pg.render_artifact(base)
    print(
        f"{'graph MB':>8}{'hash+write s':>14}{'render s':>10}{'ratio':>7}"
        f"{'render s/MB':>13}{'peak MB':>9}{'peak/size':>11}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "artifact.py"
        for megabytes in SIZES_MB:
            graph = _graph(megabytes)
            cap = dataclasses.replace(
                base, graph=dataclasses.replace(base.graph, source=graph)
            )
            data = graph.encode("utf-8")

            def hash_and_write(data: bytes = data) -> None:
                hashlib.sha256(data).hexdigest()
                target.write_bytes(data)

            baseline = _best_of(3, hash_and_write)
            render = _best_of(3, lambda cap=cap: pg.render_artifact(cap))
            tracemalloc.start()
            try:
                pg.render_artifact(cap)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            size = len(data)
            rows.append((render / baseline, peak / size))
            print(
                f"{size / 2**20:>8.0f}{baseline:>14.3f}{render:>10.3f}"
                f"{render / baseline:>7.2f}{render / (size / 2**20):>13.4f}"
                f"{peak / 2**20:>9.0f}{peak / size:>11.2f}"
            )
    time_ratio, memory_ratio = rows[-1]
    verdicts = [
        f"time {time_ratio:.2f}x hash+write (target <= {TIME_TARGET}x)",
        f"peak memory {memory_ratio:.2f}x the graph (target <= {MEMORY_TARGET}x)",
    ]
    met = time_ratio <= TIME_TARGET and memory_ratio <= MEMORY_TARGET
    print(
        f"\nat {SIZES_MB[-1]} MB: "
        + "; ".join(verdicts)
        + (": met" if met else ": NOT met")
    )


if __name__ == "__main__":
    main()
