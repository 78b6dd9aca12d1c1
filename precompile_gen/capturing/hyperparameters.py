"""An optimizer's numeric hyperparameters as inputs of each call, not constants.

A param group's ``betas``, ``eps``, ``weight_decay``, ``momentum`` and the like are
Python numbers, which a trace would build into the graph: a schedule that moves one
(``OneCycleLR`` cycles ``betas[0]`` or ``momentum``) would then need a capture per
value. So while the step is traced, each is a :class:`Hyperparameter` instead: its
value, and a 0-dim tensor read from the group's values input, which the driver
fills from the group at every call.

Arithmetic on a hyperparameter (``1 - beta1``, ``lr * weight_decay``) computes both
the number and the tensor, so what the step derives from it stays a graph input too;
a torch op that receives one (``exp_avg.mul_(beta2)``, ``add_(grad,
alpha=weight_decay)``) gets the tensor, moved into a tensor operand where the op
takes only a number there (``substituted``: a hyperparameter has
``__torch_function__``, so torch hands it every op that receives one). What a
hyperparameter decides about the step's structure is recorded instead (``Reads``):

- a comparison with a number (``if weight_decay != 0``, ``momentum > 0``) is a
  guard, checked at every call: a value on the other side changes the structure;
- anything that reads it as a plain number (``float()``, ``math.sqrt``, an op that
  would not take the tensor) bakes it: it is checked by value at every call, as
  the group's other values are.

A hyperparameter is no ``float``, so no code can read its value without going
through one of these: anything else fails loudly, never bakes a value unchecked.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from precompile_gen.capturing.data_dependent import DataDependentError

# A group's hyperparameter: (group number, key, index in a tuple value or None).
Source = tuple[int, str, int | None]
# A comparison the traced step made: the source, the operator's name, the number it
# was compared with, and the outcome.
Guard = tuple[Source, str, float, bool]

COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}


@dataclass
class Reads:
    """What the traced step did with one optimizer's hyperparameters beyond
    computing with them."""

    # Read as plain numbers: checked by value at every call.
    baked: set[Source] = field(default_factory=set)
    guards: list[Guard] = field(default_factory=list)

    def guard(self, source: Source, name: str, other: float, outcome: object) -> None:
        entry = (source, name, float(other), bool(outcome))
        if entry not in self.guards:
            self.guards.append(entry)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Hyperparameter:
    """A group's numeric value (or one derived from such values) while the step is
    traced: the number, and the tensor that carries it in the graph."""

    __slots__ = ("reads", "source", "sources", "tensor", "value")

    def __init__(
        self,
        tensor: torch.Tensor,
        value: float,
        sources: frozenset[Source],
        reads: Reads,
        source: Source | None = None,
    ) -> None:
        self.tensor = tensor
        self.value = value
        # The group values it was computed from; ``source`` is set for a group's
        # value itself, which a guard can name.
        self.sources = sources
        self.reads = reads
        self.source = source

    # -- computing: the number and the tensor alike ---------------------------------

    def _apply(
        self, op: Callable[[Any, Any], Any], other: object, reverse: bool
    ) -> Any:
        if isinstance(other, torch.Tensor):
            return op(other, self.tensor) if reverse else op(self.tensor, other)
        if isinstance(other, Hyperparameter):
            tensor, value, sources = other.tensor, other.value, other.sources
        elif _is_number(other):
            tensor, value, sources = other, other, frozenset()
        else:
            return NotImplemented
        pair = ((tensor, self.tensor), (value, self.value))
        if not reverse:
            pair = ((self.tensor, tensor), (self.value, value))
        (left, right), (left_value, right_value) = pair
        return Hyperparameter(
            op(left, right),
            op(left_value, right_value),
            self.sources | sources,
            self.reads,
        )

    def __add__(self, other: object) -> Any:
        return self._apply(operator.add, other, False)

    def __radd__(self, other: object) -> Any:
        return self._apply(operator.add, other, True)

    def __sub__(self, other: object) -> Any:
        return self._apply(operator.sub, other, False)

    def __rsub__(self, other: object) -> Any:
        return self._apply(operator.sub, other, True)

    def __mul__(self, other: object) -> Any:
        return self._apply(operator.mul, other, False)

    def __rmul__(self, other: object) -> Any:
        return self._apply(operator.mul, other, True)

    def __truediv__(self, other: object) -> Any:
        return self._apply(operator.truediv, other, False)

    def __rtruediv__(self, other: object) -> Any:
        return self._apply(operator.truediv, other, True)

    def __pow__(self, other: object) -> Any:
        return self._apply(operator.pow, other, False)

    def __rpow__(self, other: object) -> Any:
        return self._apply(operator.pow, other, True)

    def __neg__(self) -> Hyperparameter:
        return Hyperparameter(-self.tensor, -self.value, self.sources, self.reads)

    def __pos__(self) -> Hyperparameter:
        return self

    def __abs__(self) -> Hyperparameter:
        return Hyperparameter(
            self.tensor.abs(), abs(self.value), self.sources, self.reads
        )

    # -- deciding: guards on a group's value, otherwise baked ------------------------

    def _compare(self, name: str, other: object) -> Any:
        op = COMPARISONS[name]
        if isinstance(other, torch.Tensor):
            return op(self.tensor, other)
        if isinstance(other, Hyperparameter):
            self.reads.baked |= self.sources | other.sources
            return op(self.value, other.value)
        if not isinstance(other, int | float) or isinstance(other, bool):
            return NotImplemented
        outcome = op(self.value, other)
        if self.source is not None:
            self.reads.guard(self.source, name, float(other), outcome)
        else:
            self.reads.baked |= self.sources
        return outcome

    def __eq__(self, other: object) -> Any:  # type: ignore[override]
        return self._compare("eq", other)

    def __ne__(self, other: object) -> Any:  # type: ignore[override]
        return self._compare("ne", other)

    def __lt__(self, other: object) -> Any:
        return self._compare("lt", other)

    def __le__(self, other: object) -> Any:
        return self._compare("le", other)

    def __gt__(self, other: object) -> Any:
        return self._compare("gt", other)

    def __ge__(self, other: object) -> Any:
        return self._compare("ge", other)

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return bool(self._compare("ne", 0))

    def plain(self) -> float:
        """The number, read as the step's code reads a plain number: baked."""
        self.reads.baked |= self.sources
        return self.value

    def __float__(self) -> float:
        return float(self.plain())

    def __int__(self) -> int:
        return int(self.plain())

    def __index__(self) -> int:
        return operator.index(self.plain())  # type: ignore[arg-type]

    def __round__(self, digits: int | None = None) -> Any:
        return round(self.plain(), digits)

    def __trunc__(self) -> int:
        return math.trunc(self.plain())

    def __floor__(self) -> int:
        return math.floor(self.plain())

    def __ceil__(self) -> int:
        return math.ceil(self.plain())

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # torch hands any op that receives a hyperparameter, in any argument, here.
        return substituted(func, args, kwargs)

    def __repr__(self) -> str:
        # Messages and warnings that show the value decide nothing.
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# Keyword arguments ops take only as numbers, each scaling one tensor operand (by
# its position): ``add(x, y, alpha=a)`` is ``add(x, y * a)``, ``addcmul(x, t1, t2,
# value=v)`` is ``addcmul(x, t1 * v, t2)``; likewise for their in-place and foreach
# forms.
_SCALING_KEYWORDS = {"alpha": 1, "value": 1}
# Foreach ops whose fourth operand, a number, scales ``tensor1`` as ``value=``
# does (``_foreach_addcdiv_(params, avgs, denoms, -lr)``).
_FOREACH_SCALED = {
    "_foreach_addcmul",
    "_foreach_addcmul_",
    "_foreach_addcdiv",
    "_foreach_addcdiv_",
}
# Ops that would read a hyperparameter as a number into a new tensor.
_NUMBER_READERS = (torch.tensor, torch.as_tensor, torch.scalar_tensor)


