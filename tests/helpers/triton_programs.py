"""The programs the Triton-interpreter tests capture and load, each in a process of
its own that set ``TRITON_INTERPRET=1`` before importing torch: an MLP with
LayerNorm and GELU, for inference, and for a training step with AdamW inside; an MLP
with dropout in train mode; and the first MLP with a batch dim marked unbacked,
called at batches other than the captured one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Program:
    fn: Callable[..., torch.Tensor]
    # A fresh (model, optimizer if any, inputs) for it, as capture receives them.
    arguments: Callable[[], tuple[object, ...]]
    # The batch of each call the loading process makes, for a program captured with
    # a dynamic batch dim; empty: each call takes the captured arguments' shapes.
    call_batches: tuple[int, ...] = ()


def mlp_with_layernorm_gelu() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def adamw_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    return loss.detach()


def _batch(size: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(size, 4, generator=generator)
    return x, torch.randn(size, 2, generator=generator)


def inference_arguments() -> tuple[object, ...]:
    return mlp_with_layernorm_gelu(), _batch()[0]


def training_arguments() -> tuple[object, ...]:
    model = mlp_with_layernorm_gelu()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, opt, *_batch()


def dropout_arguments() -> tuple[object, ...]:
    torch.manual_seed(0)
    hidden = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5))
    model = nn.Sequential(hidden, nn.Linear(16, 2))
    return model.train(), _batch()[0]


def unbacked_arguments() -> tuple[object, ...]:
    x = _batch(4)[0]
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return mlp_with_layernorm_gelu(), x


def at_batch(arguments: tuple[object, ...], size: int) -> tuple[object, ...]:
    """The arguments with a batch of ``size`` rows for input."""
    return *arguments[:-1], _batch(size)[0]


PROGRAMS: dict[str, Program] = {
    "inference": Program(predict, inference_arguments),
    "training": Program(adamw_step, training_arguments),
    "dropout": Program(predict, dropout_arguments),
    "unbacked": Program(predict, unbacked_arguments, call_batches=(3, 7)),
}
