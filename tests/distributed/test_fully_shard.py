"""Models sharded with FSDP2's ``fully_shard`` on a real 2-rank gloo group: every
rank captures its own training step (AdamW inside) with ``precompile`` and runs it
against eager FSDP2, each rank on its own data.

One group runs every scenario (``results``) and the tests read what each rank
recorded.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.distributed import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
from torch.distributed.tensor import DTensor

import precompile_gen as pg
from precompile_gen.distributed import precompile_once

WORLD_SIZE = 2
STEPS = 3
BACKENDS = ("eager", "inductor")


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _mlp(mesh: DeviceMesh, reshard: bool = True) -> nn.Module:
    torch.manual_seed(0)
    # 5 and 3 rows do not divide by 2: the ranks' shards differ in size.
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3)
    )
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    return model


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Without biases: attention's key bias gets a gradient that is zero but for
        # rounding (softmax ignores a shift shared by all keys), which AdamW's
        # normalisation turns into full-size steps in whatever direction the
        # rounding fell, so no two orders of summation agree on it.
        self.layer = nn.TransformerEncoderLayer(
            d_model=8,
            nhead=2,
            dim_feedforward=16,
            dropout=0.0,
            batch_first=True,
            bias=False,
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


def _transformer(mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = Encoder()
    fully_shard(model.layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def _batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Each rank its own data.
    torch.manual_seed(100 + dist.get_rank())
    shape = (6, 8) if model == "mlp" else (3, 4, 8)
    return [(torch.randn(shape), torch.randn(*shape[:-1], 3)) for _ in range(STEPS)]


def _local(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _max_difference(
    got: list[torch.Tensor | None], want: list[torch.Tensor | None]
) -> float:
    return max(
        (_local(a) - _local(b)).abs().max().item()
        for a, b in zip(got, want, strict=True)
    )


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    return [value for state in opt.state.values() for value in state.values()]


def training(
    make: Callable[[DeviceMesh], nn.Module], model_name: str, backend: str
) -> Callable[[DeviceMesh], dict[str, Any]]:
    def scenario(mesh: DeviceMesh) -> dict[str, Any]:
        batches = _batches(model_name)
        eager = make(mesh)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=0.01)
        model = make(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        code, cache = pg.precompile(
            train_step, model, opt, *batches[0], backend=backend
        )
        step = pg.load(code, cache)
        want = [train_step(eager, eager_opt, x, y).item() for x, y in batches]
        got = [cast(torch.Tensor, step(model, opt, x, y)).item() for x, y in batches]
        params = list(model.parameters())
        return {
            "losses": got,
            "eager losses": want,
            "parameters": _max_difference(list(params), list(eager.parameters())),
            "gradients": _max_difference(
                [p.grad for p in params], [p.grad for p in eager.parameters()]
            ),
            "optimizer state": _max_difference(_state(opt), _state(eager_opt)),
            "placements": sorted(
                {
                    f"{type(t).__name__} {getattr(t, 'placements', '')}"
                    for p in params
                    for t in (p, p.grad)
                }
            ),
            "shard sizes": [list(_local(p).shape) for p in params],
            "all-gathers": code.count("_c10d_functional.all_gather_into_tensor"),
            "parameters gathered": len(params),
        }

    return scenario


class TiedLanguageModel(nn.Module):
    """An embedding whose weight the output layer shares, as language models tie
    them: FSDP2's root group holds the one parameter for both modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.body = nn.Linear(8, 8)
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.body(self.embed(tokens))))


def accumulating_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Two micro-batches, a backward each, one optimizer step."""
    opt.zero_grad()
    total = torch.zeros(())
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        loss = F.cross_entropy(model(xs), ys) / 2
        loss.backward()
        total = total + loss.detach()
    opt.step()
    return total


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def tied_and_accumulated(mesh: DeviceMesh) -> dict[str, Any]:
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TiedLanguageModel()
        fully_shard(model.body, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    torch.manual_seed(100 + dist.get_rank())
    batches = [
        (torch.randint(0, 11, (8,)), torch.randint(0, 11, (8,))) for _ in range(STEPS)
    ]
    eager, eager_opt = make()
    model, opt = make()
    step = pg.load(
        *pg.precompile(accumulating_step, model, opt, *batches[0], backend="eager")
    )
    inference = pg.load(*pg.precompile(predict, model, batches[0][0], backend="eager"))
    losses = [
        (
            cast(torch.Tensor, step(model, opt, x, y)).item(),
            accumulating_step(eager, eager_opt, x, y).item(),
        )
        for x, y in batches
    ]
    x = batches[0][0]
    return {
        "losses": losses,
        "parameters": _max_difference(
            list(model.parameters()), list(eager.parameters())
        ),
        "inference": _max_difference(
            [cast(torch.Tensor, inference(model, x))], [predict(eager, x)]
        ),
    }


# Optimizers beyond AdamW on the shards (eager backend, the same small MLP).
OTHER_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD, momentum": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, weight_decay=0.01
    ),
    "RMSprop, centered": lambda p: torch.optim.RMSprop(
        p, lr=0.01, momentum=0.9, centered=True
    ),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
}


def other_optimizers(mesh: DeviceMesh) -> dict[str, float]:
    batches = _batches("mlp")
    differences = {}
    for name, make_optimizer in OTHER_OPTIMIZERS.items():
        eager, model = _mlp(mesh), _mlp(mesh)
        eager_opt = make_optimizer(eager.parameters())
        opt = make_optimizer(model.parameters())
        step = pg.load(
            *pg.precompile(train_step, model, opt, *batches[0], backend="eager")
        )
        for x, y in batches:
            train_step(eager, eager_opt, x, y)
            step(model, opt, x, y)
        differences[name] = max(
            _max_difference(list(model.parameters()), list(eager.parameters())),
            _max_difference(_state(opt), _state(eager_opt)),
        )
    return differences


class CustomAllGather(DefaultAllGather):
    """FSDP2's own all-gather under another type: a custom one, to FSDP2."""


