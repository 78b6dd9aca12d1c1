"""precompile_once on real process groups: gloo on localhost, one spawned process per
rank (``run_ranks``). Each rank writes what it saw to ``rank{N}.json``; the test
reads those files.

Spawning costs an import of torch per rank (seconds on a small machine), so each test
starts one group and runs its whole scenario in it.
"""

from __future__ import annotations

import copy
import io
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_ranks
from torch import nn

import precompile_gen as pg
import precompile_gen.api as pg_api
from precompile_gen.distributed import precompile_once

# Time a failure on the source rank may take to reach every rank; far below the
# group's timeout (GROUP_TIMEOUT_S of helpers.distributed), so an error that arrived
# only by timing out fails the test.
ERROR_ARRIVES_WITHIN_S = 20

# How many captures this process made: precompile_once captures once, on the source
# rank only. (Counted around the capture: a counter inside the traced step would be
# a Python effect, which capture refuses.)
_traces = 0

# Read by step_reading_a_global: capture rejects it as a would-be constant.
_GLOBAL_SCALE = torch.ones(2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch(rank: int) -> torch.Tensor:
    # Each rank its own batch: the artifact must not be tied to the source's inputs.
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def counted_train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return train_step(model, x)


def _counting_captures() -> None:
    """Count this process's traces of counted_train_step in ``_traces``: called once,
    first thing, by each scenario that reports the count."""
    traced = pg_api.trace

    def counting(*args: Any, **kwargs: Any) -> Any:
        global _traces
        if args and args[0] is counted_train_step:
            _traces += 1
        return traced(*args, **kwargs)

    pg_api.trace = counting


def step_reading_a_global(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = (model(x) * _GLOBAL_SCALE).square().mean()
    loss.backward()
    return loss.detach()


def step_that_kills_its_process(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    os._exit(0)


def _check_against_eager(forward: Callable[..., object], rank: int) -> None:
    model, x = _model(), _batch(rank)
    reference = copy.deepcopy(model)
    loss = forward(model, x)
    expected = train_step(reference, x)
    assert isinstance(loss, torch.Tensor)
    torch.testing.assert_close(loss, expected)
    for (name, got), (_, want) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert got.grad is not None and want.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, msg=f"grad of {name}")


def _attempt(call: Callable[[], object]) -> dict[str, Any]:
    """Run ``call``; the PrecompileError it raised and how long that took, if any."""
    start = time.monotonic()
    try:
        call()
    except pg.PrecompileError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


# Scenarios: each runs on every rank of an initialised group and returns what the
# test checks, as JSON-able data.


def optimizer_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def each_rank_steps_its_own_optimizer(
    rank: int, src: int, backend: str, cache_dir: str | None
) -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    forward = precompile_once(
        optimizer_train_step,
        model,
        optimizer,
        _batch(rank),
        src=src,
        backend=backend,
        cache_dir=cache_dir,
    )
    for step in range(2):
        x = _batch(10 * rank + step)
        torch.testing.assert_close(
            forward(model, optimizer, x),
            optimizer_train_step(reference, reference_optimizer, x),
        )
    for (name, got), want in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, msg=name)
        state, expected = optimizer.state[got], reference_optimizer.state[want]
        assert list(state) == list(expected), name
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], msg=f"{name} {key}")
    first = next(iter(model.parameters()))
    return {"steps": float(optimizer.state[first]["step"])}


def loads_and_matches_eager(
    rank: int, src: int, backend: str, cache_dir: str | None
) -> dict[str, Any]:
    _counting_captures()
    forward = precompile_once(
        counted_train_step,
        _model(),
        _batch(rank),
        src=src,
        backend=backend,
        cache_dir=cache_dir,
    )
    traces = _traces
    _check_against_eager(forward, rank)
    return {"traces": traces}


def failures_reach_every_rank(rank: int, shared_dir: str) -> dict[str, Any]:
    model, x = _model(), _batch(rank)
    results = {
        "capture error, broadcast": _attempt(
            lambda: precompile_once(
                step_reading_a_global, model, x, src=1, backend="eager"
            )
        ),
        "capture error, cache_dir": _attempt(
            lambda: precompile_once(
                step_reading_a_global,
                model,
                x,
                src=1,
                backend="eager",
                cache_dir=shared_dir,
            )
        ),
        # Rank 0 looks in a folder of its own, as on a machine that does not share
        # the source's folder: its load fails, and every rank must hear of it.
        "load error on rank 0": _attempt(
            lambda: precompile_once(
                counted_train_step,
                model,
                x,
                src=1,
                backend="eager",
                cache_dir=shared_dir if rank == 1 else f"{shared_dir}-not-shared",
            )
        ),
        # Rank 0 holds another key than the one the source signed with: its load
        # refuses the pair, and every rank hears of it.
        "signature refused on rank 0": _attempt(
            lambda: precompile_once(
                counted_train_step,
                model,
                x,
                src=1,
                backend="eager",
                key=b"source key" if rank == 1 else b"another key",
            )
        ),
    }
    # After the failures the ranks are still in step: the next call, signed and
    # checked with one key everywhere, works.
    forward = precompile_once(
        counted_train_step, model, x, src=1, backend="eager", key=b"source key"
    )
    _check_against_eager(forward, rank)
    return results


def inductor_in_both_modes(rank: int, shared_dir: str) -> dict[str, Any]:
    """Broadcast, then shared folder; on a rank other than the source, list the
    kernel binaries its own inductor cache folder ends up with."""
    _counting_captures()
    for cache_dir in (None, shared_dir):
        forward = precompile_once(
            counted_train_step,
            _model(),
            _batch(rank),
            src=0,
            backend="inductor",
            cache_dir=cache_dir,
        )
        _check_against_eager(forward, rank)
    inductor_dir = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return {
        "traces": _traces,
        "binaries": sorted(
            path.relative_to(inductor_dir).as_posix()
            for path in inductor_dir.rglob("*.so")
        ),
        "built_headers": (inductor_dir / "precompiled_headers").exists(),
    }


