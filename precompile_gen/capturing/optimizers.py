"""Optimizer arguments: an optimizer's ``step()`` inside the traced function.

An optimizer of a class in ``SUPPORTED`` passed as an argument is lifted like a
module: its per-parameter state tensors become graph inputs, after the input leaves,
and one
0-dim ``lr`` tensor per param group follows them, so that a learning-rate schedule
keeps working without a recapture. While ``fn`` is traced the optimizer steps the
trace's copies of the parameters and of its state, never the example's own.

The step is traced as torch's ``capturable`` formulation, which keeps the step count
and the bias corrections in tensors: the default one turns them into Python numbers
(``.item()``), which a trace cannot follow from one call to the next. Both compute
the same update up to floating-point rounding, as does an optimizer built with
``fused=True``, whose step is traced unfused. Adagrad and Adafactor have no
capturable formulation: ``traceable_steps`` makes theirs traceable.

A parameter without state gets what the optimizer's first step creates, at capture
(``_first_state``) as in the artifact at each call: zeros, but where ``_first_fills``
records a number (NAdam's ``mu_product``, ASGD's ``mu``) or the group's ``lr`` at that
step (ASGD's ``eta``, Rprop's ``step_size``).

Any other optimizer stays an opaque argument: ``zero_grad()`` on it is replayed, as
for every optimizer, and ``step()`` on it is refused (``grad_resets``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Container, Generator
from dataclasses import dataclass
from typing import Any, cast

import torch

from precompile_gen.capture_result import (
    OptimizerArgument,
    OptimizerStateTensor,
    ParamGroup,
)
from precompile_gen.capturing import hyperparameters, traceable_steps
from precompile_gen.runtime.errors import PrecompileError

SUPPORTED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.NAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adafactor,
)
# Group values that change nothing in the update the graph computes: ``lr`` is an
# input of each call, and the capturable formulation is traced whatever the flags
# say; ``foreach`` and ``fused`` only pick how eager's kernels loop over the
# parameters (the traced update is the single-tensor or foreach one, unfused), so
# the graph's update equals a fused eager step's within floating-point rounding.
_UNCHECKED_OPTIONS = ("lr", "capturable", "foreach", "fused")
# Optimizers whose single-tensor step reads a tensor ``lr`` as a Python number
# (``value=-lr``), which a trace cannot follow from one call to the next: their
# foreach step, which computes the same update with the ``lr`` tensor, is traced.
_TENSOR_LR_IN_FOREACH_ONLY = (
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    *traceable_steps.FOREACH,
)
# Optimizers whose step reads ``lr`` only where their first step creates the state
# (Rprop's initial step sizes): the graph has the lr input but never reads it.
LR_AT_FIRST_STEP_ONLY = ("Rprop",)
# State a step keeps as one number per parameter (0-dim, in the step count's dtype).
_SCALAR_KEYS = ("step", "mu_product", "eta", "mu")


@dataclass
class LiftedOptimizer:
    """An optimizer argument as the trace uses it (still holding torch objects)."""

    optimizer: torch.optim.Optimizer
    argument: OptimizerArgument
    # The tensors the trace starts from, aligned with ``argument.state``: copies of
    # the example optimizer's state, or zeros where it has none yet.
    state: list[torch.Tensor]
    # Per group, the numbers its step may read at each call (``hyperparameters``),
    # and what the traced step did with them.
    candidates: list[list[tuple[str, int | None]]]
    reads: hyperparameters.Reads


def is_supported(value: object) -> bool:
    return type(value) in SUPPORTED


def lift(
    optimizer: torch.optim.Optimizer,
    position: int,
    params: list[torch.Tensor],
    sparse: Container[int] = (),
    *,
    where: str,
) -> LiftedOptimizer:
    """The optimizer at ``position`` (``where``, as messages name it), whose
    parameters must be among the module arguments' ``params`` (the lifted parameters,
    in PARAM_NAMES order). Those in ``sparse`` (indices) get sparse gradients, which
    the driver steps: their state is no graph input."""
    name = type(optimizer).__name__
    index_of = {id(param): index for index, param in enumerate(params)}
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise PrecompileError(
            f"the optimizer {name} at {where} has step hooks "
            "(register_step_pre_hook / register_step_post_hook), Python code that "
            "the captured step would run only once, at capture. Remove the hooks, "
            "or call the optimizer after the precompiled function."
        )
    groups = []
    candidates = []
    numbers = [key for key in optimizer.defaults if key not in _UNCHECKED_OPTIONS]
    for number, group in enumerate(optimizer.param_groups):
        candidates.append(hyperparameters.candidates(group, numbers))
        indices = _group_indices(group, number, index_of, name, where)
        lr = _lr(group, params, indices)
        groups.append(
            ParamGroup(
                indices,
                _options(optimizer, group, number),
                lr,
                values=[],
                # Eager computes with these numbers in double precision, as with lr.
                values_dtype=str(_widest_float(torch.device(lr[1]))),
                guards=[],
            )
        )
    state, tensors = _first_states(optimizer, groups, params, sparse, where)
    return LiftedOptimizer(
        optimizer,
        OptimizerArgument(
            position,
            name,
            groups,
            steps=False,
            state=state,
            first_state=_first_fills(optimizer),
        ),
        tensors,
        candidates,
        hyperparameters.Reads(),
    )


def _group_indices(
    group: dict[str, Any], number: int, index_of: dict[int, int], name: str, where: str
) -> list[int]:
    """The indices (into PARAM_NAMES) of a param group's parameters."""
    indices = []
    for param in group["params"]:
        index = index_of.get(id(param))
        if index is None:
            raise PrecompileError(
                f"param group {number} of the optimizer {name} at {where} "
                f"holds a tensor of shape {tuple(param.shape)} that is "
                "not a parameter of a module argument, so the artifact could not "
                "pass it to the graph. Build the optimizer from the parameters "
                "of the modules passed to the function."
            )
        indices.append(index)
    return indices


