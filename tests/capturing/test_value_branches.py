"""Python that branches on a tensor's value: both sides traced, one graph with a
torch.cond per branch, on both backends.

Each program is captured once per backend in a module-scoped fixture, on an example
that takes one side of each branch; the calls then take every side, and each is
compared with eager over several calls with new values: results, parameters,
buffers, gradients and optimizer state. A branch whose sides the driver cannot
serve alike is refused at capture, naming its line, with the model untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from helpers.source_lines import line_of, portable_line_of
from helpers.state_snapshot import StateSnapshot
from torch import nn
from torch.ao import quantization
from torch.nn import functional as F
from torch.optim import swa_utils

import precompile_gen as pg
from precompile_gen.capturing import branches as pg_branches

BACKENDS = ["eager", "inductor"]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Captured:
    """A loaded artifact, callable, with its code."""

    def __init__(self, fn: Callable[..., object], *args: object, backend: str) -> None:
        self.code, cache = pg.precompile(fn, *args, backend=backend)
        self.run = pg.load(self.code, cache)

    def __call__(self, *args: object) -> object:
        return self.run(*args)


def capture(fn: Callable[..., object], *args: object, backend: str) -> Captured:
    return Captured(fn, *args, backend=backend)


def assert_close(got: object, want: object, backend: str) -> None:
    # Inductor fuses the losses and the optimizer's update, and the traced
    # optimizer step takes a tensor learning rate: last bits move on either backend.
    del backend
    torch.testing.assert_close(got, want)


def header_text(code: str) -> str:
    """The artifact's header comment as one line of text, its wrapping undone."""
    lines = code[: code.index("# Sections, and the line")].splitlines()
    return " ".join(line.removeprefix("#").strip() for line in lines)


