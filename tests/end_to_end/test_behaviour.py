"""Behaviour tests: a loaded artifact computes what eager PyTorch computes.

Every case runs on both backends. Each artifact is precompiled once per backend in a
module-scoped fixture and shared by the tests that use it, because an inductor compile
costs seconds of g++ time per graph. Every test runs eager and the artifact on fresh
deep copies of the same pristine example, so tests cannot leak state into each other.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict, cast

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn import functional as F

import precompile_gen as pg
from precompile_gen.metadata import metadata_constants

BACKENDS = ["eager", "inductor"]


# --------------------------------------------------------------------------------------
# Models and traced functions
# --------------------------------------------------------------------------------------


def make_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def make_bn_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(3, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2)
    )
    return model.train()


def make_dropout_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 3)).train()


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 10)
        self.proj.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.embed(tokens)))


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def lm_step(
    model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    loss = F.cross_entropy(model(tokens), labels)
    loss.backward()
    return loss


def encode_then_head(
    encoder: nn.Module, x: torch.Tensor, head: nn.Module
) -> torch.Tensor:
    loss = head(torch.relu(encoder(x))).square().mean()
    loss.backward()
    return loss


class Batch(TypedDict):
    a: torch.Tensor
    b: tuple[torch.Tensor, torch.Tensor]


def nested_io(model: nn.Module, batch: Batch) -> dict[str, object]:
    y, z = batch["b"]
    return {"out": model(batch["a"]), "pair": (y * 2, model(z) + y.sum())}


def with_extras(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int, None]:
    out = model(x)
    return out, out.shape[0], None


# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compiled:
    """One precompiled case: the traced function, its pristine example arguments
    (deep-copy before use) and the loaded artifact."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    python_code: str
    artifact: Callable[..., object]


@dataclass
class SideBySide:
    """The results and the (mutated) arguments of eager and artifact runs."""

    expected: object
    eager_args: tuple[object, ...]
    actual: object
    artifact_args: tuple[object, ...]


def compile_case(backend: str, fn: Callable[..., object], *args: object) -> Compiled:
    # Precompile a copy, so that the pristine arguments the tests start from stay
    # valid even if capture were to change its example.
    python_code, cache = pg.precompile(fn, *copy.deepcopy(args), backend=backend)
    return Compiled(fn, args, python_code, pg.load(python_code, cache))


def run_both(case: Compiled, calls: int = 1) -> SideBySide:
    eager_args = copy.deepcopy(case.args)
    artifact_args = copy.deepcopy(case.args)
    expected: object = None
    actual: object = None
    for _ in range(calls):
        expected = case.fn(*eager_args)
        actual = case.artifact(*artifact_args)
    return SideBySide(expected, eager_args, actual, artifact_args)


def module_at(args: tuple[object, ...], position: int) -> nn.Module:
    module = args[position]
    assert isinstance(module, nn.Module)
    return module


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_grads_match(side: SideBySide, position: int = 0) -> None:
    expected = grads(module_at(side.eager_args, position))
    actual = grads(module_at(side.artifact_args, position))
    torch.testing.assert_close(actual, expected)


# --------------------------------------------------------------------------------------
# Fixtures: one artifact per case and backend
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def mlp_predict(backend: str) -> Compiled:
    return compile_case(backend, predict, make_mlp(0), randn(5, 4, seed=1))


@pytest.fixture(scope="module")
def mlp_train(backend: str) -> Compiled:
    args = (make_mlp(0), randn(5, 4, seed=1), randn(5, 3, seed=2))
    return compile_case(backend, train_step, *args)


@pytest.fixture(scope="module")
def frozen_train(backend: str) -> Compiled:
    model = make_mlp(0)
    model[0].requires_grad_(False)
    return compile_case(
        backend, train_step, model, randn(5, 4, seed=1), randn(5, 3, seed=2)
    )


@pytest.fixture(scope="module")
def tied_lm(backend: str) -> Compiled:
    torch.manual_seed(0)
    tokens = torch.tensor([1, 4, 7, 2, 9])
    labels = torch.tensor([4, 7, 2, 9, 0])
    return compile_case(backend, lm_step, TiedLM(), tokens, labels)


