"""An optimizer's step() inside the precompiled function: N calls of the artifact
equal N eager steps (parameters, gradients, optimizer state, losses), with a
learning-rate schedule between calls; each misuse is rejected and changes nothing."""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import model_zoo
from helpers.state_snapshot import StateSnapshot, assert_same_state
from torch import nn

import precompile_gen as pg
from precompile_gen.tools.inspection import inspect_artifact
from precompile_gen.tools.report_text import format_report

STEPS = 3
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]
MakeScheduler = Callable[[torch.optim.Optimizer], Any]


def mlp(batch_norm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(8)] if batch_norm else []
    # No bias before a BatchNorm, which removes it: its gradient would be rounding
    # noise, which Adam's normalised update amplifies into steps of about lr.
    first = nn.Linear(4, 8, bias=not batch_norm)
    return nn.Sequential(first, *norm, nn.ReLU(), nn.Linear(8, 3))


class TiedLM(nn.Module):
    """An embedding whose weight the output projection shares."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 6)
        self.hidden = nn.Linear(6, 6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(5, 4, generator=generator), torch.randint(
        0, 3, (5,), generator=generator
    )


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (2, 5), generator=generator), torch.randint(
        0, 10, (2, 5), generator=generator
    )


def lm_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    return loss.detach()


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def one_cycle(optimizer: torch.optim.Optimizer) -> Any:
    # The betas / momentum are built into the graph: only lr may cycle.
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.05, total_steps=10, cycle_momentum=False
    )


def assert_same_optimizer_state(
    actual: torch.optim.Optimizer,
    expected: torch.optim.Optimizer,
    model: nn.Module,
    twin: nn.Module,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    for (name, param), twin_param in zip(
        model.named_parameters(), twin.parameters(), strict=True
    ):
        got, want = actual.state.get(param, {}), expected.state.get(twin_param, {})
        assert list(got) == list(want), f"{name}: state keys {list(got)}"
        for key in want:
            torch.testing.assert_close(
                got[key], want[key], msg=f"{name} {key}", rtol=rtol, atol=atol
            )
    for got, want in zip(actual.param_groups, expected.param_groups, strict=True):
        assert got["lr"] == pytest.approx(want["lr"])


def assert_steps_match_eager(
    forward: Callable[..., object],
    make_model: Callable[[], nn.Module],
    make_optimizer: MakeOptimizer,
    make_scheduler: MakeScheduler | None,
    step: Callable[..., torch.Tensor],
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    warm_up: int = 0,
    steps: int = STEPS,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """``STEPS`` calls of ``forward`` against eager ``step`` on a twin, after
    ``warm_up`` eager steps on both (an optimizer that has already stepped)."""
    model = make_model()
    twin = copy.deepcopy(model)
    optimizer, twin_optimizer = make_optimizer(model), make_optimizer(twin)
    for seed in range(warm_up):
        step(model, optimizer, *make_batch(100 + seed))
        step(twin, twin_optimizer, *make_batch(100 + seed))
    schedulers = (
        []
        if make_scheduler is None
        else [make_scheduler(optimizer), make_scheduler(twin_optimizer)]
    )
    for seed in range(steps):
        # Dropout draws from the global generator, in eager's order on both sides.
        torch.manual_seed(1000 + seed)
        loss = forward(model, optimizer, *make_batch(seed))
        torch.manual_seed(1000 + seed)
        expected = step(twin, twin_optimizer, *make_batch(seed))
        torch.testing.assert_close(loss, expected, rtol=rtol, atol=atol)
        assert_same_state(model, twin, rtol=rtol, atol=atol)
        assert_same_optimizer_state(
            optimizer, twin_optimizer, model, twin, rtol=rtol, atol=atol
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for scheduler in schedulers:
                scheduler.step()
        # The artifact's step counts as the optimizer's for its scheduler.
        assert not [w for w in caught if "optimizer.step()" in str(w.message)]
    if schedulers:
        assert optimizer.param_groups[0]["lr"] == pytest.approx(
            twin_optimizer.param_groups[0]["lr"]
        )


def precompiled(
    make_model: Callable[[], nn.Module],
    make_optimizer: MakeOptimizer,
    step: Callable[..., torch.Tensor],
    example: tuple[torch.Tensor, torch.Tensor],
    backend: str,
) -> Callable[..., object]:
    model = make_model()
    optimizer = make_optimizer(model)
    snapshot = StateSnapshot(model)
    groups = copy.copy(optimizer.param_groups)
    # Empty but for an optimizer that creates its state in its constructor (Adagrad).
    state = StateSnapshot(list(optimizer.state.values()))
    keys = [list(values) for values in optimizer.state.values()]
    code, cache = pg.precompile(step, model, optimizer, *example, backend=backend)
    # Capture stepped copies: the example model and optimizer are as they were.
    snapshot.assert_unchanged()
    state.assert_unchanged()
    assert [list(values) for values in optimizer.state.values()] == keys
    assert optimizer.param_groups == groups
    return pg.load(code, cache)


OPTIMIZERS: dict[str, MakeOptimizer] = {
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "SGD-momentum": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01
    ),
    "SGD-nesterov": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, nesterov=True
    ),
    "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "AdamW-amsgrad": lambda m: torch.optim.AdamW(
        m.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True
    ),
    "Adam-foreach-maximize": lambda m: torch.optim.Adam(
        m.parameters(), lr=0.01, foreach=True, maximize=True
    ),
    # The fused kernels' steps, which the artifact traces unfused.
    "AdamW-fused": lambda m: torch.optim.AdamW(
        m.parameters(), lr=0.01, weight_decay=0.1, fused=True
    ),
    "SGD-fused-momentum": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, fused=True
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_eager_steps_equal_eager_pytorch_with_a_schedule(name: str) -> None:
    make_optimizer = OPTIMIZERS[name]
    forward = precompiled(mlp, make_optimizer, train_step, batch(0), "eager")
    assert_steps_match_eager(forward, mlp, make_optimizer, step_lr, train_step, batch)


def weight_decay_on_the_first_layer(
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
) -> MakeOptimizer:
    """``make`` over two param groups of the MLP: its first layer, with weight decay,
    and its last, without."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        assert isinstance(model, nn.Sequential)
        first, last = model[0], model[-1]
        return make(
            [
                {"params": list(first.parameters()), "weight_decay": 0.01},
                {"params": list(last.parameters()), "weight_decay": 0.0},
            ]
        )

    return build


