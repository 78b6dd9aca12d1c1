"""Every random op a model or a training step draws with, through the artifact on
both backends: under the same ``torch.manual_seed`` the artifact draws what eager
draws, leaves the global generator where eager leaves it, and draws afresh at each
call.

One small module per op: a linear layer whose output goes through the op. Each op
is captured twice per backend, as inference (``model(x)``) and as a training step
(forward, ``loss.backward()``, an SGD step); the artifacts are built once per module
(a module-scoped cache), so the inference tests of an op share one capture. Then
the latent sample of a VAE, and the refusal of a generator of the function's own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import precompile_gen as pg

BACKENDS = ["eager", "inductor"]
P = 0.3


def multinomial(h: torch.Tensor, *, replacement: bool) -> torch.Tensor:
    # Sampled positions along the features, as a sampling head picks tokens.
    rows = h.flatten(0, -2)
    picks = torch.multinomial(torch.softmax(rows, -1), 5, replacement=replacement)
    return rows.gather(-1, picks)


# Each op draws from the output h of a Linear, shaped (batch 6, channels 3, 2, 8).
OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rand": lambda h: h * torch.rand(h.shape),
    "randn": lambda h: h + torch.randn(6, 3, 2, 8),
    "randint": lambda h: h * torch.randint(0, 10, h.shape),
    "rand_like": lambda h: h * torch.rand_like(h),
    "randn_like": lambda h: h + torch.randn_like(h),
    "randint_like": lambda h: h * torch.randint_like(h, 1, 10),
    "bernoulli": lambda h: h * torch.bernoulli(torch.sigmoid(h)),
    "bernoulli_p": lambda h: h.mT * torch.bernoulli(torch.empty_like(h.mT), P),
    "normal_": lambda h: h + torch.empty_like(h).normal_(0.5, 2.0),
    "uniform_": lambda h: h * torch.empty_like(h).uniform_(-1.0, 1.0),
    "exponential_": lambda h: h * torch.empty_like(h).exponential_(2.0),
    "multinomial": lambda h: multinomial(h, replacement=False),
    "multinomial_replacement": lambda h: multinomial(h, replacement=True),
    "randperm": lambda h: h[torch.randperm(h.shape[0])],
    "dropout": lambda h: F.dropout(h, P),
    "dropout1d": lambda h: F.dropout1d(h.flatten(2), P),
    "dropout2d": lambda h: F.dropout2d(h, P),
    "dropout3d": lambda h: F.dropout3d(h.unsqueeze(2), P),
    "alpha_dropout": lambda h: F.alpha_dropout(h, P, training=True),
    "feature_alpha_dropout": lambda h: F.feature_alpha_dropout(h, P, training=True),
    "nn.Dropout": nn.Dropout(P),
}


class Sampler(nn.Module):
    """A layer whose output goes through one random op."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.linear(x))


def infer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    optimizer.zero_grad()
    out = model(x)
    loss = out.square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach(), out.detach()


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def batch(seed: int) -> torch.Tensor:
    return torch.randn(6, 3, 2, 8, generator=torch.Generator().manual_seed(seed))


def make_sampler(op: str) -> Sampler:
    torch.manual_seed(0)
    return Sampler(OPS[op]).train()


Artifact = Callable[..., object]
MODES = {"infer": infer, "train": train_step}


@pytest.fixture(scope="module")
def artifacts() -> Callable[[str, str, str], Artifact]:
    """The artifact of (op, backend, mode), captured on first use."""
    built: dict[tuple[str, str, str], Artifact] = {}

    def get(op: str, backend: str, mode: str) -> Artifact:
        if (op, backend, mode) not in built:
            model = make_sampler(op)
            python_code, cache = pg.precompile(
                MODES[mode], model, *arguments(mode, model), backend=backend
            )
            built[op, backend, mode] = pg.load(python_code, cache)
        return built[op, backend, mode]

    return get


def arguments(mode: str, model: nn.Module, seed: int = 0) -> tuple[object, ...]:
    return (batch(seed),) if mode == "infer" else (sgd(model), batch(seed))


@dataclass
class Outcome:
    """What one call leaves: its result, the global generator's state, and the
    model's parameters and gradients."""

    result: object
    rng_state: torch.Tensor
    tensors: dict[str, torch.Tensor]


def calls(
    fn: Callable[..., object], model: nn.Module, args: tuple[object, ...], seed: int
) -> list[Outcome]:
    # Two calls after one seed: the second draws where eager's second call does.
    torch.manual_seed(seed)
    outcomes = []
    for _ in range(2):
        result = fn(model, *args)
        tensors = {}
        for name, param in model.named_parameters():
            tensors[name] = param.detach().clone()
            if param.grad is not None:
                tensors[f"{name}.grad"] = param.grad.clone()
        outcomes.append(Outcome(result, torch.get_rng_state(), tensors))
    return outcomes


