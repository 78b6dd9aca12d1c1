"""Capture rejects what an artifact could not reproduce, with a message that names the
culprit and the fix, and a rejected capture leaves the example model and inputs
exactly as they were (values, ``.grad`` objects, version counters)."""

from __future__ import annotations

import collections
import inspect
import itertools
from collections.abc import Callable, Iterable
from typing import cast

import pytest
import torch
import torch.utils._pytree as pytree
from helpers.state_snapshot import StateSnapshot, assert_same_state, clone_with_grads
from torch import nn
from torch._dynamo.decorators import mark_dynamic, mark_unbacked

import precompile_gen as pg

# Read by ``step_with_global`` as a module-level global (not an argument).
_GLOBAL_OFFSET = torch.ones(4)

# Not importable by its path (unimportable:Pair), so the artifact
# cannot name it in a spec.
Pair = collections.namedtuple("Pair", ["first", "second"])
Pair.__module__ = "unimportable"


class Opaque:
    """A pytree node registered without a serialized_type_name: its specs cannot be
    serialised."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


pytree.register_pytree_node(
    Opaque, lambda o: ([o.value], None), lambda values, _: Opaque(*values)
)


class Net(nn.Module):
    """Small, with BatchNorm in train mode: running one step on it changes buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.lin2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