def lr_on_the_last_layer(
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
) -> MakeOptimizer:
    """``make`` over two param groups of the MLP: its first layer, and its last with
    an lr of its own, 0.005."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        assert isinstance(model, nn.Sequential)
        first, last = model[0], model[-1]
        return make(
            [
                {"params": list(first.parameters())},
                {"params": list(last.parameters()), "lr": 0.005},
            ]
        )

    return build


# Each optimizer class torch.optim ships whose step the artifact captures, in its
# non-default configurations too.
EVERY_OPTIMIZER: dict[str, MakeOptimizer] = {
    "SGD-nesterov": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    ),
    "Adam-amsgrad": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True)
    ),
    "AdamW": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.AdamW(groups, lr=0.01)
    ),
    "Adamax": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.Adamax(groups, lr=0.01)
    ),
    "RAdam": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.RAdam(groups, lr=0.01)
    ),
    "RAdam-decoupled": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.RAdam(groups, lr=0.01, decoupled_weight_decay=True)
    ),
    "RMSprop": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.RMSprop(groups, lr=0.01)
    ),
    "RMSprop-centered-momentum": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.RMSprop(groups, lr=0.01, centered=True, momentum=0.9)
    ),
    "Adadelta": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.Adadelta(groups, lr=1.0)
    ),
    # Their first steps create state that is not zeros: NAdam's mu_product, ASGD's
    # eta (the lr) and mu, Rprop's step sizes (the lr).
    "NAdam": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.NAdam(groups, lr=0.01)
    ),
    "NAdam-decoupled": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.NAdam(
            groups, lr=0.01, decoupled_weight_decay=True, momentum_decay=0.005
        )
    ),
    "ASGD": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.ASGD(groups, lr=0.05, lambd=0.01, t0=2)
    ),
    # No weight decay: its groups differ in lr (a step size per group).
    "Rprop": lr_on_the_last_layer(
        lambda groups: torch.optim.Rprop(groups, lr=0.01, etas=(0.4, 1.3))
    ),
    # No capturable formulation: their step counts (Adafactor's norms too) are read
    # from tensors in the trace. Adagrad creates its state in its constructor.
    "Adagrad": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.Adagrad(
            groups, lr=0.05, lr_decay=0.1, initial_accumulator_value=0.1
        )
    ),
    "Adafactor": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.Adafactor(groups, lr=0.05)
    ),
    "Adafactor-maximize": weight_decay_on_the_first_layer(
        lambda groups: torch.optim.Adafactor(
            groups, lr=0.05, beta2_decay=-0.5, eps=(1e-6, 1e-2), maximize=True
        )
    ),
}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_every_optimizer_steps_as_eager_does(name: str, backend: str) -> None:
    # Five steps against eager's (losses, parameters, every state tensor), from a
    # fresh optimizer (its first step creates the state), under a schedule that
    # moves lr and every other number of each group at every step.
    make_optimizer = EVERY_OPTIMIZER[name]
    forward = precompiled(mlp, make_optimizer, train_step, batch(0), backend)
    assert_steps_match_eager(
        forward, mlp, make_optimizer, Nudge, train_step, batch, steps=5
    )


class Nudge:
    """A schedule of every number of every group: lr halves at each step, and each
    other number (betas, eps, weight_decay, momentum, alpha, rho, lr_decay, etas,
    ...) shrinks by 1%, which keeps a zero zero and a positive value positive."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        for group in self.optimizer.param_groups:
            for key, value in group.items():
                if key == "lr":
                    group[key] = value * 0.5
                elif isinstance(value, float):
                    group[key] = value * 0.99
                elif isinstance(value, tuple) and all(
                    isinstance(item, float) for item in value
                ):
                    group[key] = tuple(item * 0.99 for item in value)


