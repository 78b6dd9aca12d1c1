"""The smallest training step worth precompiling, shared by the tests about files,
signing and hostile input: ``nn.Linear(3, 2)``, a sum loss, a backward."""

from __future__ import annotations

import torch
from torch import nn


def linear_model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def example_input() -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(1))


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).sum()
    loss.backward()
    return loss.detach()
