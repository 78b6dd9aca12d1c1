"""Sparse gradients of ``nn.Embedding`` and ``nn.EmbeddingBag`` (``sparse=True``):
a recommendation-style training step through the artifact equals eager's on both
backends (losses, parameters, the sparse ``.grad`` eager leaves, optimizer state),
with SGD, with Adagrad, with SparseAdam next to Adam, and with the optimizer outside the
function; what the artifact cannot reproduce is refused at capture, naming the
module and the fix, and changes nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.state_snapshot import StateSnapshot
from torch import nn

import precompile_gen as pg

STEPS = 3
BACKENDS = ["eager", "inductor"]
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Recommender(nn.Module):
    """Item and tag embedding tables, sparse, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.bag = nn.EmbeddingBag(40, 8, mode="sum", sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(
        self, items: torch.Tensor, tags: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        features = torch.cat([self.emb(items).mean(1), self.bag(tags, offsets)], 1)
        return self.head(features).squeeze(1)


def batch(seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    items = torch.randint(0, 50, (4, 3), generator=generator)
    tags = torch.randint(0, 40, (10,), generator=generator)
    offsets = torch.tensor([0, 3, 5, 8])
    return items, tags, offsets, torch.randn(4, generator=generator)


def loss_of(model: Recommender, items, tags, offsets, target) -> torch.Tensor:
    return nn.functional.mse_loss(model(items, tags, offsets), target)


def sgd_step(model, optimizer, items, tags, offsets, target):
    optimizer.zero_grad()
    loss = loss_of(model, items, tags, offsets, target)
    loss.backward()
    optimizer.step()
    return loss.detach()


def two_optimizer_step(model, sparse, dense, items, tags, offsets, target):
    sparse.zero_grad()
    dense.zero_grad()
    loss = loss_of(model, items, tags, offsets, target)
    loss.backward()
    sparse.step()
    dense.step()
    return loss.detach()


def backward_only(model, items, tags, offsets, target):
    loss = loss_of(model, items, tags, offsets, target)
    loss.backward()
    return loss.detach()


def sgd(model: Recommender) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.SGD(
            [
                {"params": [model.emb.weight, model.bag.weight], "lr": 0.5},
                {"params": model.head.parameters()},
            ],
            lr=0.1,
            momentum=0.9,
        )
    ]


def sparse_adam_and_adam(model: Recommender) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.SparseAdam([model.emb.weight, model.bag.weight], lr=0.05),
        torch.optim.Adam(model.head.parameters(), lr=0.05),
    ]


def assert_same_grad(got: torch.Tensor | None, want: torch.Tensor | None, name: str):
    assert want is not None and got is not None, name
    assert got.is_sparse == want.is_sparse, f"{name}.grad layout"
    torch.testing.assert_close(got.to_dense(), want.to_dense(), msg=name)
    if want.is_sparse:
        got, want = got.coalesce(), want.coalesce()
        assert torch.equal(got.indices(), want.indices()), name
        torch.testing.assert_close(got.values(), want.values(), msg=name)


def assert_same(model, twin, optimizers=(), twin_optimizers=()) -> None:
    for (name, param), twin_param in zip(
        model.named_parameters(), twin.parameters(), strict=True
    ):
        torch.testing.assert_close(param, twin_param, msg=name)
        assert_same_grad(param.grad, twin_param.grad, name)
        for optimizer, twin_optimizer in zip(optimizers, twin_optimizers, strict=True):
            state, want = (
                optimizer.state.get(param),
                twin_optimizer.state.get(twin_param),
            )
            assert (state is None) == (want is None), f"{name}: state"
            for key, value in (want or {}).items():
                got = state[key]
                if isinstance(value, torch.Tensor):
                    assert got.layout == value.layout, f"{name}: {key} layout"
                    torch.testing.assert_close(got.to_dense(), value.to_dense())
                else:
                    assert got == value, f"{name}: {key}"


def run_steps(
    backend: str,
    fn: Callable[..., Any],
    make_optimizers: Callable[[Recommender], list[torch.optim.Optimizer]],
) -> list[tuple[Any, Any]]:
    """STEPS calls of the artifact and of eager, each followed by a comparison."""
    model = Recommender()
    twin = copy.deepcopy(model)
    optimizers, twin_optimizers = make_optimizers(model), make_optimizers(twin)
    code, cache = pg.precompile(fn, model, *optimizers, *batch(0), backend=backend)
    step = pg.load(code, cache)
    losses = []
    for seed in range(STEPS):
        got = step(model, *optimizers, *batch(seed))
        want = fn(twin, *twin_optimizers, *batch(seed))
        losses.append((got, want))
        assert_same(model, twin, optimizers, twin_optimizers)
    return losses


@pytest.fixture(scope="module", params=BACKENDS)
def sgd_run(request: pytest.FixtureRequest) -> list[tuple[Any, Any]]:
    return run_steps(request.param, sgd_step, sgd)


@pytest.fixture(scope="module", params=BACKENDS)
def sparse_adam_run(request: pytest.FixtureRequest) -> list[tuple[Any, Any]]:
    return run_steps(request.param, two_optimizer_step, sparse_adam_and_adam)


def test_sgd_with_momentum_inside_the_step_equals_eager(sgd_run) -> None:
    for got, want in sgd_run:
        torch.testing.assert_close(got, want)


def test_sparse_adam_next_to_adam_equals_eager(sparse_adam_run) -> None:
    for got, want in sparse_adam_run:
        torch.testing.assert_close(got, want)


def test_plain_sgd_equals_eager() -> None:
    def plain(model: Recommender) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(model.parameters(), lr=0.1)]

    for got, want in run_steps("eager", sgd_step, plain):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adagrad_steps_the_embeddings_after_the_graph(backend: str) -> None:
    # The graph steps the dense head; the driver, Adagrad's own sparse step.
    def adagrad(model: Recommender) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adagrad(
                model.parameters(), lr=0.1, lr_decay=0.1, initial_accumulator_value=0.1
            )
        ]

    for got, want in run_steps(backend, sgd_step, adagrad):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_outside_accumulates_like_eager(backend: str) -> None:
    model = Recommender()
    twin = copy.deepcopy(model)
    code, cache = pg.precompile(backward_only, model, *batch(0), backend=backend)
    artifact = pg.load(code, cache)
    # Two calls before a step: the second gradient is added to the sparse .grad.
    for seed in range(2):
        artifact(model, *batch(seed))
        backward_only(twin, *batch(seed))
        assert_same(model, twin)
    assert model.emb.weight.grad is not None
    assert not model.emb.weight.grad.is_coalesced()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    twin_optimizer.step()
    assert_same(model, twin, [optimizer], [twin_optimizer])


