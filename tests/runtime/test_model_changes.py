"""A model that changes between calls: the driver re-checks it in full after any
change to its structure, and skips that check while the model is unchanged.

The driver remembers the last model that passed its full check. Each test first makes
one successful call, so that the model is remembered, then changes it the way real
code does; a valid change must run on the changed model exactly as eager PyTorch
would, an invalid one must be rejected with the full check's message, model untouched.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import cast

import pytest
import torch
from helpers.state_snapshot import assert_call_rejected, clone_with_grads
from torch import nn

import precompile_gen as pg

Forward = Callable[..., object]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = (model(x) - target).square().mean()
    loss.backward()
    return loss.detach()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=generator), torch.randn(
        8, 4, generator=generator
    )


@pytest.fixture(scope="module", params=["eager", "inductor"])
def forward(request: pytest.FixtureRequest) -> Forward:
    torch.manual_seed(0)
    code, cache = pg.precompile(train_step, Net(), *batch(0), backend=request.param)
    return pg.load(code, cache)


@pytest.fixture
def backend(forward: Forward) -> str:
    return str(forward.__globals__["BACKEND"])


@pytest.fixture
def full_checks(
    forward: Forward, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[int]]:
    """How many calls ran the full check of the model (the driver looks its helpers
    up in the artifact's namespace at each call)."""
    namespace = forward.__globals__
    calls: list[int] = []
    walk = namespace["module_state"]

    def counted(modules: list[nn.Module]) -> object:
        calls.append(1)
        return walk(modules)

    monkeypatch.setitem(namespace, "module_state", counted)
    yield calls


@pytest.fixture
def model(forward: Forward) -> Net:
    """A model the artifact has just run on successfully, so remembers."""
    torch.manual_seed(1)
    model = Net()
    forward(model, *batch(1))
    return model


def run_both(
    forward: Forward, model: nn.Module, twin: nn.Module, seed: int
) -> torch.Tensor:
    """One step on ``model`` through the artifact and on ``twin`` eagerly; the loss,
    and every parameter, gradient and buffer, must agree."""
    actual = forward(model, *batch(seed))
    expected = train_step(twin, *batch(seed))
    assert isinstance(actual, torch.Tensor)
    torch.testing.assert_close(actual, expected)
    assert_same_state(model, twin)
    return actual


def assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    got = dict(actual.named_parameters())
    want = dict(expected.named_parameters())
    assert list(got) == list(want)
    for name, param in want.items():
        torch.testing.assert_close(got[name], param, msg=name)
        if param.grad is None:
            assert got[name].grad is None, name
        else:
            assert got[name].grad is not None, name
            torch.testing.assert_close(got[name].grad, param.grad, msg=name)
    torch.testing.assert_close(
        dict(actual.named_buffers()), dict(expected.named_buffers())
    )


# --- an unchanged model --------------------------------------------------------------


def test_unchanged_model_is_checked_in_full_once(
    forward: Forward, full_checks: list[int]
) -> None:
    torch.manual_seed(1)
    model = Net()
    twin = clone_with_grads(model)
    for seed in range(3):
        run_both(forward, model, twin, seed)
    assert len(full_checks) == 1


def test_new_values_keep_the_fast_path(
    forward: Forward, model: Net, full_checks: list[int]
) -> None:
    # An optimizer step and load_state_dict write values in place: the structure the
    # full check vouched for is unchanged.
    twin = clone_with_grads(model)
    for module in (model, twin):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    run_both(forward, model, twin, 2)
    torch.manual_seed(5)
    fresh = Net().state_dict()
    model.load_state_dict(fresh)
    twin.load_state_dict(fresh)
    run_both(forward, model, twin, 3)
    assert full_checks == []


# --- valid changes: the changed model is what runs -----------------------------------


def _replace_weight(model: Net) -> None:
    torch.manual_seed(7)
    model.lin1.weight = nn.Parameter(torch.randn(4, 4))


def _replace_buffer(model: Net) -> None:
    model.bn.running_mean = torch.full((4,), 0.5)


def _replace_submodule(model: Net) -> None:
    torch.manual_seed(7)
    model.lin2 = nn.Linear(4, 4)


@pytest.mark.parametrize(
    "change",
    [_replace_weight, _replace_buffer, _replace_submodule],
    ids=lambda f: f.__name__[1:],
)
def test_replaced_member_is_used(
    forward: Forward,
    model: Net,
    full_checks: list[int],
    change: Callable[[Net], None],
) -> None:
    twin = clone_with_grads(model)
    old = dict(model.named_parameters())
    old_grads = {name: p.grad.clone() for name, p in old.items() if p.grad is not None}
    change(model)
    change(twin)
    run_both(forward, model, twin, 2)
    assert len(full_checks) == 1
    # Gradients went to the new members only; the replaced ones kept theirs.
    current = dict(model.named_parameters())
    for name, param in old.items():
        if current[name] is not param:
            torch.testing.assert_close(param.grad, old_grads[name], rtol=0, atol=0)
    run_both(forward, model, twin, 3)
    assert len(full_checks) == 1


def test_other_models_take_turns(forward: Forward, full_checks: list[int]) -> None:
    torch.manual_seed(1)
    first, second = Net(), Net()
    twins = clone_with_grads(first), clone_with_grads(second)
    for seed in range(2):
        run_both(forward, first, twins[0], seed)
        run_both(forward, second, twins[1], seed)
    assert len(full_checks) == 4


def test_model_is_not_kept_alive(forward: Forward) -> None:
    torch.manual_seed(1)
    model = Net()
    forward(model, *batch(1))
    forward(model, *batch(2))
    model_ref, weight_ref = weakref.ref(model), weakref.ref(model.lin1.weight)
    del model
    gc.collect()
    assert model_ref() is None
    assert weight_ref() is None


# --- invalid changes: rejected as the full check rejects them ------------------------


def _transposed_layout(model: Net) -> None:
    weight = model.lin1.weight
    weight.data = weight.data.t().contiguous().t()
    assert weight.shape == (4, 4) and weight.stride() == (1, 4)


CHANGES: dict[str, tuple[Callable[[Net], object], list[str]]] = {
    "parameter of another shape": (
        lambda m: setattr(m.lin2, "weight", nn.Parameter(torch.randn(4, 5))),
        ["'lin2.weight' has shape (4, 5)", "had (4, 4)"],
    ),
    "data of another shape": (
        lambda m: setattr(m.lin1.weight, "data", torch.randn(4, 2)),
        ["'lin1.weight' has shape (4, 2)", "had (4, 4)"],
    ),
    "module added": (
        lambda m: setattr(m, "extra", nn.Linear(2, 2)),
        ["unexpected ['extra.weight', 'extra.bias']"],
    ),
    "module added deep inside": (
        lambda m: setattr(m.bn, "extra", nn.Linear(2, 2)),
        ["unexpected ['bn.extra.weight', 'bn.extra.bias']"],
    ),
    "module removed": (
        lambda m: delattr(m, "lin2"),
        ["missing ['lin2.weight', 'lin2.bias']"],
    ),
    "buffer removed": (
        lambda m: delattr(m.bn, "running_var"),
        ["missing ['bn.running_var']"],
    ),
    "weights tied": (
        lambda m: setattr(m.lin2, "weight", m.lin1.weight),
        ["tied here, separate in the traced model: ['lin2.weight' to 'lin1.weight']"],
    ),
    # A Linear has no buffers, so .to() keeps its member dicts as they were and
    # converts its parameters in place (param.data = ...).
    ".to(dtype)": (
        lambda m: m.lin1.to(torch.float64),
        ["'lin1.weight' has dtype torch.float64", ".to(torch.float32)"],
    ),
    ".to(device)": (
        lambda m: m.to("meta"),
        ["'lin1.weight' is on device 'meta'", ".to('cpu')"],
    ),
    "requires_grad turned off": (
        lambda m: m.lin2.bias.requires_grad_(False),
        [
            "'lin2.bias' has requires_grad=False",
            "had True",
            ".requires_grad_(True)",
        ],
    ),
    "requires_grad turned on": (
        lambda m: cast(torch.Tensor, m.bn.running_mean).requires_grad_(True),
        ["'bn.running_mean' has requires_grad=True", "had False"],
    ),
    # The graph took the training-mode branches: BatchNorm's batch statistics and
    # running-stat updates. An eval-mode model would silently get them too.
    "model.eval()": (
        lambda m: m.eval(),
        [
            "the model (Net) is in eval mode",
            "in training mode when the function was traced",
            "with .train()",
        ],
    ),
    "one submodule in eval mode": (
        lambda m: m.bn.eval(),
        ["module 'bn' (BatchNorm1d) is in eval mode", "with .train()"],
    ),
    "module without parameters added": (
        lambda m: setattr(m, "act", nn.ReLU()),
        [
            "the model has 5 modules",
            "the traced one had 4",
            "Pass a model of the traced architecture",
        ],
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_structural_change_is_rejected(
    forward: Forward, model: Net, full_checks: list[int], change: str
) -> None:
    mutate, match = CHANGES[change]
    mutate(model)
    assert_call_rejected(forward, model, *batch(2), match=match)
    assert len(full_checks) == 1


def test_rejected_change_undone_runs_again(
    forward: Forward, model: Net, full_checks: list[int]
) -> None:
    twin = clone_with_grads(model)
    model.lin1.weight.requires_grad_(False)
    assert_call_rejected(forward, model, *batch(2), match=["requires_grad=False"])
    model.lin1.weight.requires_grad_(True)
    run_both(forward, model, twin, 2)
    run_both(forward, model, twin, 3)
    # Only the rejected call ran the full check: undone, the change leaves the model
    # exactly as the full check last found it.
    assert len(full_checks) == 1


def test_mode_switched_back_runs_again(
    forward: Forward, model: Net, full_checks: list[int]
) -> None:
    twin = clone_with_grads(model)
    model.eval()
    assert_call_rejected(forward, model, *batch(2), match=["is in eval mode"])
    model.train()
    run_both(forward, model, twin, 2)
    run_both(forward, model, twin, 3)
    # Setting a mode changes the module's attribute dict, whose version tag the fast
    # path watches (it also sees any other attribute change): back in its mode, the
    # model gets the full check once more, then is remembered again.
    assert len(full_checks) == 2


def test_a_capture_with_mixed_modes_holds_the_model_to_them() -> None:
    # Fine-tuning with frozen BatchNorm statistics: the model trains, bn is in eval.
    torch.manual_seed(0)
    model = Net()
    model.bn.eval()
    step = pg.load(*pg.precompile(train_step, model, *batch(0), backend="eager"))
    twin = clone_with_grads(model)
    for seed in (1, 2):
        run_both(step, model, twin, seed)
    model.train()
    assert_call_rejected(
        step,
        model,
        *batch(3),
        match=[
            "module 'bn' (BatchNorm1d) is in training mode",
            "in eval mode when the function was traced",
            "with .eval()",
        ],
    )


def test_changed_layout(
    forward: Forward, backend: str, model: Net, full_checks: list[int]
) -> None:
    # Same shape, other strides: only the inductor backend specialises on them.
    twin = clone_with_grads(model)
    _transposed_layout(model)
    if backend == "inductor":
        assert_call_rejected(
            forward, model, *batch(2), match=["'lin1.weight' has strides (1, 4)"]
        )
    else:
        run_both(forward, model, twin, 2)
    assert len(full_checks) == 1


def test_without_guard_primitives_every_call_is_checked(
    forward: Forward, full_checks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where torch lacks the primitives the fast path relies on, the driver still
    # works: it runs the full check at every call.
    namespace = forward.__globals__
    monkeypatch.setitem(namespace, "_GUARDED", False)
    monkeypatch.setitem(namespace, "_remembered", None)
    torch.manual_seed(1)
    model = Net()
    twin = clone_with_grads(model)
    for seed in range(3):
        run_both(forward, model, twin, seed)
    assert len(full_checks) == 3
    model.lin1.weight.requires_grad_(False)
    assert_call_rejected(forward, model, *batch(4), match=["requires_grad=False"])


def test_guard_primitives_are_available(forward: Forward) -> None:
    # The fast path must not silently fall back on the torch this project pins.
    assert forward.__globals__["_GUARDED"] is True


# --- a model of another architecture -------------------------------------------------


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(4)
        )
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            *(nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3)) for _ in range(4))
        )
        self.fc = nn.Linear(3, 10)