def _first_states(
    optimizer: torch.optim.Optimizer,
    groups: list[ParamGroup],
    params: list[torch.Tensor],
    sparse: Container[int],
    where: str,
) -> tuple[list[OptimizerStateTensor], list[torch.Tensor]]:
    """The state of each parameter the graph steps (``_first_state``), as graph
    inputs: each tensor's record, and the tensors."""
    state: list[OptimizerStateTensor] = []
    tensors: list[torch.Tensor] = []
    for group, lifted in zip(optimizer.param_groups, groups, strict=True):
        for index in lifted.params:
            param = params[index]
            if not param.requires_grad or index in sparse:
                # Never a step in the graph: no gradient, or a sparse one.
                continue
            for key, tensor in _first_state(optimizer, group, param, where).items():
                state.append(
                    OptimizerStateTensor(
                        index,
                        key,
                        tuple(tensor.shape),
                        str(tensor.dtype),
                        str(tensor.device),
                    )
                )
                tensors.append(tensor)
    return state, tensors


def _options(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], number: int
) -> dict[str, object]:
    name = type(optimizer).__name__
    options = {}
    for key in optimizer.defaults:
        if key in _UNCHECKED_OPTIONS:
            continue
        value = group.get(key)
        if isinstance(value, tuple | list):
            value = tuple(_plain(name, number, key, v) for v in value)
        else:
            value = _plain(name, number, key, value)
        options[key] = value
    if options.get("differentiable"):
        raise PrecompileError(
            f"param group {number} of the optimizer {name} has differentiable=True; "
            "an artifact's step is not differentiated through. Build the optimizer "
            "without it."
        )
    return options


def _plain(name: str, number: int, key: str, value: object) -> object:
    # The value is built into the graph and compared at every call: it must be a
    # literal the artifact can write down and compare.
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise PrecompileError(
        f"param group {number} of the optimizer {name} has {key}={value!r} (a "
        f"{type(value).__name__}), which the trace would build into the graph as a "
        "constant the artifact cannot check. Pass a Python number."
    )


def _lr(
    group: dict[str, Any], params: list[torch.Tensor], indices: list[int]
) -> tuple[str, str]:
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise PrecompileError(
            f"an optimizer's lr is a tensor of shape {tuple(lr.shape)}; it must be a "
            "number or a one-element tensor."
        )
    device = params[indices[0]].device if indices else torch.device("cpu")
    # Eager's step computes with a number lr as a Python float, in double precision
    # (a tensor lr in its own dtype): a float32 lr would round the update of a
    # float64 parameter.
    if isinstance(lr, torch.Tensor):
        return str(lr.dtype), str(device)
    return str(_widest_float(device)), str(device)


