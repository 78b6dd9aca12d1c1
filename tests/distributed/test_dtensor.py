"""DTensor parameters and inputs (what distribute_module and tensor parallelism make;
FSDP2's are in test_fully_shard.py) on a real 2-rank gloo group: every rank captures
its own shard with ``precompile`` and runs the artifact against eager DTensor code.

Spawning a group costs seconds, so one group runs every scenario (``_results``) and
the tests read what each rank recorded.
"""

from __future__ import annotations

import copy
import functools
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

import precompile_gen as pg
from precompile_gen.distributed import precompile_once
from precompile_gen.tools.inspection import inspect_artifact
from precompile_gen.tools.report_text import format_report

WORLD_SIZE = 2
SHARDED = Shard(0)
REPLICATED = Replicate()


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def predict_replicated(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Already replicated: redistributing it to the same placements moves nothing.
    dtensor = _dtensor(x)
    return model(dtensor.redistribute(dtensor.device_mesh, [REPLICATED]))


def predict_full(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _dtensor(model(x)).full_tensor()


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def predict_and_scale(
    model: nn.Module, x: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return model(x), scale * 2


def step_on_two_inputs(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    return model(x) + model(y)


def _plain_model() -> TwoLayer:
    torch.manual_seed(0)
    return TwoLayer()


def _sharded_model(mesh: DeviceMesh, up: Placement = SHARDED) -> TwoLayer:
    """``up``'s parameters with placement ``up``, ``down``'s replicated."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        placement = up if name == "up" else Replicate()
        for key, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), mesh, [placement])
            module.register_parameter(key, nn.Parameter(sharded))

    model = _plain_model()
    distribute_module(model, mesh, partition)
    return model


def _batch(mesh: DeviceMesh, seed: int, placement: Placement = REPLICATED) -> Any:
    # The same global batch on every rank, as a replicated input must be.
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    return distribute_tensor(x, mesh, [placement])


def _dtensor(tensor: torch.Tensor) -> DTensor:
    assert isinstance(tensor, DTensor), type(tensor)
    return tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return _dtensor(tensor).to_local()


def _same_dtensor(got: object, want: object, what: str) -> None:
    assert isinstance(got, DTensor) and isinstance(want, DTensor), what
    assert got.placements == want.placements, what
    torch.testing.assert_close(got.to_local(), want.to_local(), msg=what)
    torch.testing.assert_close(got.full_tensor(), want.full_tensor(), msg=what)


def _same_model(model: nn.Module, twin: nn.Module) -> None:
    for (name, got), want in zip(
        model.named_parameters(), twin.parameters(), strict=True
    ):
        _same_dtensor(got, want, name)
        if want.grad is None:
            assert got.grad is None, name
        else:
            _same_dtensor(got.grad, want.grad, f"grad of {name}")


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [
        None if p.grad is None else _local(p.grad).clone() for p in model.parameters()
    ]


def _refusal(call: Callable[[], object], model: nn.Module | None = None) -> str:
    """The PrecompileError ``call`` raised, after checking it left ``model``'s
    parameters and gradients as they were."""
    before = copy.deepcopy(model) if model is not None else None
    grads = _grads(model) if model is not None else []
    try:
        call()
    except pg.PrecompileError as error:
        if model is not None and before is not None:
            for got, want in zip(model.parameters(), before.parameters(), strict=True):
                torch.testing.assert_close(_local(got), _local(want))
            after = _grads(model)
            for got, want in zip(after, grads, strict=True):
                assert (got is None) == (want is None)
                if got is not None and want is not None:
                    torch.testing.assert_close(got, want)
        return str(error)
    raise AssertionError("no PrecompileError raised")


def _counting_full_checks(forward: Callable[..., object]) -> list[int]:
    # The driver looks module_state up in the artifact's namespace at each call.
    namespace = forward.__globals__  # type: ignore[attr-defined]
    calls: list[int] = []
    walk = namespace["module_state"]

    def counted(modules: list[nn.Module]) -> object:
        calls.append(1)
        return walk(modules)

    namespace["module_state"] = counted
    return calls


# Scenarios: each runs on every rank, in the order below, and returns what the tests
# check. Both ranks run the same collectives in the same order.


def inference(mesh: DeviceMesh, backend: str) -> dict[str, Any]:
    model = _sharded_model(mesh)
    code, cache = pg.precompile(predict, model, _batch(mesh, 0), backend=backend)
    forward = pg.load(code, cache)
    for seed in range(3):
        x = _batch(mesh, seed)
        _same_dtensor(forward(model, x), predict(model, x), f"output {seed}")
    metadata = pg.parse_metadata(code)
    if backend == "inductor":
        # One compile per backend is enough for the checks below.
        return {
            **{
                key: metadata[key]
                for key in ("DTENSORS", "SHARD_OUTPUTS", "PROCESS_GROUPS")
            },
            "inspected": format_report(inspect_artifact(code)),
        }
    forward = pg.load(
        *pg.precompile(predict_replicated, model, _batch(mesh, 0), backend="eager")
    )
    x = _batch(mesh, 5)
    _same_dtensor(forward(model, x), predict_replicated(model, x), "redistributed")
    return {
        "DTENSORS": metadata["DTENSORS"],
        "inspected": format_report(inspect_artifact(code)),
    }


def training(mesh: DeviceMesh, backend: str) -> dict[str, Any]:
    model = _sharded_model(mesh)
    twin = copy.deepcopy(model)
    forward = pg.load(
        *pg.precompile(train_step, model, _batch(mesh, 0), backend=backend)
    )
    # Capture traced copies: the example model has no gradient from it.
    assert all(p.grad is None for p in model.parameters())
    full_checks = _counting_full_checks(forward)
    for seed in range(3):
        x = _batch(mesh, seed)
        _same_dtensor(forward(model, x), train_step(twin, x), f"loss {seed}")
        _same_model(model, twin)
    full_checks_then = len(full_checks)
    refusals = {
        "another placement": _refusal(
            lambda: forward(_sharded_model(mesh, Replicate()), _batch(mesh, 0))
        ),
        "input sharded": _refusal(
            lambda: forward(model, _batch(mesh, 0, Shard(0))), model
        ),
        "plain input": _refusal(
            lambda: forward(model, _batch(mesh, 0).full_tensor()), model
        ),
    }
    # The remembered model, one parameter redistributed: the fast path lets go of it.
    replicated = _dtensor(model.up.weight.detach()).redistribute(mesh, [Replicate()])
    model.up.weight = nn.Parameter(replicated)
    refusals["parameter redistributed"] = _refusal(
        lambda: forward(model, _batch(mesh, 0)), model
    )
    if backend == "inductor":
        # A mesh of the same shape over another group: the compiled collectives run
        # on the example's.
        other = _mesh_over_new_group()
        refusals["another mesh"] = _refusal(
            lambda: forward(_sharded_model(other), _batch(other, 0))
        )
    return {"full checks": full_checks_then, "refusals": refusals}


def optimizer_training(mesh: DeviceMesh, backend: str) -> dict[str, Any]:
    model = _sharded_model(mesh)
    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.01)
    code, cache = pg.precompile(
        optimizer_step, model, optimizer, _batch(mesh, 0), backend=backend
    )
    forward = pg.load(code, cache)
    for seed in range(3):
        x = _batch(mesh, seed)
        _same_dtensor(
            forward(model, optimizer, x),
            optimizer_step(twin, twin_optimizer, x),
            f"loss {seed}",
        )
        _same_model(model, twin)
    first, twin_first = next(model.parameters()), next(twin.parameters())
    state, expected = optimizer.state[first], twin_optimizer.state[twin_first]
    for key in ("exp_avg", "exp_avg_sq"):
        _same_dtensor(state[key], expected[key], key)
    recorded: dict[str, Any] = {"steps": float(state["step"])}
    if backend == "inductor":
        metadata = pg.parse_metadata(code)
        recorded["shard inputs"] = metadata["SHARD_INPUTS"]
        recorded["process groups"] = metadata["PROCESS_GROUPS"]
        # The optimizer's state is checked where the graph takes its local shard.
        sharded = state["exp_avg"]
        state["exp_avg"] = _dtensor(sharded).redistribute(mesh, [REPLICATED])
        recorded["state resharded"] = _refusal(
            lambda: forward(model, optimizer, _batch(mesh, 0)), model
        )
        state["exp_avg"] = _dtensor(sharded).full_tensor()
        recorded["state plain"] = _refusal(
            lambda: forward(model, optimizer, _batch(mesh, 0)), model
        )
    return recorded


def refused_captures(mesh: DeviceMesh) -> dict[str, Any]:
    x = _batch(mesh, 0)
    plain_forward = pg.load(
        *pg.precompile(predict, _plain_model(), x.full_tensor(), backend="eager")
    )
    sharded = _sharded_model(mesh)
    tensor_parallel = parallelize_module(
        _plain_model(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    return {
        "tensor parallel": _refusal(
            lambda: pg.precompile(
                train_step, tensor_parallel, x.full_tensor(), backend="eager"
            )
        ),
        "full_tensor": _refusal(
            lambda: pg.precompile(predict_full, sharded, x, backend="eager")
        ),
        "aliasing": _refusal(
            lambda: pg.precompile(step_on_two_inputs, sharded, x, x, backend="eager")
        ),
        "precompile_once": _refusal(
            lambda: precompile_once(train_step, sharded, x, backend="eager")
        ),
        "dtensor model, plain capture": _refusal(
            lambda: plain_forward(sharded, x.full_tensor()), sharded
        ),
        "two meshes on inductor": _refusal(
            lambda: pg.precompile(
                predict_and_scale,
                sharded,
                x,
                _batch(_mesh_over_new_group(), 1),
                backend="inductor",
            )
        ),
        "unbacked on inductor": _refusal(
            lambda: pg.precompile(
                predict_and_scale,
                sharded,
                _batch(mesh, 0),
                _unbacked(torch.ones(3)),
                backend="inductor",
            )
        ),
    }


def _mesh_over_new_group() -> DeviceMesh:
    """A mesh of the same shape as the default one, over another process group."""
    group = dist.new_group([0, 1])
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return DeviceMesh.from_group(group, "cpu")


def _unbacked(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x


BACKENDS = ("eager", "inductor")
SCENARIOS: dict[str, Callable[[DeviceMesh], dict[str, Any]]] = {
    **{
        f"{scenario.__name__} {backend}": functools.partial(scenario, backend=backend)
        for scenario in (inference, training, optimizer_training)
        for backend in BACKENDS
    },
    "refused_captures": refused_captures,
}


def every_scenario(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario(mesh)
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
            dist.barrier()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = Path(tmp_path_factory.mktemp("dtensor"))
    ranks = run_ranks(WORLD_SIZE, out, every_scenario, deadline_s=480)
    assert all(rank is not None for rank in ranks), "a rank wrote no result"
    return [rank for rank in ranks if rank is not None]


def _scenario(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, result in enumerate(results):
        assert "failed" not in result[name], f"rank {rank}: {result[name]['failed']}"
    return [result[name] for result in results]


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_matches_eager_on_every_rank(
    results: list[dict[str, Any]], backend: str
) -> None:
    for recorded in _scenario(results, f"inference {backend}"):
        # JSON keys are strings: positions 0-3 are the parameters, 4 the input.
        assert recorded["DTENSORS"] == {
            "0": [[2], ["Shard(dim=0)"]],
            "1": [[2], ["Shard(dim=0)"]],
            "2": [[2], ["Replicate()"]],
            "3": [[2], ["Replicate()"]],
            "4": [[2], ["Replicate()"]],
        }
        if backend == "inductor":
            # The graph returns the local shard of the one result, a partial sum
            # (the row-sharded layer's), as eager's is.
            assert recorded["SHARD_OUTPUTS"] == {
                "0": [["Partial(sum)"], [3, 4], [4, 1]]
            }
            # Nothing is reduced: the result stays a partial sum, as eager's.
            assert recorded["PROCESS_GROUPS"] == []
            assert (
                "local shards: the compiled graph takes 5 DTensor inputs' local "
                "shards and returns 1 DTensor results'" in recorded["inspected"]
            ), recorded["inspected"]
            continue
        text = recorded["inspected"]
        assert (
            "DTensor input: 'up.weight', placements (Shard(dim=0)) on a mesh of "
            "shape (2,)" in text
        ), text
        assert "DTensor input: argument 1 (`x`), placements (Replicate())" in text, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_steps_match_eager_through_the_fast_path(
    results: list[dict[str, Any]], backend: str
) -> None:
    for recorded in _scenario(results, f"training {backend}"):
        # Three calls, one full check: the other two took the fast path.
        assert recorded["full checks"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_steps_match_eager(
    results: list[dict[str, Any]], backend: str
) -> None:
    for recorded in _scenario(results, f"optimizer_training {backend}"):
        assert recorded["steps"] == 3.0


def test_the_compiled_graph_takes_local_shards_of_the_captured_sharding(
    results: list[dict[str, Any]],
) -> None:
    for recorded in _scenario(results, "optimizer_training inductor"):
        shards = recorded["shard inputs"]
        # The parameters, then AdamW's state of each (step, exp_avg, exp_avg_sq),
        # all on the default group's mesh; the input leaf too.
        # Each with the shape of this rank's shard: half of up.weight's 8 rows.
        assert shards["0"] == [["0"], ["Shard(dim=0)"], [4, 4]], shards
        assert shards["2"] == [["0"], ["Replicate()"], [4, 8]], shards
        assert len(shards) > 5, shards
        # The backward's all-reduces run on the default group: each call must
        # bring it.
        assert recorded["process groups"] == [
            {"name": "0", "backend": "gloo", "ranks": [0, 1]}
        ], recorded["process groups"]
        message = recorded["state resharded"]
        for part in [
            "an optimizer's state tensor is a DTensor with placements (Replicate())",
            "compiled for placements (Shard(dim=0))",
            "Shard it as at capture",
        ]:
            assert part in message, message
        message = recorded["state plain"]
        for part in [
            "an optimizer's state tensor is a plain tensor",
            "compiled for placements (Shard(dim=0))",
            "Shard it as at capture",
        ]:
            assert part in message, message


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "another placement",
            [
                "the model's 'up.weight' is a DTensor with placements (Replicate())",
                "captured with placements (Shard(dim=0)) on a mesh of shape (2,)",
                "Redistribute it as at capture",
            ],
        ),
        (
            "input sharded",
            [
                "argument 1 (`x`) is a DTensor with placements (Shard(dim=0))",
                "captured with placements (Replicate())",
            ],
        ),
        (
            "plain input",
            [
                "argument 1 (`x`) is a plain tensor",
                "Pass a DTensor sharded as at capture",
            ],
        ),
        (
            "parameter redistributed",
            ["'up.weight' is a DTensor with placements (Replicate())"],
        ),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_with_other_sharding_is_refused(
    results: list[dict[str, Any]], case: str, expected: list[str], backend: str
) -> None:
    for recorded in _scenario(results, f"training {backend}"):
        message = recorded["refusals"][case]
        for part in expected:
            assert part in message, message


def test_the_compiled_graph_refuses_a_mesh_over_other_groups(
    results: list[dict[str, Any]],
) -> None:
    for recorded in _scenario(results, "training inductor"):
        message = recorded["refusals"]["another mesh"]
        for part in [
            "is a DTensor on a mesh over the process groups ('1',)",
            "runs its collectives on the example's mesh, over ('0',)",
            "capture again with this mesh",
        ]:
            assert part in message, message


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "tensor parallel",
            [
                "'train_step' calls DTensor.from_local()",
                "which capture does not support yet",
                "parallelize_module hooks",
            ],
        ),
        (
            "full_tensor",
            [
                "'predict_full' calls DTensor.full_tensor() (reached from ",
                "test_dtensor.py:",
                "convert the result (.full_tensor(), .to_local(), .redistribute()) "
                "after the call",
            ],
        ),
        ("aliasing", ["aliasing among DTensors", ".clone() one of them"]),
        (
            "two meshes on inductor",
            ["DTensors on more than one device mesh", "Put them on one mesh"],
        ),
        (
            "unbacked on inductor",
            ["mark_unbacked dims and DTensors", "Leave the dims static"],
        ),
        ("precompile_once", ["Call precompile() on every rank"]),
        (
            "dtensor model, plain capture",
            ["the model's 'up.weight' is a DTensor", "captured with a plain tensor"],
        ),
    ],
)
def test_what_is_not_supported_is_refused(
    results: list[dict[str, Any]], case: str, expected: list[str]
) -> None:
    for recorded in _scenario(results, "refused_captures"):
        message = recorded[case]
        for part in expected:
            assert part in message, message
