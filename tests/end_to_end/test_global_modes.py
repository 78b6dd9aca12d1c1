"""Torch's global modes at capture and at call: inference mode, grad mode, autocast,
deterministic algorithms and the backends' flags. Each artifact matches eager in
the mode it is called in, or, where the mode changes what the graph computes
(autocast), computes what was captured; a backward with grad mode off, which eager
refuses, is refused clearly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import cast

import pytest
import torch
from torch import nn

import precompile_gen as pg

Mode = Callable[[], contextlib.AbstractContextManager[object]]


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def _mlp(training: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)
    )
    norm = model[1]
    assert isinstance(norm, nn.BatchNorm1d)
    with torch.no_grad():
        cast(torch.Tensor, norm.running_mean).uniform_(-0.5, 0.5)
        cast(torch.Tensor, norm.running_var).uniform_(0.5, 1.5)
    return model.train(training)


def _conv() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )


def _x() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def _image() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _autocast() -> contextlib.AbstractContextManager[object]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _load(
    fn: Callable[..., object], *args: object, backend: str
) -> Callable[..., object]:
    code, cache = pg.precompile(fn, *args, backend=backend)
    return pg.load(code, cache)


def _check(
    forward: Callable[..., object], model: nn.Module, x: torch.Tensor, mode: Mode
) -> torch.Tensor:
    """The artifact's result in ``mode`` against eager's in the same mode."""
    with mode():
        out = forward(model, x)
        expected = predict(model, x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, expected)
    return out


# --- Inference mode -----------------------------------------------------------------
@pytest.fixture(scope="module", params=["eager", "inductor"])
def inference_forward(request: pytest.FixtureRequest) -> Callable[..., object]:
    """Captured inside inference mode, from a model made there: its parameters and
    the input are inference tensors."""
    with torch.inference_mode():
        return _load(predict, _mlp(), _x(), backend=request.param)


def test_inference_mode_call_matches_eager(
    inference_forward: Callable[..., object],
) -> None:
    with torch.inference_mode():
        model = _mlp()
    out = _check(inference_forward, model, _x(), torch.inference_mode)
    assert out.is_inference()


@pytest.mark.parametrize("mode", [contextlib.nullcontext, torch.no_grad])
def test_call_outside_inference_mode_matches_eager(
    inference_forward: Callable[..., object], mode: Mode
) -> None:
    out = _check(inference_forward, _mlp(), _x(), mode)
    assert not out.is_inference() and not out.requires_grad


def test_captured_outside_called_inside_inference_mode() -> None:
    forward = _load(predict, _mlp(), _x(), backend="eager")
    assert _check(forward, _mlp(), _x(), torch.inference_mode).is_inference()


@pytest.fixture(scope="module")
def batch_norm_training() -> Callable[..., object]:
    """Training mode: the graph updates the running statistics in place."""
    with torch.inference_mode():
        return _load(predict, _mlp(training=True), _x(), backend="eager")


def test_running_stats_of_inference_tensors_update_in_inference_mode(
    batch_norm_training: Callable[..., object],
) -> None:
    with torch.inference_mode():
        model, expected_model = _mlp(training=True), _mlp(training=True)
        out = batch_norm_training(model, _x())
        expected = predict(expected_model, _x())
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(model.state_dict(), expected_model.state_dict())


def test_inference_tensor_updated_outside_inference_mode_is_refused(
    batch_norm_training: Callable[..., object],
) -> None:
    with torch.inference_mode():
        model = _mlp(training=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        predict(_inference_copy(model), _x())
    with pytest.raises(pg.PrecompileError) as caught:
        batch_norm_training(model, _x())
    message = str(caught.value)
    assert "'1.running_mean' is an inference tensor" in message
    assert "inside torch.inference_mode()" in message and ".clone()" in message
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def _inference_copy(model: nn.Module) -> nn.Module:
    with torch.inference_mode():
        copy = _mlp(training=True)
        copy.load_state_dict(model.state_dict())
    return copy


# --- Grad mode: a backward needs it on -------------------------------------------
@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_training_step_captured_with_grad_mode_off_is_refused(mode: Mode) -> None:
    model = _mlp(training=True)
    with mode(), pytest.raises(RuntimeError, match="does not require grad"):
        train_step(model, _x())
    with mode(), pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(train_step, model, _x(), backend="eager")
    message = str(caught.value)
    assert "'train_step' runs a backward" in message and "grad mode off" in message
    assert "outside torch.no_grad() and torch.inference_mode()" in message
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture(scope="module")
def training_step() -> Callable[..., object]:
    return _load(train_step, _mlp(training=True), _x(), backend="eager")


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_training_step_called_with_grad_mode_off_is_refused(
    training_step: Callable[..., object], mode: Mode
) -> None:
    model = _mlp(training=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with mode(), pytest.raises(pg.PrecompileError) as caught:
        training_step(model, _x())
    message = str(caught.value)
    assert "runs a backward, and grad mode is off" in message
    assert "Call it outside torch.no_grad() and torch.inference_mode()" in message
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def test_training_step_matches_eager_with_grad_mode_on(
    training_step: Callable[..., object],
) -> None:
    model, expected_model = _mlp(training=True), _mlp(training=True)
    with torch.no_grad(), torch.enable_grad():
        loss = training_step(model, _x())
    torch.testing.assert_close(loss, train_step(expected_model, _x()))
    for param, expected in zip(
        model.parameters(), expected_model.parameters(), strict=True
    ):
        torch.testing.assert_close(param.grad, expected.grad)


def test_no_grad_capture_matches_eager() -> None:
    with torch.no_grad():
        forward = _load(predict, _mlp(), _x(), backend="eager")
    for mode in (torch.no_grad, contextlib.nullcontext, torch.inference_mode):
        _check(forward, _mlp(), _x(), mode)


# --- Autocast: part of what the graph computes ---------------------------------------
@pytest.fixture(scope="module", params=["eager", "inductor"])
def autocast_forwards(
    request: pytest.FixtureRequest,
) -> tuple[Callable[..., object], Callable[..., object]]:
    """The same function captured inside autocast (bfloat16) and outside it."""
    with _autocast():
        inside = _load(predict, _mlp(), _x(), backend=request.param)
    return inside, _load(predict, _mlp(), _x(), backend=request.param)


@pytest.mark.parametrize("call_mode", [_autocast, contextlib.nullcontext])
def test_autocast_capture_computes_in_bfloat16_in_any_mode(
    autocast_forwards: tuple[Callable[..., object], Callable[..., object]],
    call_mode: Mode,
) -> None:
    with call_mode():
        out = autocast_forwards[0](_mlp(), _x())
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    with _autocast():
        expected = predict(_mlp(), _x())
    torch.testing.assert_close(out, expected)


def test_capture_outside_autocast_computes_in_float32_inside_it(
    autocast_forwards: tuple[Callable[..., object], Callable[..., object]],
) -> None:
    with _autocast():
        out = autocast_forwards[1](_mlp(), _x())
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    torch.testing.assert_close(out, predict(_mlp(), _x()))


# --- Deterministic algorithms and the backends' flags --------------------------------
@contextlib.contextmanager
def _deterministic() -> Generator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@contextlib.contextmanager
def _medium_matmul_precision() -> Generator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _no_mkldnn() -> contextlib.AbstractContextManager[object]:
    return torch.backends.mkldnn.flags(enabled=False)


def _no_tf32() -> contextlib.AbstractContextManager[object]:
    return torch.backends.cudnn.flags(allow_tf32=False)


@contextlib.contextmanager
def _all_flags() -> Generator[None]:
    with _deterministic(), _medium_matmul_precision(), _no_mkldnn(), _no_tf32():
        yield


FLAGS = [_deterministic, _medium_matmul_precision, _no_mkldnn, _no_tf32]


@pytest.mark.parametrize("flag", FLAGS, ids=lambda flag: flag.__name__)
def test_flag_at_capture_and_call_matches_eager(flag: Mode) -> None:
    with flag():
        forward = _load(predict, _conv(), _image(), backend="eager")
    for mode in (flag, contextlib.nullcontext):
        _check(forward, _conv(), _image(), mode)


def test_inductor_under_every_flag_matches_eager() -> None:
    with _all_flags():
        forward = _load(predict, _conv(), _image(), backend="inductor")
    for mode in (_all_flags, contextlib.nullcontext):
        _check(forward, _conv(), _image(), mode)