def assert_draws_like_eager(artifact: Artifact, op: str, mode: str) -> None:
    model = make_sampler(op)
    twin = copy.deepcopy(model)
    seed = 11
    expected = calls(MODES[mode], twin, arguments(mode, twin, seed=1), seed)
    got = calls(artifact, model, arguments(mode, model, seed=1), seed)
    assert_same_outcomes(got, expected, f"{op} ({mode})")


def assert_same_outcomes(
    got: list[Outcome], expected: list[Outcome], what: str
) -> None:
    for call, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_same_outcome(g, e, f"{what}, call {call}")


def assert_same_outcome(got: Outcome, expected: Outcome, what: str) -> None:
    def message(problem: str) -> str:
        return f"{what}: {problem}"

    torch.testing.assert_close(got.result, expected.result, msg=message)
    torch.testing.assert_close(got.tensors, expected.tensors, msg=message)
    assert torch.equal(got.rng_state, expected.rng_state), message(
        "the global generator is not where eager leaves it"
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_inference_draws_what_eager_draws(
    artifacts: Callable[[str, str, str], Artifact], op: str, backend: str
) -> None:
    assert_draws_like_eager(artifacts(op, backend, "infer"), op, "infer")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_a_training_step_draws_what_eager_draws(
    artifacts: Callable[[str, str, str], Artifact], op: str, backend: str
) -> None:
    assert_draws_like_eager(artifacts(op, backend, "train"), op, "train")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_a_seed_repeats_the_draws_and_another_seed_draws_anew(
    artifacts: Callable[[str, str, str], Artifact], op: str, backend: str
) -> None:
    artifact = artifacts(op, backend, "infer")
    model, x = make_sampler(op), batch(1)
    draws = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        draw = artifact(model, x)
        assert isinstance(draw, torch.Tensor)
        draws.append(draw)
    torch.testing.assert_close(draws[1], draws[0], rtol=0, atol=0)
    assert not torch.equal(draws[2], draws[0]), f"{op}: seed 4 drew seed 3's numbers"


# --- The latent sample of a VAE (reparameterisation), as users write it -------------


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # mu and logvar are views with a gap between rows: randn_like's draw is
        # contiguous in eager.
        mu, logvar = self.enc(x).chunk(2, -1)
        return self.dec(mu + torch.randn_like(mu) * (0.5 * logvar).exp())


def make_vae() -> VAE:
    torch.manual_seed(0)
    return VAE()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_vae_samples_its_latent_as_eager_does(backend: str) -> None:
    python_code, cache = pg.precompile(
        lambda m, x: m(x), make_vae(), torch.randn(3, 8), backend=backend
    )
    artifact = pg.load(python_code, cache)
    model, x = make_vae(), torch.randn(3, 8)
    expected = calls(lambda m, x: m(x), model, (x,), seed=5)
    got = calls(artifact, model, (x,), seed=5)
    assert_same_outcomes(got, expected, "VAE")


# --- A generator of the function's own is refused ------------------------------------


class NoisyLayer(nn.Module):
    """Adds noise drawn from a generator the module keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h + torch.randn(h.shape, generator=self.generator)


def draw_with(model: nn.Module, x: torch.Tensor, generator: torch.Generator):
    return model(x) * torch.rand(x.shape, generator=generator)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["module attribute", "argument"])
def test_a_torch_generator_of_the_functions_own_is_refused(
    backend: str, where: str
) -> None:
    # The inductor artifact would draw from the generator object captured with it,
    # not the caller's, whatever the seed: refused, the generator left as it was.
    if where == "argument":
        model: Sampler | NoisyLayer = make_sampler("dropout")
        generator = torch.Generator().manual_seed(1)
        fn: Callable[..., object] = draw_with
        example: tuple[object, ...] = (model, batch(0), generator)
    else:
        model = NoisyLayer()
        generator = model.generator
        fn, example = infer, (model, batch(0))
    before = generator.get_state()
    weight = model.linear.weight.detach().clone()
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(fn, *example, backend=backend)
    message = str(caught.value)
    assert "passes a torch.Generator to aten.rand" in message
    assert "Leave out generator=" in message and "torch.manual_seed" in message
    assert torch.equal(generator.get_state(), before)
    torch.testing.assert_close(model.linear.weight, weight, rtol=0, atol=0)