def refusals(mesh: DeviceMesh) -> dict[str, str]:
    x, y = _batches("mlp")[0]

    def refusal(configure: Callable[[nn.Module], object], **options: Any) -> str:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))
        layers = [model[0], model[2]] if options.pop("grouped", False) else model[0]
        fully_shard(layers, mesh=options.pop("layer_mesh", mesh), **options)
        fully_shard(model, mesh=mesh)
        configure(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        before = [_local(p).clone() for p in model.parameters()]
        try:
            pg.precompile(train_step, model, opt, x, y, backend="eager")
        except pg.PrecompileError as error:
            after = [_local(p) for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            assert all(p.grad is None for p in model.parameters())
            return str(error)
        return "no PrecompileError"

    def nothing(model: nn.Module) -> None:
        pass

    def call(method: str, *args: object) -> Callable[[nn.Module], object]:
        return lambda model: getattr(model.get_submodule("0"), method)(*args)

    hsdp = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("dp", "shard"))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))
    fully_shard(plain, mesh=mesh)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    try:
        precompile_once(train_step, plain, plain_opt, x, y, backend="eager")
        once = "no PrecompileError"
    except pg.PrecompileError as error:
        once = str(error)
    return {
        "mixed precision": refusal(
            nothing, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        ),
        "cpu offload": refusal(
            nothing, offload_policy=CPUOffloadPolicy(pin_memory=False)
        ),
        "hsdp": refusal(nothing, layer_mesh=hsdp),
        "no gradient sync": refusal(call("set_requires_gradient_sync", False)),
        "all-reduce hook": refusal(call("set_all_reduce_hook", lambda t: None)),
        "divide factor": refusal(call("set_gradient_divide_factor", 4.0)),
        "unsharded": refusal(call("unshard")),
        "grouped": refusal(nothing, grouped=True),
        "custom all-gather": refusal(call("set_custom_all_gather", CustomAllGather())),
        "precompile_once": once,
    }