def test_embedding_used_twice_sums_its_sparse_gradients() -> None:
    def twice(model, items, tags, offsets, target):
        loss = loss_of(model, items, tags, offsets, target)
        loss = loss + model.emb(tags[:5]).square().mean()
        loss.backward()
        return loss.detach()

    model = Recommender()
    twin = copy.deepcopy(model)
    artifact = pg.load(*pg.precompile(twice, model, *batch(0), backend="eager"))
    for seed in range(2):
        torch.testing.assert_close(
            artifact(model, *batch(seed)), twice(twin, *batch(seed))
        )
        assert_same(model, twin)


def test_metadata_names_the_sparse_gradients_and_deferred_steps() -> None:
    model = Recommender()
    optimizers = sparse_adam_and_adam(model)
    code, _ = pg.precompile(
        two_optimizer_step, model, *optimizers, *batch(0), backend="eager"
    )
    metadata = pg.parse_metadata(code)
    names = metadata["PARAM_NAMES"]
    sparse = metadata["SPARSE_GRADIENTS"]
    assert [names[i] for i in sparse] == ["emb.weight", "bag.weight"]
    assert metadata["DEFERRED_STEPS"] == [
        {"position": 1, "class": "SparseAdam", "params": [0, 1]}
    ]
    # Only the dense head's Adam state is a graph input.
    [adam] = metadata["OPTIMIZERS"]
    assert {names[state[0]] for state in adam["state"]} == {"head.weight", "head.bias"}


def test_runtime_sparse_adam_over_other_parameters_is_rejected() -> None:
    model = Recommender()
    optimizers = sparse_adam_and_adam(model)
    artifact = pg.load(
        *pg.precompile(
            two_optimizer_step, model, *optimizers, *batch(0), backend="eager"
        )
    )
    wrong = torch.optim.SparseAdam([model.emb.weight], lr=0.05)
    snapshot = StateSnapshot(model)
    with pytest.raises(pg.PrecompileError, match=r"bag\.weight") as caught:
        artifact(model, wrong, optimizers[1], *batch(1))
    assert "capture again" in str(caught.value)
    snapshot.assert_unchanged()
    assert not wrong.state and not optimizers[1].state


