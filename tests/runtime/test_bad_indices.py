"""An index out of range: the driver refuses it before the graph runs, naming the
input, so that the process lives (a compiled kernel's own check may abort it) and the
model and optimizer are as they were; an index the graph computes itself raises
inside the graph, which has written nothing by then."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
from helpers.golden import eager_index_checks
from helpers.processes import env_with_helpers
from helpers.state_snapshot import assert_call_rejected
from helpers.token_classifier import TokenClassifier, classification_step
from torch import nn

import precompile_gen as pg
from precompile_gen.codegen import render

# The runtime support's index check, as an artifact with index checks carries it (it
# reads no metadata when executed).
_RUNTIME: dict[str, object] = {}
exec(render.runtime_support(("support", "index_checks")), _RUNTIME)
_index_problem = cast(Callable[..., "str | None"], _RUNTIME["_index_problem"])

CHILD = Path(__file__).with_name("bad_index_child.py")


@pytest.mark.slow
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_bad_token_id_is_refused_and_the_next_steps_match_eager(
    backend: str, shift: int
) -> None:
    run = subprocess.run(
        [sys.executable, str(CHILD), backend, str(shift)],
        capture_output=True,
        text=True,
        env=env_with_helpers(),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    message = report["raised"]
    assert message is not None, "the bad call raised nothing"
    if shift:
        expected = "the index the graph computes from argument 2 (`ids`) holds 50,"
    else:
        expected = "argument 2 (`ids`) holds 50 at (1, 3),"
    assert message.startswith(expected), message
    assert "outside 0 <= index < 50: pass inputs that keep it in that range" in message
    assert "embedding rows of the model's 'emb.weight'" in message
    assert report["optimizer_state"] == 0, "the failed first step left state behind"
    assert report["parameters_unchanged"]
    for loss, expected in report["losses"]:
        assert loss == pytest.approx(expected, abs=1e-5)
    assert report["max_parameter_difference"] < 1e-5


def test_a_capture_records_the_indices_it_takes_from_its_inputs() -> None:
    # The ids are embedded without their last column, and the loss's targets are
    # the ids without their first.
    embedded, targets = eager_index_checks().convention.index_checks
    assert embedded.sources == (0,)
    assert embedded.steps == (("slice.Tensor", ({"leaf": 0}, 1, 0, -1), {}),)
    assert (embedded.low, embedded.high, embedded.allowed) == (0, 10, None)
    assert embedded.what == "embedding rows of the model's '0.weight'"
    # The flatten after the slice rearranges the values the check reads anyway.
    assert targets.steps == (("slice.Tensor", ({"leaf": 0}, 1, 1, sys.maxsize), {}),)
    assert (targets.low, targets.high, targets.allowed) == (0, 10, -100)


def _lookups(table: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> object:
    # Advanced indexing wraps negative rows; gather refuses them.
    return table[rows].sum() + table.gather(1, columns).sum() + table[rows + 1].sum()


def test_each_index_is_held_to_the_range_eager_allows() -> None:
    table = torch.randn(5, 3)
    rows, columns = torch.tensor([0, 3]), torch.tensor([[0, 2]])
    cap = pg.capture(_lookups, table, rows, columns, backend="eager")
    checks = {
        (c.sources, bool(c.steps), c.low, c.high) for c in cap.convention.index_checks
    }
    # rows, and rows + 1 which the driver computes as the graph does.
    assert checks == {((1,), False, -5, 5), ((1,), True, -5, 5), ((2,), False, 0, 3)}
    forward = pg.load(pg.render_artifact(cap), None)
    torch.testing.assert_close(
        forward(table, torch.tensor([-5, 3]), columns),
        _lookups(table, torch.tensor([-5, 3]), columns),
    )
    message = assert_call_rejected(
        forward,
        table,
        torch.tensor([0, -6]),
        columns,
        match=["argument 1 (`rows`) holds -6 at (1,)", "-5 <= index < 5"],
    )
    assert "(indexing dim 0)" in message
    # A training loop's ``except IndexError`` catches it, as it catches eager's.
    with pytest.raises(IndexError) as caught:
        forward(table, torch.tensor([0, -6]), columns)
    assert isinstance(caught.value, pg.PrecompileIndexError)
    assert isinstance(caught.value, pg.PrecompileError)
    assert_call_rejected(
        forward,
        table,
        torch.tensor([0, 4]),
        columns,
        match=["the index the graph computes from argument 1 (`rows`) holds 5,"],
    )
    assert_call_rejected(
        forward,
        table,
        rows,
        torch.tensor([[2, 3]]),
        match=["argument 2 (`columns`) holds 3 at (0, 1)", "(gather dim 1)"],
    )


def test_the_index_check_reads_only_what_the_graph_indexes_with() -> None:
    cut = (("slice.Tensor", ({"leaf": 0}, 1, 1, sys.maxsize), {}),)
    ids: list[object] = [torch.tensor([[99, 1, -100], [99, 2, 3]])]
    assert _index_problem(ids, (0,), cut, 0, 10, -100) is None
    assert _index_problem(ids, (0,), (), 0, 10, -100) == (
        "holds 99 at (0, 0) (and 1 more)"
    )
    assert _index_problem(ids, (0,), cut, 0, 3, None) == "holds -100 (and 1 more)"
    empty: list[object] = [torch.zeros(0, dtype=torch.long)]
    assert _index_problem(empty, (0,), (), 0, 1, None) is None


def test_an_index_computed_from_two_inputs_is_replayed_as_the_graph_computes_it() -> (
    None
):
    # labels.masked_fill(mask == 0, -100): the padding a mask marks is ignored.
    steps = (
        ("eq.Scalar", ({"leaf": 1}, 0), {}),
        ("masked_fill.Scalar", ({"leaf": 0}, {"step": 0}, -100), {}),
        ("_to_copy.default", ({"step": 1},), {"dtype": {"dtype": "int64"}}),
    )
    leaves: list[object] = [torch.tensor([7, 2]), torch.tensor([0, 1])]
    assert _index_problem(leaves, (0, 1), steps, 0, 4, -100) is None
    leaves[1] = torch.tensor([1, 1])
    assert _index_problem(leaves, (0, 1), steps, 0, 4, -100) == "holds 7"


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_an_index_error_inside_the_graph_leaves_model_and_optimizer_as_they_were(
    optimizer: str,
) -> None:
    # The optimizer's momentum decay reads nothing of the forward: were it run
    # before the embedding, the failed call would have decayed it.
    torch.manual_seed(0)
    model = TokenClassifier(width=8, shift=1, through_float=True)
    twin = copy.deepcopy(model)

    def make(m: nn.Module) -> torch.optim.Optimizer:
        if optimizer == "SGD":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(m.parameters(), lr=0.01)

    opt, twin_opt = make(model), make(twin)
    ids, y = torch.randint(0, 49, (2, 6)), torch.randint(0, 4, (2,))
    forward = pg.load(
        *pg.precompile(classification_step, model, opt, ids, y, backend="eager")
    )
    bad = ids.clone()
    bad[1, 3] = 49
    if optimizer == "AdamW":
        # A failed first step creates no state.
        with pytest.raises(IndexError):
            forward(model, opt, bad, y)
        assert not opt.state
    forward(model, opt, ids, y)
    classification_step(twin, twin_opt, ids, y)
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(IndexError):
        forward(model, opt, bad, y)
    for before, param in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, param)
    for index, entries in state.items():
        for key, value in entries.items():
            assert torch.equal(opt.state_dict()["state"][index][key], value), key
    # Nothing the fast path remembers is taken from the failed call.
    assert getattr(forward, "__globals__", {}).get("_remembered", None) is None
    for _ in range(2):
        torch.testing.assert_close(
            forward(model, opt, ids, y), classification_step(twin, twin_opt, ids, y)
        )
    for param, expected in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(param, expected)
