"""A step that leaves no gradient behind runs each parameter's update as soon as the
backward has finished its gradient (``update_order.hoist_updates``), and still trains
exactly as the eager step does.

The reordering only moves ops; these tests hold it to eager's results on steps whose
order matters: weight decay and momentum, a parameter read after the update, a view
of a parameter taken before it and read after the backward, batch norm's running
stats, tied weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import precompile_gen as pg
from precompile_gen.capturing import update_order

Step = Callable[..., object]


class Tower(nn.Module):
    """Layers wide enough that the gradients outweigh the activations of a small
    batch, with a batch norm and a weight shared by two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64, bias=False)
        self.norm = nn.BatchNorm1d(64)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.head = nn.Linear(64, 16)
        # The first block's weight, used again after the blocks.
        self.tied = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x)).relu()
        for block in self.blocks:
            h = h + block(h).tanh()
        h = h @ self.tied.T
        return self.head(h)


def make(seed: int = 0) -> Tower:
    torch.manual_seed(seed)
    return Tower()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 16, generator=generator), torch.randn(
        4, 16, generator=generator
    )


def leaves_no_gradient(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def reads_a_parameter_after_the_update(
    model: Tower, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    first = model.head.weight[0]  # a view taken before the update
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    before = first.sum() * 1.0  # read after the backward, before the update
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach() + before.detach(), model.head.weight.sum().detach()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.1)


def _assert_trains_as_eager(
    step: Step,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    backend: str,
) -> None:
    model, reference = make(), make()
    optimizer, reference_optimizer = make_optimizer(model), make_optimizer(reference)
    code, cache = pg.precompile(step, model, optimizer, *batch(0), backend=backend)
    compiled = pg.load(code, cache)
    for seed in range(1, 4):
        got = compiled(model, optimizer, *batch(seed))
        want = step(reference, reference_optimizer, *batch(seed))
        torch.testing.assert_close(got, want)
        for (name, p), q in zip(
            model.named_parameters(), reference.parameters(), strict=True
        ):
            torch.testing.assert_close(p, q, msg=f"{name} after step {seed}")
            assert p.grad is None and q.grad is None
        for p, q in zip(model.buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(p, q)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            state, expected = optimizer.state[p], reference_optimizer.state[q]
            assert state.keys() == expected.keys()
            for key in state:
                torch.testing.assert_close(state[key], expected[key], msg=key)


@pytest.mark.parametrize("make_optimizer", [adamw, sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize(
    "step",
    [leaves_no_gradient, reads_a_parameter_after_the_update],
    ids=["leaves_no_gradient", "reads_after_update"],
)
def test_the_reordered_step_trains_as_eager(
    step: Step, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
) -> None:
    _assert_trains_as_eager(step, make_optimizer, "eager")


@pytest.mark.parametrize("make_optimizer", [adamw, sgd], ids=["adamw", "sgd"])
def test_the_reordered_step_trains_as_eager_on_inductor(
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
) -> None:
    _assert_trains_as_eager(
        reads_a_parameter_after_the_update, make_optimizer, "inductor"
    )


class _LiveBytes(TorchDispatchMode):
    """The most bytes the ops' new results held at once: each counts from the op that
    made it until it is freed; views and in-place results share their argument's
    memory and are not counted again."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for output in pytree.tree_leaves(result):
            if not isinstance(output, torch.Tensor):
                continue
            if output.untyped_storage().data_ptr() in inputs:
                continue
            size = output.untyped_storage().nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(output, self._free, size)
        return result

    def _free(self, size: int) -> None:
        self.live -= size


@contextmanager
def _counting() -> Generator[_LiveBytes]:
    mode = _LiveBytes()
    with mode:
        yield mode


def _peak_of_a_step(model: Tower) -> int:
    optimizer = adamw(model)
    code, cache = pg.precompile(
        leaves_no_gradient, model, optimizer, *batch(0), backend="eager"
    )
    compiled = pg.load(code, cache)
    compiled(model, optimizer, *batch(1))
    with _counting() as counted:
        compiled(model, optimizer, *batch(2))
    return counted.peak


def test_each_gradient_is_freed_by_its_update_on_the_eager_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = make()
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    # The step never holds all gradients at once...
    assert _peak_of_a_step(model) < gradients
    # ...where the traced order, every update after the whole backward, does.
    monkeypatch.setattr(update_order, "hoist_updates", lambda gm, updated: None)
    assert _peak_of_a_step(make()) > gradients


def test_no_update_lands_between_a_collective_and_its_wait() -> None:
    # A functional collective reads its input until wait_tensor returns it: the
    # weight decay that writes the parameter in place must wait for the wait, or
    # the all-gather may send the decayed values (FSDP2's forward gathers each
    # parameter the optimizer later decays).
    graph = torch.fx.Graph()
    param, x = graph.placeholder("param"), graph.placeholder("x")
    functional = torch.ops._c10d_functional
    gathered = graph.call_function(
        functional.all_gather_into_tensor.default, (param, 2, "0")
    )
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    waited = graph.call_function(functional.wait_tensor.default, (gathered,))
    total = graph.call_function(torch.ops.aten.sum.default, (waited,))
    decay = graph.call_function(torch.ops.aten.mul_.Tensor, (param, 0.5))
    graph.output([total, doubled])
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    update_order.hoist_updates(gm, {0})
    order = list(gm.graph.nodes)
    assert order.index(decay) > order.index(waited), order
