"""The renderer emits black-formatted code without running black, and splices the
graph without copying it more than once."""

from __future__ import annotations

import dataclasses
import random
import re
import string
import subprocess
import sys
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from helpers.golden import CASES
from helpers.processes import env_with_helpers
from helpers.stubs import (
    replace_backend_graph,
    replace_convention,
    stub_capture,
)

import precompile_gen as pg
from precompile_gen.capture_result import Backend, InputLeaf, InputStrides, StateTensor
from precompile_gen.capturing.records import input_tree
from precompile_gen.codegen.features import driver_features
from precompile_gen.codegen.layout import assignment, format_python
from precompile_gen.codegen.render import GRAPH_MARKER, render_skeleton, runtime_parts
from precompile_gen.metadata import METADATA_NAMES, metadata_constants


def large_capture(backend: Backend) -> pg.CaptureResult:
    """Metadata long and odd enough to need every layout black has for it: hundreds of
    parameters, names with quotes, backslashes and non-ASCII text, a name longer than
    a line, dynamic dims with bounds and shared symbols."""
    names = [f"layers.{i}.weight" for i in range(300)]
    names += [
        "it's",
        'say "hi"',
        "both ' and \"",
        "back\\slash",
        "caf\u00e9",
        "x" * 100,
    ]
    count = len(names)
    stub = stub_capture(backend)
    # As capture names them: the state's names are made identifiers, and unique.
    input_names = [f"p_layers_{i}_weight" for i in range(300)]
    input_names += ["p_it_s", "p_say_hi_", "p_both_and_", "p_back_slash", "p_caf_"]
    input_names += ["p_" + "x" * 100, "b_running_mean", "x", "y", "z", "literal0"]
    graph = replace_backend_graph(
        dataclasses.replace(
            stub.graph,
            # The state's, the buffer's, then the three leaves'.
            input_strides=InputStrides(
                [(16, 1)] * count, [(1,)], [None, None, None], []
            ),
        ),
        positional_names=[f"arg{i}_1" for i in range(len(input_names))],
    )
    return replace_convention(
        dataclasses.replace(stub, graph=graph),
        fn_name="large",
        input_names=input_names,
        params=[
            StateTensor(name, (16, 16), "torch.float32", "cpu", i % 3 != 0)
            for i, name in enumerate(names)
        ],
        grad_param_indices=[i for i in range(count) if i % 3 != 0],
        leaves=[
            InputLeaf((None, 4), "torch.float32", "cpu", {0: (1, 64)}, {0: "u0"}, None),
            InputLeaf(
                (None, None, 8),
                "torch.bfloat16",
                "cpu",
                {1: (None, 9), 0: (2, None)},
                {0: "u0", 1: "u1"},
                None,
            ),
            InputLeaf(None, None, None, None, None, "caf\u00e9 'q' \"q\""),
        ],
    )


CAPTURES: dict[str, Callable[[], pg.CaptureResult]] = {
    **CASES,
    "stub_eager": lambda: stub_capture("eager"),
    "stub_inductor": lambda: stub_capture("inductor"),
    "large_eager": lambda: large_capture("eager"),
    "large_inductor": lambda: large_capture("inductor"),
}


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_templates_emit_black_formatted_code(name: str) -> None:
    # What makes running black at render time unnecessary; a template change that
    # black would reformat fails here with the difference.
    skeleton = render_skeleton(CAPTURES[name]())
    assert format_python(skeleton) == skeleton


@pytest.mark.parametrize("name", ["stub_eager", "large_inductor", "inductor_inference"])
def test_the_header_names_the_line_each_section_starts_on(name: str) -> None:
    lines = pg.render_artifact(CAPTURES[name]()).splitlines()
    header = lines[: lines.index("# Sections, and the line each starts on:") + 6]
    named = [int(n) for n in re.findall(r"line (\d+)", "\n".join(header))]
    assert len(named) == 5, header
    graph, metadata, driver, forward, support = (lines[n - 1] for n in named)
    assert graph.startswith("# 1. Compiled graph")
    assert metadata.startswith("# 2. Calling-convention metadata")
    assert driver.startswith("# 3. Driver")
    assert forward.startswith("def forward(")
    assert support.startswith("# 4. Runtime support")


def _random_value(rng: random.Random, depth: int = 0) -> object:
    if depth > 2 or rng.random() < 0.35:
        kind = rng.random()
        if kind < 0.45:
            size = rng.choice([0, 1, 5, 20, 60, 75, 80, 84, 90, 150])
            return "".join(
                rng.choice(string.ascii_letters + "'\"\\ .é") for _ in range(size)
            )
        if kind < 0.75:
            return rng.choice([0, 1, -3, 12345, 10**20])
        if kind < 0.9:
            return rng.choice([True, False, None])
        return rng.choice([1.5, 1e16, 1e-05, -0.0, b"", b"it's", b'"q"'])
    size = rng.choice([0, 1, 1, 2, 3, 5, 12, 30])
    kind = rng.random()
    if kind < 0.45:
        return [_random_value(rng, depth + 1) for _ in range(size)]
    if kind < 0.8:
        return tuple(_random_value(rng, depth + 1) for _ in range(size))
    return {rng.randrange(50): _random_value(rng, depth + 1) for _ in range(size)}


