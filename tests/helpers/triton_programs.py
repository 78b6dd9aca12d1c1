"""The programs the Triton-interpreter tests capture and load, each in a process of
its own that set ``TRITON_INTERPRET=1`` before importing torch: an MLP with
LayerNorm and GELU, for inference, and for a training step with AdamW inside."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# A program: the function, and a fresh (model, optimizer or None, inputs) for it.
Program = tuple[Callable[..., torch.Tensor], Callable[[], tuple[object, ...]]]


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


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=generator)
    return x, torch.randn(3, 2, generator=generator)


def inference_arguments() -> tuple[object, ...]:
    return mlp_with_layernorm_gelu(), _batch()[0]


def training_arguments() -> tuple[object, ...]:
    model = mlp_with_layernorm_gelu()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, opt, *_batch()


PROGRAMS: dict[str, Program] = {
    "inference": (predict, inference_arguments),
    "training": (adamw_step, training_arguments),
}
