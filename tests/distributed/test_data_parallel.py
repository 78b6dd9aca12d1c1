"""Data-parallel training: a DistributedDataParallel step captured with DDP's gradient
averaging in the graph, and in-place collectives captured as functional ones. Each
test spawns one gloo group of 2 CPU ranks (``run_ranks``) and runs its whole scenario
there; every rank trains on its own batch, as in data-parallel training.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.distributed import run_ranks
from helpers.state_snapshot import StateSnapshot
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import precompile_gen as pg
from precompile_gen.distributed import precompile_once
from precompile_gen.tools.inspection import inspect_artifact
from precompile_gen.tools.report_text import format_report

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 4, generator=generator), torch.randn(
        6, 2, generator=generator
    )


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def backward_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


_OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "SGD": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    "AdamW": lambda model: torch.optim.AdamW(model.parameters(), lr=0.01),
}


def _gathered(tensors: dict[str, torch.Tensor]) -> dict[str, list[list[float]]]:
    """Each tensor as every rank has it, for the test to compare across ranks."""
    return {
        name: [t.reshape(-1).tolist() for t in _all_gather(tensor)]
        for name, tensor in tensors.items()
    }


def _all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.detach().contiguous())
    return out


def _train_like_ddp(
    rank: int, backend: str, optimizer_name: str, once: bool, **options: Any
) -> dict[str, Any]:
    """Three steps of the artifact and of DDP's eager step, side by side, both DDP
    modules built with ``options``."""
    model, reference = DDP(_model(), **options), DDP(_model(), **options)
    optimizer = _OPTIMIZERS[optimizer_name](model)
    reference_optimizer = _OPTIMIZERS[optimizer_name](reference)
    x, y = _batch(rank, 0)
    if once:
        forward = precompile_once(train_step, model, optimizer, x, y, backend=backend)
    else:
        forward = pg.load(
            *pg.precompile(train_step, model, optimizer, x, y, backend=backend)
        )
    seen: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = forward(model, optimizer, x, y)
        expected = train_step(reference, reference_optimizer, x, y)
        assert isinstance(loss, torch.Tensor)
        torch.testing.assert_close(loss, expected, msg=f"loss, step {step}")
        for (name, got), want in zip(
            model.named_parameters(), reference.parameters(), strict=True
        ):
            assert got.grad is not None and want.grad is not None, name
            torch.testing.assert_close(got.grad, want.grad, msg=f"{name}.grad, {step}")
            torch.testing.assert_close(got, want, msg=f"{name}, step {step}")
        seen[f"loss {step}"] = loss
    for name, param in model.named_parameters():
        seen[name] = param
        seen[f"{name}.grad"] = param.grad  # type: ignore[assignment]
    return _gathered(seen)


def ddp_training_matches_eager(rank: int, backend: str) -> dict[str, Any]:
    if backend == "inductor":
        return {
            "SGD": _train_like_ddp(rank, backend, "SGD", once=False),
            "AdamW once": _train_like_ddp(rank, backend, "AdamW", once=True),
        }
    return {
        "SGD": _train_like_ddp(rank, backend, "SGD", once=False),
        "AdamW once": _train_like_ddp(
            rank, backend, "AdamW", once=True, find_unused_parameters=True
        ),
        # A bucket per parameter (a cap below each one's size).
        "AdamW": _train_like_ddp(
            rank,
            backend,
            "AdamW",
            once=False,
            bucket_cap_mb=1e-5,
            gradient_as_bucket_view=True,
        ),
    }


def _assert_ranks_differ_in_loss_but_agree_on_parameters(
    results: list[dict[str, Any] | None],
) -> None:
    for result in results:
        assert result is not None
    for case, gathered in results[0].items():  # type: ignore[union-attr]
        for name, per_rank in gathered.items():
            if name.startswith("loss"):
                # Each rank its own batch: its own loss.
                assert per_rank[0] != per_rank[1], f"{case}: {name}"
            else:
                # DDP's gradients and parameters: identical replicas.
                assert per_rank[0] == per_rank[1], f"{case}: {name}"


def test_ddp_steps_match_ddp_eager_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(2, tmp_path, ddp_training_matches_eager, "eager")
    _assert_ranks_differ_in_loss_but_agree_on_parameters(results)
    assert sorted(results[0] or {}) == ["AdamW", "AdamW once", "SGD"]


@pytest.mark.slow
def test_ddp_step_with_inductor_matches_ddp_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    results = run_ranks(
        2, tmp_path, ddp_training_matches_eager, "inductor", deadline_s=400
    )
    _assert_ranks_differ_in_loss_but_agree_on_parameters(results)
    assert sorted(results[0] or {}) == ["AdamW once", "SGD"]


# Refused DDP options, at capture and at call.


def _with_buffer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _with_frozen_layer() -> nn.Module:
    model = _model()
    model.get_submodule("0").requires_grad_(False)
    return model


class TwoHeads(nn.Module):
    """A model whose second head the step leaves unused."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.unused_head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def step_inside_no_sync(model: DDP, x: torch.Tensor, y: torch.Tensor) -> Any:
    with model.no_sync():
        loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