class NetWithGradBuffer(Net):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(2, requires_grad=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def with_some_grads(model: nn.Module) -> nn.Module:
    """Pre-populate ``.grad`` on some parameters and leave the others None, so both
    kinds are checked."""
    for index, param in enumerate(model.parameters()):
        if index % 2 == 0:
            param.grad = torch.randn_like(param)
    return model


def assert_capture_rejected(
    fn: Callable[..., object],
    *args: object,
    match: Iterable[str],
    error: type[Exception] = pg.PrecompileError,
    backend: str = "eager",
    tracer: str = "make_fx",
) -> str:
    """``pg.precompile(fn, *args)`` raises ``error`` whose message (with its notes)
    contains every string in ``match``, and leaves ``args`` untouched. Returns the
    message and notes."""
    snapshot = StateSnapshot(*args)
    with pytest.raises(error) as caught:
        pg.precompile(fn, *args, backend=backend, tracer=tracer)
    message = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    for text in match:
        assert text in message, f"{text!r} not in the message: {message}"
    snapshot.assert_unchanged()
    return message


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return with_some_grads(Net())


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(8, 4)


def test_snapshot_detects_changes(model: nn.Module, x: torch.Tensor) -> None:
    # The helper is what every test below relies on; check that it can fail.
    snapshot = StateSnapshot(model, x)
    train_step(model, x)
    with pytest.raises(AssertionError):
        snapshot.assert_unchanged()


# --- tensors that would be baked in as constants ------------------------------------


def step_with_global(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = (model(x) + _GLOBAL_OFFSET[:2]).square().mean()
    loss.backward()
    return loss.detach()


def test_closed_over_global_tensor(model: nn.Module, x: torch.Tensor) -> None:
    assert_capture_rejected(
        step_with_global,
        model,
        x,
        match=["global", "'_GLOBAL_OFFSET'", "(4,)", "as an argument"],
    )


def test_closed_over_local_tensor(model: nn.Module, x: torch.Tensor) -> None:
    offset = torch.full((2,), 0.5)

    def step_with_closure(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = (model(x) * offset).square().mean()
        loss.backward()
        return loss.detach()

    assert_capture_rejected(
        step_with_closure,
        model,
        x,
        match=["closed-over", "'offset'", "(2,)", "as an argument"],
    )


class _Scaler:
    """An object a script keeps beside its model, holding tensors of its own."""

    def __init__(self) -> None:
        self.scale = torch.full((), 2.0)


_SCALER = _Scaler()


def step_with_scaler(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = (model(x) * _SCALER.scale).square().mean() + model(x).mean() * _SCALER.scale
    loss.backward()
    return loss.detach()


def test_a_tensor_held_by_a_global_object_is_named_once(
    model: nn.Module, x: torch.Tensor
) -> None:
    # GradScaler keeps its scale so: a torch.amp.GradScaler("cpu") in the step is
    # refused with its '_scale' named. Read by four nodes, it is listed once.
    error = assert_capture_rejected(
        step_with_scaler,
        model,
        x,
        match=[
            "the attribute 'scale' of the global '_SCALER' (a _Scaler) (shape ()",
            "or use the object that holds it outside the function",
        ],
    )
    assert error.count("'scale'") == 1 and " x " not in error


class ScaledLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        # A plain attribute, not register_buffer: invisible to named_buffers().
        self.scale = torch.full((out_features,), 3.0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * self.scale


class NetWithPlainAttribute(Net):
    def __init__(self) -> None:
        super().__init__()
        self.lin2 = ScaledLinear(4, 2)


def test_plain_module_tensor_attribute(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = with_some_grads(NetWithPlainAttribute())
    assert_capture_rejected(
        train_step,
        model,
        x,
        match=[
            "plain attribute",
            "'lin2.scale'",
            "argument 0 (`model`)",
            "register_buffer",
        ],
    )


# --- gradients that only parameters may receive ------------------------------------


@pytest.mark.parametrize("container", ["list", "dict"])
def test_module_inside_a_container(x: torch.Tensor, container: str) -> None:
    model = Net()

    def step_on_nested(models: object, x: torch.Tensor) -> torch.Tensor:
        inner = models[0] if isinstance(models, list) else cast(dict, models)["net"]
        return train_step(inner, x)

    models = [model] if container == "list" else {"net": model}
    where = "`models[0]`" if container == "list" else "`models['net']`"
    snapshot = StateSnapshot(model)
    assert_capture_rejected(
        step_on_nested,
        models,
        x,
        match=[
            f"argument 0 ({where}) is an nn.Module (Net) inside a container",
            "Pass it as an argument of its own",
        ],
    )
    snapshot.assert_unchanged()


def test_buffer_that_receives_a_grad(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = with_some_grads(NetWithGradBuffer())
    assert_capture_rejected(
        train_step,
        model,
        x,
        match=["buffer 'gain'", "gradient", "nn.Parameter", "requires_grad=False"],
    )


def test_user_input_that_receives_a_grad(model: nn.Module) -> None:
    x = torch.randn(8, 4, requires_grad=True)
    assert_capture_rejected(
        train_step,
        model,
        x,
        match=["argument 1 (`x`)", "(8, 4)", "gradient", "requires_grad=False"],
    )
    assert x.grad is None


# --- operators a flat functional graph cannot carry ---------------------------------


def test_while_loop_subgraph(model: nn.Module, x: torch.Tensor) -> None:
    # torch.cond is captured (tests/capturing/test_data_dependent.py); a loop's body
    # is not.
    def step_with_loop(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        _, y = torch.while_loop(
            lambda i, v: i < 2, lambda i, v: (i + 1, v.sin()), (torch.tensor(0), x)
        )
        return train_step(model, y)

    assert_capture_rejected(
        step_with_loop,
        model,
        x,
        match=["control-flow operator while_loop", "only torch.cond", "out of the"],
    )


def test_effectful_op(model: nn.Module, x: torch.Tensor) -> None:
    def step_with_print(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        torch.ops.aten._print("x")
        return train_step(model, x)

    assert_capture_rejected(
        step_with_print,
        model,
        x,
        match=["effectful", "aten._print", "Move it out of the function"],
    )


def _modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def test_mode_switch_inside_fn(model: nn.Module, x: torch.Tensor) -> None:
    def step_in_train_mode(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cast(Net, model).bn.train()
        return train_step(model, x)

    model.eval()
    assert_capture_rejected(
        step_in_train_mode,
        model,
        x,
        match=[
            "switches module 'bn' (BatchNorm1d) from eval to training mode",
            "Put the model in training mode before precompiling and before each call",
        ],
    )
    assert _modes(model) == [False] * 4


def test_mode_switch_before_fn_raises(model: nn.Module, x: torch.Tensor) -> None:
    def switching_then_failing(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        model.eval()
        raise ValueError("boom after eval()")

    # The function's own exception reaches the caller as it is.
    assert_capture_rejected(
        switching_then_failing, model, x, match=["boom after eval()"], error=ValueError
    )
    assert _modes(model) == [True] * 4


def test_mode_switched_and_back_inside_fn_is_captured(
    model: nn.Module, x: torch.Tensor
) -> None:
    # Evaluate, then train: the trace follows both phases, and the model ends in the
    # mode it started in, so there is nothing to replay.
    def evaluate_then_train(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            score = model(x).sum()
        model.train()
        return train_step(model, x) + score

    expected_model = clone_with_grads(model)
    forward = pg.load(*pg.precompile(evaluate_then_train, model, x, backend="eager"))
    assert _modes(model) == [True] * 4
    runtime_model = clone_with_grads(model)
    torch.testing.assert_close(
        forward(runtime_model, x), evaluate_then_train(expected_model, x)
    )
    assert_same_state(runtime_model, expected_model)


# --- dynamic-shape marks -----------------------------------------------------------


def test_mark_dynamic_is_rejected(model: nn.Module, x: torch.Tensor) -> None:
    mark_dynamic(x, 0)
    assert_capture_rejected(
        train_step,
        model,
        x,
        match=["argument 1 (`x`)", "mark_dynamic", "mark_unbacked"],
    )


def test_specialize_on_is_rejected(model: nn.Module, x: torch.Tensor) -> None:
    def is_one(size: int) -> bool:
        return size == 1

    if "specialize_on" in inspect.signature(mark_unbacked).parameters:
        mark_unbacked(x, 0, specialize_on=[is_one])
    else:
        # What mark_unbacked(..., specialize_on=...) stamps in torch versions that
        # have it, and what capture reads.
        mark_unbacked(x, 0)
        setattr(x, "_specialize_on", {0: [is_one]})  # noqa: B010
    assert_capture_rejected(
        train_step,
        model,
        x,
        match=["argument 1 (`x`)", "specialize_on", "Remove specialize_on"],
    )


@pytest.mark.parametrize("strict", [False, True])
def test_mark_unbacked_on_eager_backend(
    model: nn.Module, x: torch.Tensor, strict: bool
) -> None:
    mark_unbacked(x, 0, strict=strict)
    assert_capture_rejected(
        train_step,
        model,
        x,
        match=[
            "argument 1 (`x`)",
            "mark_unbacked",
            "eager backend",
            "static shapes",
            "backend='inductor'",
        ],
    )


# --- pytree specs ------------------------------------------------------------------


def test_unserialisable_output_spec(model: nn.Module, x: torch.Tensor) -> None:
    def step_returning_opaque(model: nn.Module, x: torch.Tensor) -> Opaque:
        out = model(x)
        out.square().mean().backward()
        return Opaque(out.detach())

    assert_capture_rejected(
        step_returning_opaque,
        model,
        x,
        match=[
            "result",
            "cannot be serialised",
            "serialized_type_name",
            "Return a tuple, list or dict",
        ],
    )


def test_unimportable_namedtuple_result(model: nn.Module, x: torch.Tensor) -> None:
    def step_returning_namedtuple(model: nn.Module, x: torch.Tensor) -> Pair:
        out = model(x)
        loss = out.square().mean()
        loss.backward()
        return Pair(loss.detach(), out.detach())

    assert_capture_rejected(
        step_returning_namedtuple,
        model,
        x,
        match=[
            "the result of 'step_returning_namedtuple' is a namedtuple of type 'Pair'",
            "unimportable:Pair does not import it here",
            "Define Pair at module level",
        ],
    )


def test_unserialisable_input_spec_degrades_to_no_structure_check(
    model: nn.Module,
) -> None:
    def step_on_pair(model: nn.Module, batch: Pair) -> torch.Tensor:
        loss = (model(batch.first) - batch.second).square().mean()
        loss.backward()
        return loss.detach()

    batch = Pair(torch.randn(8, 4), torch.randn(8, 2))
    # Flattening works (pytree knows namedtuples); only serialising the spec fails.
    spec = pytree.tree_flatten((batch,))[1]
    with pytest.raises(NotImplementedError):
        pytree.treespec_dumps(spec)

    snapshot = StateSnapshot(model, batch)
    python_code, cache = pg.precompile(step_on_pair, model, batch, backend="eager")
    snapshot.assert_unchanged()
    assert pg.parse_metadata(python_code)["IN_SPEC"] is None

    expected_model = clone_with_grads(model)
    expected = step_on_pair(expected_model, batch)
    forward = pg.load(python_code, cache)
    torch.testing.assert_close(forward(model, batch), expected)
    assert_same_state(model, expected_model)


# --- arguments of precompile itself -------------------------------------------------


def test_unknown_backend(model: nn.Module, x: torch.Tensor) -> None:
    assert_capture_rejected(
        train_step,
        model,
        x,
        error=ValueError,
        backend="x",
        match=["backend", "'x'", "'inductor'", "'eager'"],
    )


def test_dynamo_tracer_is_not_implemented(model: nn.Module, x: torch.Tensor) -> None:
    assert_capture_rejected(
        train_step,
        model,
        x,
        error=NotImplementedError,
        tracer="dynamo",
        match=["tracer='dynamo'", "make_fx"],
    )


def test_unknown_tracer(model: nn.Module, x: torch.Tensor) -> None:
    assert_capture_rejected(
        train_step,
        model,
        x,
        error=ValueError,
        tracer="other",
        match=["tracer", "'other'", "make_fx"],
    )


def test_non_callable_fn(model: nn.Module, x: torch.Tensor) -> None:
    # The cast only quiets the type checker: the point is a non-callable at run time.
    not_callable = cast("Callable[..., object]", 42)
    assert_capture_rejected(
        not_callable, model, x, error=ValueError, match=["callable", "got int"]
    )


def test_fn_raising_while_tracing(model: nn.Module, x: torch.Tensor) -> None:
    def exploding_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Runs BatchNorm and a backward first: any leak onto the example model
        # would show in the snapshot.
        train_step(model, x)
        raise ValueError("boom in the user's code")

    # The function's own exception, unwrapped, with a note on where it rose.
    message = assert_capture_rejected(
        exploding_step,
        model,
        x,
        match=["boom in the user's code", "'exploding_step' raised this while"],
        error=ValueError,
    )
    assert "exploding_step(*example_inputs) runs eagerly" in message


def test_every_rejection_keeps_fully_populated_grads(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = NetWithGradBuffer()
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.is_floating_point():
            tensor.grad = torch.randn_like(tensor)
    assert_capture_rejected(train_step, model, x, match=["buffer 'gain'"])


class OpaqueCache:
    """A library object that is not a pytree container."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_result_holding_an_opaque_object(model: nn.Module, x: torch.Tensor) -> None:
    def with_cache(model: nn.Module, x: torch.Tensor) -> dict[str, object]:
        out = model(x)
        return {"out": out, "cache": OpaqueCache(out)}

    assert_capture_rejected(
        with_cache,
        model,
        x,
        match=[
            "'with_cache' returns an object of type OpaqueCache at ['cache']",
            "use_cache=False",
            "register_pytree_node",
        ],
    )