def _holds(value: object) -> bool:
    if isinstance(value, Hyperparameter):
        return True
    return isinstance(value, list | tuple) and any(
        isinstance(item, Hyperparameter) for item in value
    )


def _map(value: Any, convert: Callable[[Hyperparameter], Any]) -> Any:
    if isinstance(value, Hyperparameter):
        return convert(value)
    if isinstance(value, list | tuple) and _holds(value):
        return type(value)(_map(item, convert) for item in value)
    return value


def _scaled(operand: object, factor: Hyperparameter) -> object | None:
    """``operand`` times the factor's tensor, for a tensor or a list of them; None
    for anything else."""
    if isinstance(operand, torch.Tensor):
        return operand * factor.tensor
    if isinstance(operand, list | tuple) and all(
        isinstance(item, torch.Tensor) for item in operand
    ):
        return torch._foreach_mul(list(operand), factor.tensor)
    return None


def substituted(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """``func`` called with each hyperparameter among its arguments replaced by its
    tensor; where the op takes only a number there and no tensor operand can carry
    it, by the number, baked."""
    original = dict(kwargs or {})
    if func in _NUMBER_READERS:
        return func(*_map(args, _plain), **_map_kw(original, _plain))
    operands, keywords = _tensor_forms(getattr(func, "__name__", ""), args, original)
    try:
        return func(*_map(tuple(operands), _tensor_of), **_map_kw(keywords, _tensor_of))
    except (TypeError, RuntimeError) as error:
        # The op takes a number here: its arguments were refused (TypeError), or it
        # read the 0-dim tensor as a number, which the trace refuses; either happens
        # while the arguments are parsed, before the op runs.
        if isinstance(error, RuntimeError) and not _read_as_number(error):
            raise
        return func(*_map(args, _plain), **_map_kw(original, _plain))


def _tensor_forms(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """The op's arguments with each hyperparameter that only a number may stand for
    moved where its tensor may: into a list of tensors for a foreach op, into the
    tensor operand a number-only keyword scales."""
    operands, keywords = list(args), dict(kwargs)
    if name in _FOREACH_SCALED and len(operands) == 4:
        scale = operands[3]
        if isinstance(scale, Hyperparameter):
            keywords["value"] = operands.pop()
    if name.startswith("_foreach_"):
        # A number beside lists of tensors (``_foreach_add_(avgs, eps)``,
        # ``_foreach_pow(beta1, steps)``, ``_foreach_lerp_(avgs, grads, weight)``):
        # the op's number form would read a 0-dim tensor as a number, so its tensor
        # goes once per tensor, to the op's list form.
        tensors = next((a for a in operands if isinstance(a, list | tuple)), [])
        operands = [
            [a.tensor] * len(tensors) if isinstance(a, Hyperparameter) else a
            for a in operands
        ]
    for keyword, position in _SCALING_KEYWORDS.items():
        factor = keywords.get(keyword)
        if isinstance(factor, Hyperparameter) and len(operands) > position:
            scaled = _scaled(operands[position], factor)
            if scaled is not None:
                operands[position] = scaled
                del keywords[keyword]
    return operands, keywords


def _read_as_number(error: BaseException) -> bool:
    return isinstance(error, DataDependentError) or "_local_scalar_dense" in str(error)


def _tensor_of(value: Hyperparameter) -> torch.Tensor:
    return value.tensor


def _plain(value: Hyperparameter) -> float:
    return value.plain()


def _map_kw(
    kwargs: dict[str, Any], convert: Callable[[Hyperparameter], Any]
) -> dict[str, Any]:
    return {key: _map(value, convert) for key, value in kwargs.items()}


def is_candidate(value: object) -> bool:
    """Whether a group value is one the step may read at each call: a number, or a
    tuple or list of numbers (``betas``, Rprop's ``etas``)."""
    if isinstance(value, list | tuple):
        return bool(value) and all(_is_number(item) for item in value)
    return _is_number(value)


def candidates(group: dict[str, Any], keys: list[str]) -> list[tuple[str, int | None]]:
    """The group's values among ``keys`` that may be read at each call, one entry per
    number: (key, None) for a number, (key, index) for each of a tuple's."""
    found: list[tuple[str, int | None]] = []
    for key in keys:
        value = group.get(key)
        if not is_candidate(value):
            continue
        if isinstance(value, list | tuple):
            found += [(key, index) for index in range(len(value))]
        else:
            found.append((key, None))
    return found