TARGETS = [
    "X",
    "PARAM_NAMES: list[str]",
    "IN_SPEC: str | None",
    "USER_INPUT_BOUNDS: list[dict[int, tuple[int | None, int | None]] | None]",
]


def test_assignment_lays_out_random_literals_as_black_does() -> None:
    rng = random.Random(0)
    for _ in range(600):
        value, target = _random_value(rng), rng.choice(TARGETS)
        text = assignment(value, target) + "\n"
        assert format_python(text) == text, value


@pytest.mark.parametrize("target", TARGETS)
def test_assignment_lays_out_lines_near_the_limit_as_black_does(target: str) -> None:
    # Each shape at every length that takes a line from fitting to not fitting.
    for size in range(1, 90, 3):
        atom = "a" * size
        for value in (
            atom,
            [atom],
            [atom, atom, None],
            (atom,),
            [(size,) * 12, (size,)],
            {0: (1, atom), 7: None},
            [[[atom, atom]]],
        ):
            text = assignment(value, target) + "\n"
            assert format_python(text) == text, value


def test_render_does_not_run_black() -> None:
    child = Path(__file__).with_name("render_without_black_child.py")
    done = subprocess.run(
        [sys.executable, str(child)],
        env=env_with_helpers(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("padding", ["", "\n\n"])
def test_graph_is_spliced_verbatim_with_one_copy(padding: str) -> None:
    # Black never sees the graph: a line black would rewrite stays as it is.
    line = "x=[1,2 ,3]  # (not black-formatted)\n"
    graph = line * (8 * 2**20 // len(line))
    stub = stub_capture("inductor")
    cap = dataclasses.replace(
        stub, graph=dataclasses.replace(stub.graph, source=padding + graph)
    )
    render_skeleton(cap)  # templates loaded and compiled outside the measurement
    tracemalloc.start()
    try:
        text = pg.render_artifact(cap)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert graph.rstrip("\n") in text
    assert GRAPH_MARKER not in text
    # The result, plus a copy of the graph without its leading blank lines where it
    # has any.
    copies = 1 if not padding else 2
    assert peak < (copies + 0.2) * len(graph)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_function_name_cannot_inject_code_through_the_header(backend: Backend) -> None:
    # The name lands in a comment; a line break in it must not end the comment.
    cap = replace_convention(stub_capture(backend), fn_name="f\nINJECTED = 1\r\u2028x")
    code = pg.render_artifact(cap)
    first_line = code.split("\n", 1)[0]
    assert "`f\\nINJECTED = 1\\r\\u2028x`" in first_line
    namespace: dict[str, object] = {}
    exec(compile(code, "<artifact>", "exec"), namespace)
    assert "INJECTED" not in namespace


def test_render_artifact_names_a_wrong_argument() -> None:
    with pytest.raises(ValueError, match="takes the CaptureResult"):
        pg.render_artifact("python_code")  # type: ignore[arg-type]


def test_metadata_constants_come_from_the_records_in_emission_order() -> None:
    cap = stub_capture("inductor")
    constants = metadata_constants(cap)
    assert tuple(constants) == METADATA_NAMES
    conv = cap.convention
    assert constants["PARAM_NAMES"] == [param.name for param in conv.params]
    assert constants["USER_INPUT_SYMBOLS"] == [leaf.symbols for leaf in conv.leaves]
    # The strides are the graph's, by the records they belong to.
    strides = cap.graph.input_strides
    assert constants["PARAM_STRIDES"] == strides.params
    assert constants["BUFFER_STRIDES"] == strides.buffers
    assert constants["USER_INPUT_STRIDES"] == strides.leaves


def _holds_dicts(spec: pytree.TreeSpec) -> bool:
    # As the artifact's dict_inputs part sees it: the spec's own dict nodes.
    return spec.type is dict or any(map(_holds_dicts, spec.children()))


@pytest.mark.parametrize(
    ("inputs", "flat"),
    [
        ((torch.ones(1),), True),
        ((torch.ones(1), torch.ones(2)), True),
        (({"a": torch.ones(1)},), False),
        ((torch.ones(1), [torch.ones(1), {"b": torch.ones(1)}]), False),
        ((OrderedDict(a=torch.ones(1)),), False),
        (((torch.ones(1), (torch.ones(1),)),), False),
    ],
)
def test_the_dict_inputs_part_is_carried_exactly_where_the_inputs_hold_dicts(
    inputs: tuple[object, ...], flat: bool
) -> None:
    # The trace records what the tree holds; the artifact's TreeSpec, read back from
    # IN_SPEC, must agree.
    tree = input_tree(pytree.tree_flatten(inputs)[1], len(inputs))
    assert tree.flat == flat
    cap = replace_convention(stub_capture("eager"), in_tree=tree)
    carried = "dict_inputs" in runtime_parts(driver_features(cap))
    assert tree.spec is not None
    assert carried == _holds_dicts(pytree.treespec_loads(tree.spec))