class WarmUp:
    """A hand-written schedule of the numbers other than lr: each group's weight
    decay warms up to its initial value (a group without stays without), and
    betas[0] (or momentum) and eps move at every step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.steps = optimizer, 0
        self.decays = [group["weight_decay"] for group in optimizer.param_groups]
        self._set_decays()

    def _set_decays(self) -> None:
        ramp = min(1.0, (self.steps + 1) / 3)
        for group, decay in zip(self.optimizer.param_groups, self.decays, strict=True):
            group["weight_decay"] = decay * ramp

    def step(self) -> None:
        self.steps += 1
        self._set_decays()
        for group in self.optimizer.param_groups:
            if "betas" in group:
                group["betas"] = (0.8 + 0.03 * self.steps, group["betas"][1])
                group["eps"] = 1e-8 * (1 + self.steps)
            else:
                group["momentum"] = 0.5 + 0.1 * self.steps


def one_cycle_with_momentum(optimizer: torch.optim.Optimizer) -> Any:
    # Cycles betas[0] (Adam) or momentum (SGD) against lr, as fastai's recipe does.
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=10)


def cyclic_with_momentum(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.CyclicLR(
        optimizer, base_lr=0.01, max_lr=0.05, step_size_up=2, cycle_momentum=True
    )


SCHEDULES: dict[str, tuple[MakeOptimizer, MakeScheduler]] = {
    "OneCycleLR-Adam": (
        weight_decay_on_the_first_layer(lambda g: torch.optim.Adam(g, lr=0.01)),
        one_cycle_with_momentum,
    ),
    "OneCycleLR-SGD": (
        weight_decay_on_the_first_layer(
            lambda g: torch.optim.SGD(g, lr=0.01, momentum=0.9)
        ),
        one_cycle_with_momentum,
    ),
    "CyclicLR-SGD": (
        weight_decay_on_the_first_layer(
            lambda g: torch.optim.SGD(g, lr=0.01, momentum=0.9)
        ),
        cyclic_with_momentum,
    ),
    "warm-up-AdamW": (
        weight_decay_on_the_first_layer(lambda g: torch.optim.AdamW(g, lr=0.01)),
        WarmUp,
    ),
    "warm-up-SGD-nesterov": (
        weight_decay_on_the_first_layer(
            lambda g: torch.optim.SGD(g, lr=0.01, momentum=0.5, nesterov=True)
        ),
        WarmUp,
    ),
}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_schedule_of_any_number_needs_no_recapture(name: str, backend: str) -> None:
    # Each group's numbers are read at every call, as lr is: five steps of a
    # schedule that moves momentum, betas, eps or weight decay match eager's.
    make_optimizer, make_scheduler = SCHEDULES[name]
    forward = precompiled(mlp, make_optimizer, train_step, batch(0), backend)
    assert_steps_match_eager(
        forward, mlp, make_optimizer, make_scheduler, train_step, batch, steps=5
    )


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_checkpoint_moves_between_the_artifact_and_eager(backend: str) -> None:
    # Three steps through the artifact, a checkpoint of model and optimizer, then
    # three more steps each: the artifact's from the checkpoint loaded into a fresh
    # optimizer, and eager's from the same checkpoint; and the other way round.
    def make(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5)

    forward = precompiled(mlp, make, train_step, batch(0), backend)
    model = mlp()
    optimizer = make(model)
    for seed in range(3):
        forward(model, optimizer, *batch(seed))
    checkpoint = (model.state_dict(), optimizer.state_dict())
    twins = []
    for _ in range(2):
        # A copy each: load_state_dict keeps the dict's tensors, as a load from a
        # file would give each twin its own.
        model_state, optimizer_state = copy.deepcopy(checkpoint)
        twin = mlp()
        twin.load_state_dict(model_state)
        twin_optimizer = make(twin)
        twin_optimizer.load_state_dict(optimizer_state)
        twins.append((twin, twin_optimizer))
    (by_artifact, artifact_optimizer), (by_eager, eager_optimizer) = twins
    for seed in range(3, 6):
        loss = forward(by_artifact, artifact_optimizer, *batch(seed))
        expected = train_step(by_eager, eager_optimizer, *batch(seed))
        torch.testing.assert_close(loss, expected)
    assert_same_state(by_artifact, by_eager)
    assert_same_optimizer_state(
        artifact_optimizer, eager_optimizer, by_artifact, by_eager
    )
    # Eager's state, saved after eager steps, continues through the artifact.
    model = mlp()
    optimizer = make(model)
    for seed in range(3):
        train_step(model, optimizer, *batch(seed))
    twin = copy.deepcopy(model)
    twin_optimizer = make(twin)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for seed in range(3, 6):
        torch.testing.assert_close(
            forward(twin, twin_optimizer, *batch(seed)),
            train_step(model, optimizer, *batch(seed)),
        )
    assert_same_state(twin, model)
    assert_same_optimizer_state(twin_optimizer, optimizer, twin, model)


@pytest.mark.parametrize("name", ["SGD-nesterov", "AdamW-amsgrad", "AdamW-fused"])
def test_inductor_compiles_the_update_with_the_step(name: str) -> None:
    make_optimizer = OPTIMIZERS[name]
    forward = precompiled(mlp, make_optimizer, train_step, batch(0), "inductor")
    assert_steps_match_eager(forward, mlp, make_optimizer, one_cycle, train_step, batch)


def test_inductor_with_batch_norm() -> None:
    def make_model() -> nn.Module:
        return mlp(batch_norm=True)

    forward = precompiled(make_model, adam, train_step, batch(0), "inductor")
    assert_steps_match_eager(forward, make_model, adam, step_lr, train_step, batch)


def test_an_optimizer_that_has_already_stepped() -> None:
    # The example optimizer's state is read (copied) at capture; the runtime one
    # continues from its own.
    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=0.01)

    model = mlp()
    optimizer = make_optimizer(model)
    train_step(model, optimizer, *batch(50))
    step_lr(optimizer)
    code, cache = pg.precompile(
        train_step, model, optimizer, *batch(0), backend="eager"
    )
    # The scheduler's wrapper of step() ran in the trace, on no step of the example's.
    assert "_opt_called" not in vars(optimizer)
    forward = pg.load(code, cache)
    assert_steps_match_eager(
        forward, mlp, make_optimizer, one_cycle, train_step, batch, warm_up=2
    )


@pytest.mark.parametrize("name", ["NAdam", "ASGD", "Rprop"])
def test_a_first_state_that_is_not_zeros(name: str) -> None:
    # Captured from an optimizer that has stepped (its state is copied, the example's
    # left as it was), the artifact continues one that has stepped eagerly, and
    # creates a fresh one's first state as eager does: ASGD's eta and Rprop's step
    # sizes are the lr of that first call (OneCycleLR starts below the example's).
    make_optimizer = EVERY_OPTIMIZER[name]
    model = mlp()
    optimizer = make_optimizer(model)
    train_step(model, optimizer, *batch(50))
    state = StateSnapshot(list(optimizer.state.values()))
    code, cache = pg.precompile(
        train_step, model, optimizer, *batch(0), backend="eager"
    )
    state.assert_unchanged()
    forward = pg.load(code, cache)
    assert_steps_match_eager(
        forward, mlp, make_optimizer, step_lr, train_step, batch, warm_up=1
    )
    assert_steps_match_eager(forward, mlp, make_optimizer, one_cycle, train_step, batch)


class ComplexLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.complex64) @ self.weight).abs()


def test_complex_parameters_get_complex_first_state() -> None:
    # Eager fills a complex parameter's first step sizes with complex(lr, lr).
    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Rprop(model.parameters(), lr=0.01)

    forward = precompiled(ComplexLinear, make_optimizer, train_step, batch(0), "eager")
    assert_steps_match_eager(
        forward, ComplexLinear, make_optimizer, None, train_step, batch
    )


def test_frozen_parameters_several_groups_and_batch_norm() -> None:
    def make_model() -> nn.Module:
        model = mlp(batch_norm=True)
        model[0].requires_grad_(False)
        return model

    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        assert isinstance(model, nn.Sequential)
        head, body = model[3], model[:3]
        return torch.optim.SGD(
            [
                {"params": body.parameters(), "lr": 0.05},
                {"params": head.parameters(), "weight_decay": 0.1},
            ],
            lr=0.1,
            momentum=0.9,
        )

    forward = precompiled(make_model, make_optimizer, train_step, batch(0), "eager")
    assert [g["params"] for g in forward.__globals__["OPTIMIZERS"][0]["groups"]] == [
        [0, 1, 2],
        [3, 4],
    ]
    # The frozen layer gets no gradient, so no state: it is no graph input.
    state = forward.__globals__["OPTIMIZERS"][0]["state"]
    assert [index for index, *_ in state] == [1, 2, 3, 4]
    assert_steps_match_eager(
        forward, make_model, make_optimizer, step_lr, train_step, batch
    )


def test_two_modules_each_with_its_optimizer() -> None:
    def two_optimizers(
        encoder: nn.Module,
        encoder_optimizer: torch.optim.Optimizer,
        head: nn.Module,
        head_optimizer: torch.optim.Optimizer,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> torch.Tensor:
        encoder_optimizer.zero_grad()
        head_optimizer.zero_grad()
        loss = nn.functional.cross_entropy(head(torch.relu(encoder(x))), y)
        loss.backward()
        encoder_optimizer.step()
        head_optimizer.step()
        return loss.detach()

    def models() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Linear(4, 6), nn.Linear(6, 3)

    def optimizers(
        encoder: nn.Module, head: nn.Module
    ) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (
            torch.optim.AdamW(encoder.parameters(), lr=0.01),
            torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9),
        )

    encoder, head = models()
    encoder_optimizer, head_optimizer = optimizers(encoder, head)
    code, cache = pg.precompile(
        two_optimizers,
        encoder,
        encoder_optimizer,
        head,
        head_optimizer,
        *batch(0),
        backend="eager",
    )
    forward = pg.load(code, cache)
    assert [o["class"] for o in forward.__globals__["OPTIMIZERS"]] == ["AdamW", "SGD"]
    encoder, head = models()
    twin_encoder, twin_head = copy.deepcopy(encoder), copy.deepcopy(head)
    mine, twins = optimizers(encoder, head), optimizers(twin_encoder, twin_head)
    for seed in range(STEPS):
        loss = forward(encoder, mine[0], head, mine[1], *batch(seed))
        expected = two_optimizers(
            twin_encoder, twins[0], twin_head, twins[1], *batch(seed)
        )
        torch.testing.assert_close(loss, expected)
        assert_same_state(encoder, twin_encoder)
        assert_same_state(head, twin_head)
        assert_same_optimizer_state(mine[0], twins[0], encoder, twin_encoder)
        assert_same_optimizer_state(mine[1], twins[1], head, twin_head)
    # Each optimizer at the other's position is the wrong class.
    with pytest.raises(pg.PrecompileError) as info:
        forward(encoder, mine[1], head, mine[0], *batch(0))
    assert "argument 1 (`encoder_optimizer`) must be a torch.optim.AdamW" in str(
        info.value
    )


def test_inductor_with_tied_weights_and_two_groups() -> None:
    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        assert isinstance(model, TiedLM)
        return torch.optim.AdamW(
            [
                {"params": model.embed.parameters(), "weight_decay": 0.0},
                {"params": model.hidden.parameters()},
            ],
            lr=0.01,
        )

    forward = precompiled(TiedLM, make_optimizer, lm_step, tokens(0), "inductor")
    assert_steps_match_eager(forward, TiedLM, make_optimizer, step_lr, lm_step, tokens)


def test_tied_weights() -> None:
    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=0.01)

    forward = precompiled(TiedLM, make_optimizer, lm_step, tokens(0), "eager")
    assert_steps_match_eager(forward, TiedLM, make_optimizer, step_lr, lm_step, tokens)


def test_an_optimizer_argument_used_for_zero_grad_only() -> None:
    def backward_only(
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()

    forward = precompiled(mlp, adam, backward_only, batch(0), "eager")
    (spec,) = forward.__globals__["OPTIMIZERS"]
    assert (spec["steps"], spec["state"]) == (False, [])
    model = mlp()
    twin = copy.deepcopy(model)
    optimizer, twin_optimizer = adam(model), adam(twin)
    for seed in range(2):
        forward(model, optimizer, *batch(seed))
        backward_only(twin, twin_optimizer, *batch(seed))
        assert_same_state(model, twin)
    assert not optimizer.state


def test_inspect_shows_the_optimizer_and_the_artifact_its_contract() -> None:
    model = mlp()
    code, _ = pg.precompile(train_step, model, adam(model), *batch(0), backend="eager")
    assert "# - The function steps its optimizer argument(s) inside the graph" in code
    report = inspect_artifact(code)
    assert report["signature"] == (
        "train_step(model: nn.Module, optimizer: optim.Adam, x, y)"
    )
    (optimizer,) = report["optimizers"]
    assert optimizer["state_keys"] == ["step", "exp_avg", "exp_avg_sq"]
    assert optimizer["state_tensors"] == 12
    assert optimizer["groups"][0]["params"] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    text = format_report(report)
    assert "12 tensors: step, exp_avg, exp_avg_sq" in text
    assert "argument 2 (`x`)" in text and "argument 3 (`y`)" in text


# --- Misuse: each rejected with a message naming the problem, changing nothing ----


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def adam_step() -> Callable[..., object]:
    return precompiled(mlp, adam, train_step, batch(0), "eager")


class OptimizerSnapshot:
    """An optimizer's groups and state, to prove that a rejected call left them:
    the same objects, none written in place, with the same values."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups = [dict(group) for group in optimizer.param_groups]
        self.state = {
            param: {key: (value, _copy(value)) for key, value in entry.items()}
            for param, entry in optimizer.state.items()
        }

    def assert_unchanged(self) -> None:
        assert [dict(g) for g in self.optimizer.param_groups] == self.groups
        assert list(self.optimizer.state) == list(self.state)
        for param, entry in self.optimizer.state.items():
            assert list(entry) == list(self.state[param])
            for key, value in entry.items():
                original, (copy_of, version) = self.state[param][key]
                assert value is original, f"state {key!r} was replaced"
                if isinstance(value, torch.Tensor):
                    assert value._version == version, f"state {key!r} was written"
                    if value.device.type != "meta":
                        torch.testing.assert_close(value, copy_of, rtol=0, atol=0)


