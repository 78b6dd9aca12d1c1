"""Dynamic dims: ``mark_unbacked`` on the inductor backend.

A marked dim becomes an unbacked symbol, so one artifact serves every size within the
declared bounds; dims that share a ``shape_id`` share the symbol. Two artifacts are
compiled once each and shared (an inductor compile costs seconds): an MLP inference
with a bounded batch dim, and a training step whose input and target share their batch
dim. The capture-time rejections only trace, so they cost no compile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from helpers.state_snapshot import StateSnapshot, assert_same_state
from torch import nn
from torch._dynamo.decorators import mark_unbacked

import precompile_gen as pg
from precompile_gen.capturing.trace import trace


def make_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def make_bn_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)
    )
    return model.train()


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = (model(x) - target).square().mean()
    loss.backward()
    return loss.detach()


def with_grads(model: nn.Module) -> nn.Module:
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.5)
    return model


@dataclass
class Compiled:
    code: str
    forward: Callable[..., object]


@pytest.fixture(scope="module")
def inference() -> Compiled:
    x = randn(5, 4, seed=1)
    mark_unbacked(x, 0, min=1, max=64, hint_override=8)
    code, cache = pg.precompile(predict, make_mlp(0), x)
    return Compiled(code, pg.load(code, cache))


@dataclass
class CompiledTraining(Compiled):
    # The example model and inputs as capture left them, with a snapshot from before.
    example: StateSnapshot


@pytest.fixture(scope="module")
def training() -> CompiledTraining:
    model = with_grads(make_bn_mlp(0))
    x, target = randn(6, 4, seed=1), randn(6, 3, seed=2)
    mark_unbacked(x, 0, shape_id="batch", min=2, max=64)
    mark_unbacked(target, 0, shape_id="batch")
    example = StateSnapshot(model, x, target)
    code, cache = pg.precompile(train_step, model, x, target)
    return CompiledTraining(code, pg.load(code, cache), example)


def assert_rejected(call: Callable[[], object], match: list[str]) -> None:
    with pytest.raises(pg.PrecompileError) as caught:
        call()
    message = str(caught.value)
    for text in match:
        assert text in message, f"{text!r} not in {message!r}"


# --- running at other sizes -------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2, 5, 17, 64])
def test_inference_matches_eager_at_any_batch_size(
    inference: Compiled, batch: int
) -> None:
    model, x = make_mlp(3), randn(batch, 4, seed=batch)
    torch.testing.assert_close(inference.forward(model, x), predict(model, x))


@pytest.mark.parametrize("batch", [2, 3, 17])
def test_training_step_grads_match_eager(
    training: CompiledTraining, batch: int
) -> None:
    x, target = randn(batch, 4, seed=batch), randn(batch, 3, seed=batch + 1)
    ours, eager = with_grads(make_bn_mlp(3)), with_grads(make_bn_mlp(3))
    loss = training.forward(ours, x, target)
    torch.testing.assert_close(loss, train_step(eager, x, target))
    assert_same_state(ours, eager)


def test_capture_leaves_the_example_untouched(training: CompiledTraining) -> None:
    training.example.assert_unchanged()


def test_artifact_records_dynamic_dims_and_bounds(
    inference: Compiled, training: CompiledTraining
) -> None:
    header = inference.code[: inference.code.index("# Sections")]
    assert "Dims marked with mark_unbacked (None in USER_INPUT_SHAPES)" in header
    meta = pg.parse_metadata(inference.code)
    assert meta["USER_INPUT_SHAPES"] == [(None, 4)]
    assert meta["USER_INPUT_BOUNDS"] == [{0: (1, 64)}]
    meta = pg.parse_metadata(training.code)
    assert meta["USER_INPUT_SHAPES"] == [(None, 4), (None, 3)]
    assert meta["USER_INPUT_BOUNDS"] == [{0: (2, 64)}, None]


# --- run-time checks --------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 65])
def test_size_outside_bounds_is_rejected_before_running(
    training: CompiledTraining, batch: int
) -> None:
    model = with_grads(make_bn_mlp(3))
    x, target = randn(batch, 4, seed=0), randn(batch, 3, seed=1)
    snapshot = StateSnapshot(model, x, target)
    assert_rejected(
        lambda: training.forward(model, x, target),
        ["argument 1 (`x`)", f"size {batch} in dim 0", "min=2, max=64", "wider bounds"],
    )
    snapshot.assert_unchanged()


def test_upper_bound_alone_is_shown_as_declared(inference: Compiled) -> None:
    assert_rejected(
        lambda: inference.forward(make_mlp(3), randn(65, 4, seed=0)),
        ["argument 1 (`x`) has size 65 in dim 0", "(min=1, max=64)"],
    )


def test_static_dim_is_still_checked(inference: Compiled) -> None:
    assert_rejected(
        lambda: inference.forward(make_mlp(3), randn(5, 3, seed=0)),
        ["argument 1 (`x`) has shape (5, 3)", "shape (*, 4)"],
    )


def test_a_wrong_input_is_named_by_position_and_name(
    training: CompiledTraining,
) -> None:
    model = with_grads(make_bn_mlp(3))
    snapshot = StateSnapshot(model)
    assert_rejected(
        lambda: training.forward(model, randn(6, 4, seed=0), randn(6, 5, seed=1)),
        ["argument 2 (`target`) has shape (6, 5)", "shape (*, 3)"],
    )
    snapshot.assert_unchanged()


def test_shared_shape_id_sizes_must_agree_at_run_time(
    training: CompiledTraining,
) -> None:
    model = with_grads(make_bn_mlp(3))
    snapshot = StateSnapshot(model)
    assert_rejected(
        lambda: training.forward(model, randn(3, 4, seed=0), randn(5, 3, seed=1)),
        [
            "shape_id",
            "argument 2 (`target`) dim 0 has size 5 but argument 1 (`x`) dim 0 has "
            "size 3",
            "equal sizes",
        ],
    )
    snapshot.assert_unchanged()


def test_shared_shape_id_mismatch_leaves_the_model_untouched(
    training: CompiledTraining,
) -> None:
    model = with_grads(make_bn_mlp(3))
    x, target = randn(3, 4, seed=0), randn(5, 3, seed=1)
    snapshot = StateSnapshot(model, x, target)
    with pytest.raises(pg.PrecompileError):
        training.forward(model, x, target)
    snapshot.assert_unchanged()


# --- what capture builds ----------------------------------------------------------


def test_shared_shape_id_is_one_symbol() -> None:
    x, y = randn(4, 4, seed=0), randn(4, 4, seed=1)
    mark_unbacked(x, 0, shape_id="batch")
    mark_unbacked(y, 0, shape_id="batch")
    traced = trace(lambda m, x, y: m(x + y), (make_mlp(0), x, y), backend="inductor")
    fake_x, fake_y = traced.flat_args[-2:]
    assert isinstance(fake_x, torch.Tensor) and isinstance(fake_y, torch.Tensor)
    x_size, y_size = fake_x.shape[0], fake_y.shape[0]
    assert isinstance(x_size, torch.SymInt) and isinstance(y_size, torch.SymInt)
    assert x_size.node.expr == y_size.node.expr
    symbol = str(x_size.node.expr)
    assert [leaf.symbols for leaf in traced.convention.leaves] == [
        {0: symbol},
        {0: symbol},
    ]
    assert [leaf.shape for leaf in traced.convention.leaves] == [(None, 4), (None, 4)]


def test_hint_override_reaches_the_shape_env() -> None:
    x = randn(5, 4, seed=0)
    mark_unbacked(x, 0, hint_override=32)
    traced = trace(predict, (make_mlp(0), x), backend="inductor")
    fake = traced.flat_args[-1]
    assert isinstance(fake, torch.Tensor)
    symbol = fake.shape[0]
    assert isinstance(symbol, torch.SymInt)
    shape_env = symbol.node.shape_env
    assert shape_env is not None
    assert shape_env.var_to_hint_override == {symbol.node.expr: 32}


@pytest.mark.parametrize(
    ("memory_format", "shape"),
    [(torch.channels_last, (2, 3, 5, 5)), (torch.channels_last_3d, (2, 3, 2, 4, 4))],
)
def test_marked_input_keeps_its_memory_format(
    memory_format: torch.memory_format, shape: tuple[int, ...]
) -> None:
    x = torch.randn(shape).to(memory_format=memory_format)
    mark_unbacked(x, 0)
    traced = trace(lambda x: x * 2, (x,), backend="inductor")
    fake = traced.flat_args[-1]
    assert isinstance(fake, torch.Tensor)
    assert fake.is_contiguous(memory_format=memory_format)


def test_strict_and_negative_dim_marks_are_honoured() -> None:
    x = randn(3, 4, seed=0)
    mark_unbacked(x, -1, strict=True)
    traced = trace(lambda m, x: m(x.t()), (nn.Linear(3, 2), x), backend="inductor")
    assert [leaf.shape for leaf in traced.convention.leaves] == [(3, None)]
    assert [leaf.bounds for leaf in traced.convention.leaves] == [None]


# --- capture-time rejections ------------------------------------------------------


def branch_on_batch(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > 2:
        return model(x)
    return model(x) * 2


def test_guard_on_marked_dim_is_rejected_at_capture() -> None:
    x = randn(5, 4, seed=0)
    mark_unbacked(x, 0)
    assert_rejected(
        lambda: pg.capture(branch_on_batch, make_mlp(0), x),
        [
            "'branch_on_batch' needs to know the size of argument 1 (`x`) dim 0",
            "u0 > 2",
            "test_dynamic.py",
            "leave the dim static",
        ],
    )


def test_view_that_pins_marked_dim_is_rejected_at_capture() -> None:
    x = randn(4, 4, seed=0)
    mark_unbacked(x, 0)
    assert_rejected(
        lambda: pg.capture(lambda m, x: m(x).view(2, 6), make_mlp(0), x),
        ["fixes argument 1 (`x`) dim 0 to the size 4", "x.view(x.shape[0], -1)"],
    )


def test_equal_dims_without_shared_shape_id_are_rejected_at_capture() -> None:
    x, y = randn(4, 4, seed=0), randn(4, 4, seed=1)
    mark_unbacked(x, 0)
    mark_unbacked(y, 0)
    assert_rejected(
        lambda: pg.capture(lambda m, x, y: m(x + y), make_mlp(0), x, y),
        [
            "Eq(u0, u1)",
            "u0 is argument 1 (`x`) dim 0, u1 is argument 2 (`y`) dim 0",
            "same mark_unbacked shape_id",
        ],
    )


def test_data_dependent_branch_is_rejected_at_capture() -> None:
    def branch_on_data(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x) if x.sum() > 0 else model(-x)

    x = randn(4, 4, seed=0)
    mark_unbacked(x, 0)
    assert_rejected(
        lambda: pg.capture(branch_on_data, make_mlp(0), x),
        ["value computed from tensor data", "torch.where"],
    )


def test_eager_backend_rejects_mark_unbacked() -> None:
    x = randn(4, 4, seed=0)
    mark_unbacked(x, 0)
    assert_rejected(
        lambda: pg.precompile(predict, make_mlp(0), x, backend="eager"),
        [
            "argument 1 (`x`)",
            "mark_unbacked",
            "backend='inductor'",
            "leave the dim static",
        ],
    )


class Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize(
    ("make_input", "match"),
    [
        (
            lambda: randn(4, 4, seed=0).as_subclass(Tagged),
            ["argument 1 (`x`) is a tensor subclass (Tagged)", "plain torch.Tensor"],
        ),
        (
            lambda: randn(4, 4, seed=0).t(),
            ["argument 1 (`x`)", "strides (1, 4)", "channels_last", ".contiguous()"],
        ),
    ],
    ids=["subclass", "transposed"],
)
def test_unsupported_marked_input_is_rejected(
    make_input: Callable[[], torch.Tensor], match: list[str]
) -> None:
    x = make_input()
    mark_unbacked(x, 0)
    assert_rejected(lambda: trace(predict, (make_mlp(0), x), backend="inductor"), match)


def test_example_outside_its_own_bounds_is_rejected() -> None:
    x = randn(4, 4, seed=0)
    mark_unbacked(x, 0, min=5)
    assert_rejected(
        lambda: trace(predict, (make_mlp(0), x), backend="inductor"),
        ["argument 1 (`x`) has size 4 in dim 0", "(min=5)", "widen min/max"],
    )


def test_shared_shape_id_examples_must_agree() -> None:
    x, y = randn(4, 4, seed=0), randn(5, 4, seed=1)
    mark_unbacked(x, 0, shape_id="batch")
    mark_unbacked(y, 0, shape_id="batch")
    assert_rejected(
        lambda: trace(lambda m, x, y: m(x), (make_mlp(0), x, y), backend="inductor"),
        [
            "shape_id='batch'",
            "argument 1 (`x`) dim 0 has 4",
            "argument 2 (`y`) dim 0 has 5",
        ],
    )


def test_mark_outside_the_tensor_is_rejected() -> None:
    x = randn(4, 4, seed=0)
    mark_unbacked(x, 2)
    assert_rejected(
        lambda: trace(predict, (make_mlp(0), x), backend="inductor"),
        ["argument 1 (`x`) has 2 dims", "marked dim 2"],
    )
