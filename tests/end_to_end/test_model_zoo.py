"""Model zoo: real architectures from torchvision, timm and transformers, captured
whole and compared with eager PyTorch.

Every model is built from a config in code with seeded random weights (nothing is
downloaded) and runs on a small batch. Two functions are precompiled for each: a
training step (train mode: forward, loss, ``.backward()``) and an inference call (eval
mode). A loaded artifact runs on one deep copy of the model and eager PyTorch on
another; the tests compare the results, every parameter's ``.grad`` and every buffer.

Each artifact is precompiled once per model and backend in a module-scoped fixture
and shared. The eager backend covers every model. The inductor backend spends 10-100 s
of g++ time per graph, so it covers a few models, chosen by measured compile time (see
``INDUCTOR_MODELS``); those cases are marked slow.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest
import torch
import torch.utils._pytree as pytree
from helpers.model_zoo import (
    bert,
    convnext_atto,
    gpt2,
    images,
    mobilenet_v3_small,
    resnet18,
    swin_t,
    timm_vit_tiny,
    tokens,
    torchvision_vit,
)
from torch import nn
from torch.nn import functional as F

import precompile_gen as pg

# --------------------------------------------------------------------------------------
# The traced functions
# --------------------------------------------------------------------------------------


def classify_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def hf_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # transformers models take their labels as a keyword and compute their own loss
    # (shifted next-token cross-entropy for GPT-2, cross-entropy over the classes for
    # BERT); the traced function itself takes positional arguments only.
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    return loss.detach()


def predict(model: nn.Module, x: torch.Tensor) -> object:
    return model(x)


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], nn.Module]
    # The example batch (x, y) for a seed.
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    train_step: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

    def model(self, training: bool) -> nn.Module:
        torch.manual_seed(0)
        model = self.build()
        # One forward pass in train mode on another batch, as if the model had seen
        # data: BatchNorm's running statistics are no longer their initial zeros and
        # ones, so eval mode reads buffers that matter.
        with torch.no_grad():
            model.train()(self.batch(2)[0])
        return model.train(training)


ZOO = {
    zoo.name: zoo
    for zoo in [
        # Batch norm over two 1x1 maps (resnet18's and mobilenet's last stage at 32x32)
        # normalises two values per channel, which amplifies float32 rounding into
        # 10% gradient differences; at 64x64 it sees eight.
        ZooModel("resnet18", resnet18, lambda seed: images(2, 64, seed), classify_step),
        ZooModel(
            "mobilenet_v3_small",
            mobilenet_v3_small,
            lambda seed: images(2, 64, seed),
            classify_step,
        ),
        ZooModel(
            "torchvision_vit",
            torchvision_vit,
            lambda seed: images(2, 32, seed),
            classify_step,
        ),
        ZooModel("swin_t", swin_t, lambda seed: images(2, 64, seed), classify_step),
        ZooModel(
            "convnext_atto",
            convnext_atto,
            lambda seed: images(2, 32, seed),
            classify_step,
        ),
        ZooModel(
            "timm_vit_tiny",
            timm_vit_tiny,
            lambda seed: images(2, 32, seed),
            classify_step,
        ),
        ZooModel("gpt2", gpt2, lambda seed: tokens(None, seed), hf_step),
        ZooModel("bert", bert, lambda seed: tokens(3, seed), hf_step),
    ]
}

# Seconds to precompile the training step + the inference call on the inductor backend,
# each in a fresh process with an empty kernel cache on a 2-core machine:
# torchvision_vit 24 + 13, bert 32 + 13, timm_vit_tiny 56 + 21, convnext_atto 57 + 23,
# resnet18 85 + 20, mobilenet_v3_small 98 + 42, gpt2 about 47 + 22, swin_t's inference
# about 68 (its training step does not lower: Inductor's LayerNorm-backward
# decomposition returns another layout than eager's kernel). The two cheapest (a
# vision transformer and a text encoder), plus resnet18: the one model here whose
# buffers (BatchNorm's running statistics) the compiled graph updates in place. This
# file takes about 3 minutes.
INDUCTOR_MODELS = ["torchvision_vit", "bert", "resnet18"]

CASES = [pytest.param((name, "eager"), id=f"{name}-eager") for name in ZOO] + [
    pytest.param((name, "inductor"), id=f"{name}-inductor", marks=pytest.mark.slow)
    for name in INDUCTOR_MODELS
]


# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compiled:
    """One precompiled case: the traced function, its pristine example arguments
    (deep-copy before use) and the loaded artifact."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    artifact: Callable[..., object]


def compile_case(backend: str, fn: Callable[..., object], *args: object) -> Compiled:
    python_code, cache = pg.precompile(fn, *copy.deepcopy(args), backend=backend)
    return Compiled(fn, args, pg.load(python_code, cache))


