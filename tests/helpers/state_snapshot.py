"""A snapshot of every tensor a call could touch, to prove later that nothing changed:
the tests' check that a rejected capture or call leaves the model, its buffers, its
``.grad`` fields and the inputs exactly as they were."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import precompile_gen as pg

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@dataclass(frozen=True)
class _TensorState:
    tensor: torch.Tensor
    value: torch.Tensor
    version: int
    requires_grad: bool
    grad: torch.Tensor | None
    grad_value: torch.Tensor | None
    grad_version: int | None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _TensorState:
        grad = tensor.grad
        return cls(
            tensor=tensor,
            value=tensor.detach().clone(),
            version=tensor._version,
            requires_grad=tensor.requires_grad,
            grad=grad,
            grad_value=None if grad is None else grad.detach().clone(),
            grad_version=None if grad is None else grad._version,
        )

    def assert_same(self, name: str, tensor: torch.Tensor) -> None:
        assert tensor is self.tensor, f"{name} was replaced by another tensor"
        assert tensor._version == self.version, f"{name} was written in place"
        assert tensor.requires_grad == self.requires_grad, (
            f"{name}.requires_grad changed"
        )
        _assert_equal(tensor.detach(), self.value, f"{name} changed value")
        assert tensor.grad is self.grad, f"{name}.grad was replaced or set"
        if self.grad is not None:
            assert self.grad_value is not None
            assert self.grad._version == self.grad_version, f"{name}.grad was written"
            _assert_equal(self.grad, self.grad_value, f"{name}.grad changed")


def _assert_equal(actual: torch.Tensor, expected: torch.Tensor, message: str) -> None:
    if actual.device.type == "meta":
        # Meta tensors have no values; the version counter still catches writes.
        assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype), message
        return
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=message)


def named_tensors(args: Iterable[object]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (tied aliases included) of the module arguments and
    every tensor leaf of the other arguments, by a readable name."""
    found: dict[str, torch.Tensor] = {}
    for position, arg in enumerate(args):
        if isinstance(arg, nn.Module):
            members = itertools.chain(
                arg.named_parameters(remove_duplicate=False),
                arg.named_buffers(remove_duplicate=False),
            )
            for name, tensor in members:
                found[f"argument {position}: {name}"] = tensor
            continue
        # By leaf index: not every registered pytree type has key paths.
        for index, leaf in enumerate(pytree.tree_leaves(arg)):
            if isinstance(leaf, torch.Tensor):
                found[f"argument {position}, leaf {index}"] = leaf
    return found


class StateSnapshot:
    """The state of some models and inputs, to prove later that nothing changed."""

    def __init__(self, *objects: object) -> None:
        self._objects = objects
        self._states = {
            name: _TensorState.of(tensor)
            for name, tensor in named_tensors(objects).items()
        }

    def assert_unchanged(self) -> None:
        now = named_tensors(self._objects)
        assert list(now) == list(self._states), "the set of tensors changed"
        for name, tensor in now.items():
            self._states[name].assert_same(name, tensor)


def assert_same_state(
    actual: nn.Module,
    expected: nn.Module,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """``actual``'s parameters, buffers and ``.grad`` fields equal ``expected``'s
    (within ``rtol`` and ``atol`` as assert_close takes them; its defaults by
    default)."""
    got, want = named_tensors([actual]), named_tensors([expected])
    assert list(got) == list(want), "the models have different members"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], msg=name, rtol=rtol, atol=atol
        )
        if want[name].grad is None:
            assert got[name].grad is None, f"{name}.grad was set"
        else:
            assert got[name].grad is not None, f"{name}.grad is missing"
            torch.testing.assert_close(
                got[name].grad,
                want[name].grad,
                msg=f"{name}.grad",
                rtol=rtol,
                atol=atol,
            )


def clone_with_grads(model: ModuleT) -> ModuleT:
    """A deep copy with copies of the ``.grad`` fields, which deepcopy leaves out."""
    clone = copy.deepcopy(model)
    originals = dict(model.named_parameters())
    for name, param in clone.named_parameters():
        grad = originals[name].grad
        param.grad = None if grad is None else grad.clone()
    return clone


def assert_call_rejected(
    forward: Callable[..., object],
    *args: object,
    match: Iterable[str],
    also_unchanged: Iterable[object] = (),
) -> str:
    """``forward(*args)`` raises PrecompileError whose message contains every string
    in ``match``; ``args`` and ``also_unchanged`` are untouched. Returns the message."""
    snapshot = StateSnapshot(*args, *also_unchanged)
    with pytest.raises(pg.PrecompileError) as caught:
        forward(*args)
    message = str(caught.value)
    for text in match:
        assert text in message, f"{text!r} not in the message: {message}"
    snapshot.assert_unchanged()
    return message
