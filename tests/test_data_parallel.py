"""Data-parallel training: a DistributedDataParallel step captured with DDP's gradient
averaging in the graph, and in-place collectives captured as functional ones. Each
test spawns one gloo group of 2 CPU ranks (``run_ranks``) and runs its whole scenario
there; every rank trains on its own batch, as in data-parallel training.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from state_snapshot import StateSnapshot
from test_distributed import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import precompile_gen as pg
from precompile_gen.distributed import precompile_once

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)


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
    rank: int, backend: str, optimizer_name: str, once: bool
) -> dict[str, Any]:
    """Three steps of the artifact and of DDP's eager step, side by side."""
    model, reference = DDP(_model()), DDP(_model())
    optimizer = _OPTIMIZERS[optimizer_name](model)
    reference_optimizer = _OPTIMIZERS[optimizer_name](reference)
    x, y = _batch(rank, 0)
    if once:
        forward = precompile_once(train_step, model, optimizer, x, y, backend=backend)
    else:
        forward = pg.load(*pg.precompile(train_step, model, optimizer, x, y, backend=backend))
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
        return {"SGD": _train_like_ddp(rank, backend, "SGD", once=False)}
    return {
        "SGD": _train_like_ddp(rank, backend, "SGD", once=False),
        "AdamW once": _train_like_ddp(rank, backend, "AdamW", once=True),
        "AdamW": _train_like_ddp(rank, backend, "AdamW", once=False),
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
    results = run_ranks(2, tmp_path, ddp_training_matches_eager, "inductor")
    _assert_ranks_differ_in_loss_but_agree_on_parameters(results)