def test_a_model_of_another_architecture_gets_a_short_message() -> None:
    code, cache = pg.precompile(
        lambda model, tokens: model(tokens),
        TinyGPT(),
        torch.zeros(2, 5, dtype=torch.long),
        backend="eager",
    )
    forward = pg.load(code, cache)
    message = assert_call_rejected(
        forward, TinyCNN(), torch.zeros(2, 5, dtype=torch.long), match=[]
    )
    first_line, *details = message.split("\n")
    # Every name of one differs from every name of the other: 19 + 30.
    assert first_line == (
        "the model's parameters and buffers differ from the traced model's (49 names "
        "differ). Pass a model of the traced architecture (only weight values may "
        "differ), or capture again with this model."
    )
    assert details == [
        "  missing ['wte.weight', 'blocks.0.0.weight', 'blocks.0.0.bias'] and 16 more",
        "  unexpected ['convs.0.0.weight', 'convs.0.0.bias', 'convs.0.1.weight'] and "
        "27 more (absent from the traced model, or tied to another tensor there)",
    ]
    assert len(message) < 600, message


def test_parameters_made_views_of_one_tensor_are_named_in_a_short_message() -> None:
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    forward = pg.load(*pg.precompile(step, model, torch.ones(2, 4), backend="eager"))
    # As a flattening of the parameters into one buffer leaves them.
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    offset = 0
    for param in model.parameters():
        param.data = flat[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    message = assert_call_rejected(forward, model, torch.ones(2, 4), match=[])
    assert message.startswith(
        "the model's '0.weight', the model's '0.bias', the model's '1.weight' and 3 "
        "more share one storage in this call"
    ), message
    assert "Pass separate tensors" in message and len(message) < 600, message
