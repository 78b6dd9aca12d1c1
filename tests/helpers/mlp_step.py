"""A training step on a two-layer MLP, with its example batch: what the kernel-cache
tests precompile with Inductor, and what their fresh processes load and check."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    return loss.detach()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, generator=generator), torch.randn(
        3, 2, generator=generator
    )