@pytest.fixture(scope="module")
def two_modules(backend: str) -> Compiled:
    torch.manual_seed(0)
    encoder, head = nn.Linear(4, 6), nn.Linear(6, 2)
    return compile_case(backend, encode_then_head, encoder, randn(3, 4, seed=1), head)


@pytest.fixture(scope="module")
def bn_train(backend: str) -> Compiled:
    args = (make_bn_mlp(0), randn(4, 3, seed=1), randn(4, 2, seed=2))
    return compile_case(backend, train_step, *args)


@pytest.fixture(scope="module")
def nested(backend: str) -> Compiled:
    torch.manual_seed(0)
    batch: Batch = {
        "a": randn(2, 3, seed=1),
        "b": (randn(2, 3, seed=2), randn(2, 3, seed=3)),
    }
    return compile_case(backend, nested_io, nn.Linear(3, 3), batch)


@pytest.fixture(scope="module")
def extras(backend: str) -> Compiled:
    return compile_case(backend, with_extras, make_mlp(0), randn(5, 4, seed=1))


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


def test_mlp_inference_matches_eager(mlp_predict: Compiled) -> None:
    side = run_both(mlp_predict)
    assert isinstance(side.actual, torch.Tensor)
    torch.testing.assert_close(side.actual, side.expected)


def test_training_step_loss_and_grads_match_eager(mlp_train: Compiled) -> None:
    side = run_both(mlp_train)
    torch.testing.assert_close(side.actual, side.expected)
    model = module_at(side.artifact_args, 0)
    assert all(p.grad is not None for p in model.parameters())
    assert_grads_match(side)


def test_second_training_step_accumulates_grads_like_eager(
    mlp_train: Compiled,
) -> None:
    side = run_both(mlp_train)
    eager_model = module_at(side.eager_args, 0)
    artifact_model = module_at(side.artifact_args, 0)
    first_eager, first_artifact = grads(eager_model), grads(artifact_model)
    # Same weights and batch in both steps, so the accumulated grads are twice the
    # first ones; a driver that overwrote .grad would give the first ones instead.
    doubled = {k: None if g is None else 2 * g for k, g in first_eager.items()}

    expected = mlp_train.fn(*side.eager_args)
    actual = mlp_train.artifact(*side.artifact_args)

    torch.testing.assert_close(actual, expected)
    assert_grads_match(side)
    torch.testing.assert_close(grads(artifact_model), doubled)
    # Eager .backward() adds into the existing .grad tensors in place.
    for name, p in eager_model.named_parameters():
        assert p.grad is first_eager[name]
    for name, p in artifact_model.named_parameters():
        assert p.grad is first_artifact[name]