def _copy(value: object) -> tuple[object, int | None]:
    if isinstance(value, torch.Tensor):
        return value.clone(), value._version
    return value, None


def rejected(
    forward: Callable[..., object],
    model: nn.Module,
    optimizer: object,
    *inputs: torch.Tensor,
) -> str:
    snapshots = [StateSnapshot(model, *inputs)]
    optimizer_snapshot = (
        OptimizerSnapshot(optimizer)
        if isinstance(optimizer, torch.optim.Optimizer)
        else None
    )
    with pytest.raises(pg.PrecompileError) as info:
        forward(model, optimizer, *inputs)
    for snapshot in snapshots:
        snapshot.assert_unchanged()
    if optimizer_snapshot is not None:
        optimizer_snapshot.assert_unchanged()
    return str(info.value)


def stepped_adam(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = adam(model)
    train_step(model, optimizer, *batch(7))
    optimizer.zero_grad()
    return optimizer


def test_another_optimizer_class_is_rejected(adam_step: Callable[..., object]) -> None:
    model = mlp()
    message = rejected(
        adam_step, model, torch.optim.SGD(model.parameters(), lr=0.1), *batch(1)
    )
    assert "argument 1 (`optimizer`) must be a torch.optim.Adam" in message
    assert "got SGD" in message


def test_an_optimizer_of_another_model_is_rejected(
    adam_step: Callable[..., object],
) -> None:
    model = mlp()
    message = rejected(adam_step, model, adam(mlp()), *batch(1))
    assert "param group 0 of the Adam at argument 1 (`optimizer`) holds" in message
    assert "not in the model" in message
    assert "Build the optimizer from this model's parameters" in message


def test_a_parameter_replaced_after_the_optimizer_was_built_is_named(
    adam_step: Callable[..., object],
) -> None:
    # The optimizer holds the old tensor, the model the new one under the same name:
    # not an optimizer of another model.
    model = mlp()
    optimizer = adam(model)
    head = model[2]
    assert isinstance(head, nn.Linear)
    head.weight = nn.Parameter(head.weight.detach().clone())
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert message == (
        "param group 0 of the Adam at argument 1 (`optimizer`) holds tensors the "
        "model no longer has, where the traced step had the model's ['2.weight']: "
        "the model holds other tensors under those names now (a parameter replaced "
        "after the optimizer was built), which the optimizer does not hold. Build "
        "the optimizer from the model's current parameters, in the traced order, or "
        "capture again with it."
    )


def deep_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(20)), nn.Linear(4, 3))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_an_optimizer_of_another_model_is_named_in_a_short_message() -> None:
    # 42 parameters: a message that listed each foreign tensor ran to thousands of
    # characters before it said what to do.
    forward = precompiled(deep_mlp, sgd, train_step, batch(0), "eager")
    model = deep_mlp()
    message = rejected(forward, model, sgd(deep_mlp()), *batch(1))
    first_line, *details = message.split("\n")
    assert first_line == (
        "param group 0 of the SGD at argument 1 (`optimizer`) holds 42 of its 42 "
        "tensors not in the model: the optimizer was built for another model. Build "
        "the optimizer from this model's parameters, in the traced order, or capture "
        "again with it."
    )
    assert details == [
        "  holds [<a tensor of shape (4, 4)>, <a tensor of shape (4,)>, "
        "<a tensor of shape (4, 4)>] and 39 more",
        "  traced ['0.weight', '0.bias', '1.weight'] and 39 more",
    ]
    assert len(message) < 600, message