def _refused(call: Callable[[], object], *snapshotted: object) -> str:
    """The PrecompileError ``call`` raised; that it left everything as it was."""
    snapshot = StateSnapshot(*snapshotted)
    with pytest.raises(pg.PrecompileError) as error:
        call()
    snapshot.assert_unchanged()
    return str(error.value)


def _refused_captures(rank: int) -> dict[str, str]:
    x, y = _batch(rank, 0)

    def capture(model: nn.Module, fn: Callable[..., object] = backward_step) -> str:
        return _refused(lambda: pg.precompile(fn, model, x, y, backend="eager"), model)

    hooked = DDP(_model())
    hooked.register_comm_hook(None, allreduce_hook)
    compressed = DDP(_model())
    compressed._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    unsynced = DDP(_model())
    with unsynced.no_sync():
        no_sync = capture(unsynced)
    partly_ignored = _model()
    DDP._set_params_and_buffers_to_ignore_for_model(partly_ignored, ["0.bias"])
    return {
        "comm hook": capture(hooked),
        "builtin comm hook": capture(compressed),
        "no_sync": no_sync,
        "static_graph": capture(DDP(_model(), static_graph=True)),
        "frozen": capture(DDP(_with_frozen_layer())),
        "buffers": capture(DDP(_with_buffer())),
        "unused": capture(DDP(TwoHeads(), find_unused_parameters=True)),
        "no_sync in fn": capture(DDP(_model()), step_inside_no_sync),
        "ignored": capture(DDP(partly_ignored)),
    }


def _refused_calls(rank: int) -> tuple[dict[str, str], str, str]:
    model = DDP(_model())
    x, y = _batch(rank, 0)
    code, cache = pg.precompile(backward_step, model, x, y, backend="eager")
    forward = pg.load(code, cache)

    def call(module: nn.Module) -> str:
        return _refused(lambda: forward(module, x, y), module, x, y)

    with model.no_sync():
        no_sync = call(model)
    other_group = DDP(_model(), process_group=dist.new_group([0, 1]))
    refused = {
        "no_sync": no_sync,
        "plain module": call(model.module),
        "other group": call(other_group),
    }
    static = DDP(_model())
    static._set_static_graph()
    refused["static_graph"] = call(static)
    model.register_comm_hook(None, allreduce_hook)
    refused["comm hook"] = call(model)
    return refused, code, base64.b64encode(cache).decode()


def ddp_options_refused(rank: int) -> dict[str, Any]:
    calls, code, cache = _refused_calls(rank)
    return {"capture": _refused_captures(rank), "call": calls, "pair": [code, cache]}


