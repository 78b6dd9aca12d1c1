# Runtime support for optimizer steps the driver takes itself: carried after the
# gradients part by every artifact whose function steps an optimizer over parameters
# with sparse gradients, from its first "# ---" heading on. The lines above that
# heading are not carried: they import what the rest of the artifact defines, so that
# ruff and pyrefly check this part as a module of its own.
from precompile_gen.runtime_support.calls import _STATE_NAMES
from precompile_gen.runtime_support.declarations import (
    _SIGNATURE,
    ARGUMENT_NAMES,
    DEFERRED_STEPS,
)
from precompile_gen.runtime_support.support import _argument, _fail

# isort: split

# --- Deferred optimizer steps -------------------------------------------------------
# The graph's step leaves out the parameters with sparse gradients, which the sparse
# optimizers step: the driver takes those steps after the graph, on .grad.
from typing import cast

import torch


def _check_deferred_steps(
    args: tuple[object, ...], tensors: list[torch.Tensor]
) -> list[tuple[torch.optim.Optimizer, set[int]]]:
    """The optimizers whose step the driver takes for the parameters with sparse
    gradients, each with those parameters (by id); change nothing."""
    steps = []
    for spec in DEFERRED_STEPS:
        position, cls = spec["position"], getattr(torch.optim, spec["class"])
        optimizer = args[position]
        where = _argument(position, ARGUMENT_NAMES)
        if type(optimizer) is not cls:
            _fail(
                f"{where} must be a torch.optim.{cls.__name__}, as in the traced "
                f"call ({_SIGNATURE}), but got {type(optimizer).__name__}. "
                f"Pass that optimizer at position {position}, or capture again with "
                "this one."
            )
        optimizer = cast(torch.optim.Optimizer, optimizer)
        held = [p for group in optimizer.param_groups for p in group["params"]]
        wanted = [tensors[index] for index in spec["params"]]
        if {id(p) for p in wanted} - {id(p) for p in held} or (
            cls is torch.optim.SparseAdam and wanted and len(held) != len(wanted)
        ):
            names = {id(tensor): name for tensor, name in zip(tensors, _STATE_NAMES)}
            _fail(
                f"the {cls.__name__} at {where} holds "
                f"{[names.get(id(p), 'a tensor not in the model') for p in held]}, "
                "but the traced one stepped the sparse gradients of "
                f"{[_STATE_NAMES[i] for i in spec['params']]}. "
                "Build the optimizer from this model's parameters, as for the "
                "traced call, or capture again with it."
            )
        steps.append((optimizer, {id(p) for p in wanted}))
    return steps


def _take_deferred_steps(steps: list[tuple[torch.optim.Optimizer, set[int]]]) -> None:
    """Each optimizer's step for the parameters with sparse gradients alone, once
    the gradients are on .grad: the graph updated the others."""
    for optimizer, wanted in steps:
        if not wanted:
            continue  # a SparseAdam the function does not step
        groups = optimizer.param_groups
        held = [group["params"] for group in groups]
        for group in groups:
            group["params"] = [p for p in group["params"] if id(p) in wanted]
        try:
            optimizer.step()
        finally:
            for group, params in zip(groups, held):
                group["params"] = params
