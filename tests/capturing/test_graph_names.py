"""The names the artifact gives the traced function's arguments and the graph's inputs:
the eager graph takes its inputs under them, the metadata tabulates them, ``inspect``
shows the function's signature with them; and they never change what the graph
computes."""

from __future__ import annotations

import dataclasses
import functools
import keyword
import re

import pytest
import torch
from helpers.stubs import replace_convention, stub_capture
from torch import nn

import precompile_gen as pg
from precompile_gen.capturing.graph_names import argument_names
from precompile_gen.tools.inspection import inspect_artifact


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def encode(
    model: nn.Module, batch: dict[str, torch.Tensor], xs: list[torch.Tensor]
) -> torch.Tensor:
    return model(batch["input_ids"]) * batch["mask"] + xs[0] - xs[1]


def test_eager_graph_takes_its_inputs_under_the_conventions_names() -> None:
    cap = pg.capture(predict, _mlp(), torch.randn(3, 4), backend="eager")
    assert (
        "def _graph_forward(self, p_0_weight, p_0_bias, p_2_weight, p_2_bias, x):"
        in cap.graph.source
    )
    assert "flat_" not in cap.graph.source
    assert cap.convention.input_names == [
        "p_0_weight",
        "p_0_bias",
        "p_2_weight",
        "p_2_bias",
        "x",
    ]


def test_buffers_and_input_leaves_are_named_by_their_paths() -> None:
    batch = {"input_ids": torch.randn(2, 4), "mask": torch.randn(2, 3)}
    xs = [torch.randn(2, 3), torch.randn(2, 3)]
    cap = pg.capture(encode, Normed().eval(), batch, xs, backend="eager")
    assert cap.convention.input_names == [
        "p_lin_weight",
        "p_lin_bias",
        "p_bn_weight",
        "p_bn_bias",
        "b_bn_running_mean",
        "b_bn_running_var",
        "b_bn_num_batches_tracked",
        "batch_input_ids",
        "batch_mask",
        "xs_0",
        "xs_1",
    ]
    assert cap.convention.argument_names == ["model", "batch", "xs"]
    forward = pg.load(
        *pg.precompile(encode, Normed().eval(), batch, xs, backend="eager")
    )
    torch.testing.assert_close(
        forward(Normed().eval(), batch, xs), encode(Normed().eval(), batch, xs)
    )


# Parameter names fx's code would read as its own globals, builtins, and a node's
# name (``t``, ``addmm``), and dict keys that are keywords or no identifier at all.
def clashing(
    model: nn.Module,
    torch_: torch.Tensor,
    t: torch.Tensor,
    addmm: torch.Tensor,
    extras: dict[str, torch.Tensor],
) -> torch.Tensor:
    out = model(torch_) + t * addmm
    return out + extras["class"] - extras["a b"] * extras["1x"] + extras["torch"]


def _renamed(fn: object, name: str) -> object:
    """``clashing`` with its second parameter named ``name``."""
    code = clashing.__code__
    names = list(code.co_varnames)
    names[1] = name
    return type(clashing)(
        code.replace(co_varnames=tuple(names)), clashing.__globals__, "clashing"
    )


@pytest.mark.parametrize("name", ["torch", "device", "list", "self", "inf"])
def test_names_that_clash_run_the_graph_as_eager_does(name: str) -> None:
    fn = _renamed(clashing, name)
    model = _mlp()
    args = (
        torch.randn(3, 4),
        torch.randn(3, 2),
        torch.randn(3, 2),
        {key: torch.randn(3, 2) for key in ("class", "a b", "1x", "torch")},
    )
    cap = pg.capture(fn, model, *args, backend="eager")  # type: ignore[arg-type]
    names = cap.convention.input_names
    assert len(set(names)) == len(names)
    for input_name in names:
        assert input_name.isidentifier() and not keyword.iskeyword(input_name)
        assert input_name not in {"self", "torch", "device", "list", "inf"}
    assert names[4:] == [
        f"{name}_1",
        "t",
        "addmm",
        "extras_class",
        "extras_a_b",
        "extras_1x",
        "extras_torch",
    ]
    assert cap.convention.argument_names[1] == name
    namespace: dict[str, object] = {}
    exec(compile(pg.render_artifact(cap), "<artifact>", "exec"), namespace)
    forward = namespace["forward"]
    assert callable(forward)
    torch.testing.assert_close(forward(model, *args), clashing(model, *args))