def test_other_param_groups_are_rejected(adam_step: Callable[..., object]) -> None:
    model = mlp()
    optimizer = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        lr=0.01,
    )
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "has 2 param groups, but the traced one had 1" in message


def test_foreach_and_fused_may_change_between_calls() -> None:
    # They choose eager's kernels, not the update: a call with other settings is
    # the same step.
    def fused(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=0.01, fused=True)

    def foreach(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)

    forward = precompiled(mlp, fused, train_step, batch(0), "eager")
    assert_steps_match_eager(forward, mlp, foreach, None, train_step, batch)


def test_a_value_that_decides_the_structure_is_rejected_when_it_changes(
    adam_step: Callable[..., object],
) -> None:
    # Adam without weight decay traced no decay at all: a decay now would be
    # another step, not other numbers.
    # Checked at every call, also after calls that passed with this optimizer.
    model = mlp()
    optimizer = stepped_adam(model)
    adam_step(model, optimizer, *batch(1))
    optimizer.param_groups[0]["weight_decay"] = 0.01
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "has weight_decay=0.01" in message
    assert "the traced step was built for weight_decay == 0.0" in message
    assert "decides which operations the step runs" in message
    assert "Set it back, or capture again with this value" in message
    # A flag is built into the graph, and checked by value.
    optimizer = stepped_adam(model)
    optimizer.param_groups[0]["amsgrad"] = True
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "has amsgrad=True" in message
    assert "built with amsgrad=False" in message
    assert "Set it back, or capture again with this value" in message
    # A value the graph reads at each call must be a number.
    optimizer = stepped_adam(model)
    optimizer.param_groups[0]["betas"] = (torch.tensor(0.9), 0.999)
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "has betas[0]=tensor(0.9000)" in message
    assert "Set it to a Python number" in message


