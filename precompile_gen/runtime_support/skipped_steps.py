# Runtime support for a step that a path through the function's branches skips:
# carried after the gradients part by every artifact whose function may return
# before its step, from its first "# ---" heading on. The lines above that heading
# are not carried: they import what the rest of the artifact defines, so that ruff
# and pyrefly check this part as a module of its own.
from precompile_gen.runtime_support.calls import _with_numbers
from precompile_gen.runtime_support.declarations import GRAD_PARAM_INDICES, STEP_RESETS
from precompile_gen.runtime_support.gradients import reset_grad
from precompile_gen.runtime_support.support import _CheckedState

# isort: split

# --- A skipped step -----------------------------------------------------------------
# A path through the function's branches on tensor values returns before its step
# (an early return on a bad batch): no gradients, no optimizer step. The graph's last
# output says whether the call's path took the step.
from typing import Any

_SKIPPED_SCALAR_OUTPUTS: list[int] = globals().get("SCALAR_OUTPUTS", [])


def _step_taken(flat_outputs: list[Any]) -> tuple[list[Any], bool]:
    """The graph's outputs without its last, and whether that says the call's path
    took the step."""
    *outputs, taken = flat_outputs
    return outputs, bool(taken)


def _without_step(flat_outputs: list[Any]) -> list[Any]:
    """The function's own flat outputs of a call whose path skipped the step: the
    gradient outputs after them are blanks, dropped."""
    results = flat_outputs[: len(flat_outputs) - len(GRAD_PARAM_INDICES)]
    if _SKIPPED_SCALAR_OUTPUTS:
        return _with_numbers(results, _SKIPPED_SCALAR_OUTPUTS)
    return results


def _reset_step_grads(state: _CheckedState) -> None:
    # After the graph, before the gradients are added: the graph never reads .grad.
    for index, set_to_none in STEP_RESETS:
        reset_grad(state.tensors[index], set_to_none)
