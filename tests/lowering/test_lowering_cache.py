"""A capture of an unchanged program reuses the lowering an earlier one kept, and
any change to what lowering reads misses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.state_snapshot import StateSnapshot
from torch import nn
from torch._dynamo.decorators import mark_unbacked

import precompile_gen as pg
from precompile_gen.capture_result import Backend
from precompile_gen.capturing.trace import TracedGraph, trace
from precompile_gen.lowering import lower, lowering_cache


@pytest.fixture(autouse=True)
def kept_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The suite lowers every capture afresh (tests/conftest.py); these turn the
    # cache on, in a folder of their own.
    folder = tmp_path / "lowering"
    monkeypatch.setenv("PRECOMPILE_GEN_LOWERING_CACHE", "1")
    monkeypatch.setattr(lowering_cache, "_folder", lambda: folder)
    return folder


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def predict(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).relu()


def predict_again(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The same ops as predict under another name, which the artifact shows.
    return m(x).relu()


def train_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).square().mean()
    loss.backward()
    return loss


def traced(fn: Callable[..., object], *args: object) -> TracedGraph:
    return trace(fn, args, backend="inductor")


def key_of(fn: Callable[..., object], *args: object) -> str | None:
    return lowering_cache.key(traced(fn, *args))


def test_the_key_is_the_same_for_the_same_capture() -> None:
    x = torch.randn(3, 4)
    assert key_of(predict, model(), x) == key_of(predict, model(), x.clone())


@pytest.mark.parametrize(
    "change",
    [
        "program",
        "function name",
        "dtype",
        "strides",
        "requires_grad",
        "shared storage",
        "inductor config",
        "environment",
    ],
)
def test_a_change_to_what_lowering_reads_misses(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(4, 4)
    base = key_of(train_step, model(), x)
    if change == "program":
        changed = key_of(lambda m, x: m(x).tanh(), model(), x)
    elif change == "function name":
        changed, base = key_of(predict_again, model(), x), key_of(predict, model(), x)
    elif change == "dtype":
        changed = key_of(train_step, model().double(), x.double())
    elif change == "strides":
        changed = key_of(train_step, model(), x.t().contiguous().t())
    elif change == "requires_grad":
        frozen = model()
        frozen[0].weight.requires_grad_(False)
        changed = key_of(train_step, frozen, x)
    elif change == "shared storage":
        base = key_of(lambda m, a, b: m(a + b), model(), x, x.clone())
        changed = key_of(lambda m, a, b: m(a + b), model(), x, x)
    elif change == "inductor config":
        from torch._inductor import config

        with config.patch({"cpp.min_chunk_size": config.cpp.min_chunk_size + 1}):
            changed = key_of(train_step, model(), x)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "0")
        changed = key_of(train_step, model(), x)
    assert base is not None and changed is not None
    assert changed != base


def test_the_same_ops_from_other_lines_share_the_key() -> None:
    # The artifact shows no source lines (its graph names ops, not lines), so an
    # edit that leaves the graph as it was, a comment say, makes the same artifact.
    x = torch.randn(3, 4)
    first = key_of(lambda m, x: m(x).relu(), model(), x)
    assert first == key_of(lambda m, x: m(x).relu(), model(), x)


@torch.library.custom_op("precompile_gen_tests::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@scaled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_what_the_key_cannot_see_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(5, 4)
    mark_unbacked(x, 0)
    assert key_of(predict, model(), x) is None
    # An op of the user's own: its kernel and fake implementation are their code.
    assert key_of(lambda m, x: scaled(m(x)), model(), torch.randn(5, 4)) is None
    monkeypatch.setenv("PRECOMPILE_GEN_LOWERING_CACHE", "0")
    assert key_of(predict, model(), torch.randn(5, 4)) is None
    monkeypatch.setenv("PRECOMPILE_GEN_LOWERING_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    assert key_of(predict, model(), torch.randn(5, 4)) is None


def test_a_second_capture_reuses_the_lowering_and_makes_the_same_pair(
    kept_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, x = model(), torch.randn(4, 4)
    first = pg.precompile(train_step, m, x)
    assert len(list(kept_in.glob("*.pickle"))) == 1

    def not_again(*args: object) -> None:
        raise AssertionError("lowered again")

    monkeypatch.setattr(lower, "_lower_graph", not_again)
    snapshot = StateSnapshot(m, x)
    second = pg.precompile(train_step, m, x)
    snapshot.assert_unchanged()
    assert second == first
    twin = model()
    loss = pg.load(*second)(m, x)
    torch.testing.assert_close(loss, train_step(twin, x))
    for param, twin_param in zip(m.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(param.grad, twin_param.grad)


def test_an_unreadable_entry_is_lowered_again(
    kept_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(2, 4)
    entry = key_of(predict, model(), x)
    assert entry is not None
    kept_in.mkdir(parents=True)
    (kept_in / f"{entry}.pickle").write_bytes(b"not a pickle")
    calls = []
    lower_graph = lower._lower_graph

    def counted(traced: TracedGraph, backend: Backend) -> object:
        calls.append(1)
        return lower_graph(traced, backend)

    monkeypatch.setattr(lower, "_lower_graph", counted)
    code, cache = pg.precompile(predict, model(), x)
    assert calls == [1]
    assert lowering_cache.load(entry) is not None
    torch.testing.assert_close(pg.load(code, cache)(model(), x), predict(model(), x))


def test_a_lowering_that_cannot_be_kept_leaves_the_capture_as_it_is(
    kept_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file where the folder should be: the entry cannot be written.
    kept_in.parent.mkdir(parents=True, exist_ok=True)
    kept_in.write_text("not a folder", encoding="utf-8")
    x = torch.randn(2, 4)
    code, cache = pg.precompile(predict, model(), x)
    torch.testing.assert_close(pg.load(code, cache)(model(), x), predict(model(), x))
    assert kept_in.read_text(encoding="utf-8") == "not a folder"

    def unpicklable(*args: object, **kwargs: object) -> bytes:
        raise TypeError("cannot pickle")

    kept_in.unlink()
    monkeypatch.setattr(lowering_cache.pickle, "dumps", unpicklable)
    assert pg.precompile(predict, model(), x) == (code, cache)
    assert not kept_in.exists()