def test_sgd_momentum_that_becomes_zero_is_rejected() -> None:
    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    forward = precompiled(mlp, sgd, train_step, batch(0), "eager")
    model = mlp()
    optimizer = sgd(model)
    optimizer.param_groups[0]["momentum"] = 0.0
    message = rejected(forward, model, optimizer, *batch(1))
    assert "has momentum=0.0" in message
    assert "built for momentum != 0.0" in message
    assert "Set it back, or capture again with this value" in message


def test_state_of_another_layout_is_rejected(adam_step: Callable[..., object]) -> None:
    model = mlp()
    optimizer = stepped_adam(model)
    first = next(iter(model.parameters()))
    optimizer.state[first]["exp_avg"] = optimizer.state[first]["exp_avg"].double()
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "state 'exp_avg' of the model's '0.weight'" in message
    assert "dtype torch.float64" in message
    del optimizer.state[first]["exp_avg_sq"]
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "holds the state ['step', 'exp_avg'] for the model's '0.weight'" in message


def test_state_in_another_memory_layout_is_rejected_on_inductor() -> None:
    forward = precompiled(mlp, adam, train_step, batch(0), "inductor")
    model = mlp()
    optimizer = stepped_adam(model)
    first, *others = model.parameters()
    # Only the first parameter has state, its exp_avg laid out transposed. Inductor
    # asserts that layout only after kernels that update parameters in place, so the
    # driver checks it first, before creating the others' first-step state.
    for param in others:
        del optimizer.state[param]
    exp_avg = optimizer.state[first]["exp_avg"]
    optimizer.state[first]["exp_avg"] = exp_avg.t().contiguous().t()
    message = rejected(forward, model, optimizer, *batch(1))
    assert (
        "the state 'exp_avg' of the model's '0.weight' in the Adam at argument 1 "
        "(`optimizer`) has strides (1, 8), but the example had (4, 1)"
    ) in message
    assert "Pass it in the example's layout" in message
    assert list(optimizer.state) == [first]
    # With the layout restored, the same call steps as eager does.
    optimizer.state[first]["exp_avg"] = exp_avg
    twin, twin_optimizer = copy.deepcopy((model, optimizer))
    torch.testing.assert_close(
        forward(model, optimizer, *batch(1)),
        train_step(twin, twin_optimizer, *batch(1)),
    )
    torch.testing.assert_close(
        dict(model.named_parameters()), dict(twin.named_parameters())
    )