def assert_same_state(got: nn.Module, want: nn.Module, backend: str) -> None:
    assert_close(got.state_dict(), want.state_dict(), backend)
    for (name, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_close(p.grad, q.grad, backend)


# --- The user's own branch -----------------------------------------------------------


def make_linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def signed(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if y.sum() > 0:
        return out + y
    return out - y


def signed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The backward spans the branch: the forward before it and the side after it.
    out = model(x)
    z = out * y if y.sum() > 0 else (out - y).relu()
    loss = z.pow(2).mean()
    loss.backward()
    return loss.detach()


def sign_checks(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Two branches in a row: four paths, and a value converted with float(bool()).
    out = model(x)
    if out.mean() > 0:
        out = out * 2
    scale = float(bool((y > 0).all()))
    return out * scale + y


@pytest.fixture(scope="module", params=BACKENDS)
def signed_artifacts(request: pytest.FixtureRequest) -> dict[str, Callable]:
    backend = request.param
    model, x, y = make_linear(0), randn(5, 4, seed=1), randn(5, 3, seed=2).abs()
    return {
        "backend": backend,
        "predict": capture(signed, model, x, y, backend=backend),
        "step": capture(signed_step, model, x, y, backend=backend),
        "checks": capture(sign_checks, model, x, y, backend=backend),
    }


@pytest.mark.parametrize("name", ["predict", "step"])
def test_each_call_takes_the_side_its_values_decide(
    signed_artifacts: dict, name: str
) -> None:
    fn = signed if name == "predict" else signed_step
    backend = signed_artifacts["backend"]
    model, eager_model = make_linear(0), make_linear(0)
    for call, sign in enumerate([-1.0, 1.0, -1.0, 1.0]):
        x, y = randn(5, 4, seed=10 + call), randn(5, 3, seed=20 + call).abs() * sign
        assert_close(
            signed_artifacts[name](model, x, y), fn(eager_model, x, y), backend
        )
        assert_same_state(model, eager_model, backend)


def test_two_branches_serve_all_four_paths(signed_artifacts: dict) -> None:
    backend = signed_artifacts["backend"]
    model = make_linear(0)
    x = randn(5, 4, seed=1)
    for scale, flip in [(1.0, 1.0), (-1.0, 1.0), (1.0, -1.0), (-1.0, -1.0)]:
        y = randn(5, 3, seed=3).abs() * flip
        xs = x * scale
        assert_close(
            signed_artifacts["checks"](model, xs, y), sign_checks(model, xs, y), backend
        )


def test_the_header_names_each_branch_and_the_graph_holds_a_cond(
    signed_artifacts: dict,
) -> None:
    code = signed_artifacts["checks"].code
    header = header_text(code)
    assert "it is a torch.cond in the graph" in header
    assert "The 2 branches:" in header
    for text in ("if out.mean() > 0:", "scale = float(bool("):
        # Named relative to the working directory: no folder of this machine.
        assert portable_line_of(sign_checks, text) in header
    assert line_of(sign_checks, "if out.mean()") not in code
    if signed_artifacts["backend"] == "eager":
        assert "torch.ops.higher_order.cond(" in code
        assert "def _graph_true_graph_0__true_graph_0(self" in code


# --- A training step with its optimizer and BatchNorm --------------------------------


def make_bn_net(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def robust_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    out = model(x)
    # A loss chosen by the batch: BatchNorm's statistics are updated before the
    # branch, the backward and the momentum step after it, on either side.
    if y.abs().max() > 1:  # noqa: SIM108 (the if statement, as users write it)
        loss = F.smooth_l1_loss(out, y)
    else:
        loss = F.mse_loss(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_training_step_branches_between_losses(backend: str) -> None:
    model, optimizer = make_bn_net(0)
    run = capture(
        robust_step,
        model,
        optimizer,
        randn(6, 4, seed=1),
        randn(6, 2, seed=2) * 0.1,
        backend=backend,
    )
    eager_model, eager_optimizer = make_bn_net(0)
    for call, spread in enumerate([3.0, 0.1, 0.1, 3.0]):
        x, y = randn(6, 4, seed=30 + call), randn(6, 2, seed=40 + call) * spread
        assert_close(
            run(model, optimizer, x, y),
            robust_step(eager_model, eager_optimizer, x, y),
            backend,
        )
        assert_same_state(model, eager_model, backend)
        momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
        assert_close(
            momentum,
            [
                eager_optimizer.state[p]["momentum_buffer"]
                for p in eager_model.parameters()
            ],
            backend,
        )


def make_sgd_linear(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_linear(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def normalised_when_large(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    if loss.item() > 1.0:  # a Python float compared: a branch on the loss's value
        loss = loss / loss.detach()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_item_compared_is_a_branch(backend: str) -> None:
    x, y = randn(5, 4, seed=1), randn(5, 3, seed=2)
    run = capture(
        normalised_when_large, *make_sgd_linear(0), x, y * 0.1, backend=backend
    )
    got, want = make_sgd_linear(0), make_sgd_linear(0)
    for call, spread in enumerate([10.0, 0.1, 10.0, 0.1]):
        x, y = randn(5, 4, seed=70 + call), randn(5, 3, seed=80 + call) * spread
        assert_close(run(*got, x, y), normalised_when_large(*want, x, y), backend)
        assert_same_state(got[0], want[0], backend)


# --- Library modules that branch on buffer values ------------------------------------


def averaged_step(
    model: nn.Linear, averaged: swa_utils.AveragedModel, x: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        model.weight.add_(x.mean())
    # Branches on n_averaged == 0: a copy at the first call, a running mean after.
    averaged.update_parameters(model)
    return averaged(x)


def make_averaged(seed: int) -> tuple[nn.Linear, swa_utils.AveragedModel]:
    model = make_linear(seed)
    return model, swa_utils.AveragedModel(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_averaged_model_copies_then_averages(backend: str) -> None:
    # Captured on a model averaged once already: the first call takes the side the
    # example did not.
    model, averaged = make_averaged(0)
    averaged.update_parameters(model)
    run = capture(averaged_step, model, averaged, randn(3, 4, seed=1), backend=backend)
    got, want = make_averaged(0), make_averaged(0)
    for call in range(3):
        x = randn(3, 4, seed=50 + call)
        assert_close(run(*got, x), averaged_step(*want, x), backend)
        assert_close(got[1].state_dict(), want[1].state_dict(), backend)
    assert int(got[1].n_averaged) == 3


def make_fake_quantized(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), quantization.FakeQuantize(), nn.ReLU(), nn.Linear(6, 2)
    )


def quantized_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def test_fake_quantize_is_refused_for_its_number_of_paths() -> None:
    # Its observer's and its checks' branches make 20 paths through one module,
    # each traced and compiled whole: more than capture explores.
    model = make_fake_quantized(0)
    snapshot = StateSnapshot(model)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(quantized_step, model, randn(5, 4, seed=1), backend="eager")
    message = str(caught.value)
    for expected in (
        f"more than {pg_branches.MAX_PATHS} paths",
        "torch/ao/quantization/",
        portable_line_of(quantized_step, "loss = model(x)"),
        "torch.where",
    ):
        assert expected in message, f"{expected!r} not in the message: {message}"
    snapshot.assert_unchanged()


# --- A step skipped on a bad batch ---------------------------------------------------


def make_adamw_linear(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_linear(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def skipping_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    if not torch.isfinite(loss):
        return loss.detach()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()  # after the step: the skipping path resets nothing
    return loss.detach()


def skipping_step_reset_first(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    optimizer.zero_grad()  # before the branch: both paths reset
    loss = F.mse_loss(model(x), y)
    if not torch.isfinite(loss):
        return loss.detach()
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", [skipping_step, skipping_step_reset_first])
def test_a_step_skipped_on_a_bad_batch_leaves_the_model_as_eager_does(
    fn: Callable[..., torch.Tensor], backend: str
) -> None:
    x, y = randn(5, 4, seed=1), randn(5, 3, seed=2)
    run = capture(fn, *make_adamw_linear(0), x, y, backend=backend)
    assert "SKIPPABLE_STEP: bool = True" in run.code
    got, want = make_adamw_linear(0), make_adamw_linear(0)
    # The first call skips: no gradients, no optimizer state, as eager leaves them.
    for call, scale in enumerate([float("inf"), 1.0, float("nan"), 1.0, 1.0]):
        x, y = randn(5, 4, seed=90 + call) * scale, randn(5, 3, seed=95 + call)
        torch.testing.assert_close(run(*got, x, y), fn(*want, x, y), equal_nan=True)
        assert_same_state(got[0], want[0], backend)
        assert len(got[1].state) == len(want[1].state)
        assert_close(got[1].state_dict(), want[1].state_dict(), backend)


# --- Refusals ------------------------------------------------------------------------


def diverging_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if torch.isfinite(loss):
        optimizer.step()
    # The gradients stay on .grad where the step did not run: not a skipped step.
    return loss.detach()


def halving(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    while out.abs().max() > 1:
        out = out / 2
    return out


def test_a_loop_on_a_value_is_refused_at_capture() -> None:
    model = make_linear(0)
    model(randn(2, 4, seed=0)).sum().backward()  # a .grad to keep untouched
    x = randn(5, 4, seed=1) * 1e6
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(halving, model, x, backend="eager")
    message = str(caught.value)
    for expected in (
        portable_line_of(halving, "while out.abs().max() > 1:"),
        "a loop whose number of iterations",
        "torch.where",
    ):
        assert expected in message, f"{expected!r} not in the message: {message}"
    snapshot.assert_unchanged()


def returns_a_number(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    out = model(x)
    if out.sum() > 0:
        return out, 1
    return out * 2, 1


def skips_two_ways(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    if loss > 100:
        return loss.detach()
    if loss > 50:  # skips too, but resets what the first skip leaves
        optimizer.zero_grad()
        return loss.detach()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


@pytest.mark.parametrize(
    ("fn", "problem", "fix"),
    [
        (returns_a_number, "returns a Python value (1) after a branch", "tensors"),
        (skips_two_ways, "skip its step and reset other .grad fields", "before the"),
    ],
)
def test_paths_one_driver_cannot_follow_are_refused_at_capture(
    fn: Callable[..., object], problem: str, fix: str
) -> None:
    model, optimizer = make_adamw_linear(0)
    x = randn(5, 4, seed=1)
    args = (model, x) if fn is returns_a_number else (model, optimizer, x, x[:, :3])
    snapshot = StateSnapshot(*args)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(fn, *args, backend="eager")
    message = str(caught.value)
    for expected in (problem, fix):
        assert expected in message, f"{expected!r} not in the message: {message}"
    snapshot.assert_unchanged()
    assert not optimizer.state


def first_rows(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if out.sum() > 0:
        return out[:2]
    return out


def checked(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if not (out.abs() < 1e3).all():
        raise ValueError("activations out of range")
    return out.relu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("fn", "text", "why"),
    [
        (diverging_step, "if torch.isfinite(loss):", "its sides differ in"),
        (first_rows, "if out.sum() > 0:", "other shapes or dtypes"),
        (checked, "if not (out.abs() < 1e3).all():", "ValueError when traced"),
    ],
)
def test_a_side_one_graph_cannot_serve_is_refused_at_the_call_that_takes_it(
    fn: Callable[..., object], text: str, why: str, backend: str
) -> None:
    def arguments(model: nn.Module, optimizer: object, scale: float) -> tuple:
        x = randn(5, 4, seed=1) * scale
        if fn is diverging_step:
            return (model, optimizer, x, randn(5, 3, seed=2))
        return (model, x)

    model, optimizer = make_adamw_linear(0)
    sign = -100.0 if fn is first_rows else 1.0  # the example's sum is negative
    run = capture(fn, *arguments(model, optimizer, sign), backend=backend)
    where = portable_line_of(fn, text)
    header = header_text(run.code)
    assert where in header and why in header
    # The side the example took runs as eager's.
    eager_model, eager_optimizer = make_adamw_linear(0)
    assert_close(
        run(*arguments(model, optimizer, sign)),
        fn(*arguments(eager_model, eager_optimizer, sign)),
        backend,
    )
    assert_same_state(model, eager_model, backend)
    # The other side: a clear error, and the model and optimizer as they were.
    calls: dict[Callable[..., object], float] = {
        diverging_step: float("inf"),
        first_rows: -sign,
        checked: 1e4,
    }
    bad = calls[fn]
    args = arguments(model, optimizer, bad)
    snapshot = StateSnapshot(*args)
    values = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    with pytest.raises(pg.PrecompileError) as caught:
        run(*args)
    message = str(caught.value)
    for expected in (where, why, "Run this call eagerly"):
        assert expected in message, f"{expected!r} not in the message: {message}"
    # Values, .grad fields and version counters (AOTAutograd counts a version of
    # each input the graph writes before it runs; the driver gives them back).
    snapshot.assert_unchanged()
    torch.testing.assert_close(
        (model.state_dict(), optimizer.state_dict()), values, rtol=0, atol=0
    )
