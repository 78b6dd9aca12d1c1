"""A classifier of token sequences (an embedding, a linear head) and its training
step with the optimizer inside: the program the bad-index tests call with ids out of
range, in this process and in a child."""

from __future__ import annotations

import torch
from torch import nn


class TokenClassifier(nn.Module):
    def __init__(
        self, width: int = 16, shift: int = 0, through_float: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, width)
        self.head = nn.Linear(width, 4)
        # With a shift, the graph computes the ids it embeds: the driver checks
        # ids + shift; through a float, which it does not replay, only the graph's
        # embedding checks them.
        self.shift = shift
        self.through_float = through_float

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.through_float:
            ids = (ids.float() + self.shift).long()
        elif self.shift:
            ids = ids + self.shift
        return self.head(self.emb(ids)).mean(1)


def classification_step(
    model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(ids), y)
    loss.backward()
    opt.step()
    return loss.detach()