# Tolerance. The eager backend replays eager's own ATen ops and matches bit for bit;
# Inductor fuses and reorders float32 arithmetic (reductions split differently, other
# matmul kernels, fused multiply-adds), which changes the rounding. Rounding error is
# proportional to the magnitude of the numbers combined, not to the result: a value that
# is small because large terms cancel (the gradient of a bias that a following
# normalisation makes irrelevant is zero up to rounding) carries the rounding of those
# terms. So every value is compared against a scale, the magnitude of what it is
# computed alongside: an output leaf against its own largest element, a gradient
# against the largest gradient of the model, a buffer against the largest buffer. The
# corpus's largest difference is 1.1e-5 of scale (resnet18's gradients, whose last
# batch norms see only eight values per channel; the other models stay below 3e-6);
# 1e-4 leaves a margin, while a wrong gradient or a missed update is off by far more.
ATOL_OF_SCALE = 1e-4


def scale_of(tensors: Iterable[torch.Tensor]) -> float:
    """The largest magnitude among the floating-point ``tensors`` (0.0 if none)."""
    return max(
        (t.detach().abs().max().item() for t in tensors if t.is_floating_point()),
        default=0.0,
    )


def assert_close_at_scale(
    actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str
) -> None:
    """Every element of ``actual`` within ``ATOL_OF_SCALE * scale`` of ``expected``'s;
    integer tensors (token ids, batch counters) exactly equal."""
    atol = ATOL_OF_SCALE * scale if expected.is_floating_point() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=0.0, atol=atol, msg=lambda detail: f"{what}: {detail}"
    )


def assert_result_matches(actual: object, expected: object, what: str) -> None:
    """The same structure, and each tensor leaf at its own scale."""
    actual_leaves, actual_spec = pytree.tree_flatten(actual)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert actual_spec == expected_spec, f"{what}: {actual_spec} != {expected_spec}"
    for index, (got, want) in enumerate(
        zip(actual_leaves, expected_leaves, strict=True)
    ):
        name = what if len(expected_leaves) == 1 else f"{what}, leaf {index}"
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), name
        assert_close_at_scale(got, want, scale_of([want]), name)


def assert_state_matches(actual: nn.Module, expected: nn.Module) -> None:
    """Every parameter's ``.grad`` (set where eager set it, and close) and every
    buffer, each group at its own scale."""
    expected_grads = {n: p.grad for n, p in expected.named_parameters()}
    actual_grads = {n: p.grad for n, p in actual.named_parameters()}
    assert list(actual_grads) == list(expected_grads)
    grad_scale = scale_of(g for g in expected_grads.values() if g is not None)
    for name, want in expected_grads.items():
        got = actual_grads[name]
        if want is None:
            assert got is None, f"{name}.grad was set, eager leaves it None"
        else:
            assert got is not None, f"{name}.grad is None, eager set it"
            assert_close_at_scale(got, want, grad_scale, f"{name}.grad")
    expected_buffers = dict(expected.named_buffers())
    actual_buffers = dict(actual.named_buffers())
    assert list(actual_buffers) == list(expected_buffers)
    buffer_scale = scale_of(expected_buffers.values())
    for name, want in expected_buffers.items():
        assert_close_at_scale(actual_buffers[name], want, buffer_scale, name)


def model_of(args: tuple[object, ...]) -> nn.Module:
    model = args[0]
    assert isinstance(model, nn.Module)
    return model


# --------------------------------------------------------------------------------------
# Fixtures: one artifact per model, backend and kind
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=CASES)
def case(request: pytest.FixtureRequest) -> tuple[ZooModel, str]:
    name, backend = request.param
    return ZOO[name], backend


# Both backends keep the models' dropout and stochastic depth: each call is seeded,
# and the artifact draws the same masks from the global generator as eager does.


@pytest.fixture(scope="module")
def training(case: tuple[ZooModel, str]) -> Compiled:
    zoo, backend = case
    model = zoo.model(training=True)
    return compile_case(backend, zoo.train_step, model, *zoo.batch(1))


@pytest.fixture(scope="module")
def inference(case: tuple[ZooModel, str]) -> Compiled:
    zoo, backend = case
    x, _ = zoo.batch(1)
    model = zoo.model(training=False)
    return compile_case(backend, predict, model, x)


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


def test_training_steps_match_eager(training: Compiled) -> None:
    eager_args = copy.deepcopy(training.args)
    artifact_args = copy.deepcopy(training.args)
    # Two steps: the second adds onto the first one's .grad and updates the running
    # statistics again. Each call is seeded, so dropout and stochastic depth draw the
    # same masks in eager and in the artifact (and other masks in the second step).
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = training.fn(*eager_args)
        torch.manual_seed(seed)
        actual = training.artifact(*artifact_args)
        assert_result_matches(actual, expected, f"loss of step {seed + 1}")
    eager_model, artifact_model = model_of(eager_args), model_of(artifact_args)
    assert all(p.grad is not None for p in eager_model.parameters())
    assert_state_matches(artifact_model, eager_model)


def test_inference_matches_eager(inference: Compiled) -> None:
    eager_args = copy.deepcopy(inference.args)
    artifact_args = copy.deepcopy(inference.args)
    expected = inference.fn(*eager_args)
    actual = inference.artifact(*artifact_args)
    assert_result_matches(actual, expected, "output")
    eager_model, artifact_model = model_of(eager_args), model_of(artifact_args)
    assert all(p.grad is None for p in artifact_model.parameters())
    assert_state_matches(artifact_model, eager_model)