_CAPTURE_REFUSALS = {
    "comm hook": ["communication hook", "without the hook"],
    "builtin comm hook": ["hook registered (BuiltinCommHookType.FP16_COMPRESS)"],
    "no_sync": ["inside a no_sync() context", "outside no_sync()"],
    "static_graph": ["static_graph=True", "static_graph=False"],
    "frozen": ["do not require grad (module.0.weight", "requires_grad=True"],
    "buffers": ["broadcast_buffers=True", "broadcast_buffers=False"],
    "unused": ["got no gradient", "unused_head.weight", "Use every parameter"],
    "no_sync in fn": ["inside no_sync()", "call backward once"],
    "ignored": ["ignores some parameters", "without _ddp_params_and_buffers_to_ignore"],
}
_CALL_REFUSALS = {
    "no_sync": ["inside a no_sync() context", "outside no_sync()"],
    "plain module": [
        "argument 0 (`model`) was a DistributedDataParallel",
        "Pass the DDP-wrapped",
    ],
    "other group": ["over process group '1'", "group '0'", "Wrap the model with"],
    "comm hook": ["communication hook", "Remove the hook"],
    "static_graph": ["set to static_graph after capture", "Leave static_graph off"],
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = run_ranks(2, tmp_path_factory.mktemp("ranks"), ddp_options_refused)
    assert results[0] is not None and results[1] is not None
    return [results[0], results[1]]


@pytest.mark.parametrize("case", sorted(_CAPTURE_REFUSALS))
def test_unsupported_ddp_options_are_refused_at_capture(
    refusals: list[dict[str, Any]], case: str
) -> None:
    for result in refusals:
        message = result["capture"][case]
        for words in _CAPTURE_REFUSALS[case]:
            assert words in message, message


@pytest.mark.parametrize("case", sorted(_CALL_REFUSALS))
def test_ddp_calls_the_graph_was_not_built_for_are_refused(
    refusals: list[dict[str, Any]], case: str
) -> None:
    for result in refusals:
        message = result["call"][case]
        for words in _CALL_REFUSALS[case]:
            assert words in message, message


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_call_without_the_captured_group_is_refused(
    refusals: list[dict[str, Any]],
) -> None:
    code, cache = refusals[1]["pair"]
    forward = pg.load(code, base64.b64decode(cache))
    model, (x, y) = _model(), _batch(0, 0)
    with pytest.raises(pg.PrecompileError, match="init_process_group"):
        forward(model, x, y)


def test_a_call_on_another_world_size_is_refused(
    refusals: list[dict[str, Any]], single_rank_group: None
) -> None:
    code, cache = refusals[1]["pair"]
    forward = pg.load(code, base64.b64decode(cache))
    model, (x, y) = DDP(_model()), _batch(0, 0)
    snapshot = StateSnapshot(model, x, y)
    with pytest.raises(pg.PrecompileError) as error:
        forward(model, x, y)
    snapshot.assert_unchanged()
    message = str(error.value)
    assert "process group '0' (gloo, global ranks [0, 1])" in message
    assert "global ranks [0]" in message
    assert "Precompile again on this group" in message
    metadata = pg.parse_metadata(code)
    assert metadata["PROCESS_GROUPS"] == [
        {"name": "0", "backend": "gloo", "ranks": [0, 1]}
    ]
    assert metadata["PARAM_NAMES"][0] == "module.0.weight"
    report = format_report(inspect_artifact(code))
    assert "0     gloo     [0, 1]        argument 0 (bucket_cap_mb=25.0)" in report


# In-place collectives inside the function.


def synced(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    total = model(x)
    dist.all_reduce(total)
    biggest = x * 1
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    smallest = x * 1
    dist.all_reduce(smallest, dist.ReduceOp.MIN)
    shared = x * 3
    dist.broadcast(shared, src=1)
    gathered = x.new_empty(2 * x.shape[0], x.shape[1])
    dist.all_gather_single(gathered, x)
    scattered = x.new_empty(x.shape[0] // 2, x.shape[1])
    dist.reduce_scatter_single(scattered, x)
    # The deprecated names of the two above, as older code calls them.
    stacked = x.new_empty(2 * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(stacked, x)  # pyrefly: ignore[deprecated]
    halves = x.new_empty(x.shape[0] // 2, x.shape[1])
    dist.reduce_scatter_tensor(halves, x * 2)  # pyrefly: ignore[deprecated]
    return total, biggest, smallest, shared, gathered, scattered, stacked, halves


def async_all_reduce(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    dist.all_reduce(y, async_op=True)
    return y


def product_all_reduce(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    dist.all_reduce(y, op=dist.ReduceOp.PRODUCT)
    return y


def reduce_to_rank_0(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    dist.reduce(y, dst=0)
    return y


def in_place_collectives(rank: int) -> dict[str, Any]:
    model, (x, _) = _model(), _batch(rank, 0)
    expected = synced(model, x)
    results: dict[str, Any] = {}
    for mode in ("precompile", "precompile_once"):
        if mode == "precompile":
            forward = pg.load(*pg.precompile(synced, model, x, backend="eager"))
        else:
            forward = precompile_once(synced, model, x, src=1, backend="eager")
        x2 = _batch(rank, 1)[0]
        got = forward(model, x2)
        assert isinstance(got, tuple)
        for name, value, want in zip(
            (
                "total",
                "max",
                "min",
                "broadcast",
                "gathered",
                "scattered",
                "stacked",
                "halves",
            ),
            got,
            synced(model, x2),
            strict=True,
        ):
            torch.testing.assert_close(value, want, msg=f"{mode}: {name}")
        results[mode] = _gathered({"total": got[0], "broadcast": got[3]})
    assert expected[0].shape == (6, 2)
    results["refused"] = {
        name: _refused(
            lambda fn=fn: pg.precompile(fn, model, x, backend="eager"), model
        )
        for name, fn in (
            ("async", async_all_reduce),
            ("product", product_all_reduce),
            ("reduce", reduce_to_rank_0),
        )
    }
    return results


def test_in_place_collectives_are_captured_as_functional_ones(tmp_path: Path) -> None:
    results = run_ranks(2, tmp_path, in_place_collectives)
    for result in results:
        assert result is not None
        for mode in ("precompile", "precompile_once"):
            for name, per_rank in result[mode].items():
                assert per_rank[0] == per_rank[1], f"{mode}: {name}"
        async_error, product_error, reduce_error = result["refused"].values()
        assert "torch.distributed.reduce, which" in reduce_error
        assert "all_gather_into_tensor" in reduce_error
        assert "all_reduce with async_op=True" in async_error
        assert "Call it with async_op=False" in async_error
        assert "op=" in product_error and "SUM, AVG, MAX and MIN do" in product_error
