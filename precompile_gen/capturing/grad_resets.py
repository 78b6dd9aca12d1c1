"""zero_grad() inside the traced function: recorded at capture, replayed by the driver.

A trace sees the gradients ``fn`` computes, not its resets of ``.grad``: the trace's
copies of the parameters start without gradients, so a ``zero_grad()`` before the
backward changes nothing the graph records. Eager PyTorch, though, would reset the
caller's gradients before the backward adds to them. So while ``fn`` is traced, each
``zero_grad()`` of a module or of an optimizer is applied to the trace's copies of the
module arguments' parameters (never to the example model's own), and which
parameters it reset, and how, is recorded; the artifact's driver resets the runtime
model's gradients the same way before adding the harvested ones.

An optimizer's ``step()`` is captured only for an optimizer argument of a supported
class (``optimizers``); any other is refused, since it would update the parameters
with Python code outside the graph.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from precompile_gen.capturing import convention, optimizers
from precompile_gen.runtime.errors import PrecompileError

# parameter index (into PARAM_NAMES) -> whether its .grad ends up None (True) or
# zeroed in place (False) when the function's resets are applied to an existing one.
Resets = dict[int, bool]


@contextlib.contextmanager
def recording(
    originals: list[torch.Tensor],
    copies: list[torch.Tensor],
    resets: Resets,
    stepping: list[torch.optim.Optimizer],
    stepped: set[int],
) -> Generator[None]:
    """While the current thread traces ``fn``: route ``Module.zero_grad`` and
    ``Optimizer.zero_grad`` to the trace's ``copies`` of the module arguments'
    parameters (``originals``, index-aligned), recording each reset in ``resets``;
    let the optimizer arguments in ``stepping`` step (recording their ids in
    ``stepped``) and refuse any other ``Optimizer.step``. Other threads' calls are
    left alone."""
    tracing_thread = threading.get_ident()
    record = _recorder(originals, copies, resets)

    def module_zero_grad(module: torch.nn.Module, set_to_none: bool = True) -> None:
        # The module arguments are reparametrised: parameters() yields the copies.
        record(module.parameters(), set_to_none, f"a {type(module).__name__}")

    def optimizer_zero_grad(
        optimizer: torch.optim.Optimizer, set_to_none: bool = True
    ) -> None:
        # The optimizer holds the example model's own parameters: their copies are
        # reset instead, so capture leaves the example's .grad fields as they were.
        params = (p for group in optimizer.param_groups for p in group["params"])
        record(params, set_to_none, f"the optimizer {type(optimizer).__name__}")

    def refuse_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
        if threading.get_ident() != tracing_thread:
            return
        if any(optimizer is lifted for lifted in stepping):
            stepped.add(id(optimizer))
            return
        raise _step_refused(optimizer)

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _routed(torch.nn.Module, "zero_grad", module_zero_grad, tracing_thread)
        )
        stack.enter_context(
            _routed(
                torch.optim.Optimizer, "zero_grad", optimizer_zero_grad, tracing_thread
            )
        )
        stack.callback(register_optimizer_step_pre_hook(refuse_step).remove)
        yield


def _recorder(
    originals: list[torch.Tensor], copies: list[torch.Tensor], resets: Resets
) -> Callable[[Iterable[torch.Tensor], bool, str], None]:
    """What a ``zero_grad()`` on the parameters ``params`` of ``owner`` does while
    ``fn`` is traced: reset their copies, and record the reset in ``resets``."""
    index_of = {id(t): i for i, t in enumerate(originals)}
    index_of.update({id(t): i for i, t in enumerate(copies)})

    def record(params: Iterable[torch.Tensor], set_to_none: bool, owner: str) -> None:
        for param in params:
            index = index_of.get(id(param))
            if index is None:
                raise PrecompileError(
                    f"the function calls zero_grad() on {owner}, which holds a tensor "
                    f"of shape {tuple(param.shape)} that is not a parameter of a "
                    "module argument, so the artifact could not reset it. Reset that "
                    "tensor's .grad outside the precompiled function."
                )
            convention.reset_grad(copies[index], set_to_none)
            resets[index] = resets.get(index, False) or set_to_none

    return record


def _step_refused(optimizer: torch.optim.Optimizer) -> PrecompileError:
    """Why the traced function may not call ``step()`` on ``optimizer``."""
    name = type(optimizer).__name__
    if type(optimizer) in (*optimizers.SUPPORTED, torch.optim.SparseAdam):
        problem = "which is not an argument of the function"
        fix = "Pass the optimizer to the function as an argument"
    elif isinstance(optimizer, torch.optim.LBFGS):
        problem = (
            "whose step(closure) calls the closure, a forward and backward, as many "
            "times as its line search decides, which one captured graph cannot hold"
        )
        fix = "Precompile the closure's forward and backward instead"
    else:
        problem = (
            "whose step the artifact cannot capture (it captures those of "
            f"{', '.join(cls.__name__ for cls in optimizers.SUPPORTED)})"
        )
        fix = "Use one of those"
    return PrecompileError(
        f"the function calls step() on the optimizer {name}, {problem}. {fix}, "
        "or call the optimizer after the precompiled function: "
        "loss = step(model, *inputs); optimizer.step()."
    )


@contextlib.contextmanager
def _routed(
    owner: type, name: str, replacement: Callable[..., None], thread: int
) -> Generator[None]:
    """Route ``owner.name`` to ``replacement`` for calls made on ``thread``."""
    real: Callable[..., Any] = getattr(owner, name)

    def method(self: object, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() != thread:
            return real(self, *args, **kwargs)
        return replacement(self, *args, **kwargs)

    setattr(owner, name, method)
    try:
        yield
    finally:
        setattr(owner, name, real)
