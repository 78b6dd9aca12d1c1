"""Complex numbers on both backends, against eager PyTorch: complex parameters,
buffers, inputs and outputs, FFTs, view_as_complex and polar, in training steps."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precompile_gen as pg


class Spectral(nn.Module):
    """A Fourier layer: its backward runs irfft's, which doubles the middle
    frequencies in place, on a complex tensor that Inductor runs as fallbacks."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(0.1 * torch.randn(4, 4, 6, dtype=torch.cfloat))
        self.lift, self.proj = nn.Conv1d(2, 4, 1), nn.Conv1d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        f = torch.fft.rfft(h)
        out = torch.zeros_like(f)
        out[:, :, :6] = torch.einsum("bim,iom->bom", f[:, :, :6], self.w)
        return self.proj(F.gelu(torch.fft.irfft(out, n=h.shape[-1]) + h))


def spectral_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


class Rotor(nn.Module):
    """Real weights, and a complex buffer that each call turns a little."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        phase = torch.polar(torch.ones(8), torch.linspace(0.0, 3.0, 8))
        self.register_buffer("phase", phase)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def surface_step(
    model: Rotor, x: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A complex input and output, view_as_complex, fft/ifft, rfft2/irfft2, polar and
    a complex buffer read and updated in place, with a backward through them all."""
    h = model(x)
    pairs = torch.view_as_complex(h.reshape(4, 4, 2))
    spectrum = torch.fft.ifft(torch.fft.fft(h) * z).real
    grid = torch.fft.irfft2(torch.fft.rfft2(h.reshape(4, 2, 4)), s=(2, 4))
    rotated = torch.polar(h.abs() + 1, h) * model.phase
    loss = (
        (pairs * pairs.conj()).real.sum()
        + (spectrum * grid.reshape(4, 8)).sum()
        + rotated.real.sum()
        + rotated.angle().sum()
    )
    loss.backward()
    model.phase.mul_(torch.polar(torch.ones(()), torch.tensor(0.1)))
    return loss.detach(), rotated.detach() * z


def _spectral_args(model: nn.Module) -> tuple[object, ...]:
    torch.manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.randn(3, 2, 32)


def _surface_args(model: nn.Module) -> tuple[object, ...]:
    torch.manual_seed(1)
    return model, torch.randn(4, 8), torch.randn(4, 8, dtype=torch.cfloat)


_CASES: dict[str, tuple[Callable[..., object], type[nn.Module], Callable]] = {
    "spectral": (spectral_step, Spectral, _spectral_args),
    "surface": (surface_step, Rotor, _surface_args),
}


@pytest.fixture(scope="module", params=["eager", "inductor"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def artifacts(backend: str) -> dict[str, Callable[..., object]]:
    """Each case's artifact, captured on a copy of the case's model."""
    loaded = {}
    for name, (fn, model_type, make_args) in _CASES.items():
        torch.manual_seed(0)
        code, cache = pg.precompile(fn, *make_args(model_type()), backend=backend)
        loaded[name] = pg.load(code, cache)
    return loaded


@pytest.mark.parametrize("case", sorted(_CASES))
def test_two_steps_match_eager(
    artifacts: dict[str, Callable[..., object]], case: str
) -> None:
    """Outputs, gradients, parameters and buffers match eager after two steps."""
    fn, model_type, make_args = _CASES[case]
    torch.manual_seed(0)
    eager_model = model_type()
    compiled_model = copy.deepcopy(eager_model)
    eager_args, compiled_args = make_args(eager_model), make_args(compiled_model)
    for _ in range(2):
        torch.testing.assert_close(artifacts[case](*compiled_args), fn(*eager_args))
        for (name, want), got in zip(
            eager_model.named_parameters(), compiled_model.parameters(), strict=True
        ):
            torch.testing.assert_close(got.grad, want.grad, msg=f"grad of {name}")
            torch.testing.assert_close(got, want, msg=f"parameter {name}")
        for (name, want), got in zip(
            eager_model.named_buffers(), compiled_model.buffers(), strict=True
        ):
            torch.testing.assert_close(got, want, msg=f"buffer {name}")


@pytest.mark.parametrize("bit", ["conjugate", "negative"])
def test_lazy_bits_refused_at_call(
    artifacts: dict[str, Callable[..., object]], bit: str
) -> None:
    """An input whose conjugate or negative bit is set is refused before the graph
    runs (the graph was traced on a resolved tensor, and Inductor's kernels read
    memory as it is), and the model is left as it was."""
    model, x, z = Rotor(), torch.randn(4, 8), torch.randn(4, 8, dtype=torch.cfloat)
    if bit == "conjugate":
        z, fix = z.conj(), ".resolve_conj()"
    else:
        x, fix = torch.randn(4, 8, dtype=torch.cfloat).conj().imag, ".resolve_neg()"
    before = model.phase.clone()
    with pytest.raises(pg.PrecompileError, match=f"its {bit} bit is set") as caught:
        artifacts["surface"](model, x, z)
    assert fix in str(caught.value)
    torch.testing.assert_close(model.phase, before)
    assert model.lin.weight.grad is None


def test_lazy_bits_refused_at_capture() -> None:
    model, x, z = Rotor(), torch.randn(4, 8), torch.randn(4, 8, dtype=torch.cfloat)
    with pytest.raises(pg.PrecompileError, match=r"conjugate bit set") as caught:
        pg.precompile(surface_step, model, x, z.conj(), backend="eager")
    assert ".resolve_conj()" in str(caught.value)
