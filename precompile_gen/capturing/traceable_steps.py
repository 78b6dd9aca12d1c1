"""The steps of the optimizers that have no ``capturable`` formulation, made traceable.

Adagrad's and Adafactor's steps read numbers eager keeps in tensors (the step count,
and Adafactor's norms of the parameter and of its update) with ``.item()``, which a
trace cannot follow from one call to the next. While ``fn`` is traced
(``optimizers.stepping_copies``) they compute the same math on the tensors themselves:

- Adagrad: its foreach step (``FOREACH``). Its reads of the step count go through
  ``_get_value``, which returns the tensor while ``torch.compiler.is_compiling()`` (as
  during the trace), so ``clr = lr / (1 + (step - 1) * lr_decay)`` is a tensor, which
  the foreach update multiplies by; the single-tensor step passes it to
  ``addcdiv_(value=...)``, which takes a number.
- Adafactor: ``adafactor`` below (``traceable`` puts it in place of torch's), eager's
  single-tensor step line for line, with ``min``/``max`` of numbers as
  ``minimum``/``clamp`` of 0-dim tensors.

Each computes eager's update up to floating-point rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable
from typing import Any, cast

import torch
from torch.optim import _adafactor

# Those whose foreach step, traced, computes their update with tensors.
FOREACH = (torch.optim.Adagrad,)


@contextlib.contextmanager
def traceable(optimizers: Iterable[torch.optim.Optimizer]) -> Generator[None]:
    """While ``fn`` is traced: an Adafactor among ``optimizers`` steps with
    ``adafactor`` below. Only a module attribute of ``torch.optim`` changes, and is
    put back."""
    if not any(
        isinstance(optimizer, torch.optim.Adafactor) for optimizer in optimizers
    ):
        yield
        return
    # Adafactor.step calls its module's adafactor().
    original = _adafactor.adafactor
    cast(Any, _adafactor).adafactor = adafactor
    try:
        yield
    finally:
        cast(Any, _adafactor).adafactor = original


def adafactor(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    row_vars: list[torch.Tensor | None],
    col_vars: list[torch.Tensor | None],
    variances: list[torch.Tensor | None],
    state_steps: list[torch.Tensor],
    foreach: bool | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    has_complex: bool = False,
    *,
    d: float,
    lr: torch.Tensor,
    beta2_decay: float,
    weight_decay: float,
    eps1: float | None,
    eps2: float,
    maximize: bool,
) -> None:
    """``torch.optim._adafactor._single_tensor_adafactor`` (eager's step whatever
    ``foreach`` says: the two compute the same update), with ``lr`` the trace's 0-dim
    tensor and the numbers it reads with ``.item()`` kept in 0-dim tensors. The
    comments quote the eager lines each statement stands for."""
    if grad_scale is not None or found_inf is not None:
        raise AssertionError("Grad scaling should occur outside of optimizer.step()")
    for param, grad, row_var, col_var, variance, step_t in zip(
        params, grads, row_vars, col_vars, variances, state_steps, strict=True
    ):
        grad = -grad if maximize else grad
        if eps1 is None:
            # As eager: the first parameter's dtype sets it for the group.
            eps1 = torch.finfo(param.dtype).eps
        # step_t += 1; step_float = step_t.item()
        step_t += 1
        # one_minus_beta2_t = step_float**beta2_decay, applied as lerp_'s weight,
        # which eager's kernel rounds to the parameter's dtype
        weight = (step_t**beta2_decay).to(param.device, param.dtype)
        # rho_t = min(lr, 1 / (step_float**0.5))
        rho_t = torch.minimum(lr, 1 / step_t**0.5)
        # alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho_t
        norm = param.norm(2).to(rho_t.dtype)
        alpha = (norm / param.numel() ** 0.5).clamp(min=eps2) * rho_t
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        var_estimate = _variance(grad, row_var, col_var, variance, weight, eps1)
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        # denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
        norm = update.norm(2).to(alpha.dtype)
        denom = (norm / ((update.numel() ** 0.5) * d)).clamp(min=1.0)
        # param.add_(update, alpha=-alpha / denom)
        param.add_(update * (-alpha / denom).to(param.dtype))


def _variance(
    grad: torch.Tensor,
    row_var: torch.Tensor | None,
    col_var: torch.Tensor | None,
    variance: torch.Tensor | None,
    weight: torch.Tensor,
    eps1: float,
) -> torch.Tensor:
    """The second moments updated in place (eager's lines, but for lerp_'s weight, a
    tensor here), and the variance estimate the update divides by."""
    if grad.dim() > 1:
        assert row_var is not None and col_var is not None
        row_mean = (
            torch.linalg.vector_norm(grad, dim=-1, keepdim=True)
            .square_()
            .div_(grad.size(-1))
        )
        row_var.lerp_(row_mean, weight)
        col_mean = (
            torch.linalg.vector_norm(grad, dim=-2, keepdim=True)
            .square_()
            .div_(grad.size(-2))
        )
        col_var.lerp_(col_mean, weight)
        var_estimate = row_var @ col_var
        return var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    assert variance is not None
    variance.lerp_(grad * grad, weight)
    # avoid writing into variance during update
    return variance.clone()