def test_metadata_tabulates_each_tensor_and_input_leaf() -> None:
    batch = {"input_ids": torch.randn(2, 4), "mask": torch.randn(2, 3)}
    xs = [torch.randn(2, 3), torch.randn(2, 3)]
    code, _ = pg.precompile(encode, Normed(), batch, xs, backend="eager")
    table = code[code.index("# The graph's inputs at a glance") :]
    table = table[: table.index("\nPARAM_NAMES")]
    rows = [
        r"#   input\s+name\s+shape\s+stride\s+dtype\s+device\s+requires grad\n",
        r"#   p_lin_weight\s+lin\.weight\s+\(3, 4\)\s+\(4, 1\)\s+float32\s+cpu"
        r"\s+yes\n",
        r"#   b_bn_num_batches_tracked\s+bn\.num_batches_tracked\s+\(\)\s+\(\)\s+"
        r"int64\s+cpu\s+no\n",
        r"#   batch_input_ids\s+input leaf 0\s+\(2, 4\)\s+\(4, 1\)\s+float32\s+cpu"
        r"\s+-\n",
        r"#   xs_1\s+input leaf 3\s+\(2, 3\)",
    ]
    for row in rows:
        assert re.search(row, table), row
    # The specs are drawn above their serialised form.
    assert "# IN_SPEC: ({'input_ids': *, 'mask': *}, [*, *])\nIN_SPEC" in code
    assert "# OUT_SPEC: *\nOUT_SPEC" in code
    assert pg.parse_metadata(code)["ARGUMENT_NAMES"] == ["model", "batch", "xs"]


def test_inspect_shows_the_functions_own_parameter_names() -> None:
    code, _ = pg.precompile(predict, _mlp(), torch.randn(3, 4), backend="eager")
    assert inspect_artifact(code)["signature"] == "predict(model: nn.Module, x)"


def step(model: nn.Module, *tensors: torch.Tensor) -> torch.Tensor:
    return model(tensors[0]) + tensors[1]


class Scaler:
    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)


def test_argument_names_follow_the_signature() -> None:
    assert argument_names(step, 3) == ["model", "tensors_0", "tensors_1"]
    assert argument_names(Scaler(), 2) == ["model", "x"]
    assert argument_names(functools.partial(step), 2) == ["model", "tensors_0"]
    # No signature to read: by position.
    assert argument_names(max, 2) == ["arg0", "arg1"]


def test_a_star_args_function_names_its_leaves_by_position() -> None:
    cap = pg.capture(
        step, _mlp(), torch.randn(3, 4), torch.randn(3, 2), backend="eager"
    )
    assert cap.convention.input_names[-2:] == ["tensors_0", "tensors_1"]
    code = pg.render_artifact(cap)
    assert inspect_artifact(code)["signature"] == (
        "step(model: nn.Module, tensors_0, tensors_1)"
    )


def test_a_capture_naming_too_few_inputs_is_refused_at_render() -> None:
    stub = stub_capture("eager")
    names = stub.convention.input_names[:-1]
    cap = replace_convention(stub, input_names=names)
    with pytest.raises(ValueError, match=r"names 3 graph inputs .* records make 4"):
        pg.render_artifact(cap)


def test_a_capture_with_strides_for_too_few_inputs_is_refused_at_render() -> None:
    stub = stub_capture("eager")
    strides = stub.graph.input_strides._replace(leaves=[])
    cap = dataclasses.replace(
        stub, graph=dataclasses.replace(stub.graph, input_strides=strides)
    )
    with pytest.raises(
        ValueError,
        match=r"input_strides hold 0 strides for its input leaves, but its "
        r"convention has 1: one per input leaf",
    ):
        pg.render_artifact(cap)