def _widest_float(device: torch.device) -> torch.dtype:
    # MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def _first_state(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    param: torch.Tensor,
    where: str,
) -> dict[str, torch.Tensor]:
    """Copies of ``param``'s state, or what the optimizer's first step creates for it
    (``_fresh``), which the first update treats as eager's fresh state."""
    name = type(optimizer).__name__
    keys = _state_keys(optimizer, group, param)
    existing = optimizer.state.get(param)
    if not existing:
        fills = _first_fills(optimizer)
        return {
            key: _fresh(key, param, fills.get(key, 0.0), group["lr"]) for key in keys
        }
    if list(existing) != keys or not all(
        isinstance(value, torch.Tensor) for value in existing.values()
    ):
        raise PrecompileError(
            f"the optimizer {name} at {where} holds state "
            f"{sorted(existing)} for a parameter of shape {tuple(param.shape)}, where "
            f"its step keeps the tensors {keys}. Capture with an optimizer "
            f"whose state {name} itself created (or a fresh one)."
        )
    return {key: value.detach().clone() for key, value in existing.items()}


def _fresh(
    key: str, param: torch.Tensor, fill: float | str, lr: object
) -> torch.Tensor:
    """The tensor ``key`` of ``param``'s state as its optimizer's first step creates it
    (``_init_group`` of each class in torch.optim): 0-dim for a number the step keeps,
    Adafactor's factored second moments, otherwise like the parameter; filled with
    ``fill`` (``_first_fills``), ``lr`` where it says so."""
    if key in _SCALAR_KEYS:
        tensor = torch.zeros((), dtype=_scalar_dtype(), device=param.device)
    elif key in ("row_var", "col_var"):
        shape = list(param.shape)
        shape[-1 if key == "row_var" else -2] = 1
        tensor = param.new_zeros(shape)
    else:
        tensor = torch.zeros_like(param)
    value = float(cast(Any, lr)) if fill == "lr" else float(fill)
    if value != 0:
        tensor.fill_(complex(value, value) if tensor.is_complex() else value)
    return tensor


def _first_fills(optimizer: torch.optim.Optimizer) -> dict[str, float | str]:
    """What the first step fills each state key with, where not zeros: a number, or
    "lr" for the group's lr at that step (the runtime creates the same)."""
    if isinstance(optimizer, torch.optim.NAdam):
        return {"mu_product": 1.0}
    if isinstance(optimizer, torch.optim.ASGD):
        # eta is the lr in the step count's dtype, as eager's as_tensor makes it.
        return {"eta": "lr", "mu": 1.0}
    if isinstance(optimizer, torch.optim.Rprop):
        return {"step_size": "lr"}
    if isinstance(optimizer, torch.optim.Adagrad):
        # Its constructor's value for every group (a group's own is never read).
        value = float(optimizer.defaults["initial_accumulator_value"])
        return {"sum": value} if value else {}
    return {}


def _state_keys(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor
) -> list[str]:
    """The state a step keeps per parameter, in the order its first step creates it
    (``_fresh`` creates each)."""
    if isinstance(optimizer, torch.optim.SGD):
        return ["momentum_buffer"] if group["momentum"] != 0 else []
    if isinstance(optimizer, torch.optim.Adamax):
        return ["step", "exp_avg", "exp_inf"]
    if isinstance(optimizer, torch.optim.RMSprop):
        keys = ["step", "square_avg"]
        keys += ["momentum_buffer"] if group["momentum"] > 0 else []
        return [*keys, "grad_avg"] if group["centered"] else keys
    if isinstance(optimizer, torch.optim.Adadelta):
        return ["step", "square_avg", "acc_delta"]
    if isinstance(optimizer, torch.optim.NAdam):
        return ["step", "mu_product", "exp_avg", "exp_avg_sq"]
    if isinstance(optimizer, torch.optim.ASGD):
        return ["step", "eta", "mu", "ax"]
    if isinstance(optimizer, torch.optim.Rprop):
        return ["step", "prev", "step_size"]
    if isinstance(optimizer, torch.optim.Adagrad):
        return ["step", "sum"]
    if isinstance(optimizer, torch.optim.Adafactor):
        # Factored over the last two dimensions where there are two.
        factored = param.dim() > 1
        return ["step", "row_var", "col_var"] if factored else ["step", "variance"]
    keys = ["step", "exp_avg", "exp_avg_sq"]  # Adam, AdamW, RAdam
    return [*keys, "max_exp_avg_sq"] if group.get("amsgrad") else keys