def test_a_stale_gradient_is_rejected() -> None:
    # Without zero_grad() in the function, eager would step with the sum of the old
    # and the new gradient; the traced step saw the new one alone.
    forward = precompiled(mlp, adam, step_without_reset, batch(0), "eager")
    model = mlp()
    optimizer = adam(model)
    # Without a .grad, the call is eager's step.
    twin = copy.deepcopy(model)
    twin_optimizer = adam(twin)
    forward(model, optimizer, *batch(1))
    step_without_reset(twin, twin_optimizer, *batch(1))
    assert_same_state(model, twin)
    message = rejected(forward, model, optimizer, *batch(2))
    assert "the model's '0.weight' comes with a .grad" in message
    assert "Call zero_grad() in the function" in message


class WithUnusedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def step_without_reset(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_a_gradient_the_step_would_apply_to_an_unreached_parameter_is_rejected() -> (
    None
):
    forward = precompiled(WithUnusedLayer, adam, step_without_reset, batch(0), "eager")
    model = WithUnusedLayer()
    optimizer = adam(model)
    model.unused.weight.grad = torch.ones_like(model.unused.weight)
    message = rejected(forward, model, optimizer, *batch(1))
    assert "the model's 'unused.weight' has a .grad" in message
    assert "the traced step had no gradient for it" in message
    assert "Set its .grad to None before the call" in message


def test_a_bad_lr_and_state_of_other_types_or_devices_are_rejected(
    adam_step: Callable[..., object],
) -> None:
    model = mlp()
    optimizer = stepped_adam(model)
    optimizer.param_groups[0]["lr"] = "0.01"
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "has lr='0.01'; it must be a number or a one-element tensor" in message
    optimizer.param_groups[0]["lr"] = 0.01
    first = next(iter(model.parameters()))
    step_count = optimizer.state[first]["step"]
    optimizer.state[first]["step"] = 1.0
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "state 'step' of the model's '0.weight' is a float" in message
    optimizer.state[first]["step"] = step_count.to("meta")
    message = rejected(adam_step, model, optimizer, *batch(1))
    assert "state 'step' of the model's '0.weight' is on device 'meta'" in message
    assert "Move the optimizer's state there" in message


def test_a_gradient_hook_is_rejected(adam_step: Callable[..., object]) -> None:
    model = mlp()
    weight = model[2].weight
    assert isinstance(weight, torch.Tensor)
    weight.register_hook(lambda grad: grad * 2)
    message = rejected(adam_step, model, adam(model), *batch(1))
    assert "the model's '2.weight' has a gradient hook" in message


def test_a_fresh_sgd_with_dampening_is_rejected() -> None:
    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)

    forward = precompiled(mlp, sgd, train_step, batch(0), "eager")
    model = mlp()
    message = rejected(forward, model, sgd(model), *batch(1))
    assert "no momentum buffer yet" in message
    assert "dampening=0" in message
    # Once the optimizer has stepped, its buffers exist and the call is eager's.
    assert_steps_match_eager(forward, mlp, sgd, None, train_step, batch, warm_up=1)


