"""What is specific to the inductor backend: lowering errors and the layout contract."""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings

import pytest
import torch
from helpers.stubs import replace_convention, stub_capture
from torch import nn

import precompile_gen as pg


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())


@pytest.fixture(scope="module", params=["eager", "inductor"])
def mlp_forward(request: pytest.FixtureRequest) -> tuple[str, object]:
    code, cache = pg.precompile(
        predict, _mlp(), torch.randn(3, 4), backend=request.param
    )
    return request.param, pg.load(code, cache)


@pytest.fixture(scope="module", params=["eager", "inductor"])
def conv_forward(request: pytest.FixtureRequest) -> tuple[str, object]:
    example = torch.randn(2, 3, 8, 8)
    code, cache = pg.precompile(predict, _conv(), example, backend=request.param)
    return request.param, pg.load(code, cache)


def _check_layout_contract(
    backend: str, forward: object, model: nn.Module, x: torch.Tensor
) -> None:
    """Inductor rejects a parameter of the same shape in another layout, untouched
    model and all; eager runs it and matches eager PyTorch."""
    assert callable(forward)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if backend == "inductor":
        with pytest.raises(pg.PrecompileError) as caught:
            forward(model, x)
        message = str(caught.value)
        assert "layout" in message and "backend='eager'" in message
        assert ".contiguous()" in message
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, before[name], rtol=0, atol=0)
            assert param.grad is None
    else:
        out = forward(model, x)
        assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(out, predict(copy.deepcopy(model), x))


