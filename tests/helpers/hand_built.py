"""A capture no tracer made, rendered in the test process and in child processes,
which must render the same bytes."""

from __future__ import annotations

import dataclasses

import precompile_gen as pg
from helpers.stubs import replace_convention, stub_capture
from precompile_gen.capture_result import (
    InputLeaf,
    InputStrides,
    ModuleArgument,
    StateTensor,
)


def hand_built_capture() -> pg.CaptureResult:
    """A capture no tracer made: dicts and non-ASCII text exercise the literal
    renderer's ordering and escaping."""
    stub = stub_capture("eager")
    # The strides: the two parameters', the buffer's, then the two leaves'.
    graph = dataclasses.replace(
        stub.graph,
        input_strides=InputStrides([(4, 1), (1,)], [(1,)], [None, None], []),
    )
    return replace_convention(
        dataclasses.replace(stub, graph=graph),
        fn_name="hand_built",
        num_positional_args=3,
        modules=[
            ModuleArgument(0, [True], {}),
            ModuleArgument(2, [False, True], {"1": {"forward hook": 2}}),
        ],
        params=[
            StateTensor("m0.w\u00e9ight", (4, 4), "torch.float32", "cpu", True),
            StateTensor("m1.bias", (4,), "torch.bfloat16", "cpu", True),
        ],
        grad_param_indices=[1],
        leaves=[
            InputLeaf(
                (None, 4),
                "torch.float32",
                "cpu",
                {1: (None, 9), 0: (1, 64)},
                {0: "u0"},
                None,
            ),
            InputLeaf(None, None, None, None, None, 0.1),
        ],
        input_names=["p_m0_w", "p_m1_bias", "b_running_mean", "x", "y", "lit0"],
    )
