# Runtime support for a backward: carried after the base part
# (precompile_gen/runtime_support/support.py) by every artifact whose graph computes
# gradients or resets them, from its first "# ---" heading on. The lines above that
# heading are not carried: they import what the rest of the artifact defines, so that
# ruff and pyrefly check this part as a module of its own.
from typing import TYPE_CHECKING

from precompile_gen.runtime_support.support import _CheckedState, _fail

if TYPE_CHECKING:
    # Declared only: capture imports this part, which reads no metadata until the
    # artifact's forward() runs.
    from precompile_gen.runtime_support.declarations import (
        GRAD_PARAM_INDICES,
        GRAD_RESETS,
    )

# isort: split

# --- Gradients ----------------------------------------------------------------------
# The graph returns the parameters' gradients after the function's own result; they
# are added to .grad as eager backward adds them, running the parameters' hooks.
from collections.abc import Callable
from typing import Any, cast

import torch

# Parameters with sparse gradients (the sparse_gradients part's), which need a sparse
# sum; None in an artifact without them.
_SPARSE_GRADIENTS = globals().get("SPARSE_GRADIENTS")


def _check_grad_mode() -> None:
    if not torch.is_grad_enabled():
        _fail(
            "this artifact runs a backward, and grad mode is off (the call is inside "
            "torch.no_grad() or torch.inference_mode()), where the function's "
            "backward raises eagerly. Call it outside torch.no_grad() and "
            "torch.inference_mode()."
        )


def reset_grad(param: torch.Tensor, set_to_none: bool) -> None:
    """What ``zero_grad(set_to_none)`` does to one parameter."""
    grad = param.grad
    if grad is None:
        return
    if set_to_none:
        param.grad = None
        return
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()


def _reset_grads(state: _CheckedState) -> None:
    # The graph never reads .grad, so the function's resets can come first, as in
    # eager: gradients reset to None are freed before the graph computes new ones.
    for index, set_to_none in GRAD_RESETS:
        reset_grad(state.tensors[index], set_to_none)


def _scatter_gradients(state: _CheckedState, flat_outputs: list[Any]) -> list[Any]:
    """Add the graph's trailing gradient outputs to the parameters' ``.grad`` as eager
    ``.backward()`` would; return the outputs before them, the function's own."""
    num_results = len(flat_outputs) - len(GRAD_PARAM_INDICES)
    _add_gradients(state.tensors, flat_outputs[num_results:])
    return flat_outputs[:num_results]


def _add_gradients(tensors: list[torch.Tensor], grads: list[object]) -> None:
    accumulate_into: list[torch.Tensor] = []
    increments: list[torch.Tensor] = []
    post_hooked: list[torch.Tensor] = []
    for index, output in zip(GRAD_PARAM_INDICES, grads):
        grad = cast(torch.Tensor, output)
        param = tensors[index]
        hooks = param._backward_hooks
        if hooks:
            grad = _run_grad_hooks(hooks, grad)
        if param._post_accumulate_grad_hooks:
            post_hooked.append(param)
        if param.grad is None:
            param.grad = grad
        elif _SPARSE_GRADIENTS and (grad.is_sparse or param.grad.is_sparse):
            _accumulate_sparse(param, grad)
        else:
            accumulate_into.append(param.grad)
            increments.append(grad)
    if accumulate_into:
        # One call for all: a Python add_() per parameter costs more than the adds.
        torch._foreach_add_(accumulate_into, increments)
    for param in post_hooked:
        _run_post_accumulate_grad_hooks(param)


def _accumulate_sparse(param: torch.Tensor, grad: torch.Tensor) -> None:
    # As eager's accumulation: in place (a sparse sum keeps both gradients' indices
    # and values, uncoalesced), except a dense gradient onto a sparse .grad, which
    # makes .grad a new dense tensor.
    held = cast(torch.Tensor, param.grad)
    with torch.no_grad():
        if held.is_sparse and not grad.is_sparse:
            param.grad = grad + held
        else:
            held += grad


def _run_grad_hooks(
    hooks: dict[int, Callable[..., Any]], grad: torch.Tensor
) -> torch.Tensor:
    # Hooks from param.register_hook() see, and may replace, each gradient before it
    # is added to .grad, as in eager backward (which runs them without grad mode).
    with torch.no_grad():
        for hook in list(hooks.values()):
            replaced = hook(grad)
            if replaced is not None:
                grad = replaced
    return grad


def _run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    # Hooks from param.register_post_accumulate_grad_hook() run once .grad is updated.
    hooks = param._post_accumulate_grad_hooks
    if hooks:
        with torch.no_grad():
            for hook in list(hooks.values()):
                hook(param)