def test_unsupported_optimizers_are_refused_at_capture() -> None:
    model = mlp()
    snapshot = StateSnapshot(model)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.01)
    with pytest.raises(pg.PrecompileError) as info:
        pg.precompile(train_step, model, lbfgs, *batch(0), backend="eager")
    assert "calls step() on the optimizer LBFGS" in str(info.value)
    assert "as many times as its line search decides" in str(info.value)
    assert "Precompile the closure's forward and backward instead" in str(info.value)
    stranger = torch.optim.SGD(
        [*model.parameters(), nn.Parameter(torch.ones(2))], lr=0.1
    )
    with pytest.raises(
        pg.PrecompileError, match="not a parameter of a module argument"
    ):
        pg.precompile(train_step, model, stranger, *batch(0), backend="eager")
    hooked = adam(model)
    hooked.register_step_pre_hook(lambda *_: None)
    with pytest.raises(pg.PrecompileError, match="has step hooks"):
        pg.precompile(train_step, model, hooked, *batch(0), backend="eager")
    snapshot.assert_unchanged()


# --- Real programs: models nobody here wrote, stepping their optimizer -------------


def hf_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=False)
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_resnet18_with_sgd() -> None:
    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4
        )

    def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A batch of 8: at 32x32 the last stage's BatchNorms normalise over the
        # batch alone, which with 2 samples amplifies any rounding a thousandfold
        # per step.
        return model_zoo.images(8, 32, seed)

    forward = precompiled(model_zoo.resnet18, sgd, train_step, make_batch(0), "eager")
    # The graph reads weight_decay and momentum at each call, so it computes
    # grad + weight_decay * param as a product and a sum, where eager's add fuses
    # them (one rounding): after three steps at this lr, parameters differ by about
    # 4e-5 relative, gradients by 3e-5 of their largest value.
    assert_steps_match_eager(
        forward,
        model_zoo.resnet18,
        sgd,
        step_lr,
        train_step,
        make_batch,
        rtol=1e-4,
        atol=1e-4,
    )


def test_gpt2_with_adamw_and_dropout() -> None:
    def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return model_zoo.tokens(None, seed)

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    forward = precompiled(model_zoo.gpt2, adamw, hf_step, make_batch(0), "eager")
    # Its attention's key biases get gradients of rounding noise only (softmax does
    # not see them), which Adam's normalised update turns into steps of about lr:
    # there the capturable formulation's rounding shows most, so lr stays small.
    assert_steps_match_eager(
        forward, model_zoo.gpt2, adamw, step_lr, hf_step, make_batch
    )


def test_optimizer_configurations_the_artifact_cannot_hold_are_refused_at_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = mlp()
    snapshot = StateSnapshot(model)

    def refused(optimizer: torch.optim.Optimizer, *inputs: torch.Tensor) -> str:
        with pytest.raises(pg.PrecompileError) as info:
            pg.precompile(train_step, model, optimizer, *inputs, backend="eager")
        return str(info.value)

    differentiable = torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True)
    assert "differentiable=True" in refused(differentiable, *batch(0))
    tensor_option = torch.optim.SGD(model.parameters(), lr=0.1)
    tensor_option.param_groups[0]["weight_decay"] = torch.tensor(0.1)
    message = refused(tensor_option, *batch(0))
    assert "has weight_decay=tensor(0.1000) (a Tensor)" in message
    assert "Pass a Python number" in message
    wide_lr = torch.optim.SGD(model.parameters(), lr=0.1)
    wide_lr.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])
    assert "lr is a tensor of shape (2,)" in refused(wide_lr, *batch(0))
    foreign_state = adam(model)
    first = next(iter(model.parameters()))
    foreign_state.state[first] = {"momentum_buffer": torch.zeros_like(first)}
    message = refused(foreign_state, *batch(0))
    assert "holds state ['momentum_buffer']" in message
    assert "keeps the tensors ['step', 'exp_avg', 'exp_avg_sq']" in message
    x, y = batch(0)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    with pytest.raises(pg.PrecompileError, match="together with mark_unbacked dims"):
        pg.precompile(train_step, model, adam(model), x, y, backend="inductor")

    # A step that took its lr from anywhere but the group's tensor would keep it
    # fixed in the graph. (One that read the tensor with .item() fails in the trace.)
    def fixed_lr_sgd(
        params: list[torch.Tensor], grads: list[torch.Tensor], *_: object, **__: object
    ) -> None:
        for param, grad in zip(params, grads, strict=True):
            param.add_(grad, alpha=-0.1)

    monkeypatch.setattr(sys.modules["torch.optim.sgd"], "sgd", fixed_lr_sgd)
    message = refused(torch.optim.SGD(model.parameters(), lr=0.1), *batch(0))
    assert (
        "the optimizer SGD at argument 1 (`optimizer`) did not read param group 0's lr"
    ) in message
    snapshot.assert_unchanged()
