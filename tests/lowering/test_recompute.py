"""The post-grad pass that recomputes, before its late readers, a tensor whose
readers are far apart."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from precompile_gen.lowering import recompute

# More ops than the pass's smallest gap between a tensor's readers.
GAP = 60


def after_a_gap(t: torch.Tensor) -> torch.Tensor:
    """``t`` plus one, GAP times: that many ops in the graph."""
    for _ in range(GAP):
        t = t + 1
    return t


def late_reader_step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # ``activation`` is read at once and again after GAP ops, which hold ``x`` and
    # ``w`` (the step's inputs) but not ``scaled``.
    scaled = x * w
    activation = torch.relu(scaled)
    early = activation.sum()
    h = after_a_gap(x)
    return early, (activation * h).sum()


def traced(fn: object, *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)  # type: ignore[arg-type]


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    # 64 KiB and more: large enough to be worth freeing.
    return torch.randn(64, 512), torch.randn(64, 512)


def test_an_activation_read_far_apart_is_recomputed_before_its_late_reader() -> None:
    gm = traced(late_reader_step, *inputs())
    assert recompute.recompute_far_reads(gm.graph) == 1
    gm.recompile()
    relus = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)
    assert len(relus) == 2
    first, second = relus
    # The early reader keeps the first; the late one reads a copy made after the
    # gap, from x and w (the product is recomputed too, as nothing holds it).
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    assert all(position[user] < position[second] - GAP for user in first.users)
    assert second.args[0].target is torch.ops.aten.mul.Tensor
    x, w = inputs()
    for got, expected in zip(gm(x, w), late_reader_step(x, w), strict=True):
        torch.testing.assert_close(got, expected)


def test_an_input_written_in_between_is_not_read_again() -> None:
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        activation = torch.relu(x * w)
        early = activation.sum()
        x.mul_(2)  # the recomputation would read the doubled x
        h = after_a_gap(w)
        return early, (activation * h).sum()

    gm = traced(step, *inputs())
    assert recompute.recompute_far_reads(gm.graph) == 0
    gm.recompile()
    x, w = inputs()
    for got, expected in zip(gm(x.clone(), w), step(x.clone(), w), strict=True):
        torch.testing.assert_close(got, expected)


def test_a_tensor_made_by_a_matmul_is_kept() -> None:
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        activation = torch.relu(x @ w.t() @ x)
        early = activation.sum()
        h = after_a_gap(x)
        return early, (activation * h).sum()

    gm = traced(step, *inputs())
    # Recomputing the relu would keep the matmul's output alive instead.
    assert recompute.recompute_far_reads(gm.graph) == 0


def test_a_random_draw_is_never_repeated() -> None:
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        noise = torch.rand_like(x)
        early = noise.sum()
        h = after_a_gap(w)
        return early, (noise * h).sum()

    gm = traced(step, *inputs())
    assert recompute.recompute_far_reads(gm.graph) == 0


def test_the_pass_keys_inductors_cache_on_its_own_source() -> None:
    uuid = recompute.RecomputeFarReads().uuid()
    assert isinstance(uuid, str) and uuid == recompute.RecomputeFarReads().uuid()
