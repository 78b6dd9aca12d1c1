"""Concurrency and process state.

A loaded ``forward`` keeps no state between calls, so threads may share it, each
with its own model; ``precompile`` may run on several threads at once (inductor
lowerings take turns on a lock, as torch's compiler requires); and ``load`` leaves
the process as it found it, apart from the kernel binaries it primes.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.concurrency_jobs import JOBS, Job
from helpers.processes import env_with_helpers
from torch import nn

import precompile_gen as pg

THREADS = 8
STEPS_PER_THREAD = 3


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[str, bytes]]:
    start = threading.Barrier(len(JOBS))

    def run(job: Job, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
        start.wait()
        return pg.precompile(job.fn, model, *batch, backend=job.backend, key=job.key)

    # Examples are built first: initialising a model draws from torch's
    # process-wide generator.
    examples = {name: job.example() for name, job in JOBS.items()}
    with ThreadPoolExecutor(max_workers=len(JOBS)) as pool:
        futures = {
            name: pool.submit(run, job, *examples[name]) for name, job in JOBS.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _forward(name: str, pairs: dict[str, tuple[str, bytes]]) -> Callable[..., Any]:
    return pg.load(*pairs[name], key=JOBS[name].key)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def test_concurrent_precompiles_give_correct_artifacts(
    pairs: dict[str, tuple[str, bytes]],
) -> None:
    for name, job in JOBS.items():
        forward = _forward(name, pairs)
        model, batch = job.example(seed=3)
        reference = copy.deepcopy(model)
        torch.testing.assert_close(
            forward(model, *batch), job.fn(reference, *batch), msg=name
        )
        torch.testing.assert_close(_grads(model), _grads(reference), msg=name)
        torch.testing.assert_close(
            dict(model.named_buffers()), dict(reference.named_buffers()), msg=name
        )


def test_concurrent_eager_precompiles_render_the_sequential_bytes(
    pairs: dict[str, tuple[str, bytes]],
) -> None:
    for name, job in JOBS.items():
        if job.backend == "eager":
            model, batch = job.example()
            code, cache = pg.precompile(
                job.fn, model, *batch, backend="eager", key=job.key
            )
            assert pairs[name] == (code, cache), name


def _run_steps(
    forward: Callable[..., Any], job: Job, seed: int, model: nn.Module
) -> list[Any]:
    """Several calls on ``model``; what each returned, and the grads and buffers
    after it (gradients accumulate across calls)."""
    record = []
    for step in range(STEPS_PER_THREAD):
        result = forward(model, *job.batch(seed * STEPS_PER_THREAD + step))
        record.append(
            (
                result,
                {k: None if g is None else g.clone() for k, g in _grads(model).items()},
                {k: b.clone() for k, b in model.named_buffers()},
            )
        )
    return record


@pytest.mark.parametrize("name", ["eager train", "inductor train", "inductor predict"])
def test_threads_share_one_loaded_forward(
    pairs: dict[str, tuple[str, bytes]], name: str
) -> None:
    job = JOBS[name]
    forward = _forward(name, pairs)
    # Built here: initialising a model draws from torch's process-wide generator.
    model = job.make_model(0)
    start = threading.Barrier(THREADS)

    def in_thread(seed: int, model: nn.Module) -> list[Any]:
        start.wait()
        return _run_steps(forward, job, seed, model)

    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        copies = [copy.deepcopy(model) for _ in range(THREADS)]
        concurrent = list(pool.map(in_thread, range(THREADS), copies))
    sequential = [
        _run_steps(forward, job, seed, copy.deepcopy(model)) for seed in range(THREADS)
    ]

    torch.testing.assert_close(concurrent, sequential)
    # And the sequential runs are eager's.
    eager = _run_steps(job.fn, job, 0, copy.deepcopy(model))
    torch.testing.assert_close(sequential[0], eager)


# --- load leaves the process as it found it -----------------------------------------

CHILD = Path(__file__).with_name("process_state_child.py")


def test_load_leaves_torch_and_logging_state_unchanged(
    pairs: dict[str, tuple[str, bytes]], tmp_path: Path
) -> None:
    # A fresh process, so the imports load triggers (inductor's, on the first
    # inductor artifact) count too.
    names = ["eager train", "inductor train", "inductor predict"]
    for i, name in enumerate(names):
        (tmp_path / f"{i}.py").write_text(pairs[name][0], encoding="utf-8")
        (tmp_path / f"{i}.cache").write_bytes(pairs[name][1])
    env = env_with_helpers(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    child = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report == {"load": {}, "rng consumed by load": False, "calls": {}}
