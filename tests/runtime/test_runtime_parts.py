"""The runtime support's parts as plain code: each executed on a capture's metadata
and section 3's convention, as an artifact executes them, and its functions called
directly, without a graph."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers.golden import (
    eager_multi_module,
    eager_pytree_types,
    eager_train_step,
    inductor_dynamic_dims,
)

import precompile_gen as pg
from precompile_gen.codegen import render
from precompile_gen.metadata import metadata_constants


def executed(cap: pg.CaptureResult) -> dict[str, Any]:
    """The parts ``cap``'s artifact carries, executed after its metadata and its
    section 3 constants, as in the artifact (sections 1 and 3's code left out)."""
    features = render.driver_features(cap)
    driver = render.driver_section(cap, features)
    namespace: dict[str, Any] = {
        **metadata_constants(cap),
        "_USER_POSITIONS": driver.user_positions,
        "_SIGNATURE": driver.signature,
        "_TENSOR_ARGUMENTS": features.tensor_arguments,
    }
    text = render.runtime_support(render.runtime_parts(features))
    exec(compile(text, "<runtime support>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def two_towers() -> dict[str, Any]:
    return executed(eager_multi_module())


def test_a_dict_in_another_key_order_is_taken_by_key(
    two_towers: dict[str, Any],
) -> None:
    encoder, head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, leaves = two_towers["_split_arguments"]((encoder, {"x": x}, head))
    assert leaves[0] is x and not caught
    assert two_towers["_leaf_name"](({"x": x},), 0) == "argument 1 (`batch['x']`)"


def test_a_dict_without_the_example_key_is_refused_by_name(
    two_towers: dict[str, Any],
) -> None:
    encoder, head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
    with pytest.raises(pg.PrecompileError, match=r"lacks the key\(s\) \['x'\]"):
        two_towers["_split_arguments"]((encoder, {"y": torch.randn(5, 4)}, head))


def test_a_dynamic_dim_outside_its_bounds_is_refused_in_its_own_keywords() -> None:
    runtime = executed(inductor_dynamic_dims())
    model = torch.nn.Linear(4, 2)
    _, leaves = runtime["_split_arguments"]((model, torch.randn(64, 4)))
    assert leaves[0].shape == (64, 4)
    with pytest.raises(pg.PrecompileError, match=r"outside .* \(min=2, max=64\)"):
        runtime["_split_arguments"]((model, torch.randn(65, 4)))


def test_the_gradients_are_added_and_the_results_returned() -> None:
    runtime = executed(eager_train_step())
    assert "_scatter_gradients" in runtime and "_check_leaf_sharding" not in runtime
    params = [torch.zeros(2, requires_grad=True) for _ in range(4)]
    params[0].grad = torch.ones(2)
    state = runtime["_CheckedState"](params)
    grads = [torch.full((2,), float(i)) for i in range(4)]
    loss = torch.tensor(3.0)
    assert runtime["_scatter_gradients"](state, [loss, *grads]) == [loss]
    first, last = params[0].grad, params[3].grad
    assert first is not None and first.tolist() == [1.0, 1.0]  # 1 + 0
    assert last is not None and last.tolist() == [3.0, 3.0]
    runtime["reset_grad"](params[3], True)
    assert params[3].grad is None


def test_namedtuple_and_dataclass_types_are_registered_when_executed() -> None:
    runtime = executed(eager_pytree_types())
    result = runtime["_result"]([torch.zeros(1), torch.ones(())])
    assert type(result).__name__ == "Scores" and result.total.item() == 1.0
    with pytest.raises(pg.PrecompileError, match="cannot be imported here"):
        runtime["_register_pytree_types"](["helpers.golden:NoSuchType"])


def test_a_layout_that_repeats_elements_cannot_be_copied_into() -> None:
    runtime = executed(inductor_dynamic_dims())
    distinct = runtime["_distinct_elements"]
    assert distinct((3, 4), (4, 1)) and distinct((3, 1), (1, 5))
    assert not distinct((3, 4), (0, 1))
