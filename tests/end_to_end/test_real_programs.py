"""Programs as people write them: inputs that alias, pytree types registered without
key paths, inputs used only for their shape, tensor literals inside the function,
library code that checks ``torch.compiler.is_compiling()``, and exceptions a caller
catches by type.

Every result is compared with eager PyTorch on both backends. Inductor artifacts are
built once per module (module-scoped fixtures): each costs a kernel compile.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.utils._pytree as pytree
from helpers.state_snapshot import StateSnapshot, assert_call_rejected, clone_with_grads
from torch import nn

import precompile_gen as pg

BACKENDS = ["eager", "inductor"]


def _load(fn: Callable[..., object], *example: object, backend: str):
    python_code, cache = pg.precompile(fn, *example, backend=backend)
    return pg.load(python_code, cache)


# --- 1. Aliasing among the inputs ----------------------------------------------------


def double_then_add(scale: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Reads b after writing a: the result depends on whether they share memory.
    a.mul_(2.0)
    return scale(a + b)


def make_scale() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def eager_and_artifact(
    forward: Callable[..., object],
    make_args: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """The artifact on fresh arguments from ``make_args`` equals eager on others,
    the result and every input after the call."""
    model = make_scale()
    expected_args, got_args = make_args(), make_args()
    expected = double_then_add(model, *expected_args)
    got = forward(model, *got_args)
    torch.testing.assert_close(got, expected)
    for name, g, e in zip("ab", got_args, expected_args, strict=True):
        torch.testing.assert_close(g, e, msg=f"input {name} after the call")


def same_tensor_twice() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(4.0) + 1
    return t, t


def overlapping_views() -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(6.0) + 1
    return base[0:4], base[1:5]


def separate_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(4.0) + 1, torch.arange(4.0) + 1


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def twice_artifact(backend: str) -> Callable[..., object]:
    return _load(double_then_add, make_scale(), *same_tensor_twice(), backend=backend)


@pytest.fixture(scope="module")
def views_artifact(backend: str) -> Callable[..., object]:
    return _load(double_then_add, make_scale(), *overlapping_views(), backend=backend)


@pytest.fixture(scope="module")
def separate_artifact(backend: str) -> Callable[..., object]:
    return _load(double_then_add, make_scale(), *separate_tensors(), backend=backend)


def test_same_tensor_twice_with_mutation_matches_eager(
    twice_artifact: Callable[..., object],
) -> None:
    eager_and_artifact(twice_artifact, same_tensor_twice)
    # The calling convention records it: positions 2 and 3 follow the two parameters.
    assert [sorted(group) for group in aliased_inputs(twice_artifact)] == [[2, 3]]


def test_overlapping_views_with_mutation_match_eager(
    views_artifact: Callable[..., object],
) -> None:
    eager_and_artifact(views_artifact, overlapping_views)


def test_separate_tensors_match_eager(
    separate_artifact: Callable[..., object],
) -> None:
    eager_and_artifact(separate_artifact, separate_tensors)
    assert aliased_inputs(separate_artifact) == []


def aliased_inputs(forward: Callable[..., object]) -> list[dict[int, object]]:
    return forward.__globals__["ALIASED_INPUTS"]  # type: ignore[attr-defined]


def test_aliasing_at_capture_but_not_at_call_is_rejected(
    twice_artifact: Callable[..., object],
) -> None:
    assert_call_rejected(
        twice_artifact,
        make_scale(),
        *separate_tensors(),
        match=[
            "argument 1 (`a`) and argument 2 (`b`) were one tensor",
            "do not share one storage in this call",
            "capture again with separate tensors",
        ],
    )


def test_aliasing_at_call_but_not_at_capture_is_rejected(
    separate_artifact: Callable[..., object],
) -> None:
    for args in (same_tensor_twice(), overlapping_views()):
        assert_call_rejected(
            separate_artifact,
            make_scale(),
            *args,
            match=[
                "argument 1 (`a`) and argument 2 (`b`) share one storage in this call",
                "did not at capture",
                ".clone() one of them",
            ],
        )


def test_views_at_other_offsets_are_rejected(
    views_artifact: Callable[..., object],
) -> None:
    base = torch.arange(8.0)
    assert_call_rejected(
        views_artifact,
        make_scale(),
        base[2:6],
        base[3:7],
        match=[
            "argument 1 (`a`) shares a storage with argument 2 (`b`) as at capture",
            "at offset 2",
            "traced with offset 0",
            "Pass views at the example's offsets",
        ],
    )


def weight_step(model: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    loss = model(weight).square().mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_also_passed_as_input(backend: str) -> None:
    # Eager back-propagates through both uses into the one parameter.
    model = make_scale()
    forward = _load(weight_step, model, model.weight, backend=backend)
    expected_model, got_model = clone_with_grads(model), clone_with_grads(model)
    expected = weight_step(expected_model, expected_model.weight)
    got = forward(got_model, got_model.weight)
    torch.testing.assert_close(got, expected)
    for (name, g), e in zip(
        got_model.named_parameters(), expected_model.parameters(), strict=True
    ):
        torch.testing.assert_close(g.grad, e.grad, msg=f"{name}.grad")
    assert_call_rejected(
        forward,
        got_model,
        got_model.weight.detach().clone(),
        match=["the model's 'weight' and argument 1 (`weight`) were one tensor"],
    )


def test_aliasing_made_by_replacing_a_parameter_s_data_is_seen(
    separate_artifact: Callable[..., object], backend: str
) -> None:
    # The first call remembers the model; `.data = ...` with the same shape keeps
    # every other signal the driver remembers it by.
    model = make_scale()
    a, b = torch.randn(4), torch.randn(4, 4)
    separate_artifact(model, a, b[0])
    model.weight.data = b
    assert_call_rejected(
        separate_artifact,
        model,
        a,
        b[0],
        match=[
            "the model's 'weight' and argument 2 (`b`) share one storage in this call"
        ],
    )


# --- 2. Pytree types registered without key paths -----------------------------------


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


# Registered the way older code does: no flatten_with_keys_fn.
pytree.register_pytree_node(
    Pair,
    lambda pair: ([pair.first, pair.second], None),
    lambda children, _: Pair(*children),
)


def pair_step(model: nn.Module, pairs: list[Pair]) -> torch.Tensor:
    return model(pairs[0].first + pairs[0].second).sum()


def test_pytree_node_without_key_paths() -> None:
    model = make_scale()
    pairs = [Pair(torch.ones(2, 4), torch.full((2, 4), 2.0))]
    forward = _load(pair_step, model, pairs, backend="eager")
    torch.testing.assert_close(forward(model, pairs), pair_step(model, pairs))
    # The leaves of such a node are named by position, in capture and in the driver.
    bad = [Pair(torch.ones(2, 4), torch.ones(3, 4))]
    assert_call_rejected(
        forward, model, bad, match=["argument 1 (`pairs[0][1]`) has shape (3, 4)"]
    )


# --- 3. Layout checks only where the compiled graph depends on the layout ----------


def shape_only(model: nn.Module, sized: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(y) * sized.shape[0]


@pytest.fixture(scope="module")
def shape_only_inductor() -> tuple[str, Callable[..., object]]:
    python_code, cache = pg.precompile(
        shape_only, make_scale(), torch.randn(4, 4), torch.randn(2, 4)
    )
    return python_code, pg.load(python_code, cache)


def test_input_used_only_for_its_shape_takes_any_layout(
    shape_only_inductor: tuple[str, Callable[..., object]],
) -> None:
    python_code, forward = shape_only_inductor
    strides = pg.parse_metadata(python_code)["USER_INPUT_STRIDES"]
    assert strides == [None, (4, 1)]
    model, y = make_scale(), torch.randn(2, 4)
    transposed = torch.randn(4, 4).t()
    torch.testing.assert_close(
        forward(model, transposed, y), shape_only(model, transposed, y)
    )


def test_input_a_kernel_reads_is_copied_into_its_layout(
    shape_only_inductor: tuple[str, Callable[..., object]],
) -> None:
    # The kernels were compiled for y's layout: another one is copied into it
    # (test_input_structures checks what is said about it).
    _, forward = shape_only_inductor
    model, sized, y = make_scale(), torch.randn(4, 4).t(), torch.randn(4, 2).t()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = forward(model, sized, y)
    torch.testing.assert_close(got, shape_only(model, sized, y))


# --- 4. Exceptions keep their types --------------------------------------------------


def raises_value_error(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > 1:
        raise ValueError("batch too large for this model")
    return model(x)


def test_the_function_s_own_exception_reaches_the_caller() -> None:
    model, x = make_scale(), torch.randn(2, 4)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(ValueError, match="batch too large") as caught:
        pg.precompile(raises_value_error, model, x, backend="eager")
    assert type(caught.value) is ValueError
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "raised this while it was traced" in notes
    assert "raises_value_error(*example_inputs) runs eagerly" in notes
    snapshot.assert_unchanged()


@pytest.mark.parametrize(
    ("backend", "tracer", "builtin"),
    [
        ("tvm", "make_fx", ValueError),
        ("eager", "jit", ValueError),
        ("eager", "dynamo", NotImplementedError),
    ],
)
def test_rejections_are_also_of_torch_s_builtin_type(
    backend: str, tracer: str, builtin: type[Exception]
) -> None:
    with pytest.raises(builtin) as caught:
        pg.precompile(
            raises_value_error,
            make_scale(),
            torch.randn(1, 4),
            backend=backend,
            tracer=tracer,
        )
    assert isinstance(caught.value, pg.PrecompileError)


def test_mark_unbacked_on_the_eager_backend_is_not_implemented() -> None:
    x = torch.randn(3, 4)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    with pytest.raises(NotImplementedError) as caught:
        pg.precompile(shape_only, make_scale(), x, torch.randn(2, 4), backend="eager")
    assert isinstance(caught.value, pg.PrecompileError)
    assert "backend='inductor'" in str(caught.value)


# --- 5. Library code that checks torch.compiler.is_compiling() ----------------------


def compiling_aware(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Like transformers' mask code: another path while compiling.
    if torch.compiler.is_compiling():
        return model(x)
    return model(x) + 1.0


def test_the_trace_runs_with_is_compiling_true() -> None:
    model, x = make_scale(), torch.randn(2, 4)
    forward = _load(compiling_aware, model, x, backend="eager")
    torch.testing.assert_close(forward(model, x), model(x))
    assert not torch.compiler.is_compiling()


def test_is_compiling_is_restored_when_the_function_raises() -> None:
    with pytest.raises(ValueError):
        pg.precompile(
            raises_value_error, make_scale(), torch.randn(2, 4), backend="eager"
        )
    assert not torch.compiler.is_compiling()


# --- 6. Tensor literals the function creates ----------------------------------------


def masked_scores(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    scores = model(x) * torch.tensor(0.5)
    mask = torch.tensor([0.0, float("-inf"), 0.0, 0.0])
    return torch.softmax(scores + mask, dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_literals_are_kept_in_the_artifact(backend: str) -> None:
    model, x = make_scale(), torch.randn(2, 4)
    python_code, cache = pg.precompile(masked_scores, model, x, backend=backend)
    # The values are visible in the graph section.
    assert "_literal0_values = 0.5\n" in python_code
    assert '_literal1_values = [0.0, float("-inf"), 0.0, 0.0]\n' in python_code
    forward = pg.load(python_code, cache)
    other = torch.randn(2, 4)
    torch.testing.assert_close(forward(model, other), masked_scores(model, other))


def mutates_its_literal(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    total = torch.tensor([0.0, 0.0, 0.0, 0.0])
    total.add_(model(x).sum(0))
    return total


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_literal_is_fresh_at_every_call(backend: str) -> None:
    # The function writes into its literal; a second call must start from zeros.
    model, x = make_scale(), torch.randn(2, 4)
    forward = _load(mutates_its_literal, model, x, backend=backend)
    first, second = forward(model, x), forward(model, x)
    torch.testing.assert_close(first, mutates_its_literal(model, x))
    torch.testing.assert_close(second, first)


GLOBAL_OFFSET = torch.ones(4)


def reads_a_global(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) + GLOBAL_OFFSET


def copies_a_global(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # torch.tensor() of an existing tensor copies it, but its value is the global's.
    return model(x) + torch.tensor(GLOBAL_OFFSET)


def large_literal(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) + torch.tensor([0.5] * 5000)[:4]


def complex_literal(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) * torch.tensor([1 + 1j, 1, 1, 1]).real


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (reads_a_global, ["the global 'GLOBAL_OFFSET'"]),
        (copies_a_global, ["the global 'GLOBAL_OFFSET'"]),
        (large_literal, ["5000 elements, more than the 4096", "pass large literals"]),
        (complex_literal, ["of dtype torch.complex64, which has no Python literal"]),
    ],
)
def test_tensors_that_are_not_literals_stay_rejected(
    fn: Callable[..., torch.Tensor], match: list[str]
) -> None:
    model, x = make_scale(), torch.randn(2, 4)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(fn, model, x, backend="eager")
    for text in match:
        assert text in str(caught.value), f"{text!r} not in: {caught.value}"
    snapshot.assert_unchanged()


def test_a_copied_model_reads_its_own_literals() -> None:
    # The literal belongs to the program, not to the model it was traced with.
    model, x = make_scale(), torch.randn(2, 4)
    forward = _load(masked_scores, model, x, backend="eager")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.bias.add_(1.0)
    torch.testing.assert_close(forward(other, x), masked_scores(other, x))


# --- Aliasing with mark_unbacked dims -----------------------------------------------


def test_marked_tensor_passed_twice_is_rejected_at_capture() -> None:
    x = torch.randn(3, 4)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    model = make_scale()
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(double_then_add, model, x, x)
    assert "passed in more than one position" in str(caught.value)
    assert "pass a .clone() in the other position" in str(caught.value)
    snapshot.assert_unchanged()


def test_views_of_one_storage_with_marked_dims_are_rejected_at_capture() -> None:
    base = torch.randn(8, 4)
    a, b = base[0:4], base[2:6]
    torch._dynamo.decorators.mark_unbacked(a, 0)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(double_then_add, make_scale(), a, b)
    assert "views of one storage" in str(caught.value)
    assert ".clone() one of them" in str(caught.value)
