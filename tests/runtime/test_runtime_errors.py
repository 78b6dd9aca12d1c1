"""The loaded artifact validates every call before running anything: a wrong call
raises PrecompileError saying what differed and how to fix it, and leaves the runtime
model's parameters, buffers and ``.grad`` fields exactly as they were."""

from __future__ import annotations

import collections
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, cast

import pytest
import torch
from helpers.state_snapshot import (
    StateSnapshot,
    assert_call_rejected,
    assert_same_state,
    clone_with_grads,
)
from torch import nn

import precompile_gen as pg
from precompile_gen.codegen import render
from precompile_gen.runtime.errors import listed

# Not importable by its path (unimportable:Pair): the artifact cannot
# name it in its spec, so an artifact taking it has IN_SPEC = None and only the leaf
# checks run.
Pair = collections.namedtuple("Pair", ["first", "second"])
Pair.__module__ = "unimportable"


class Batch(TypedDict):
    inputs: tuple[torch.Tensor, torch.Tensor]
    target: torch.Tensor


class Net(nn.Module):
    """Small, with BatchNorm in train mode: running one step on it changes buffers."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.lin2 = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


class ReorderedNet(Net):
    """Net's layers registered in another order: the same names, in another order."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin2 = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.lin1 = nn.Linear(4, 4)


class RenamedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.bn(self.fc1(x))))


class TiedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.lin2.weight = self.lin1.weight


def train_step(model: nn.Module, batch: Batch, scale: float) -> torch.Tensor:
    x1, x2 = batch["inputs"]
    target = batch["target"]
    loss = (model(x1 + x2) - target).square().mean() * scale
    loss.backward()
    return loss.detach()


def pair_step(model: nn.Module, pair: Pair) -> torch.Tensor:
    loss = (model(pair.first) - pair.second).square().mean()
    loss.backward()
    return loss.detach()


def make_batch(rows: int = 8) -> Batch:
    return {
        "inputs": (torch.randn(rows, 4), torch.randn(rows, 4)),
        "target": torch.randn(rows, 4),
    }


def make_model(cls: Callable[[], nn.Module] = Net) -> nn.Module:
    """A model whose grads were populated by a successful eager step."""
    torch.manual_seed(0)
    model = cls()
    train_step(model, make_batch(), 0.5)
    return model


# --- artifacts, one per scenario ----------------------------------------------------


@dataclass(frozen=True)
class Artifact:
    python_code: str
    cache: bytes
    forward: Callable[..., object]


def _build(fn: Callable[..., object], *example: object) -> Artifact:
    python_code, cache = pg.precompile(fn, *example, backend="eager")
    return Artifact(python_code, cache, pg.load(python_code, cache))


@pytest.fixture(scope="module")
def batch_artifact() -> Artifact:
    torch.manual_seed(1)
    return _build(train_step, Net(), make_batch(), 0.5)


@pytest.fixture(scope="module")
def pair_artifact() -> Artifact:
    torch.manual_seed(1)
    return _build(pair_step, Net(), Pair(torch.randn(8, 4), torch.randn(8, 4)))


@pytest.fixture
def forward(batch_artifact: Artifact) -> Callable[..., object]:
    return batch_artifact.forward


@pytest.fixture
def model(forward: Callable[..., object]) -> nn.Module:
    """The runtime model, with grads populated by a successful call of the artifact."""
    torch.manual_seed(2)
    model = Net()
    forward(model, make_batch(), 0.5)
    assert all(p.grad is not None for p in model.parameters())
    return model


@pytest.fixture
def batch() -> Batch:
    return make_batch()