def _check_input_layout(forward: object, model: nn.Module, x: torch.Tensor) -> None:
    """An input in another layout runs like eager on both backends: inductor copies
    it into the example's layout, which the graph does not write."""
    assert callable(forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the copy's warning: test_input_structures
        out = forward(model, x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, predict(copy.deepcopy(model), x))


def test_transposed_input(mlp_forward: tuple[str, object]) -> None:
    _, forward = mlp_forward
    x = torch.randn(4, 3).t()
    assert x.shape == (3, 4) and not x.is_contiguous()
    _check_input_layout(forward, _mlp(), x)


def test_channels_last_input(conv_forward: tuple[str, object]) -> None:
    _, forward = conv_forward
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    _check_input_layout(forward, _conv(), x)


def test_non_contiguous_weight(mlp_forward: tuple[str, object]) -> None:
    backend, forward = mlp_forward
    model = _mlp()
    first = model[0]
    assert isinstance(first, nn.Linear)
    first.weight = nn.Parameter(first.weight.detach().t().contiguous().t())
    assert first.weight.shape == (8, 4) and not first.weight.is_contiguous()
    _check_layout_contract(backend, forward, model, torch.randn(3, 4))


def test_example_layout_still_runs(mlp_forward: tuple[str, object]) -> None:
    _, forward = mlp_forward
    assert callable(forward)
    model, x = _mlp(), torch.randn(3, 4)
    torch.testing.assert_close(forward(model, x), predict(copy.deepcopy(model), x))


def test_graph_without_compute_suggests_eager() -> None:
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(lambda x: x, torch.randn(3))
    message = str(caught.value)
    assert "nothing to compile" in message and "backend='eager'" in message


def test_float_output_next_to_tensors_suggests_eager() -> None:
    def scaled(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return model(x) * 2, 0.5

    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(scaled, _mlp(), torch.randn(3, 4))
    message = str(caught.value)
    assert "float" in message and "backend='eager'" in message
    code, cache = pg.precompile(scaled, _mlp(), torch.randn(3, 4), backend="eager")
    model, x = _mlp(), torch.randn(3, 4)
    out, scale = pg.load(code, cache)(model, x)  # type: ignore[misc]
    torch.testing.assert_close(out, scaled(copy.deepcopy(model), x)[0])
    assert scale == 0.5


def _stub_forward(call_body: str) -> object:
    """The inductor driver around a stand-in ``call`` that runs ``call_body``."""
    graph = f"def call(flat_inputs: list[object]) -> list[object]:\n    {call_body}\n"
    stub = stub_capture("inductor")
    cap = replace_convention(
        dataclasses.replace(stub, graph=dataclasses.replace(stub.graph, source=graph)),
        leaves=[stub.convention.leaves[0]._replace(shape=(2, 4), bounds=None)],
        grad_param_indices=[],
        aliased_inputs=[],
    )
    namespace: dict[str, object] = {}
    exec(compile(pg.render_artifact(cap), "<stub>", "exec"), namespace)
    return namespace["forward"]


def _stub_model() -> nn.Module:
    model = nn.Module()
    model.weight = nn.Parameter(torch.zeros(4, 4))
    model.register_buffer("running_mean", torch.zeros(4))
    return model


@pytest.mark.parametrize(
    "assertion",
    [
        "expected size 2==3, stride 4==1 at dim=0",
        "wrong number of dimensions",
    ],
)
def test_driver_turns_layout_assertions_into_precompile_errors(assertion: str) -> None:
    forward = _stub_forward(f"raise AssertionError({assertion!r})")
    assert callable(forward)
    with pytest.raises(pg.PrecompileError) as caught:
        forward(_stub_model(), torch.zeros(2, 4))
    assert assertion in str(caught.value)
    assert "layout" in str(caught.value)


def test_driver_reraises_other_assertions_unchanged() -> None:
    forward = _stub_forward("raise AssertionError('a user check failed')")
    assert callable(forward)
    with pytest.raises(AssertionError) as caught:
        forward(_stub_model(), torch.zeros(2, 4))
    assert type(caught.value) is AssertionError
    assert str(caught.value) == "a user check failed"


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def bn_train_step(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    return loss.detach()


def bn_stats_step(
    model: nn.Module, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor
) -> torch.Tensor:
    # F.batch_norm updates mean and var in place, though its schema does not say so.
    loss = nn.functional.batch_norm(model(x), mean, var, training=True).pow(2).mean()
    loss.backward()
    return loss.detach()


def test_layout_error_on_a_late_input_changes_nothing() -> None:
    # The graph updates the model's BatchNorm statistics before it reads `var`,
    # which it writes: the driver must reject its layout before the graph runs.
    x = torch.randn(4, 4)
    code, cache = pg.precompile(
        bn_stats_step, _bn_model(), x, torch.zeros(4), torch.ones(4)
    )
    forward = pg.load(code, cache)
    model, mean, var = _bn_model(), torch.zeros(4), torch.ones(8)[::2]
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(pg.PrecompileError) as caught:
        forward(model, x, mean, var)
    message = str(caught.value)
    assert "argument 3 (`var`) has strides (2,)" in message
    assert "writes into it in place" in message
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(mean, torch.zeros(4)) and torch.equal(var, torch.ones(4))


class PermutedNormHead(nn.Module):
    """LayerNorm over channels-last features, then permuted to channels-first (as
    swin_t's head does): eager's layer-norm backward returns a contiguous gradient,
    the decomposition AOTAutograd re-traces with keeps the permuted layout, and the
    captured graph's view of that gradient fails when it is re-traced."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(channels, channels)
        self.norm = nn.LayerNorm(channels)
        self.fc = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.proj(x)).permute(0, 3, 1, 2)
        return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def test_a_graph_inductor_cannot_retrace_is_a_precompile_error_with_the_fix() -> None:
    torch.manual_seed(0)
    model, x = PermutedNormHead(), torch.randn(2, 2, 2, 8)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(bn_train_step, model, x, torch.randn(2, 3))
    message = str(caught.value)
    assert "the inductor backend failed to compile the captured graph" in message
    assert "select_decomp_table()" in message and "backend='eager'" in message
    # The fix it names works, and matches eager.
    from torch._inductor.decomposition import select_decomp_table

    code, cache = pg.precompile(
        bn_train_step,
        model,
        x,
        torch.randn(2, 3),
        decompositions=select_decomp_table(),
    )
    target = torch.randn(2, 3)
    expected_model, got_model = copy.deepcopy(model), copy.deepcopy(model)
    torch.testing.assert_close(
        pg.load(code, cache)(got_model, x, target),
        bn_train_step(expected_model, x, target),
    )
    for got, want in zip(
        got_model.parameters(), expected_model.parameters(), strict=True
    ):
        torch.testing.assert_close(got.grad, want.grad)


def test_graph_section_maps_inductors_positional_names_to_the_inputs() -> None:
    code, _ = pg.precompile(predict, _mlp(), torch.randn(3, 4), backend="inductor")
    section = code[code.index("# 1. Compiled graph") : code.index("# 2. Calling")]
    table = section[: section.index("\nimport ")]
    assert re.search(r"#   arg0_1\s+p_0_weight\s+parameter 0\.weight\n", table)
    assert re.search(r"#   arg4_1\s+x\s+input leaf 0\n", table)
    # Inductor's inner call unpacks its inputs under exactly these names.
    assert "arg0_1, arg1_1, arg2_1, arg3_1, arg4_1 = args" in section
    # The module's second `call` is explained where it is spliced.
    assert ("# noqa: F811" in section) == ("hence its `# noqa: F811`" in table)