def test_frozen_params_get_no_grad(frozen_train: Compiled) -> None:
    side = run_both(frozen_train)
    torch.testing.assert_close(side.actual, side.expected)
    model = module_at(side.artifact_args, 0)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["0.weight", "0.bias"]
    for name, p in model.named_parameters():
        assert (p.grad is None) == (name in frozen), name
    assert_grads_match(side)
    meta = pg.parse_metadata(frozen_train.python_code)
    assert meta["PARAM_NAMES"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert meta["GRAD_PARAM_INDICES"] == [2, 3]


def test_tied_weights_are_one_param_and_grads_match(tied_lm: Compiled) -> None:
    meta = pg.parse_metadata(tied_lm.python_code)
    # named_parameters(remove_duplicate=False) yields embed.weight, proj.weight (the
    # same tensor) and proj.bias; the tied tensor is listed once, by its first name.
    assert meta["PARAM_NAMES"] == ["embed.weight", "proj.bias"]

    side = run_both(tied_lm)
    torch.testing.assert_close(side.actual, side.expected)
    model = module_at(side.artifact_args, 0)
    assert isinstance(model, TiedLM)
    assert model.proj.weight is model.embed.weight
    assert_grads_match(side)


def test_two_modules_are_prefixed_and_match_eager(two_modules: Compiled) -> None:
    meta = pg.parse_metadata(two_modules.python_code)
    assert meta["MODULE_POSITIONS"] == [0, 2]
    assert meta["NUM_POSITIONAL_ARGS"] == 3
    assert meta["PARAM_NAMES"] == ["m0.weight", "m0.bias", "m1.weight", "m1.bias"]

    side = run_both(two_modules)
    torch.testing.assert_close(side.actual, side.expected)
    assert_grads_match(side, position=0)
    assert_grads_match(side, position=2)


@pytest.mark.parametrize("calls", [1, 2])
def test_batchnorm_running_stats_update_like_eager(
    bn_train: Compiled, calls: int
) -> None:
    side = run_both(bn_train, calls=calls)
    torch.testing.assert_close(side.actual, side.expected)
    eager_model = module_at(side.eager_args, 0)
    artifact_model = module_at(side.artifact_args, 0)
    buffers = dict(artifact_model.named_buffers())
    assert list(buffers) == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    assert buffers["1.num_batches_tracked"].item() == calls
    torch.testing.assert_close(buffers, dict(eager_model.named_buffers()))
    assert_grads_match(side)


def test_nested_inputs_and_outputs_match_eager(nested: Compiled) -> None:
    side = run_both(nested)
    assert pytree.tree_structure(side.actual) == pytree.tree_structure(side.expected)
    assert isinstance(side.actual, dict)
    assert list(side.actual) == ["out", "pair"]
    assert isinstance(side.actual["pair"], tuple)
    torch.testing.assert_close(side.actual, side.expected)


def test_non_tensor_outputs_match_eager(extras: Compiled) -> None:
    side = run_both(extras)
    assert isinstance(side.actual, tuple)
    assert isinstance(side.expected, tuple)
    out, count, nothing = side.actual
    assert type(count) is int
    assert count == side.expected[1] == 5
    assert nothing is None
    torch.testing.assert_close(out, side.expected[0])


def test_other_checkpoint_of_same_architecture(mlp_train: Compiled) -> None:
    other = make_mlp(1)
    other.load_state_dict(make_mlp(2).state_dict())
    example = module_at(mlp_train.args, 0)
    assert not torch.equal(
        other.state_dict()["0.weight"], example.state_dict()["0.weight"]
    )
    x, target = mlp_train.args[1:]
    eager_model = copy.deepcopy(other)

    actual = mlp_train.artifact(other, x, target)
    expected = mlp_train.fn(eager_model, x, target)

    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(grads(other), grads(eager_model))
    # The example's loss differs, so the artifact did not bake the example's weights.
    example_loss = mlp_train.fn(copy.deepcopy(example), x, target)
    assert isinstance(example_loss, torch.Tensor)
    assert isinstance(actual, torch.Tensor)
    assert not torch.allclose(actual, example_loss)


def test_render_of_capture_is_precompile_text(
    backend: str, mlp_predict: Compiled
) -> None:
    cap = pg.capture(predict, *copy.deepcopy(mlp_predict.args), backend=backend)
    assert isinstance(cap, pg.CaptureResult)
    assert cap.backend == backend
    text = pg.render_artifact(cap)
    assert pg.render_artifact(cap) == text
    assert pg.parse_metadata(text) == metadata_constants(cap)
    assert text == mlp_predict.python_code


def test_parameter_gradient_hooks_run_as_in_eager(mlp_train: Compiled) -> None:
    def hooked(model: nn.Module) -> list[str]:
        """Clip one layer's gradient, scale another's, and log what the hooks saw."""
        log: list[str] = []
        layers = cast(nn.Sequential, model)
        first, last = cast(nn.Linear, layers[0]), cast(nn.Linear, layers[2])
        first.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        first.weight.register_hook(lambda g: log.append(f"saw {g.abs().max():.2f}"))
        last.weight.register_hook(lambda g: g * 0.5)
        last.weight.register_post_accumulate_grad_hook(
            lambda p: log.append(f"accumulated {cast(torch.Tensor, p.grad).sum():.4f}")
        )
        return log

    eager_args = copy.deepcopy(mlp_train.args)
    artifact_args = copy.deepcopy(mlp_train.args)
    eager_log = hooked(module_at(eager_args, 0))
    log = hooked(module_at(artifact_args, 0))
    for _ in range(2):
        expected = mlp_train.fn(*eager_args)
        actual = mlp_train.artifact(*artifact_args)
        torch.testing.assert_close(actual, expected)
    assert_grads_match(SideBySide(None, eager_args, None, artifact_args))
    # The same hooks ran as often, each on the gradient eager gave it: the logging
    # hook saw the clipped one, the post-accumulate hook the accumulated .grad. (The
    # order across parameters is backward's own, so only each one's is compared.)
    assert sorted(log) == sorted(eager_log) and len(log) == 4
    assert [line for line in log if line.startswith("saw")] == ["saw 0.01"] * 2


@pytest.fixture(scope="module")
def dropout_train(backend: str) -> Compiled:
    args = (make_dropout_mlp(0), randn(16, 8, seed=1), randn(16, 3, seed=2))
    return compile_case(backend, train_step, *args)


def test_dropout_draws_from_the_global_generator_like_eager(
    dropout_train: Compiled,
) -> None:
    # Under the same seed the artifact draws the same masks as eager; each call
    # draws new ones (no mask is baked into the artifact).
    eager_args = copy.deepcopy(dropout_train.args)
    artifact_args = copy.deepcopy(dropout_train.args)
    losses: list[torch.Tensor] = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        expected = dropout_train.fn(*eager_args)
        torch.manual_seed(seed)
        actual = dropout_train.artifact(*artifact_args)
        assert isinstance(actual, torch.Tensor)
        torch.testing.assert_close(actual, expected)
        losses.append(actual)
    side = SideBySide(None, eager_args, None, artifact_args)
    assert_grads_match(side)
    assert not torch.equal(losses[0], losses[1])


def test_precompile_leaves_example_model_untouched(backend: str) -> None:
    model = make_bn_mlp(0)
    x, target = randn(4, 3, seed=1), randn(4, 2, seed=2)
    # One eager step gives the example non-default BatchNorm stats and populated
    # grads; clearing the later layers' grads covers a .grad that is None as well.
    train_step(model, x, target)
    for p in model[1:].parameters():
        p.grad = None
    params_before = dict(model.named_parameters())
    buffers_before = dict(model.named_buffers())
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    grads_before = grads(model)
    grad_values_before = {
        k: None if g is None else g.clone() for k, g in grads_before.items()
    }
    inputs_before = (x.clone(), target.clone())

    pg.precompile(train_step, model, x, target, backend=backend)

    assert model.training
    for name, p in model.named_parameters():
        assert p is params_before[name], name
        assert p.grad is grads_before[name], name
    for name, b in model.named_buffers():
        assert b is buffers_before[name], name
    torch.testing.assert_close(model.state_dict(), state_before, rtol=0, atol=0)
    torch.testing.assert_close(grads(model), grad_values_before, rtol=0, atol=0)
    torch.testing.assert_close((x, target), inputs_before, rtol=0, atol=0)
    assert grads(model)["0.weight"] is not None
    assert grads(model)["3.weight"] is None


def test_eager_driver_runs_the_graph_without_grad_and_restores_the_mode() -> None:
    python_code, _ = pg.precompile(
        predict, make_mlp(0), randn(5, 4, seed=1), backend="eager"
    )
    namespace: dict[str, object] = {"__name__": "artifact"}
    exec(compile(python_code, "<artifact>", "exec"), namespace)
    forward = namespace["forward"]
    assert callable(forward)
    model, x = make_mlp(0), randn(5, 4, seed=1)
    out = forward(model, x)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    assert torch.is_grad_enabled()
    with torch.no_grad():
        forward(model, x)
        assert not torch.is_grad_enabled()

    modes: list[bool] = []

    def failing_call(flat_inputs: list[object]) -> list[object]:
        modes.append(torch.is_grad_enabled())
        raise RuntimeError("the graph failed")

    namespace["call"] = failing_call
    with pytest.raises(RuntimeError, match="the graph failed"):
        forward(model, x)
    assert modes == [False]
    assert torch.is_grad_enabled()
