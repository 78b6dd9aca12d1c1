"""Inputs and results as users pass them: a dict batch in another key order, a tensor
in another memory layout than the example's, and namedtuples and dataclasses in and
out, on both backends, against eager PyTorch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from helpers.state_snapshot import (
    StateSnapshot,
    assert_call_rejected,
    assert_same_state,
    clone_with_grads,
)
from torch import nn

import precompile_gen as pg

BACKENDS = ["eager", "inductor"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.conv = nn.Conv2d(3, 2, 3)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@dataclasses.dataclass(frozen=True)
class Compiled:
    backend: str
    python_code: str
    cache: bytes
    forward: Callable[..., object]

    def reload(self) -> Callable[..., object]:
        """A fresh load, whose once-per-artifact warnings are still to come."""
        return pg.load(self.python_code, self.cache)


def compile_for(backend: str, fn: Callable[..., object], *example: object) -> Compiled:
    python_code, cache = pg.precompile(fn, *example, backend=backend)
    return Compiled(backend, python_code, cache, pg.load(python_code, cache))


def assert_runs_like_eager(
    forward: Callable[..., object], fn: Callable[..., object], *args: object
) -> object:
    """``forward`` on a copy of the model gives what ``fn`` gives eagerly: the
    result, the parameters and buffers and their ``.grad`` fields."""
    model = args[0]
    assert isinstance(model, nn.Module)
    ours, eager = clone_with_grads(model), clone_with_grads(model)
    expected = fn(eager, *args[1:])
    got = forward(ours, *args[1:])
    # By leaves: assert_close does not open dataclasses.
    got_leaves, got_spec = pytree.tree_flatten(got)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert got_spec == expected_spec
    torch.testing.assert_close(got_leaves, expected_leaves)
    assert_same_state(ours, eager)
    return got


# --- 1. Dicts match by key ------------------------------------------------------------


def dict_step(model: Net, batch: dict[str, object]) -> dict[str, torch.Tensor]:
    extras = batch["extras"]
    assert isinstance(extras, dict)
    h = model.lin(batch["features"]) * extras["scale"]
    loss = F.mse_loss(model.bn(h), extras["target"])
    loss.backward()
    return {"loss": loss.detach(), "h": h.detach()}


def make_batch(seed: int) -> dict[str, object]:
    return {
        "features": randn(5, 4, seed=seed),
        "extras": {
            "scale": randn(3, seed=seed + 1),
            "target": randn(5, 3, seed=seed + 2),
        },
    }


def reversed_keys(batch: dict[str, object]) -> dict[str, object]:
    return {
        key: reversed_keys(value) if isinstance(value, dict) else value
        for key, value in reversed(batch.items())
    }


@pytest.fixture(scope="module", params=BACKENDS)
def dict_artifact(request: pytest.FixtureRequest) -> Compiled:
    return compile_for(request.param, dict_step, make_net(), make_batch(0))


def test_dict_in_another_key_order_runs_like_eager(dict_artifact: Compiled) -> None:
    batch = reversed_keys(make_batch(1))
    assert list(batch) == ["extras", "features"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_runs_like_eager(dict_artifact.forward, dict_step, make_net(), batch)
    # The example's order still runs, as before.
    assert_runs_like_eager(dict_artifact.forward, dict_step, make_net(), make_batch(2))


def test_another_key_order_is_said_once(dict_artifact: Compiled) -> None:
    forward = dict_artifact.reload()
    with pytest.warns(UserWarning, match="another order than the example's") as said:
        forward(make_net(), reversed_keys(make_batch(1)))
    assert "takes its values by key" in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward(make_net(), reversed_keys(make_batch(3)))
        forward(make_net(), make_batch(3))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda extras: extras.pop("scale"),
            ["argument 1 (`batch['extras']`) lacks the key(s) ['scale']"],
        ),
        (
            lambda extras: extras.update(weight=torch.ones(3)),
            [
                "argument 1 (`batch['extras']`) has the key(s) ['weight'], which the "
                "example"
            ],
        ),
        (
            lambda extras: extras.update(weight=extras.pop("scale")),
            ["lacks the key(s) ['scale'] and has the key(s) ['weight']"],
        ),
    ],
    ids=["missing", "extra", "renamed"],
)
def test_dict_with_other_keys_is_refused(
    dict_artifact: Compiled,
    change: Callable[[dict[str, object]], object],
    match: list[str],
) -> None:
    model, batch = make_net(), reversed_keys(make_batch(1))
    model.lin.weight.grad = torch.ones(3, 4)
    extras = batch["extras"]
    assert isinstance(extras, dict)
    change(extras)
    fix = "Pass a dict with exactly those keys, or capture again with these."
    assert_call_rejected(dict_artifact.forward, model, batch, match=[*match, fix])


# --- 2. Another memory layout ---------------------------------------------------------


def layout_step(
    model: Net, x: torch.Tensor, image: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    y = model.lin(x)
    loss = y.pow(2).mean() + model.conv(image).mean()
    loss.backward()
    # ``total`` is written in place: the caller must see the update.
    total.add_(y.detach().sum(0))
    return loss.detach()


def layout_example(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return randn(5, 4, seed=seed), randn(2, 3, 6, 6, seed=seed + 1), torch.zeros(2, 3)


@pytest.fixture(scope="module", params=BACKENDS)
def layout_artifact(request: pytest.FixtureRequest) -> Compiled:
    return compile_for(request.param, layout_step, make_net(), *layout_example(0))


def sliced(x: torch.Tensor) -> torch.Tensor:
    # The same values as the columns of a wider batch: ``wide[:, 2:6]``.
    wide = torch.zeros(x.shape[0], 9)
    wide[:, 2:6] = x
    return wide[:, 2:6]


def run_both(
    forward: Callable[..., object],
    x: torch.Tensor,
    image: torch.Tensor,
    total: torch.Tensor,
) -> None:
    model = make_net()
    ours, eager = clone_with_grads(model), clone_with_grads(model)
    ours_total, eager_total = total.clone(), total.clone()
    got = forward(ours, x, image, ours_total)
    torch.testing.assert_close(got, layout_step(eager, x, image, eager_total))
    assert_same_state(ours, eager)
    torch.testing.assert_close(ours_total, eager_total)


@pytest.mark.parametrize(
    "relayout",
    [
        lambda x, image: (sliced(x), image),
        lambda x, image: (x.t().contiguous().t(), image),
        lambda x, image: (x, image.to(memory_format=torch.channels_last)),
        lambda x, image: (sliced(x), image.to(memory_format=torch.channels_last)),
    ],
    ids=["slice", "transposed", "channels_last", "both"],
)
def test_input_in_another_layout_runs_like_eager(
    layout_artifact: Compiled,
    relayout: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    x, image, total = layout_example(1)
    x, image = relayout(x, image)
    assert not (x.is_contiguous() and image.is_contiguous())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_both(layout_artifact.forward, x, image, total)


def test_copies_also_on_the_fast_path(layout_artifact: Compiled) -> None:
    # One model, called again unchanged: the second call skips the model's full
    # check, not the copy.
    forward = layout_artifact.forward
    model = make_net()
    ours, eager = clone_with_grads(model), clone_with_grads(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in (1, 2, 3):
            x, image, total = layout_example(seed)
            x, image = sliced(x), image.to(memory_format=torch.channels_last)
            ours_total, eager_total = total.clone(), total.clone()
            got = forward(ours, x, image, ours_total)
            torch.testing.assert_close(got, layout_step(eager, x, image, eager_total))
            assert_same_state(ours, eager)
            torch.testing.assert_close(ours_total, eager_total)


def test_copy_is_said_once_per_artifact(layout_artifact: Compiled) -> None:
    forward = layout_artifact.reload()
    x, image, total = layout_example(1)
    if layout_artifact.backend == "eager":
        # ATen's kernels take any layout: nothing to copy, nothing to say.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            forward(make_net(), sliced(x), image, total)
        return
    with pytest.warns(
        UserWarning, match=r"argument 1 \(`x`\) has strides \(9, 1\)"
    ) as said:
        forward(make_net(), sliced(x), image, total)
    message = str(said[0].message)
    assert "(80 bytes a call)" in message and ".contiguous()" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward(make_net(), sliced(x), image, total)


def test_input_the_graph_writes_is_not_copied(layout_artifact: Compiled) -> None:
    x, image, total = layout_example(1)
    transposed = torch.zeros(3, 2).t()
    if layout_artifact.backend == "eager":
        run_both(layout_artifact.forward, x, image, transposed)
        return
    model = make_net()
    model.lin.weight.grad = torch.ones(3, 4)
    assert_call_rejected(
        layout_artifact.forward,
        model,
        x,
        image,
        transposed,
        match=[
            "argument 3 (`total`) has strides (1, 2), but the example had (3, 1)",
            "the graph writes into it in place",
            ".contiguous()",
            "backend='eager'",
        ],
    )
    # In the example's layout, it is updated as eager updates it.
    run_both(layout_artifact.forward, x, image, total)


def test_metadata_records_the_inputs_written_in_place(
    layout_artifact: Compiled,
) -> None:
    metadata = pg.parse_metadata(layout_artifact.python_code)
    names = [metadata["PARAM_NAMES"], metadata["BUFFER_NAMES"]]
    leaves_start = sum(len(n) for n in names)
    # Only ``total``, the last input leaf: the step's model has no buffers.
    assert metadata["MUTATED_INPUTS"] == [leaves_start + 2]


def scale_rows(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model.lin(x * 2)


@pytest.fixture(scope="module", params=BACKENDS)
def expanded_artifact(request: pytest.FixtureRequest) -> Compiled:
    # The example repeats one column: its layout has a stride of 0.
    example = randn(5, 1, seed=0).expand(5, 4)
    return compile_for(request.param, scale_rows, make_net(), example)


def test_input_of_an_expanded_example_is_not_copied(
    expanded_artifact: Compiled,
) -> None:
    x = randn(5, 4, seed=1)
    if expanded_artifact.backend == "eager":
        assert_runs_like_eager(expanded_artifact.forward, scale_rows, make_net(), x)
        return
    assert_call_rejected(
        expanded_artifact.forward,
        make_net(),
        x,
        match=[
            "argument 1 (`x`) has strides (4, 1), but the example had (1, 0)",
            "repeats elements (an expanded tensor)",
            "backend='eager'",
        ],
    )
    # Another tensor expanded the same way runs, as eager does.
    same_layout = randn(5, 1, seed=2).expand(5, 4)
    assert_runs_like_eager(
        expanded_artifact.forward, scale_rows, make_net(), same_layout
    )


# --- 3. Namedtuples and dataclasses ---------------------------------------------------


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    target: torch.Tensor
    extras: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Stats:
    mean: torch.Tensor
    logits: torch.Tensor


class StepOutput(NamedTuple):
    loss: torch.Tensor
    stats: Stats


def typed_step(model: Net, batch: Batch) -> StepOutput:
    logits = model.lin(batch.features) * batch.extras["scale"]
    loss = F.mse_loss(model.bn(logits), batch.target)
    loss.backward()
    return StepOutput(loss.detach(), Stats(logits.mean().detach(), logits.detach()))


def make_typed_batch(seed: int) -> Batch:
    return Batch(
        randn(5, 4, seed=seed),
        randn(5, 3, seed=seed + 1),
        {"scale": randn(3, seed=seed + 2), "shift": randn(3, seed=seed + 3)},
    )


@pytest.fixture(scope="module", params=BACKENDS)
def typed_artifact(request: pytest.FixtureRequest) -> Compiled:
    return compile_for(request.param, typed_step, make_net(), make_typed_batch(0))


def test_namedtuple_and_dataclass_round_trip(typed_artifact: Compiled) -> None:
    got = assert_runs_like_eager(
        typed_artifact.forward, typed_step, make_net(), make_typed_batch(1)
    )
    assert type(got) is StepOutput
    assert type(got.stats) is Stats


def test_dict_inside_a_dataclass_matches_by_key(typed_artifact: Compiled) -> None:
    batch = make_typed_batch(1)
    batch.extras = dict(reversed(batch.extras.items()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_runs_like_eager(typed_artifact.forward, typed_step, make_net(), batch)


def test_types_are_recorded_by_import_path(typed_artifact: Compiled) -> None:
    metadata = pg.parse_metadata(typed_artifact.python_code)
    assert metadata["PYTREE_TYPES"] == [
        f"{__name__}:Batch",
        f"{__name__}:StepOutput",
        f"{__name__}:Stats",
    ]
    assert f"{__name__}:Batch" in str(metadata["IN_SPEC"])


def test_dataclass_input_with_other_fields_is_refused(typed_artifact: Compiled) -> None:
    batch = make_typed_batch(1)
    batch.extras = {"scale": batch.extras["scale"]}
    assert_call_rejected(
        typed_artifact.forward,
        make_net(),
        batch,
        match=["argument 1 (`batch.extras`) lacks the key(s) ['shift']"],
    )


def test_type_that_cannot_be_imported_here_is_refused_at_load() -> None:
    compiled = compile_for("eager", typed_step, make_net(), make_typed_batch(0))
    code = compiled.python_code.replace(
        f'"{__name__}:Stats"', '"no_such_module_of_the_user:Stats"'
    )
    with pytest.raises(pg.PrecompileError) as caught:
        exec(compile(code, "<artifact>", "exec"), {"__name__": "artifact"})
    message = str(caught.value)
    assert "no_such_module_of_the_user:Stats" in message
    assert "cannot be imported here" in message
    assert "Import the module that defines it before loading" in message


def _local_dataclass_result(model: Net, x: torch.Tensor) -> object:
    @dataclasses.dataclass
    class Local:
        y: torch.Tensor

    return Local(model.lin(x))


def _local_namedtuple_result(model: Net, x: torch.Tensor) -> object:
    class Local(NamedTuple):
        y: torch.Tensor

    return Local(model.lin(x))


def _with_local_dataclass_input() -> tuple[Callable[..., object], object]:
    @dataclasses.dataclass
    class Local:
        x: torch.Tensor

    def step(model: Net, inputs: Local) -> torch.Tensor:
        return model.lin(inputs.x)

    return step, Local(randn(5, 4, seed=0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("case", "match"),
    [
        (
            lambda: (_local_dataclass_result, randn(5, 4, seed=0)),
            "the result of '_local_dataclass_result' is a dataclass of type "
            "'_local_dataclass_result.<locals>.Local'",
        ),
        (
            lambda: (_local_namedtuple_result, randn(5, 4, seed=0)),
            "the result of '_local_namedtuple_result' is a namedtuple of type "
            "'_local_namedtuple_result.<locals>.Local'",
        ),
        (
            _with_local_dataclass_input,
            "argument 1 (`inputs`) is a dataclass of type "
            "'_with_local_dataclass_input.<locals>.Local'",
        ),
    ],
    ids=["dataclass_result", "namedtuple_result", "dataclass_input"],
)
def test_type_defined_in_a_function_is_refused_at_capture(
    backend: str, case: Callable[[], tuple[Callable[..., object], object]], match: str
) -> None:
    fn, argument = case()
    model = make_net()
    snapshot = StateSnapshot(model, argument)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(fn, model, argument, backend=backend)
    message = str(caught.value)
    assert match in message
    assert "it is defined inside a function, so it has no import path" in message
    assert "Define Local at module level" in message
    snapshot.assert_unchanged()


# The capturing script, which defines the type, and another script, which does not.
CAPTURING_SCRIPT = Path(__file__).with_name("main_type_capture_child.py")
LOADING_SCRIPT = Path(__file__).with_name("main_type_load_child.py")


def test_type_of_the_capturing_script_loads_where_it_is_defined(
    tmp_path: Path,
) -> None:
    # A type of __main__ is imported from the loading process's __main__: the
    # capturing script loads it, another script that lacks it is told so.
    paths = [str(tmp_path / "artifact.py"), str(tmp_path / "artifact.cache")]
    runs = [
        subprocess.run(
            [sys.executable, str(script), *paths],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        for script in (CAPTURING_SCRIPT, LOADING_SCRIPT)
    ]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
    assert runs[0].stdout.strip() == "['__main__:Out']"
    message = runs[1].stdout
    assert "the type __main__:Out" in message
    assert "cannot be imported here" in message
    assert "must be defined in the loading script's too" in message