def source_dies(rank: int) -> dict[str, Any]:
    return _attempt(
        lambda: precompile_once(
            step_that_kills_its_process, _model(), _batch(rank), src=1, backend="eager"
        )
    )


@pytest.mark.parametrize(("world_size", "src"), [(2, 0), (4, 2)])
def test_every_rank_matches_eager_and_only_src_traced(
    world_size: int, src: int, tmp_path: Path
) -> None:
    results = run_ranks(
        world_size, tmp_path, loads_and_matches_eager, src, "eager", None
    )
    traces = [result["traces"] if result else None for result in results]
    assert traces == [1 if rank == src else 0 for rank in range(world_size)]


def test_each_rank_steps_its_own_optimizer(tmp_path: Path) -> None:
    results = run_ranks(
        2, tmp_path, each_rank_steps_its_own_optimizer, 0, "eager", None
    )
    assert [result["steps"] if result else None for result in results] == [2.0, 2.0]


def test_shared_folder_mode_writes_one_pair_and_every_rank_loads_it(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    results = run_ranks(2, tmp_path, loads_and_matches_eager, 1, "eager", str(shared))
    assert [result["traces"] if result else None for result in results] == [0, 1]
    # One pair, named after the function, and no temporary file left behind.
    files = {path.suffix: path for path in shared.iterdir()}
    assert sorted(files) == [".cache", ".py"], list(shared.iterdir())
    artifact, cache = files[".py"], files[".cache"]
    assert artifact.name.startswith("counted_train_step.")
    assert artifact.stem == cache.stem
    pg.load(artifact.read_text(encoding="utf-8"), cache.read_bytes())


def test_failures_reach_every_rank_within_a_timeout(tmp_path: Path) -> None:
    with pytest.raises(pg.PrecompileError) as capture_error:
        pg.precompile(step_reading_a_global, _model(), _batch(0), backend="eager")
    results = run_ranks(2, tmp_path, failures_reach_every_rank, str(tmp_path / "pairs"))
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} did not finish its scenario"
        for case in ("capture error, broadcast", "capture error, cache_dir"):
            outcome = result[case]
            error = outcome["error"]
            assert isinstance(error, str), f"rank {rank}, {case}: no error raised"
            assert "failed on source rank 1" in error
            assert str(capture_error.value) in error
            assert outcome["seconds"] < ERROR_ARRIVES_WITHIN_S
        load_error = result["load error on rank 0"]
        error = load_error["error"]
        assert isinstance(error, str), f"rank {rank}: no error for rank 0's load"
        assert "failed on rank(s) [0]" in error
        if rank == 0:
            assert "cache_dir must be one folder that every rank sees" in error
        assert load_error["seconds"] < ERROR_ARRIVES_WITHIN_S
        signature_error = result["signature refused on rank 0"]["error"]
        assert isinstance(signature_error, str), f"rank {rank}: signature accepted"
        assert "failed on rank(s) [0]" in signature_error
        if rank == 0:
            assert "signature does not match this key" in signature_error


def test_a_source_rank_that_dies_does_not_hang_the_others(tmp_path: Path) -> None:
    results = run_ranks(2, tmp_path, source_dies)
    assert results[1] is None  # the source rank exited inside fn
    waiting = results[0]
    assert waiting is not None
    error = waiting["error"]
    assert isinstance(error, str)
    assert "waiting for source rank 1's precompiled pair failed" in error
    assert waiting["seconds"] < ERROR_ARRIVES_WITHIN_S


@pytest.mark.slow
def test_inductor_pair_compiled_once_runs_on_every_rank_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One compile worker per rank: this test's machine may have few cores.
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    shared = tmp_path / "shared"
    results = run_ranks(2, tmp_path, inductor_in_both_modes, str(shared))
    source, other = results
    assert source is not None and other is not None
    # Two calls, each traced on the source only.
    assert (source["traces"], other["traces"]) == (2, 0)
    # Rank 1 started with an empty inductor cache folder, as on another machine, and
    # ends with exactly the binaries the cache carried: it compiled nothing, not even
    # the precompiled header inductor builds before its first compile.
    (cache_file,) = shared.glob("*.cache")
    envelope = torch.load(io.BytesIO(cache_file.read_bytes()), weights_only=True)
    assert other["binaries"] == sorted(envelope["artifact"]["files"])
    assert not other["built_headers"]


def test_single_rank_group_loads_and_rejects_bad_arguments(
    single_rank_group: None,
) -> None:
    forward = precompile_once(counted_train_step, _model(), _batch(0), backend="eager")
    _check_against_eager(forward, 0)
    with pytest.raises(ValueError, match="src=1 is not a rank of the group"):
        precompile_once(train_step, _model(), _batch(0), src=1, backend="eager")
    with pytest.raises(ValueError, match="backend must be one of"):
        precompile_once(train_step, _model(), _batch(0), backend="aot")
    with pytest.raises(ValueError, match="name must be a plain file name"):
        precompile_once(
            train_step, _model(), _batch(0), cache_dir="pairs", name="../escape"
        )


def test_without_a_process_group_says_how_to_start_one() -> None:
    assert not dist.is_initialized()
    with pytest.raises(pg.PrecompileError, match="init_process_group"):
        precompile_once(train_step, _model(), _batch(0), backend="eager")


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    """A one-process gloo group in this process: no spawn, no port."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
