"""Random draws inside activation checkpointing, through the artifact on both
backends: the backward's recompute draws the forward's numbers where eager's
checkpoint restores the generator for it (``preserve_rng_state``, the default), and
draws afresh where it does not; parameters, gradients, the optimizer's state and the
global generator after each call are eager's.

Every form a training program checkpoints with: ``checkpoint`` reentrant or not,
``checkpoint_sequential``, selective checkpointing with a policy that saves the
matmuls, ``preserve_rng_state=False``, ``native_dropout`` (CUDA's dropout), and
the libraries' gradient checkpointing: transformers' (BERT's reentrant default,
GPT-2 non-reentrant) and timm's (a ViT with stochastic depth). Each step runs its
optimizer inside (Adam; SGD with momentum for the ViT), so
the optimizer's state follows the gradients. Then what the artifact cannot repeat
(a seed, a state set from outside, draws a ``fork_rng`` discards): refused at
capture, naming the line, with the model and the caller's generator as they were.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import model_zoo
from helpers.source_lines import line_of
from helpers.state_snapshot import StateSnapshot
from torch import nn
from torch._dynamo.decorators import mark_unbacked
from torch.nn import functional as F
from torch.utils import checkpoint as ckpt

import precompile_gen as pg

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BACKENDS = ["eager", "inductor"]
P = 0.3


def block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(P))


class Residual(nn.Module):
    """A projection, then three residual blocks, each checkpointed, each with a
    dropout inside."""

    def __init__(self, *, use_reentrant: bool, preserve_rng_state: bool = True) -> None:
        super().__init__()
        # Reentrant checkpointing needs an input that requires grad: the projection's.
        self.project = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([block() for _ in range(3)])
        self.use_reentrant = use_reentrant
        self.preserve_rng_state = preserve_rng_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.project(x)
        for layer in self.blocks:
            x = x + ckpt.checkpoint(
                layer,
                x,
                use_reentrant=self.use_reentrant,
                preserve_rng_state=self.preserve_rng_state,
            )
        return x


class Sequential(nn.Module):
    """Four blocks checkpointed in two segments."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(block() for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ckpt.checkpoint_sequential(self.layers, 2, x, use_reentrant=False)


def save_matmuls(
    ctx: ckpt.SelectiveCheckpointContext, op: object, *args: object, **kwargs: object
) -> ckpt.CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return ckpt.CheckpointPolicy.MUST_SAVE
    return ckpt.CheckpointPolicy.PREFER_RECOMPUTE


class Selective(nn.Module):
    """Two blocks under selective checkpointing that saves the matmuls' outputs and
    recomputes the rest, the dropout included."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(block(), block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        contexts = functools.partial(
            ckpt.create_selective_checkpoint_contexts, save_matmuls
        )
        return ckpt.checkpoint(self.layers, x, use_reentrant=False, context_fn=contexts)


class FusedDropout(nn.Module):
    """A block that drops out as eager does on CUDA, with the fused op whose output
    depends on its input (``native_dropout``), not a fill of an empty tensor as on
    CPU: the recompute's input is computed again, and must be shown to be the
    forward's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, _ = torch.native_dropout(torch.relu(self.linear(x)), P, True)
        return output


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(8, 8)
        self.block = FusedDropout()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.project(x)
        return x + ckpt.checkpoint(self.block, x, use_reentrant=False)


FORMS: dict[str, Callable[[], nn.Module]] = {
    "non-reentrant": lambda: Residual(use_reentrant=False),
    "reentrant": lambda: Residual(use_reentrant=True),
    "preserve_rng_state=False": lambda: Residual(
        use_reentrant=False, preserve_rng_state=False
    ),
    "reentrant, preserve_rng_state=False": lambda: Residual(
        use_reentrant=True, preserve_rng_state=False
    ),
    "checkpoint_sequential": Sequential,
    "selective": Selective,
    "native_dropout": Fused,
}


def adam_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def hf_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def checkpointed_gpt2() -> nn.Module:
    model = _pretrained(model_zoo.gpt2())
    model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def checkpointed_bert() -> nn.Module:
    # One checkpointed layer shows its recompute's draws as two would, in half the
    # compile time (the slowest test of the suite with two).
    model = _pretrained(model_zoo.bert(layers=1))
    # transformers' default: reentrant checkpointing.
    model.gradient_checkpointing_enable()
    # Set as BERT's first call with labels sets it, so the example and its twin
    # read the same value.
    model.config.problem_type = "single_label_classification"
    return model


def classify_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    return loss.detach()


def checkpointed_timm_vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    # Stochastic depth and dropout in every block, the blocks checkpointed as timm
    # does it (checkpoint_seq).
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        num_classes=10,
        drop_rate=0.1,
        proj_drop_rate=0.1,
        drop_path_rate=0.2,
    )
    model.set_grad_checkpointing(True)
    return model


