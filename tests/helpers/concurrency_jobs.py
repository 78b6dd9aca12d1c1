"""The captures the concurrency tests start at once, and their examples: what both
the tests and the fresh process that checks load's effect on process state build."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

KEY = b"concurrency test key"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.lin(x))))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))


def train_step(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> dict[str, torch.Tensor]:
    out = model(x)
    loss = nn.functional.mse_loss(out, target)
    loss.backward()
    return {"loss": loss.detach(), "out": out.detach()}


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sigmoid()


def net_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + seed)
    return torch.randn(5, 4, generator=generator), torch.randn(
        5, 2, generator=generator
    )


def mlp_batch(seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(7, 3, generator=torch.Generator().manual_seed(200 + seed)),)


@dataclass(frozen=True)
class Job:
    fn: Callable[..., object]
    make_model: Callable[[int], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, ...]]
    backend: str
    key: bytes | None = None

    def example(self, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return self.make_model(seed), self.batch(seed)


# Two inductor captures (each compiles kernels: the expensive part of this module)
# and four eager ones, all started at once.
JOBS = {
    "inductor train": Job(train_step, make_net, net_batch, "inductor", KEY),
    "inductor predict": Job(predict, make_mlp, mlp_batch, "inductor"),
    "eager train": Job(train_step, make_net, net_batch, "eager"),
    "eager train signed": Job(train_step, make_net, net_batch, "eager", KEY),
    "eager predict": Job(predict, make_mlp, mlp_batch, "eager"),
    "eager predict 2": Job(
        predict, lambda seed: make_mlp(seed + 1), mlp_batch, "eager"
    ),
}