def _scalar_dtype() -> torch.dtype:
    # The dtype torch's optimizers keep their step counts in.
    return (
        torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    )


@contextlib.contextmanager
def stepping_copies(
    lifted: list[LiftedOptimizer],
    param_copies: list[torch.Tensor],
    state_copies: list[torch.Tensor],
    lrs: list[torch.Tensor],
    values: list[torch.Tensor],
) -> Generator[None]:
    """While ``fn`` is traced: each optimizer holds the trace's copies of its
    parameters (``param_copies``, in PARAM_NAMES order), of its state
    (``state_copies``, all optimizers' in order), its groups' ``lr`` tensors
    (``lrs``) and, for each group with numbers its step may read at each call, the
    values tensor that carries them (``values``, see ``hyperparameters``); it steps
    with the capturable formulation, or the traceable one of ``traceable_steps``.
    Everything is put back."""
    state_iter = iter(state_copies)
    lr_iter = iter(lrs)
    values_iter = iter(values)
    widened = _WidenedCounts()
    saved = []
    for entry in lifted:
        optimizer = entry.optimizer
        saved.append(
            (
                optimizer.state,
                [dict(group) for group in optimizer.param_groups],
                vars(optimizer).get("_opt_called"),
            )
        )
        traced_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for spec in entry.argument.state:
            tensor = next(state_iter)
            if spec.key == "step":
                tensor = widened.count(tensor)
            traced_state[param_copies[spec.param]][spec.key] = tensor
        optimizer.state = traced_state
        groups = zip(
            optimizer.param_groups, entry.argument.groups, entry.candidates, strict=True
        )
        for number, (group, spec, candidates) in enumerate(groups):
            group["params"] = [param_copies[index] for index in spec.params]
            group["lr"] = next(lr_iter)
            if candidates:
                _hyperparameters_in(group, number, candidates, next(values_iter), entry)
            _traceable_formulation(optimizer, group)
    try:
        with traceable_steps.traceable(entry.optimizer for entry in lifted):
            yield
        widened.write_back()
    finally:
        for entry, (state, groups, opt_called) in zip(lifted, saved, strict=True):
            _put_back(entry.optimizer, state, groups, opt_called)


def _put_back(
    optimizer: torch.optim.Optimizer,
    state: Any,
    groups: list[dict[str, Any]],
    opt_called: object,
) -> None:
    """The example optimizer as it was before the trace stepped its copies."""
    optimizer.state = state
    for group, original in zip(optimizer.param_groups, groups, strict=True):
        group.clear()
        group.update(original)
    # A learning-rate scheduler's wrapper of step() marks the optimizer as
    # stepped; the trace's step was no step of the example's.
    if opt_called is None:
        vars(optimizer).pop("_opt_called", None)
    else:
        cast(Any, optimizer)._opt_called = opt_called


def _traceable_formulation(
    optimizer: torch.optim.Optimizer, group: dict[str, Any]
) -> None:
    """Have ``group`` step with the formulation a trace can follow."""
    group["capturable"] = True
    if isinstance(optimizer, _TENSOR_LR_IN_FOREACH_ONLY):
        group["foreach"] = True
    # The fused kernel is one opaque op per step; its unfused formulation is what a
    # trace can follow (and Inductor fuses again).
    if group.get("fused"):
        group["fused"] = False


def _hyperparameters_in(
    group: dict[str, Any],
    number: int,
    candidates: list[tuple[str, int | None]],
    values: torch.Tensor,
    entry: LiftedOptimizer,
) -> None:
    """Put in ``group`` (group ``number``) a Hyperparameter for each of its
    ``candidates``, carried by its element of ``values``."""
    for position, (key, index) in enumerate(candidates):
        source = (number, key, index)
        value = group[key] if index is None else group[key][index]
        hyperparameter = hyperparameters.Hyperparameter(
            values[position], value, frozenset([source]), entry.reads, source
        )
        if index is None:
            group[key] = hyperparameter
        else:
            items = list(group[key])
            items[index] = hyperparameter
            group[key] = tuple(items) if isinstance(group[key], tuple) else items