def _pretrained(model: nn.Module) -> PreTrainedModel:
    from transformers import PreTrainedModel

    assert isinstance(model, PreTrainedModel)
    return model


def batch(seed: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def hf_batch(labels: int | None) -> Callable[[int], tuple[torch.Tensor, ...]]:
    return lambda seed: model_zoo.tokens(labels, seed)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


@dataclass(frozen=True)
class Case:
    """A model (``build`` gives the same one each time), its step, its inputs and its
    optimizer."""

    build: Callable[[], nn.Module]
    step: Callable[..., torch.Tensor]
    inputs: Callable[[int], tuple[torch.Tensor, ...]]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = adam

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build().train()


CASES = {
    **{
        name: Case(build, adam_step, lambda s: (batch(s),))
        for name, build in FORMS.items()
    },
    "gpt2 gradient checkpointing": Case(checkpointed_gpt2, hf_step, hf_batch(None)),
    "bert gradient checkpointing": Case(checkpointed_bert, hf_step, hf_batch(3)),
    # A ViT's key biases get gradients that are 0 up to rounding (softmax ignores a
    # shift shared by a query's scores), which Adam's normalised step would turn
    # into steps of +-lr; SGD with momentum keeps them rounding-sized.
    "timm vit gradient checkpointing": Case(
        checkpointed_timm_vit,
        classify_step,
        lambda seed: model_zoo.images(2, 32, seed),
        sgd,
    ),
}
# GPT-2's and the ViT's inductor compiles are the slowest here (about a minute
# each); BERT covers the libraries' checkpointing there.
SLOW_TO_COMPILE = {"gpt2 gradient checkpointing", "timm vit gradient checkpointing"}
PARAMS = [
    pytest.param(name, backend, id=f"{name}-{backend}")
    for name in CASES
    for backend in BACKENDS
    if backend == "eager" or name not in SLOW_TO_COMPILE
]


@pytest.fixture(scope="module")
def artifacts() -> Callable[[str, str], Callable[..., object]]:
    """The artifact of (case, backend), captured on first use."""
    built: dict[tuple[str, str], Callable[..., object]] = {}

    def get(name: str, backend: str) -> Callable[..., object]:
        if (name, backend) not in built:
            case = CASES[name]
            model = case.model()
            python_code, cache = pg.precompile(
                case.step,
                model,
                case.optimizer(model),
                *case.inputs(0),
                backend=backend,
            )
            built[name, backend] = pg.load(python_code, cache)
        return built[name, backend]

    return get


@dataclass
class Outcome:
    """What one step leaves: its loss, the model's parameters and gradients, the
    optimizer's state and the global generator's state."""

    loss: object
    parameters: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    optimizer: object
    generator: torch.Tensor


def run_steps(
    step: Callable[..., object],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    case: Case,
) -> list[Outcome]:
    """Three steps on new batches, each after its own seed, and what each left."""
    outcomes = []
    for call in range(3):
        torch.manual_seed(100 + call)
        loss = step(model, optimizer, *case.inputs(call + 1))
        named = dict(model.named_parameters())
        outcomes.append(
            Outcome(
                loss=loss,
                parameters={n: p.detach().clone() for n, p in named.items()},
                grads={
                    n: p.grad.clone() for n, p in named.items() if p.grad is not None
                },
                optimizer=copy.deepcopy(optimizer.state_dict()["state"]),
                generator=torch.get_rng_state(),
            )
        )
    return outcomes


@pytest.mark.parametrize(("name", "backend"), PARAMS)
def test_a_checkpointed_step_draws_what_eager_draws(
    artifacts: Callable[[str, str], Callable[..., object]],
    name: str,
    backend: str,
) -> None:
    case = CASES[name]
    artifact = artifacts(name, backend)
    model, twin = case.model(), case.model()
    got = run_steps(artifact, model, case.optimizer(model), case)
    expected = run_steps(case.step, twin, case.optimizer(twin), case)
    for call, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g.generator, e.generator), (
            f"call {call}: the global generator is not where eager leaves it"
        )
        for group in ("loss", "parameters", "grads", "optimizer"):
            want = getattr(e, group)
            assert_close_at_scale(getattr(g, group), want, f"call {call}, {group}")


# Each group of tensors is compared at its own scale: float32 rounding that the
# graph orders otherwise than eager, which Adam's normalised step carries into the
# parameters, stays far below it; a dropout mask other than eager's (the fault this
# file guards against: 16% of the largest gradient in GPT-2) does not.
ATOL_OF_SCALE = 1e-4