def read_grad_inside(model, optimizer, items, tags, offsets, target):
    optimizer.zero_grad()
    loss = loss_of(model, items, tags, offsets, target)
    loss.backward()
    norm = model.emb.weight.grad.coalesce().values().norm()
    optimizer.step()
    return loss.detach(), norm


def forward_after_step(model, optimizer, items, tags, offsets, target):
    sgd_step(model, optimizer, items, tags, offsets, target)
    return model(items, tags, offsets).detach()


def two_steps(model, optimizer, items, tags, offsets, target):
    loss = loss_of(model, items, tags, offsets, target)
    loss.backward()
    optimizer.step()
    optimizer.step()
    return loss.detach()


def sparse_adam_with_head(model: Recommender) -> list[torch.optim.Optimizer]:
    return [torch.optim.SparseAdam(model.parameters(), lr=0.05)]


REFUSED = {
    "adamw": (
        sgd_step,
        lambda model: [torch.optim.AdamW(model.parameters())],
        ["'emb'", "AdamW does not take sparse gradients", "SparseAdam", "sparse=False"],
    ),
    "weight_decay": (
        sgd_step,
        lambda model: [torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)],
        ["'emb'", "weight_decay=0.1", "weight_decay=0", "sparse=False"],
    ),
    "sparse_adam_dense_param": (
        sgd_step,
        sparse_adam_with_head,
        ["SparseAdam", "not the weight of an nn.Embedding", "another optimizer"],
    ),
    "grad_read_inside": (
        read_grad_inside,
        lambda model: [torch.optim.SGD(model.parameters(), lr=0.1)],
        ["sparse gradient of module 'emb'", "after the precompiled function"],
    ),
    "two_steps": (
        two_steps,
        lambda model: [torch.optim.SGD(model.parameters(), lr=0.1)],
        [
            "step() on the SGD at argument 1 (`optimizer`) more than once",
            "Step once per call",
        ],
    ),
    "forward_after_step": (
        forward_after_step,
        lambda model: [torch.optim.SGD(model.parameters(), lr=0.1)],
        ["'emb'", "after the optimizer's step", "sparse=False"],
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_use_is_refused_at_capture_and_changes_nothing(case: str) -> None:
    fn, make_optimizers, fragments = REFUSED[case]
    model = Recommender()
    [optimizer] = make_optimizers(model)
    # A .grad and optimizer state from an eager step (only a backward where eager's
    # step raises), which capture must keep.
    if case in ("adamw", "weight_decay", "sparse_adam_dense_param"):
        backward_only(model, *batch(5))
    else:
        sgd_step(model, optimizer, *batch(5))
    state = copy.deepcopy(optimizer.state_dict())
    snapshot = StateSnapshot(model)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(fn, model, optimizer, *batch(0), backend="eager")
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))
    snapshot.assert_unchanged()
    assert str(optimizer.state_dict()) == str(state)


class PaddedBags(nn.Module):
    """padding_idx, a mean bag and per-sample weights: each backward drops or scales
    rows before it builds the sparse gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8, sparse=True, padding_idx=0)
        self.mean_bag = nn.EmbeddingBag(40, 8, mode="mean", sparse=True)
        self.weighted_bag = nn.EmbeddingBag(
            40, 8, mode="sum", sparse=True, padding_idx=1
        )

    def forward(self, items, tags, offsets, weights):
        bags = self.mean_bag(tags, offsets)
        weighted = self.weighted_bag(tags, offsets, per_sample_weights=weights)
        return (self.emb(items).sum(1) * bags + weighted).square().mean()


def padded_batch(seed: int, pads: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    items = torch.randint(1, 50, (4, 3), generator=generator)
    items.view(-1)[:pads] = 0
    tags = torch.randint(0, 40, (10,), generator=generator)
    tags[:pads] = 1
    weights = torch.rand(10, generator=generator)
    return items, tags, torch.tensor([0, 3, 5, 8]), weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_mean_and_weighted_bags_equal_eager(backend: str) -> None:
    def backward(model, *inputs):
        loss = model(*inputs)
        loss.backward()
        return loss.detach()

    model = PaddedBags()
    twin = copy.deepcopy(model)
    code, cache = pg.precompile(backward, model, *padded_batch(0, 2), backend=backend)
    artifact = pg.load(code, cache)
    # Other numbers of padded entries than the example's.
    for seed, pads in [(1, 0), (2, 5)]:
        model.zero_grad()
        twin.zero_grad()
        torch.testing.assert_close(
            artifact(model, *padded_batch(seed, pads)),
            backward(twin, *padded_batch(seed, pads)),
        )
        assert_same(model, twin)