def test_snapshot_detects_changes(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    # Every test below relies on the snapshot; check that a real call trips it.
    snapshot = StateSnapshot(model)
    forward(model, batch, 0.5)
    with pytest.raises(AssertionError):
        snapshot.assert_unchanged()


# --- the call's arguments -----------------------------------------------------------


def test_wrong_arity(forward: Callable[..., object], model: nn.Module) -> None:
    assert_call_rejected(
        forward,
        model,
        match=[
            "takes 3 positional arguments",
            "(model, batch, scale)",
            "got 1",
            "Pass the module(s) and inputs in the order",
        ],
    )


def test_keyword_arguments(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    snapshot = StateSnapshot(model, batch)
    with pytest.raises(pg.PrecompileError) as caught:
        forward(model, batch, scale=0.5)
    message = str(caught.value)
    for text in [
        "positional arguments only",
        "(model, batch, scale)",
        "['scale']",
        "Pass every argument by position",
    ]:
        assert text in message, f"{text!r} not in the message: {message}"
    snapshot.assert_unchanged()


def test_non_module_at_module_position(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    assert_call_rejected(
        forward,
        torch.randn(8, 4),
        batch,
        0.5,
        also_unchanged=[model],
        match=[
            "argument 0 (`model`) must be an nn.Module",
            "got Tensor",
            "Pass the model",
        ],
    )


def test_dict_instead_of_tuple(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    x1, x2 = batch["inputs"]
    wrong = {"inputs": {"a": x1, "b": x2}, "target": batch["target"]}
    assert_call_rejected(
        forward,
        model,
        wrong,
        0.5,
        match=[
            "nested differently",
            "expected ({'inputs': (*, *), 'target': *}, *)",
            "got ({'inputs': {'a': *, 'b': *}, 'target': *}, *)",
            "Pass inputs with the example's containers",
        ],
    )


def test_missing_key(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    wrong = {"inputs": batch["inputs"]}
    assert_call_rejected(
        forward,
        model,
        wrong,
        0.5,
        match=[
            "argument 1 (`batch`) lacks the key(s) ['target']",
            "matches the example's by key, in any order",
            "Pass a dict with exactly those keys",
        ],
    )


def test_leaf_count_mismatch(pair_artifact: Artifact) -> None:
    # With IN_SPEC = None the structure check is skipped, so the leaf count is what
    # catches a different structure.
    assert pg.parse_metadata(pair_artifact.python_code)["IN_SPEC"] is None
    model = make_model()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pair_artifact.forward(model, Pair(x, y))
    assert_call_rejected(
        pair_artifact.forward,
        model,
        (x, y, y),
        match=["flatten to 3 leaves", "had 2", "Pass inputs with the example's"],
    )


def test_leaf_checks_run_without_in_spec(pair_artifact: Artifact) -> None:
    model = make_model()
    assert_call_rejected(
        pair_artifact.forward,
        model,
        Pair(torch.randn(8, 4), torch.randn(8, 5)),
        match=[
            "argument 1 (`pair.second`) has shape (8, 5)",
            "(8, 4)",
            "Pass that shape",
        ],
    )


def test_wrong_shape(forward: Callable[..., object], model: nn.Module) -> None:
    assert_call_rejected(
        forward,
        model,
        make_batch(rows=3),
        0.5,
        match=[
            "argument 1 (`batch['inputs'][0]`) has shape (3, 4)",
            "captured with shape (8, 4)",
            "Pass that shape, or capture again",
        ],
    )


def test_wrong_dtype(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    wrong = {**batch, "target": torch.randn(8, 4, dtype=torch.float64)}
    assert_call_rejected(
        forward,
        model,
        wrong,
        0.5,
        match=[
            "argument 1 (`batch['target']`) has dtype torch.float64",
            "captured with torch.float32",
            ".to(torch.float32)",
        ],
    )


def test_wrong_device(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    x1, x2 = batch["inputs"]
    wrong = {**batch, "inputs": (x1.to("meta"), x2)}
    assert_call_rejected(
        forward,
        model,
        wrong,
        0.5,
        match=[
            "argument 1 (`batch['inputs'][0]`) is on device 'meta'",
            "captured on 'cpu'",
            ".to('cpu')",
        ],
    )


def test_tensor_where_example_had_non_tensor(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    assert_call_rejected(
        forward,
        model,
        batch,
        torch.tensor(0.5),
        match=[
            "argument 2 (`scale`) is a tensor",
            "traced with a float there",
            "Pass a Python float",
        ],
    )


def test_another_float_is_the_graph_s_number(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    # The trace only multiplied by scale: the graph takes it as a number.
    assert forward.__globals__["NUMBER_INPUTS"] == {3: None}
    eager = clone_with_grads(model)
    got = forward(model, batch, 0.25)
    assert torch.equal(cast(torch.Tensor, got), train_step(eager, batch, 0.25))
    assert_same_state(model, eager, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("value", "shown"), [(1, "1"), (True, "True"), ("0.5", "'0.5'")]
)
def test_other_scalar_than_a_float(
    forward: Callable[..., object],
    model: nn.Module,
    batch: Batch,
    value: object,
    shown: str,
) -> None:
    # 1 or True would compute as 1.0 here, but with an int tensor, or in Python,
    # not as the float the graph was traced with.
    assert_call_rejected(
        forward,
        model,
        batch,
        value,
        match=[
            f"argument 2 (`scale`) is {shown}, but the function was traced with a "
            "float there",
            "Pass a Python float",
        ],
    )


def test_non_tensor_where_example_had_tensor(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    wrong = {**batch, "target": 1.0}
    assert_call_rejected(
        forward,
        model,
        wrong,
        0.5,
        match=[
            "argument 1 (`batch['target']`) must be a tensor",
            "shape (8, 4)",
            "got float",
        ],
    )


# --- the runtime model ---------------------------------------------------------------


def test_different_param_names(forward: Callable[..., object], batch: Batch) -> None:
    assert_call_rejected(
        forward,
        make_model(RenamedNet),
        batch,
        0.5,
        match=[
            "missing ['lin1.weight', 'lin1.bias']",
            "unexpected ['fc1.weight', 'fc1.bias']",
            "Pass a model of the traced architecture",
        ],
    )


def test_same_names_in_another_order(
    forward: Callable[..., object], batch: Batch
) -> None:
    assert_call_rejected(
        forward,
        make_model(ReorderedNet),
        batch,
        0.5,
        match=["same names in another order", "Pass a model of the traced"],
    )


def test_different_tying(forward: Callable[..., object], batch: Batch) -> None:
    tied = make_model(TiedNet)
    # Both names are there; what differs is that they are one tensor.
    assert {"lin1.weight", "lin2.weight"} <= dict(
        tied.named_parameters(remove_duplicate=False)
    ).keys()
    message = assert_call_rejected(
        forward,
        tied,
        batch,
        0.5,
        match=[
            "tied here, separate in the traced model: ['lin2.weight' to 'lin1.weight']",
            "Pass a model of the traced architecture",
        ],
    )
    assert "tied" in message or "tying" in message, message


def test_param_with_different_shape(
    forward: Callable[..., object], batch: Batch
) -> None:
    assert_call_rejected(
        forward,
        make_model(lambda: Net(hidden=5)),
        batch,
        0.5,
        match=["'lin1.weight' has shape (5, 4)", "had (4, 4)", "capture again"],
    )


def test_different_dtype(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    double = clone_with_grads(model).double()
    assert_call_rejected(
        forward,
        double,
        batch,
        0.5,
        also_unchanged=[model],
        match=[
            "'lin1.weight' has dtype torch.float64",
            "had torch.float32",
            ".to(torch.float32)",
        ],
    )


def test_different_device(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    on_meta = clone_with_grads(model).to("meta")
    assert all(p.grad is not None for p in on_meta.parameters())
    assert_call_rejected(
        forward,
        on_meta,
        batch,
        0.5,
        also_unchanged=[model],
        match=["'lin1.weight' is on device 'meta'", "was on 'cpu'", ".to('cpu')"],
    )


# --- recovery and the artifact on its own --------------------------------------------


def test_correct_call_after_rejection_matches_eager(
    forward: Callable[..., object], model: nn.Module
) -> None:
    expected_model = clone_with_grads(model)
    first, second = make_batch(), make_batch()
    torch.testing.assert_close(
        forward(model, first, 0.5), train_step(expected_model, first, 0.5)
    )
    assert_same_state(model, expected_model)

    assert_call_rejected(forward, model, make_batch(rows=3), 0.5, match=["shape"])
    assert_call_rejected(forward, Net(hidden=5), second, 0.5, match=["shape"])

    torch.testing.assert_close(
        forward(model, second, 0.5), train_step(expected_model, second, 0.5)
    )
    assert_same_state(model, expected_model)


def test_error_type_without_precompile_gen(
    batch_artifact: Artifact, tmp_path: Path
) -> None:
    artifact = tmp_path / "artifact.py"
    artifact.write_text(batch_artifact.python_code, encoding="utf-8")
    child = Path(__file__).with_name("error_without_package_child.py")
    result = subprocess.run(
        [sys.executable, str(child), str(artifact)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:4] == ["PrecompileError", "True", "artifact", "True"], result.stdout
    assert "takes 3 positional arguments" in lines[4]
    assert "got 0" in lines[4]


def _sgd_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_the_shape_message_of_an_optimizer_step_does_not_suggest_mark_unbacked() -> (
    None
):
    # A capture with an optimizer argument refuses mark_unbacked dims, so the
    # message must not send the caller there.
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    code, cache = pg.precompile(
        _sgd_step, model, optimizer, torch.randn(3, 4), backend="eager"
    )
    forward = pg.load(code, cache)
    with pytest.raises(pg.PrecompileError) as info:
        forward(model, optimizer, torch.randn(5, 4))
    message = str(info.value)
    assert "argument 2 (`x`) has shape (5, 4)" in message
    assert "Pass that shape, or capture again with this one" in message
    assert "mark_unbacked" not in message


# --- arguments named by position and by the traced function's own name --------------


@pytest.fixture(scope="module")
def sgd_artifact() -> Artifact:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return _build(_sgd_step, model, optimizer, torch.randn(3, 4))


def test_a_tensor_argument_is_named_by_position_and_name(
    sgd_artifact: Artifact,
) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert_call_rejected(
        sgd_artifact.forward,
        model,
        optimizer,
        torch.randn(3, 4, dtype=torch.float64),
        match=["argument 2 (`x`) has dtype torch.float64", ".to(torch.float32)"],
    )


def test_a_module_argument_is_named_by_position_and_name(
    sgd_artifact: Artifact,
) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert_call_rejected(
        sgd_artifact.forward,
        {"model": model},
        optimizer,
        torch.randn(3, 4),
        match=["argument 0 (`model`) must be an nn.Module", "got dict"],
        also_unchanged=[model],
    )


def test_an_optimizer_argument_is_named_by_position_and_name(
    sgd_artifact: Artifact,
) -> None:
    model = nn.Linear(4, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    assert_call_rejected(
        sgd_artifact.forward,
        model,
        adam,
        torch.randn(3, 4),
        match=["argument 1 (`optimizer`) must be a torch.optim.SGD", "got Adam"],
    )
    foreign = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
    assert_call_rejected(
        sgd_artifact.forward,
        model,
        foreign,
        torch.randn(3, 4),
        match=["param group 0 of the SGD at argument 1 (`optimizer`) holds"],
    )


def test_a_leaf_inside_a_dict_is_named_by_its_path_below_the_name(
    forward: Callable[..., object], model: nn.Module, batch: Batch
) -> None:
    batch["target"] = torch.randn(8, 3)
    assert_call_rejected(
        forward,
        model,
        batch,
        0.5,
        match=["argument 1 (`batch['target']`) has shape (8, 3)", "(8, 4)"],
    )


def test_extra_positional_arguments_are_named_as_args_k() -> None:
    def step(model: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        return model(args[0] + args[1]).sum()

    model = nn.Linear(4, 2)
    artifact = _build(step, model, torch.randn(3, 4), torch.randn(3, 4))
    assert_call_rejected(
        artifact.forward,
        model,
        torch.randn(3, 4),
        torch.randn(5, 4),
        match=["argument 2 (`args_1`) has shape (5, 4)"],
    )


def test_a_capture_error_names_the_argument_as_the_artifact_would() -> None:
    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(batch["x"]).sum()
        loss.backward()
        return loss.detach()

    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.capture(step, nn.Linear(4, 2), {"x": x}, backend="eager")
    message = str(caught.value)
    assert "the input argument 1 (`batch['x']`) (a (3, 4) tensor)" in message
    assert "requires_grad=False" in message
    assert x.grad is None


# --- lists in messages ----------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 4, 5, 46])
def test_the_artifact_and_the_package_list_names_alike(count: int) -> None:
    # The artifact carries its own copy of the helper, since it never imports
    # precompile_gen; the two must show a list the same way.
    support: dict[str, Any] = {}
    exec(compile(render.runtime_support(), "<runtime support>", "exec"), support)
    names = [f"layer{i}.weight" for i in range(count)]
    assert support["_listed"](names) == listed(names)
    shown = listed(names)
    if count <= 4:
        assert shown == repr(names)
    else:
        assert shown == f"{names[:3]!r} and {count - 3} more"