def refused_calls(mesh: DeviceMesh) -> dict[str, str]:
    """Calls that break the convention a pair was captured with."""
    x, y = _batches("mlp")[0]
    model = _mlp(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pair = pg.precompile(train_step, model, opt, x, y, backend="eager")
    step = pg.load(*pair)
    # Rank 0's pair, on every rank: rank 1's shards of the 5-row layer have 2 rows.
    shared = [pair]
    dist.broadcast_object_list(shared, src=0)
    rank0_step = pg.load(*shared[0])

    def refusal(call: Callable[[], object]) -> str:
        before = [_local(p).clone() for p in model.parameters()]
        try:
            call()
        except pg.PrecompileError as error:
            after = [_local(p) for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            return str(error)
        return "no PrecompileError"

    layers = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def unsharded() -> object:
        for layer in layers:
            layer.unshard()
        try:
            return step(model, opt, x, y)
        finally:
            for layer in layers:
                layer.reshard()

    recorded = {"unsharded": refusal(unsharded)}
    if dist.get_rank() == 1:
        # Refused before its first collective (rank 0 would wait in it for rank 1).
        recorded["other rank's pair"] = refusal(lambda: rank0_step(model, opt, x, y))
    return recorded


SCENARIOS: dict[str, Callable[[DeviceMesh], Any]] = {
    **{
        f"{name} {backend}": training(make, name, backend)
        for backend in BACKENDS
        for name, make in (("mlp", _mlp), ("transformer", _transformer))
    },
    "mlp eager, reshard_after_forward=False": training(
        lambda mesh: _mlp(mesh, reshard=False), "mlp", "eager"
    ),
    "tied weights, two micro-batches, inference": tied_and_accumulated,
    "other optimizers": other_optimizers,
    "refusals": refusals,
    "refused calls": refused_calls,
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
    out = Path(tmp_path_factory.mktemp("fully_shard"))
    ranks = run_ranks(WORLD_SIZE, out, every_scenario, deadline_s=600)
    assert all(rank is not None for rank in ranks), "a rank wrote no result"
    return [rank for rank in ranks if rank is not None]


def _scenario(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, result in enumerate(results):
        assert "failed" not in result[name], f"rank {rank}: {result[name]['failed']}"
    return [result[name] for result in results]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_steps_match_eager_fsdp2_on_every_rank(
    results: list[dict[str, Any]], model: str, backend: str
) -> None:
    recorded = _scenario(results, f"{model} {backend}")
    # Each rank its own data: its own losses.
    assert recorded[0]["eager losses"] != recorded[1]["eager losses"]
    for rank in recorded:
        assert rank["losses"] == pytest.approx(rank["eager losses"], rel=1e-5)
        for what in ("parameters", "gradients", "optimizer state"):
            assert rank[what] < 1e-5, (what, rank[what])
        # Still sharded between calls, gradients too, as eager FSDP2 leaves them.
        assert rank["placements"] == ["DTensor (Shard(dim=0),)"]
    if model == "mlp":
        # 5 and 3 rows over 2 ranks: shards of 3 and 2, of 2 and 1.
        assert recorded[0]["shard sizes"][2:4] == [[3, 16], [3]]
        assert recorded[1]["shard sizes"][2:4] == [[2, 16], [2]]


def test_resharded_parameters_are_gathered_again_for_the_backward(
    results: list[dict[str, Any]],
) -> None:
    resharded = _scenario(results, "mlp eager")[0]
    kept = _scenario(results, "mlp eager, reshard_after_forward=False")[0]
    # Without resharding, each parameter is gathered once, in the forward, and kept
    # for the backward. With it, the weights the backward needs (the two layers
    # whose inputs need gradients) are gathered again there.
    assert kept["all-gathers"] == kept["parameters gathered"] == 6
    assert resharded["all-gathers"] == 6 + 2
    for rank in _scenario(results, "mlp eager, reshard_after_forward=False"):
        assert rank["losses"] == pytest.approx(rank["eager losses"], rel=1e-5)
        assert rank["parameters"] < 1e-5


def test_tied_weights_micro_batches_and_inference_match_eager_fsdp2(
    results: list[dict[str, Any]],
) -> None:
    for rank in _scenario(results, "tied weights, two micro-batches, inference"):
        for got, want in rank["losses"]:
            assert got == pytest.approx(want, rel=1e-5)
        assert rank["parameters"] < 1e-5
        assert rank["inference"] < 1e-5


def test_other_optimizers_step_the_shards_as_eager_fsdp2_does(
    results: list[dict[str, Any]],
) -> None:
    for rank in _scenario(results, "other optimizers"):
        assert sorted(rank) == sorted(OTHER_OPTIMIZERS)
        for name, difference in rank.items():
            # Parameters and every state tensor, after 3 steps.
            assert difference < 1e-5, (name, difference)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("mixed precision", ["has a mixed-precision policy", "without mp_policy"]),
        ("cpu offload", ["CPUOffloadPolicy", "without offload_policy"]),
        ("hsdp", ["2-D mesh (HSDP", "over a 1-D mesh"]),
        ("no gradient sync", ["set_requires_gradient_sync(False)", "gradient sync on"]),
        ("all-reduce hook", ["set_all_reduce_hook", "remove the hook"]),
        ("divide factor", ["set_gradient_divide_factor", "scale the loss instead"]),
        ("unsharded", ["holds its parameter 'weight' unsharded", "call reshard()"]),
        ("grouped", ["shares one fully_shard call", "call fully_shard on each module"]),
        (
            "custom all-gather",
            ["set_custom_all_gather", "shard it with FSDP2's default collectives"],
        ),
        ("precompile_once", ["fully_shard (FSDP2)", "Call precompile() on every rank"]),
    ],
)
def test_what_fsdp2_offers_beyond_the_capture_is_refused(
    results: list[dict[str, Any]], case: str, expected: list[str]
) -> None:
    for rank in _scenario(results, "refusals"):
        message = rank[case]
        for part in expected:
            assert part in message, message
        if case != "precompile_once":
            assert "module '0' of the module at argument 0 (`model`)" in message


def test_a_call_that_breaks_the_captured_sharding_is_refused(
    results: list[dict[str, Any]],
) -> None:
    rank0, rank1 = _scenario(results, "refused calls")
    for rank in (rank0, rank1):
        message = rank["unsharded"]
        assert "is a plain tensor, but the artifact was captured with a DTensor" in (
            message
        ), message
    message = rank1["other rank's pair"]
    for part in [
        "this rank's shard of the model's '2.weight' has shape (2, 16)",
        "shards of shape (3, 16), those of the rank that captured it",
        "precompile() on every rank",
    ]:
        assert part in message, message
