"""A small convolutional classifier, its training step and an example batch: what
the standalone tests capture in one process and run in another, which must not
import precompile_gen (so this module does not either). Both sides build the same
model and batch from the same seeds."""

from __future__ import annotations

import torch
from torch import nn


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.bn(self.conv(images)))
        return self.head(features.mean((2, 3)))


def train_step(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    logits = model(batch["images"])
    loss = nn.functional.cross_entropy(logits, batch["labels"])
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach()}


def example() -> tuple[SmallNet, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = SmallNet()
    generator = torch.Generator().manual_seed(1)
    batch = {
        "labels": torch.randint(0, 3, (4,), generator=generator),
        "images": torch.randn(4, 2, 6, 6, generator=generator),
    }
    return model, batch
