"""Float arguments the function computes with: graph inputs, as under torch.compile.

A sampling temperature, a mixup coefficient or a loss weight passed as a Python
float changes at every call. The graph takes each such float as a number (a 0-dim
float64 tensor), so one artifact serves every value, on both backends, and matches
eager. A float the function also uses as a Python value (a comparison, a branch, a
torch argument that takes only a number) is built in as the example's, and a call
with another value is refused, naming the line that used it. Each artifact is
compiled once per backend in a module-scoped fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
import pytest
import torch
from helpers.source_lines import portable_line_of
from helpers.state_snapshot import assert_call_rejected
from torch import nn
from torch.nn import functional as F

import precompile_gen as pg

BACKENDS = ["eager", "inductor"]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_classifier(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def artifact(fn: Callable[..., object], *args: object, backend: str) -> Callable:
    code, cache = pg.precompile(fn, *args, backend=backend)
    return pg.load(code, cache)


def assert_matches(got: torch.Tensor, want: torch.Tensor, backend: str) -> None:
    # Inductor fuses softmax and the losses, which moves the last bit.
    if backend == "eager":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- A training step with a mixup coefficient and a temperature -----------------------


def mixup_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    lam: float,
    temperature: float,
) -> tuple[torch.Tensor, float]:
    # As timm and many scripts write it, with the draw made by the caller.
    mixed = lam * x + (1 - lam) * x.flip(0)
    logits = model(mixed) / temperature
    loss = lam * F.cross_entropy(logits, y) + (1.0 - lam) * F.cross_entropy(
        logits, y.flip(0)
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), lam / temperature


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.fixture(scope="module", params=BACKENDS)
def mixup(request: pytest.FixtureRequest) -> tuple[str, Callable]:
    model = make_classifier(0)
    step = artifact(
        mixup_step,
        model,
        sgd(model),
        randn(6, 4, seed=1),
        torch.tensor([0, 1, 2, 0, 1, 2]),
        0.7,
        1.0,
        backend=request.param,
    )
    return request.param, step


def test_a_training_step_takes_new_floats_at_every_call(
    mixup: tuple[str, Callable],
) -> None:
    backend, step = mixup
    ours, theirs = make_classifier(3), make_classifier(3)
    our_sgd, their_sgd = sgd(ours), sgd(theirs)
    draws = np.random.default_rng(0).beta(0.4, 0.4, size=4)
    for call, (lam, temperature) in enumerate(
        zip(map(float, draws), [1.0, 0.5, 2.0, 0.7], strict=True)
    ):
        x, y = randn(6, 4, seed=10 + call), torch.randint(0, 3, (6,))
        got_loss, got_ratio = step(ours, our_sgd, x, y, lam, temperature)
        want_loss, want_ratio = mixup_step(theirs, their_sgd, x, y, lam, temperature)
        assert_matches(got_loss, want_loss, backend)
        # The number the step returns is computed by the graph, in float64 as Python
        # computes it.
        assert type(got_ratio) is float and got_ratio == want_ratio
        for got, want in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert_matches(got, want, backend)
            momentum = their_sgd.state[want]["momentum_buffer"]
            assert_matches(our_sgd.state[got]["momentum_buffer"], momentum, backend)


def test_a_float_argument_is_a_number_of_the_graph(
    mixup: tuple[str, Callable],
) -> None:
    _, step = mixup
    # lam and temperature, leaves 2 and 3: numbers the graph takes, no values kept.
    assert step.__globals__["NUMBER_INPUTS"] == {2: None, 3: None}
    assert step.__globals__["USER_INPUT_VALUES"] == [None, None, None, None]


def test_a_call_without_a_float_is_refused_and_changes_nothing(
    mixup: tuple[str, Callable],
) -> None:
    _, step = mixup
    model = make_classifier(3)
    optimizer = sgd(model)
    x, y = randn(6, 4, seed=5), torch.tensor([0, 1, 2, 0, 1, 2])
    assert_call_rejected(
        step,
        model,
        optimizer,
        x,
        y,
        1,
        1.0,
        match=[
            "argument 4 (`lam`) is 1",
            "traced with a float there",
            "Pass a Python float",
        ],
    )
    assert optimizer.state == {}


# --- Sampling at a temperature --------------------------------------------------------


def sample_probs(model: nn.Module, x: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(model(x) / temperature, dim=-1)


def test_sampling_at_new_temperatures_matches_eager() -> None:
    model = make_classifier(0)
    probs = artifact(sample_probs, model, randn(5, 4, seed=0), 1.0, backend="eager")
    for seed, temperature in enumerate([1.0, 0.5, 2.0, 1e-3]):
        x = randn(5, 4, seed=seed)
        got = probs(model, x, temperature)
        assert torch.equal(got, sample_probs(model, x, temperature))


def numbers(
    model: nn.Module, x: torch.Tensor, t: float
) -> tuple[torch.Tensor, float, float, float, float]:
    return model(x), 3.0 / t, t / 3.0, 0.1 - t * 0.7, (t + 0.7) / (t - 0.3)


def test_arithmetic_between_numbers_is_python_s_bit_for_bit() -> None:
    # 3.0 / t computed as t.reciprocal() * 3.0 would round twice: it differs from
    # Python's in about a third of these.
    model = make_classifier(0)
    computed = artifact(numbers, model, randn(1, 4, seed=0), 1.7, backend="eager")
    x = randn(1, 4, seed=1)
    for t in np.random.default_rng(1).uniform(0.31, 10.0, size=200).tolist():
        got = cast(tuple[object, ...], computed(model, x, t))
        assert got[1:] == numbers(model, x, t)[1:]


def reciprocal_scaled(model: nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    return model(x) * (1.0 / scale)


def test_a_division_by_a_zero_float_raises_as_eager_does() -> None:
    model = make_classifier(0)
    scaled = artifact(
        reciprocal_scaled, model, randn(2, 4, seed=0), 2.0, backend="eager"
    )
    x = randn(2, 4, seed=1)
    assert torch.equal(scaled(model, x, 4.0), reciprocal_scaled(model, x, 4.0))
    with pytest.raises(ZeroDivisionError):
        reciprocal_scaled(model, x, 0.0)
    with pytest.raises(RuntimeError, match="divides by zero, where eager raises"):
        scaled(model, x, 0.0)


# --- A float used as a Python value ---------------------------------------------------


def sharpened(model: nn.Module, x: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = model(x) / temperature
    if temperature < 1.0:
        logits = logits - logits.max(dim=-1, keepdim=True).values
    return logits.softmax(dim=-1)


def test_a_float_compared_is_built_in_and_held_to_its_line() -> None:
    model = make_classifier(0)
    probs = artifact(sharpened, model, randn(3, 4, seed=0), 0.5, backend="eager")
    x = randn(3, 4, seed=1)
    assert torch.equal(probs(model, x, 0.5), sharpened(model, x, 0.5))
    with pytest.raises(pg.PrecompileError) as info:
        probs(model, x, 2.0)
    message = str(info.value)
    assert "argument 2 (`temperature`) is 2.0" in message
    assert "its traced value 0.5 as a Python value at" in message
    assert portable_line_of(sharpened, "if temperature < 1.0") in message
    assert "Pass 0.5" in message


def dropped(model: nn.Module, x: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(model(x), p=p, training=False) * p


def clamped(model: nn.Module, x: torch.Tensor, limit: float) -> torch.Tensor:
    # torch.clamp takes only a Python number for max: traced with it built in.
    return torch.clamp(model(x), max=limit)


@pytest.mark.parametrize(
    ("fn", "value", "other", "why"),
    [
        (dropped, 0.25, 0.5, "passed to torch.nn.functional.dropout"),
        (clamped, 0.1, 0.2, "traced with 0.1, which the graph has built in"),
    ],
)
def test_a_float_a_torch_function_takes_is_built_in(
    fn: Callable[..., torch.Tensor], value: float, other: float, why: str
) -> None:
    model = make_classifier(0)
    run = artifact(fn, model, randn(3, 4, seed=0), value, backend="eager")
    x = randn(3, 4, seed=1)
    assert torch.equal(run(model, x, value), fn(model, x, value))
    with pytest.raises(pg.PrecompileError) as info:
        run(model, x, other)
    assert f"is {other}" in str(info.value)
    if fn is dropped:
        assert portable_line_of(dropped, "F.dropout") in str(info.value)
    else:
        assert why in str(info.value)