def value_tensors(lifted: list[LiftedOptimizer]) -> list[torch.Tensor]:
    """For each group (of each optimizer) with numbers its step may read at each
    call, the example's values, as the 1-D tensor the trace reads them from: on the
    group's lr device, in its ``values_dtype``."""
    tensors = []
    for entry in lifted:
        for group, spec, candidates in zip(
            entry.optimizer.param_groups,
            entry.argument.groups,
            entry.candidates,
            strict=True,
        ):
            if not candidates:
                continue
            numbers = [
                float(group[key] if index is None else group[key][index])
                for key, index in candidates
            ]
            dtype = getattr(torch, spec.values_dtype.removeprefix("torch."))
            tensors.append(torch.tensor(numbers, dtype=dtype, device=spec.lr[1]))
    return tensors


def traced_group(
    group: ParamGroup,
    number: int,
    candidates: list[tuple[str, int | None]],
    reads: hyperparameters.Reads,
    values_read: bool,
) -> ParamGroup:
    """``group`` as the traced step used its numbers (``candidates``, read at each
    call from the values tensor if the graph reads it, ``values_read``): those it
    read as plain numbers stay options, checked by value; the others leave the
    options, and what they decided about the structure becomes guards."""
    baked = {key for (g, key, _) in reads.baked if g == number}
    free = {key for key, _ in candidates} - baked
    guards = [
        (key, index, name, other, outcome)
        for (g, key, index), name, other, outcome in reads.guards
        if g == number and key in free
    ]
    return group._replace(
        options={k: v for k, v in group.options.items() if k not in free},
        values=candidates if values_read else [],
        guards=guards,
    )


class _WidenedCounts:
    """The step counts the traced step reads, as float64 copies of the state.

    Eager's step reads its count as a Python number (``.item()``) and computes the
    bias corrections in double precision; the capturable formulation computes them
    in the count's dtype, float32, which would round the update of a float64
    parameter (and, less, of a float32 one). A count is an integer, exact in both
    dtypes; the state keeps eager's dtype, so the step's increment is written back.
    """

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def count(self, state: torch.Tensor) -> torch.Tensor:
        wide = _widest_float(state.device)
        if state.dtype == wide:
            return state
        copy = state.to(wide)
        self.pairs.append((state, copy))
        return copy

    def write_back(self) -> None:
        # Every count, stepped or not (a foreach step does not bump the version
        # counter); ``state_read`` erases the writes of counts no step touched.
        for state, copy in self.pairs:
            state.copy_(copy)


def state_read(graph: torch.fx.Graph, placeholder: torch.fx.Node) -> bool:
    """Whether the traced step read the state tensor input ``placeholder``. A float64
    copy of a step count that no step read (``fn`` did not step, or the parameter
    got no gradient), and its write back, are erased first, so that its count is no
    input."""
    for user in list(placeholder.users):
        if user.target is torch.ops.aten._to_copy.default and all(
            write.target is torch.ops.aten.copy_.default
            and write.args == (placeholder, user)
            and not write.users
            for write in user.users
        ):
            for write in list(user.users):
                graph.erase_node(write)
            graph.erase_node(user)
    return bool(placeholder.users)


def values_read(graph: torch.fx.Graph, placeholder: torch.fx.Node) -> bool:
    """Whether the traced step computed with the values tensor ``placeholder``. Each
    of its numbers is selected from it as the trace begins; a selection nothing read
    is erased first."""
    for user in list(placeholder.users):
        if not user.users:
            graph.erase_node(user)
    return bool(placeholder.users)


def lr_tensors(lifted: list[LiftedOptimizer]) -> list[torch.Tensor]:
    """The example's ``lr`` of each group of each optimizer, as the trace's input.

    It requires grad so that SGD takes its tensor-``lr`` path (``addcmul_``) rather
    than ``add_(alpha=lr)``, which would read the value with ``.item()``; the step
    runs without grad, so nothing is recorded for it."""
    tensors = []
    for entry in lifted:
        for group, spec in zip(
            entry.optimizer.param_groups, entry.argument.groups, strict=True
        ):
            dtype, device = spec.lr
            value = group["lr"]
            if isinstance(value, torch.Tensor):
                value = value.detach().reshape(()).item()
            tensors.append(
                torch.tensor(
                    float(value),
                    dtype=getattr(torch, dtype.removeprefix("torch.")),
                    device=device,
                    requires_grad=True,
                )
            )
    return tensors
