"""Module hooks are part of the calling convention: the trace ran the hooks the model
had, so the graph has them built in and runs no other. A call whose model has other
hooks (on a module, or torch's global module hooks) is rejected, on the full check
and on the fast path for an unchanged model alike, and changes nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers.state_snapshot import StateSnapshot
from torch import nn
from torch.nn.utils import prune

import precompile_gen as pg
from precompile_gen.tools.inspection import inspect_artifact
from precompile_gen.tools.report_text import format_report


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def double_input(
    module: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    return (inputs[0] * 2,)


def add_one(
    module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
) -> torch.Tensor:
    return output + 1


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def example() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def load(fn: Callable[..., object], model: nn.Module) -> Callable[..., object]:
    python_code, cache = pg.precompile(fn, model, example(), backend="eager")
    return pg.load(python_code, cache)


@pytest.fixture(scope="module")
def plain() -> Callable[..., object]:
    """An MLP captured without hooks."""
    return load(predict, make_mlp())


@pytest.fixture(scope="module")
def hooked() -> Callable[..., object]:
    """An MLP whose first Linear doubles its input in a forward pre-hook."""
    model = make_mlp()
    model[0].register_forward_pre_hook(double_input)
    return load(predict, model)


@pytest.fixture
def global_hook() -> Iterator[Callable[[], None]]:
    """Registers a global module forward hook on demand; removed after the test."""
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def register() -> None:
        # A hook that only watches, as profilers' hooks do: the artifact would never
        # run it.
        handles.append(
            nn.modules.module.register_module_forward_hook(lambda *args: None)
        )

    yield register
    for handle in handles:
        handle.remove()


def test_hooks_are_recorded_in_the_metadata(caplog: pytest.LogCaptureFixture) -> None:
    model = make_mlp()
    model.register_forward_hook(add_one)
    model[2].register_forward_hook(add_one)
    model[2].register_forward_hook(add_one)
    python_code, _ = pg.precompile(predict, model, example(), backend="eager")
    metadata = pg.parse_metadata(python_code)
    assert metadata["MODULE_HOOKS"] == [
        {"": {"forward hook": 1}, "2": {"forward hook": 2}}
    ]
    assert metadata["GLOBAL_MODULE_HOOKS"] == {}
    report = inspect_artifact(python_code)
    assert report["modules"][0]["hooks"] == 3
    assert "hooks" in format_report(report)
    # Capture says that the artifact never calls the hooks themselves.
    (warning,) = [
        r for r in caplog.records if r.name == "precompile_gen.capturing.graph_inputs"
    ]
    assert "anything else they do (recording, logging) happens only now" in (
        warning.getMessage()
    )
    assert warning.getMessage().endswith("Hooked: [<root>, 2].")


def test_a_capture_without_hooks_says_nothing_of_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pg.capture(predict, make_mlp(), example(), backend="eager")
    assert not [
        r for r in caplog.records if r.name == "precompile_gen.capturing.graph_inputs"
    ]


def test_the_traced_hooks_run_as_in_eager(hooked: Callable[..., object]) -> None:
    model = make_mlp()
    model[0].register_forward_pre_hook(double_input)
    x = example()
    for _ in range(2):  # the full check, then the fast path
        torch.testing.assert_close(hooked(model, x), model(x))
    # The hook's effect is in the graph: without it, eager differs.
    out = hooked(model, x)
    assert isinstance(out, torch.Tensor)
    assert not torch.allclose(out, make_mlp()(x))


def test_a_hook_added_after_capture_is_rejected(plain: Callable[..., object]) -> None:
    model, x = make_mlp(), example()
    torch.testing.assert_close(plain(model, x), model(x))
    handle = model[2].register_forward_hook(add_one)
    with pytest.raises(
        pg.PrecompileError,
        match=r"module '2' \(Linear\) has 1 forward hook in this call, but no "
        r"forward hooks when the function was traced.*capture again with these",
    ):
        plain(model, x)
    handle.remove()
    torch.testing.assert_close(plain(model, x), model(x))


def test_a_fresh_model_with_a_hook_is_rejected(plain: Callable[..., object]) -> None:
    model = make_mlp()
    model.register_forward_pre_hook(double_input)
    with pytest.raises(
        pg.PrecompileError, match=r"the model \(Sequential\) has 1 forward pre-hook"
    ):
        plain(model, example())


def test_a_traced_hook_removed_is_rejected(hooked: Callable[..., object]) -> None:
    model, x = make_mlp(), example()
    handle = model[0].register_forward_pre_hook(double_input)
    torch.testing.assert_close(hooked(model, x), model(x))
    handle.remove()
    with pytest.raises(
        pg.PrecompileError,
        match=r"module '0' \(Linear\) has no forward pre-hooks in this call, but 1 "
        r"forward pre-hook when the function was traced",
    ):
        hooked(model, x)
    # Another hook of the same kind in its place is the traced convention again.
    model[0].register_forward_pre_hook(double_input)
    torch.testing.assert_close(hooked(model, x), model(x))


def test_a_global_module_hook_is_rejected(
    plain: Callable[..., object], global_hook: Callable[[], None]
) -> None:
    model, x = make_mlp(), example()
    torch.testing.assert_close(plain(model, x), model(x))
    global_hook()
    with pytest.raises(
        pg.PrecompileError,
        match=r"torch's global module hooks \(register_module_forward_hook\) include "
        r"1 forward hook in this call, but no forward hooks when the function was "
        r"traced",
    ):
        plain(model, x)


def test_other_hook_handles_cost_a_full_check_not_a_rejection(
    plain: Callable[..., object],
) -> None:
    model, x = make_mlp(), example()
    plain(model, x)
    # A tensor hook takes a hook handle too, which fails the fast path's signal.
    watched = torch.zeros(1, requires_grad=True)
    watched.register_hook(lambda grad: grad)
    torch.testing.assert_close(plain(model, x), model(x))


def test_a_rejected_training_step_changes_nothing() -> None:
    forward = load(train_step, make_mlp())
    model, x = make_mlp(), example()
    forward(model, x)
    model[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(
        pg.PrecompileError, match=r"module '0' \(Linear\) has 1 backward hook"
    ):
        forward(model, x)
    snapshot.assert_unchanged()


def test_spectral_norm_hooks_match_eager() -> None:
    # torch.nn.utils.spectral_norm computes the weight in a forward pre-hook and, in
    # training mode, updates its power-iteration buffers there.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.utils.spectral_norm(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 3)
    )
    # A deep copy carries the hook along, as a model built the same way has it.
    eager_model, artifact_model = copy.deepcopy(model), copy.deepcopy(model)
    forward = load(train_step, model)
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(
            forward(artifact_model, x), train_step(eager_model, x)
        )
    torch.testing.assert_close(
        dict(artifact_model.named_buffers()), dict(eager_model.named_buffers())
    )
    torch.testing.assert_close(
        {name: p.grad for name, p in artifact_model.named_parameters()},
        {name: p.grad for name, p in eager_model.named_parameters()},
    )


def test_pruning_hooks_match_eager() -> None:
    # torch.nn.utils.prune computes the weight from weight_orig and a mask buffer in
    # a forward pre-hook.
    def pruned() -> nn.Sequential:
        model = make_mlp()
        prune.l1_unstructured(model[0], "weight", amount=0.5)
        return model

    forward = load(train_step, pruned())
    eager_model, artifact_model = pruned(), pruned()
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(
            forward(artifact_model, x), train_step(eager_model, x)
        )
    torch.testing.assert_close(
        {name: p.grad for name, p in artifact_model.named_parameters()},
        {name: p.grad for name, p in eager_model.named_parameters()},
    )
