"""zero_grad() inside the traced function: each call of the artifact resets the runtime
model's gradients as the eager call would, before adding the new ones; an optimizer's
step() inside the function is refused at capture.

The resets are plain Python on ``.grad`` fields, the same for both backends, so most
cases run on the eager backend; one runs on inductor.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import cast

import pytest
import torch
from helpers.state_snapshot import StateSnapshot, assert_same_state, clone_with_grads
from torch import nn

import precompile_gen as pg
from precompile_gen.tools.inspection import inspect_artifact

Step = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    # A frozen parameter: zero_grad() resets it too, and no gradient reaches it.
    model[2].bias.requires_grad_(False)
    return model


def batch(seed: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))


def with_grads(model: nn.Sequential) -> nn.Sequential:
    """The model after an earlier backward: its .grad fields hold values."""
    model(batch(99)).square().sum().backward()
    return model


def zero_grad_first(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach()


def zero_grad_to_zeros(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=False)
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach()


def zero_grad_of_one_layer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    cast(nn.Sequential, model)[0].zero_grad()
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach()


def zero_grad_last(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().sum()
    loss.backward()
    model.zero_grad()
    return loss.detach()


def two_backwards(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model(x).sum().backward()
    model.zero_grad()
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach()


STEPS: dict[str, tuple[Step, list[tuple[int, bool]]]] = {
    "zero_grad first": (zero_grad_first, [(0, True), (1, True), (2, True), (3, True)]),
    "zero_grad(set_to_none=False)": (
        zero_grad_to_zeros,
        [(0, False), (1, False), (2, False), (3, False)],
    ),
    "zero_grad of one layer": (zero_grad_of_one_layer, [(0, True), (1, True)]),
    "zero_grad last": (zero_grad_last, [(0, True), (1, True), (2, True), (3, True)]),
    "two backwards": (two_backwards, [(0, True), (1, True), (2, True), (3, True)]),
}


@pytest.fixture(scope="module", params=sorted(STEPS))
def case(request: pytest.FixtureRequest) -> tuple[Step, Callable[..., object], str]:
    step, _ = STEPS[request.param]
    example = with_grads(make_model())
    snapshot = StateSnapshot(example)
    forward = pg.load(*pg.precompile(step, example, batch(0), backend="eager"))
    # The trace reset only its own copies of the parameters.
    snapshot.assert_unchanged()
    return step, forward, request.param


def test_grad_resets_are_recorded_in_the_metadata(
    case: tuple[Step, Callable[..., object], str],
) -> None:
    _, forward, name = case
    assert forward.__globals__["GRAD_RESETS"] == STEPS[name][1]


@pytest.mark.parametrize("earlier_backward", [False, True])
def test_each_call_resets_and_adds_gradients_as_eager_does(
    case: tuple[Step, Callable[..., object], str], earlier_backward: bool
) -> None:
    step, forward, _ = case
    model = make_model()
    if earlier_backward:
        with_grads(model)
    twin = clone_with_grads(model)
    for seed in (1, 2, 3):
        grads = [p.grad for p in model.parameters()]
        torch.testing.assert_close(forward(model, batch(seed)), step(twin, batch(seed)))
        assert_same_state(model, twin)
        if step is zero_grad_to_zeros:
            # Zeroed in place, as eager does: the same tensors hold the new values.
            for before, param in zip(grads, model.parameters(), strict=True):
                assert before is None or param.grad is before


def test_inductor_resets_gradients_too() -> None:
    model = with_grads(make_model())
    forward = pg.load(*pg.precompile(zero_grad_first, model, batch(0)))
    twin = clone_with_grads(model)
    for seed in (1, 2):
        result = forward(model, batch(seed))
        torch.testing.assert_close(result, zero_grad_first(twin, batch(seed)))
        assert_same_state(model, twin)


def test_gradients_reset_to_none_are_freed_before_the_graph_runs(
    case: tuple[Step, Callable[..., object], str],
) -> None:
    # As in eager, where zero_grad() runs before the backward allocates new
    # gradients: the peak of a step holds one set of gradients, not two.
    step, forward, name = case
    model = with_grads(make_model())
    reset_to_none = {index for index, to_none in STEPS[name][1] if to_none}
    old = {
        index: weakref.ref(param.grad)
        for index, param in enumerate(model.parameters())
        if param.grad is not None
    }
    namespace = forward.__globals__  # type: ignore[attr-defined]
    graph = namespace["call"]
    alive_at_call: list[int] = []

    def call(inputs: list[torch.Tensor]) -> object:
        alive_at_call.extend(i for i, ref in old.items() if ref() is not None)
        return graph(inputs)

    namespace["call"] = call
    try:
        twin = clone_with_grads(model)
        torch.testing.assert_close(forward(model, batch(1)), step(twin, batch(1)))
    finally:
        namespace["call"] = graph
    assert_same_state(model, twin)
    assert sorted(alive_at_call) == sorted(set(old) - reset_to_none)


def test_an_optimizers_zero_grad_resets_the_parameters_it_holds() -> None:
    example = with_grads(make_model())
    optimizer = torch.optim.SGD(example[2].parameters(), lr=0.1)

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss.detach()

    snapshot = StateSnapshot(example)
    forward = pg.load(*pg.precompile(step, example, batch(0), backend="eager"))
    snapshot.assert_unchanged()
    assert forward.__globals__["GRAD_RESETS"] == [(2, True), (3, True)]
    # The runtime model's last layer is reset, as the optimizer's own model's would
    # be; the first layer accumulates.
    model = with_grads(make_model())
    twin = clone_with_grads(model)
    forward(model, batch(1))
    twin[2].zero_grad()
    twin(batch(1)).square().sum().backward()
    assert_same_state(model, twin)


def test_an_optimizer_step_inside_the_function_is_refused() -> None:
    example = with_grads(make_model())
    optimizer = torch.optim.SGD(example.parameters(), lr=0.1)

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        optimizer.step()
        return loss.detach()

    snapshot = StateSnapshot(example)
    with pytest.raises(pg.PrecompileError) as info:
        pg.precompile(step, example, batch(0), backend="eager")
    message = str(info.value)
    assert "calls step() on the optimizer SGD" in message
    assert "loss = step(model, *inputs); optimizer.step()" in message
    snapshot.assert_unchanged()


def test_an_optimizer_holding_other_tensors_is_refused() -> None:
    other = nn.Parameter(torch.ones(3))
    other.grad = torch.full((3,), 2.0)
    optimizer = torch.optim.SGD([other], lr=0.1)

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss.detach()

    example = make_model()
    snapshot = StateSnapshot(example, other)
    with pytest.raises(pg.PrecompileError) as info:
        pg.precompile(step, example, batch(0), backend="eager")
    message = str(info.value)
    assert "zero_grad() on the optimizer SGD" in message
    assert "not a parameter of a module argument" in message
    assert "Reset that tensor's .grad outside the precompiled function" in message
    snapshot.assert_unchanged()


def test_other_threads_and_later_calls_keep_torchs_own_zero_grad() -> None:
    module_zero_grad = nn.Module.zero_grad
    optimizer_zero_grad = torch.optim.Optimizer.zero_grad
    bystander = with_grads(make_model())

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Another thread's zero_grad() during the trace is its own business.
        worker = threading.Thread(target=bystander.zero_grad)
        worker.start()
        worker.join()
        return zero_grad_first(model, x)

    pg.precompile(step, make_model(), batch(0), backend="eager")
    assert all(p.grad is None for p in bystander.parameters())
    assert nn.Module.zero_grad is module_zero_grad
    assert torch.optim.Optimizer.zero_grad is optimizer_zero_grad
    # No hook is left behind: an optimizer steps as usual.
    model = with_grads(make_model())
    before = [p.detach().clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(next(model.parameters()), before[0])


def test_inspect_shows_what_each_call_does_to_each_gradient() -> None:
    def grads_shown(step: Step) -> dict[str, object]:
        code, _ = pg.precompile(step, make_model(), batch(0), backend="eager")
        state = inspect_artifact(code)["module_state"]
        return {s["name"]: s["grad"] for s in state if s["kind"] == "parameter"}

    assert grads_shown(zero_grad_of_one_layer) == {
        "0.weight": "set to None, then harvested",
        "0.bias": "set to None, then harvested",
        "2.weight": "harvested",
        "2.bias": "no",
    }
    assert grads_shown(zero_grad_to_zeros)["2.bias"] == "zeroed"
