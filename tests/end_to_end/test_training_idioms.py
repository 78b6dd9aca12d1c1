"""Training-step idioms as tutorials and training scripts write them, captured whole
with their optimizer step and compared with eager PyTorch over three steps on new
batches: gradient clipping, gradient accumulation over micro-batches, a gradient
penalty (a backward through a gradient), ``torch.func.functional_call``, a backward
that keeps its graph for a second one, label smoothing, and weight and spectral norm
parametrizations.

The eager backend covers each; the inductor backend, which compiles kernels for
each, covers gradient clipping, the commonest of them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precompile_gen as pg

Step = Callable[
    [nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], torch.Tensor
]


def clip_norm_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()
    return loss.detach()


def clip_value_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    nn.utils.clip_grad_value_(model.parameters(), clip_value=0.01)
    opt.step()
    return loss.detach()


def accumulating_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    total = torch.zeros(())
    for micro_x, micro_y in zip(x.chunk(2), y.chunk(2), strict=True):
        loss = F.cross_entropy(model(micro_x), micro_y) / 2
        loss.backward()
        total += loss.detach()
    opt.step()
    return total


def penalised_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    x = x.clone().requires_grad_(True)
    out = model(x)
    (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.cross_entropy(out, y) + slope.pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def functional_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    loss = F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
    loss.backward()
    opt.step()
    return loss.detach()


def twice_backward_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    opt.step()
    return loss.detach()


def plain_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def weight_normed() -> nn.Module:
    first = nn.utils.parametrizations.weight_norm(nn.Linear(4, 8))
    return nn.Sequential(first, nn.ReLU(), nn.Linear(8, 3))


def spectral_normed() -> nn.Module:
    first = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 8))
    return nn.Sequential(first, nn.ReLU(), nn.Linear(8, 3))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


CASES: dict[str, tuple[Callable[[], nn.Module], Step, Callable[..., object]]] = {
    "clip_grad_norm": (mlp, clip_norm_step, sgd),
    "clip_grad_value": (mlp, clip_value_step, adam),
    "accumulation": (mlp, accumulating_step, sgd),
    "gradient_penalty": (mlp, penalised_step, adam),
    "functional_call": (mlp, functional_step, sgd),
    "retain_graph": (mlp, twice_backward_step, sgd),
    "weight_norm": (weight_normed, plain_step, adam),
    "spectral_norm": (spectral_normed, plain_step, sgd),
}


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 4, generator=generator), torch.randint(0, 3, (4,)))
        for _ in range(4)
    ]


def run_against_eager(case: str, backend: str) -> None:
    build, step, optimizer = CASES[case]
    torch.manual_seed(0)
    model = build()
    twin = copy.deepcopy(model)
    opt = optimizer(model)
    twin_opt = optimizer(twin)
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(twin_opt, torch.optim.Optimizer)
    (x, y), *calls = batches(1)
    python_code, cache = pg.precompile(step, model, opt, x, y, backend=backend)
    loaded = pg.load(python_code, cache)
    for x, y in calls:
        torch.testing.assert_close(loaded(model, opt, x, y), step(twin, twin_opt, x, y))
        for (name, param), twin_param in zip(
            model.named_parameters(), twin.parameters(), strict=True
        ):
            torch.testing.assert_close(param, twin_param, msg=name)
            torch.testing.assert_close(param.grad, twin_param.grad, msg=name)
        for (name, buffer), twin_buffer in zip(
            model.named_buffers(), twin.buffers(), strict=True
        ):
            torch.testing.assert_close(buffer, twin_buffer, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_idiom_matches_eager_on_the_eager_backend(case: str) -> None:
    run_against_eager(case, "eager")


@pytest.mark.slow
def test_gradient_clipping_matches_eager_on_the_inductor_backend() -> None:
    run_against_eager("clip_grad_norm", "inductor")
