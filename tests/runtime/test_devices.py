"""The device, index included, is part of the calling convention.

An artifact captured on CUDA is rendered here from a real eager capture whose
metadata says "cuda:0"; the checks refuse CPU tensors before anything runs, so they
are exercised on any machine. Where torch.cuda.is_available() is False, such an
artifact is refused at load, and, executed on its own, at its first call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.stubs import replace_convention, stub_capture
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import precompile_gen as pg
from precompile_gen.capture_result import CaptureResult

NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a machine without CUDA"
)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def on_cuda(cap: CaptureResult, *, state: bool = True, leaves: bool = True) -> str:
    """The artifact of ``cap`` with its module state, its input leaves or both
    recorded on "cuda:0", as a capture on the first GPU records them."""

    def moved(tensors: list[Any], move: bool) -> list[Any]:
        return [t._replace(device="cuda:0") if move else t for t in tensors]

    return pg.render_artifact(
        replace_convention(
            cap,
            params=moved(cap.convention.params, state),
            buffers=moved(cap.convention.buffers, state),
            leaves=moved(cap.convention.leaves, leaves),
        )
    )


@pytest.fixture(scope="module")
def capture() -> CaptureResult:
    torch.manual_seed(0)
    return pg.capture(step, Scaled(), torch.randn(2, 4), backend="eager")


@pytest.fixture
def cuda_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that reports a CUDA device, for the messages of one that has one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def assert_refused_untouched(
    forward: Callable[..., object], model: nn.Module, x: object, match: list[str]
) -> None:
    with pytest.raises(pg.PrecompileError) as caught:
        forward(model, x)
    for part in match:
        assert part in str(caught.value)
    # Refused before the graph ran: the step would have left gradients.
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.usefixtures("cuda_available")
def test_a_cpu_input_where_cuda_0_was_captured(capture: CaptureResult) -> None:
    forward = pg.load(on_cuda(capture, state=False), None)
    assert_refused_untouched(
        forward,
        Scaled(),
        torch.randn(2, 4),
        match=[
            "argument 1 (`x`) is on device 'cpu'",
            "captured on 'cuda:0'",
            ".to('cuda:0')",
            "capture again on this device",
        ],
    )


@pytest.mark.usefixtures("cuda_available")
def test_a_cpu_model_where_cuda_0_was_captured(capture: CaptureResult) -> None:
    forward = pg.load(on_cuda(capture, leaves=False), None)
    assert_refused_untouched(
        forward,
        Scaled(),
        torch.randn(2, 4),
        match=[
            "the model's 'lin.weight' is on device 'cpu'",
            "was on 'cuda:0'",
            ".to('cuda:0')",
            "capture again on this device",
        ],
    )


@pytest.mark.usefixtures("cuda_available")
def test_an_input_on_cuda_1_where_cuda_0_was_captured(capture: CaptureResult) -> None:
    forward = pg.load(on_cuda(capture, state=False), None)
    # A fake tensor reports a CUDA device with no GPU behind it; the checks read
    # only its shape, dtype and device.
    with FakeTensorMode():
        x = torch.empty(2, 4, device="cuda:1")
    assert str(x.device) == "cuda:1"
    assert_refused_untouched(
        forward,
        Scaled(),
        x,
        match=[
            "argument 1 (`x`) is on device 'cuda:1'",
            "captured on 'cuda:0'",
            ".to('cuda:0')",
        ],
    )


@NO_CUDA
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_cuda_artifact_is_refused_at_load_without_cuda(
    capture: CaptureResult, backend: str
) -> None:
    # The inductor stub's kernels would build at load: the refusal comes first.
    cap = capture if backend == "eager" else stub_capture("inductor")
    with pytest.raises(pg.PrecompileError) as caught:
        pg.load(on_cuda(cap), None)
    message = str(caught.value)
    assert "captured for CUDA (its tensors were on 'cuda:0')" in message
    assert "torch.cuda.is_available() is False" in message
    assert "on a machine with a GPU, or capture again on CPU" in message


@NO_CUDA
def test_a_cuda_artifact_run_on_its_own_without_cuda_says_so_at_the_call(
    capture: CaptureResult,
) -> None:
    namespace: dict[str, object] = {}
    exec(compile(on_cuda(capture), "<artifact>", "exec"), namespace)
    forward = namespace["forward"]
    assert callable(forward)
    with pytest.raises(Exception) as caught:
        forward(Scaled(), torch.randn(2, 4))
    assert type(caught.value).__name__ == "PrecompileError"
    message = str(caught.value)
    assert "argument 1 (`x`) is on device 'cpu'" in message
    assert "captured for CUDA, on 'cuda:0'" in message
    assert "no CUDA device (torch.cuda.is_available() is False)" in message
    assert "on a machine with a GPU, or capture again on CPU" in message