def assert_close_at_scale(got: object, want: object, what: str) -> None:
    tensors = [t for t in pytree.tree_leaves(want) if isinstance(t, torch.Tensor)]
    scale = max(
        (t.abs().max().item() for t in tensors if t.is_floating_point()), default=0
    )
    torch.testing.assert_close(
        got,
        want,
        rtol=0.0,
        atol=ATOL_OF_SCALE * scale,
        msg=lambda detail: f"{what}: {detail}",
    )


def backward_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def test_a_checkpointed_dropout_with_an_unbacked_batch_dim_draws_what_eager_draws() -> (
    None
):
    # A symbolic trace, whose generator events are placed among the ops it keeps.
    # (An optimizer step is not captured with mark_unbacked dims.)
    case = CASES["non-reentrant"]
    model, twin = case.model(), case.model()
    x = batch(0)
    mark_unbacked(x, 0, min=1, max=64)
    forward = pg.load(*pg.precompile(backward_step, model, x, backend="inductor"))
    for rows in (3, 9):
        other = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))
        torch.manual_seed(rows)
        got, got_state = forward(model, other), torch.get_rng_state()
        torch.manual_seed(rows)
        expected = backward_step(twin, other)
        assert torch.equal(got_state, torch.get_rng_state()), f"batch {rows}"
        assert_close_at_scale(got, expected, f"batch {rows}, loss")
        grads = {n: p.grad for n, p in model.named_parameters()}
        twin_grads = {n: p.grad for n, p in twin.named_parameters()}
        assert_close_at_scale(grads, twin_grads, f"batch {rows}, grads")


# --- What the artifact cannot repeat is refused ---------------------------------------

OUTSIDE_STATE = torch.Generator().manual_seed(7).get_state()


def seeds_inside(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(3)
    return model(x) * torch.rand(8)


def draws_in_fork_rng(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():
        noise = torch.rand(8)
    return model(x) * noise


def sets_a_state_from_outside(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.set_rng_state(OUTSIDE_STATE)
    return model(x) * torch.rand(8)


def fork_rng_without_draws(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():
        out = model(x)
    return out * torch.rand(8)


@pytest.mark.parametrize(
    ("fn", "line", "what"),
    [
        (seeds_inside, "torch.manual_seed(3)", "seeds torch's generator"),
        (draws_in_fork_rng, "with torch.random.fork_rng():", "to a saved state"),
        (sets_a_state_from_outside, "torch.set_rng_state(", "to a saved state"),
    ],
)
def test_a_change_of_generator_state_the_artifact_cannot_repeat_is_refused(
    fn: Callable[..., torch.Tensor], line: str, what: str
) -> None:
    model, x = nn.Linear(8, 8), batch(0)
    model(x).sum().backward()  # a .grad to keep untouched
    snapshot = StateSnapshot(model, x)
    generator = torch.get_rng_state()
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(fn, model, x, backend="eager")
    message = str(caught.value)
    for text in (repr(fn.__name__), what, line_of(fn, line), "torch.manual_seed"):
        assert text in message, f"{text!r} not in the message: {message}"
    assert "outside the function" in message and "as an argument" in message
    snapshot.assert_unchanged()
    assert torch.equal(torch.get_rng_state(), generator)


class CountsItsCalls(nn.Module):
    """A checkpointed block that updates a buffer in place before it draws from a
    value computed from it: the recompute draws from another value than the forward,
    which the artifact cannot show to be the forward's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        output, _ = torch.native_dropout(self.linear(x) * self.calls, P, True)
        return output


def test_a_recompute_on_values_updated_in_place_is_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 8), CountsItsCalls())

    def step(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        h = model[0](x)
        loss = ckpt.checkpoint(model[1], h, use_reentrant=False).square().mean()
        loss.backward()
        return loss.detach()

    x = batch(0)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(step, model, x, backend="eager")
    message = str(caught.value)
    for text in (
        "'step'",
        "aten.native_dropout.default",
        "updated in place",
        "move the random op out of the checkpointed function",
    ):
        assert text in message, f"{text!r} not in the message: {message}"
    snapshot.assert_unchanged()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_rng_without_draws_inside_is_captured(backend: str) -> None:
    model, x = nn.Linear(8, 8), batch(0)
    python_code, cache = pg.precompile(
        fork_rng_without_draws, model, x, backend=backend
    )
    artifact = pg.load(python_code, cache)
    torch.manual_seed(5)
    got, got_state = artifact(model, x), torch.get_rng_state()
    torch.manual_seed(5)
    expected = fork_rng_without_draws(model, x)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got_state, torch.get_rng_state())


def test_capture_leaves_the_callers_generator_where_it_was() -> None:
    # Capture runs the step (and its draws) more than once; it is no call.
    case = CASES["non-reentrant"]
    model = case.model()
    torch.manual_seed(9)
    before = torch.get_rng_state()
    pg.capture(adam_step, model, adam(model), batch(0), backend="eager")
    assert torch.equal(torch.get_rng_state(), before)
