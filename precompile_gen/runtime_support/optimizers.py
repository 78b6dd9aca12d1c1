# Runtime support for optimizer arguments: carried after the calls part
# (precompile_gen/runtime_support/calls.py) by every artifact whose capture takes an
# optimizer, from its first "# ---" heading on. The lines above that heading are not
# carried: they import what the rest of the artifact defines, so that ruff and pyrefly
# check this part as a module of its own.
from typing import Any, cast

import torch

from precompile_gen.runtime_support.calls import _STATE_NAMES
from precompile_gen.runtime_support.declarations import (
    _SIGNATURE,
    ARGUMENT_NAMES,
    GRAD_PARAM_INDICES,
    GRAD_RESETS,
    OPTIMIZERS,
)
from precompile_gen.runtime_support.support import (
    _argument,
    _CheckedState,
    _fail,
    _layout_message,
    _listed,
    _same_layout,
)

# --- Optimizer arguments ------------------------------------------------------------
# Each call holds the runtime optimizer to the traced one (class, param groups, values
# built into the graph, state layout), creates the state its first step would, and
# passes the state and each group's lr to the graph, which updates the parameters and
# the state in place. The capture's data comes in at the first call (_optimizers()
# builds an _OptimizerArguments from the metadata); each check returns its message,
# which the functions section 3 calls raise.

# A state tensor's shape, dtype and device as a matching tensor reports them, so
# that it costs one comparison.
_Signature = tuple[torch.Size, Any, torch.device]
_StateLayout = list[tuple[int, list[str], list[_Signature]]]


def _dtype(name: str) -> Any:
    # "torch.float32" -> torch.float32, as the metadata names dtypes.
    return getattr(torch, name.removeprefix("torch."), None)


def _state_layout(state: list[Any]) -> _StateLayout:
    """Per parameter with state (index into PARAM_NAMES): its keys, in the order the
    step creates them, and each tensor's signature."""
    layout: _StateLayout = []
    for index, key, shape, dtype, device, _ in state:
        if not layout or layout[-1][0] != index:
            layout.append((index, [], []))
        layout[-1][1].append(key)
        signature = (torch.Size(shape), _dtype(dtype), torch.device(device))
        layout[-1][2].append(signature)
    return layout


class _Step:
    """One optimizer argument of a call that passed the checks: what its step
    reads, and the state its first step has yet to create."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.fresh: list[int] = []
        # The state created for them, which joins the optimizer's only once the
        # graph has run: a call that fails leaves the optimizer as it was.
        self.created: dict[int, dict[str, torch.Tensor]] = {}


class _OptimizerArguments:
    """The optimizer arguments as the capture recorded them (OPTIMIZERS, by the
    names ARGUMENT_NAMES, the signature and the module state's names give), the
    gradients the graph computes (GRAD_PARAM_INDICES), those the function resets
    (GRAD_RESETS) and the steps the driver takes itself (DEFERRED_STEPS)."""

    def __init__(
        self,
        optimizers: list[dict[str, Any]],
        argument_names: list[str],
        signature: str,
        state_names: list[str],
        grad_param_indices: list[int],
        grad_resets: list[tuple[int, bool]],
        deferred_steps: list[dict[str, Any]],
    ) -> None:
        self.optimizers = optimizers
        self.argument_names = argument_names
        self.signature = signature
        self.state_names = state_names
        self.classes: list[type[torch.optim.Optimizer]] = [
            getattr(torch.optim, optimizer["class"]) for optimizer in optimizers
        ]
        self.layouts = [_state_layout(optimizer["state"]) for optimizer in optimizers]
        self.gradients = set(grad_param_indices)
        # Parameters whose .grad the function resets before its backward, and
        # those it sets to None.
        self.reset = {index for index, _ in grad_resets}
        self.reset_to_none = {index for index, to_none in grad_resets if to_none}
        # Parameters with sparse gradients, which the driver steps after the graph.
        self.deferred = {index for step in deferred_steps for index in step["params"]}

    def checked_steps(
        self, args: tuple[object, ...], tensors: list[torch.Tensor]
    ) -> list[_Step] | str:
        """Each optimizer argument held to the traced one, or the message of the
        first difference; changes nothing."""
        steps = []
        for spec, cls, layout in zip(self.optimizers, self.classes, self.layouts):
            position = spec["position"]
            optimizer = args[position]
            where = _argument(position, self.argument_names)
            if type(optimizer) is not cls:
                return (
                    f"{where} must be a torch.optim.{cls.__name__}, as in the traced "
                    f"call ({self.signature}), but got {type(optimizer).__name__}. "
                    f"Pass that optimizer at position {position}, or capture again "
                    "with this one."
                )
            step = _Step(optimizer)
            subject = f"the {cls.__name__} at {where}"
            problem = self._groups_problem(
                step.optimizer, spec["groups"], tensors, subject
            )
            if problem is None and spec["steps"]:
                problem = self._gradients_problem(spec["groups"], tensors, subject)
            if problem is None:
                problem = self._state_problem(step, spec, layout, tensors, subject)
            if problem is not None:
                return problem
            steps.append(step)
        return steps

    def _groups_problem(
        self,
        optimizer: torch.optim.Optimizer,
        traced_groups: list[dict[str, Any]],
        tensors: list[torch.Tensor],
        subject: str,
    ) -> str | None:
        groups = optimizer.param_groups
        if len(groups) != len(traced_groups):
            return (
                f"{subject} has {len(groups)} param groups, but the traced one had "
                f"{len(traced_groups)}. Build it with the traced groups, or capture "
                "again with this optimizer."
            )
        for number, (group, traced) in enumerate(zip(groups, traced_groups)):
            params, indices = group["params"], traced["params"]
            if len(params) != len(indices) or any(
                param is not tensors[index] for param, index in zip(params, indices)
            ):
                return self._params_message(number, subject, params, indices, tensors)
            for key, value in traced["options"].items():
                now = group.get(key)
                if (tuple(now) if isinstance(now, list) else now) != value:
                    return (
                        f"param group {number} of {subject} has {key}={now!r}, but "
                        f"the traced step was built with {key}={value!r}, which it "
                        "reads as a constant. Set it back, or capture again with "
                        "this value."
                    )
            problem = _values_problem(
                group, traced, f"param group {number} of {subject}"
            )
            if problem is not None:
                return problem
            lr = group["lr"]
            if not (
                isinstance(lr, (int, float))
                or (isinstance(lr, torch.Tensor) and lr.numel() == 1)
            ) or isinstance(lr, bool):
                return (
                    f"param group {number} of {subject} has lr={lr!r}; it must be a "
                    "number or a one-element tensor."
                )
        return None

    def _params_message(
        self,
        number: int,
        subject: str,
        params: list[torch.Tensor],
        indices: list[int],
        tensors: list[torch.Tensor],
    ) -> str:
        # Error path only: each parameter by its name in the model, where it has one.
        names = {
            id(tensor): repr(name) for tensor, name in zip(tensors, self.state_names)
        }
        replaced = _replaced(params, indices, tensors, names)
        if replaced:
            return (
                f"param group {number} of {subject} holds tensors the model no "
                f"longer has, where the traced step had the model's "
                f"{_listed(replaced, str)}: the model holds other tensors under those "
                "names now (a parameter replaced after the optimizer was built), "
                "which the optimizer does not hold. Build the optimizer from the "
                "model's current parameters, in the traced order, or capture again "
                "with it."
            )
        foreign = sum(id(param) not in names for param in params)
        held = (
            f"{foreign} of its {len(params)} tensors not in the model: the optimizer "
            "was built for another model"
            if foreign
            else "parameters of the model, but not the traced ones in the traced order"
        )
        shown = [
            names.get(id(param)) or f"<a tensor of shape {tuple(param.shape)}>"
            for param in params
        ]
        traced = [self.state_names[index] for index in indices]
        return (
            f"param group {number} of {subject} holds {held}. Build the optimizer "
            "from this model's parameters, in the traced order, or capture again "
            f"with it.\n  holds {_listed(shown, str)}\n  traced {_listed(traced)}"
        )

    def _gradients_problem(
        self,
        traced_groups: list[dict[str, Any]],
        tensors: list[torch.Tensor],
        subject: str,
    ) -> str | None:
        # The traced step read the gradients this call's backward computes, before
        # any other code saw them: the .grad each parameter enters the step with in
        # eager must be exactly that.
        for traced in traced_groups:
            for index in traced["params"]:
                if index in self.deferred:
                    # Stepped by the driver from its .grad, after the gradients are
                    # added and their hooks have run, as eager's step.
                    continue
                param, name = tensors[index], self.state_names[index]
                if index in self.gradients:
                    if param.grad is not None and index not in self.reset:
                        return (
                            f"the model's {name!r} comes with a .grad, which eager's "
                            "backward would add this call's gradient to before "
                            f"{subject} steps with the sum, but the traced step saw "
                            "this call's gradient alone. Call zero_grad() in the "
                            "function, or set the .grad fields to None before the "
                            "call."
                        )
                    if param._backward_hooks or param._post_accumulate_grad_hooks:
                        return (
                            f"the model's {name!r} has a gradient hook (register_hook "
                            "or register_post_accumulate_grad_hook), which eager runs "
                            f"before {subject} steps, but the artifact only after its "
                            "step. Remove the hook, or call the optimizer after the "
                            "precompiled function."
                        )
                elif param.grad is not None and index not in self.reset_to_none:
                    return (
                        f"the model's {name!r} has a .grad, which {subject}'s step "
                        "would apply, but the traced step had no gradient for it (the "
                        "function's backward does not reach it). Set its .grad to "
                        "None before the call (optimizer.zero_grad() in the function "
                        "does it at every call)."
                    )
        return None

    def _state_problem(
        self,
        step: _Step,
        spec: dict[str, Any],
        layout: _StateLayout,
        tensors: list[torch.Tensor],
        subject: str,
    ) -> str | None:
        """The optimizer's state held to the traced step's; notes in ``step`` the
        parameters whose state its first step has yet to create."""
        state = step.optimizer.state
        for index, keys, signatures in layout:
            param_state = state.get(tensors[index])
            if not param_state:
                if "momentum_buffer" in keys:
                    problem = self._fresh_momentum_problem(
                        step.optimizer, spec["groups"], index, subject
                    )
                    if problem is not None:
                        return problem
                step.fresh.append(index)
                continue
            if list(param_state) != keys:
                return (
                    f"{subject} holds the state {list(param_state)} for the model's "
                    f"{self.state_names[index]!r}, but its traced step keeps {keys}. "
                    "Pass an optimizer whose state its own steps created, or capture "
                    "again with this one."
                )
            for key, signature in zip(keys, signatures):
                tensor = param_state[key]
                if (
                    not isinstance(tensor, torch.Tensor)
                    or (tensor.shape, tensor.dtype, tensor.device) != signature
                ):
                    problem = _optimizer_state_problem(
                        tensor,
                        f"{subject}'s state {key!r} of the model's "
                        f"{self.state_names[index]!r}",
                        signature,
                    )
                    if problem is not None:
                        return problem
        return None

    def _fresh_momentum_problem(
        self,
        optimizer: torch.optim.Optimizer,
        traced_groups: list[dict[str, Any]],
        index: int,
        subject: str,
    ) -> str | None:
        # A first SGD step copies the gradient into the momentum buffer; the traced
        # step computes momentum * buffer + (1 - dampening) * gradient, which is that
        # copy from a zero buffer only without dampening (this call's, which the
        # graph may read at each call).
        dampening = _group_of(optimizer, traced_groups, index).get("dampening", 0)
        if dampening != 0:
            return (
                f"{subject} has no momentum buffer yet for the model's "
                f"{self.state_names[index]!r}, and its first step with dampening="
                f"{dampening} differs from the traced one. Take the first step "
                "eagerly (optimizer.step() after a backward), or build the optimizer "
                "with dampening=0."
            )
        return None

    def layout_problem(
        self, steps: list[_Step], tensors: list[torch.Tensor]
    ) -> tuple[str, torch.Tensor, tuple[int, ...]] | None:
        """The first state tensor not in the layout Inductor specialised on (which it
        asserts inside the graph, possibly after it has updated parameters in
        place): what it is, the tensor and the traced strides. State a first step
        creates is laid out like its parameter, which was checked."""
        for spec, step in zip(self.optimizers, steps):
            state, fresh = step.optimizer.state, set(step.fresh)
            for index, key, _, _, _, strides in spec["state"]:
                if strides is None or index in fresh:
                    continue
                tensor = state[tensors[index]][key]
                if not _same_layout(tensor, strides):
                    owner = _argument(spec["position"], self.argument_names)
                    what = (
                        f"the state {key!r} of the model's "
                        f"{self.state_names[index]!r} in the {spec['class']} at "
                        f"{owner}"
                    )
                    return what, tensor, strides
        return None

    def inputs(
        self, steps: list[_Step], tensors: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The graph's inputs after the input leaves: each optimizer's state tensors,
        created first where its step has not yet, each group's lr, then the values
        tensor of each group whose numbers the graph reads at each call."""
        state: list[torch.Tensor] = []
        lrs: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for spec, step, layout in zip(self.optimizers, steps, self.layouts):
            optimizer = step.optimizer
            fresh = set(step.fresh)
            for index, keys, signatures in layout:
                param = tensors[index]
                if index in fresh:
                    param_state = step.created[index] = _first_state(
                        param,
                        keys,
                        signatures,
                        spec.get("first_state", {}),
                        _group_of(optimizer, spec["groups"], index)["lr"],
                    )
                else:
                    param_state = optimizer.state[param]
                state.extend([param_state[key] for key in keys])
            for group, traced in zip(optimizer.param_groups, spec["groups"]):
                dtype, device = traced["lr"]
                lr = group["lr"]
                if isinstance(lr, torch.Tensor):
                    lrs.append(lr.detach().reshape(()).to(_dtype(dtype), device))
                else:
                    lrs.append(torch.tensor(lr, dtype=_dtype(dtype), device=device))
                if "values" in traced:
                    numbers = [
                        _group_value(group, *entry) for entry in traced["values"]
                    ]
                    values.append(
                        torch.tensor(
                            numbers, dtype=_dtype(traced["values_dtype"]), device=device
                        )
                    )
        return state + lrs + values

    def finish(self, steps: list[_Step], tensors: list[torch.Tensor]) -> None:
        """After the graph ran: the state its first step created joins each
        optimizer's, and a scheduler learns that the optimizer stepped."""
        for spec, step in zip(self.optimizers, steps):
            for index, param_state in step.created.items():
                step.optimizer.state[tensors[index]] = param_state
            # A learning-rate scheduler wraps its optimizer's step() to note that it
            # ran, and warns on its own step() if it did not: the artifact's step is
            # that step.
            stepped = step.optimizer.step
            if spec["steps"] and getattr(stepped, "_wrapped_by_lr_sched", False):
                cast(Any, step.optimizer)._opt_called = True


def _group_value(group: dict[str, Any], key: str, index: int | None) -> object:
    value = group.get(key)
    if index is None:
        return value
    return value[index] if isinstance(value, (tuple, list)) else None


def _value_name(key: str, index: int | None) -> str:
    return key if index is None else f"{key}[{index}]"


def _values_problem(
    group: dict[str, Any], traced: dict[str, Any], where: str
) -> str | None:
    """Whether the group's numbers the graph reads at each call are numbers, and
    decide the step's structure as they did when it was traced."""
    for key, index in traced.get("values", ()):
        value = _group_value(group, key, index)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            name = _value_name(key, index)
            return (
                f"{where} has {name}={value!r}; the traced step reads it at each call "
                "as a number. Set it to a Python number."
            )
    for key, index, comparison, other, outcome in traced.get("guards", ()):
        value = _group_value(group, key, index)
        if _COMPARISONS[comparison](value, other) != outcome:
            name = _value_name(key, index)
            traced_side = _COMPARISON_TEXT[comparison][outcome]
            return (
                f"{where} has {name}={value!r}, but the traced step was built for "
                f"{name} {traced_side} {other!r}: that decides which operations the "
                "step runs, not only their numbers. Set it back, or capture again "
                "with this value."
            )
    return None


# A traced comparison of a group's value with a number, and how to say what held.
_COMPARISONS = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
}
_COMPARISON_TEXT = {
    "eq": {True: "==", False: "!="},
    "ne": {True: "!=", False: "=="},
    "lt": {True: "<", False: ">="},
    "le": {True: "<=", False: ">"},
    "gt": {True: ">", False: "<="},
    "ge": {True: ">=", False: "<"},
}


def _first_state(
    param: torch.Tensor,
    keys: list[str],
    signatures: list[_Signature],
    fills: dict[str, float | str],
    lr: float | torch.Tensor,
) -> dict[str, torch.Tensor]:
    """What the optimizer's first step creates for ``param``, in its order of keys:
    tensors laid out like the parameter where they match it, filled with zeros, or
    the number or the group's ``lr`` that the capture recorded for the key
    (``fills``); a complex tensor gets both parts that value, as eager fills it."""
    state = {}
    for key, (shape, dtype, device) in zip(keys, signatures):
        if (shape, dtype, device) == (param.shape, param.dtype, param.device):
            tensor = torch.zeros_like(param)
        else:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        fill = fills.get(key, 0.0)
        value = float(lr) if fill == "lr" else float(fill)
        if value != 0:
            tensor.fill_(complex(value, value) if tensor.is_complex() else value)
        state[key] = tensor
    return state


def _group_of(
    optimizer: torch.optim.Optimizer, traced_groups: list[dict[str, Any]], index: int
) -> dict[str, Any]:
    # The optimizer's param group that holds the parameter at ``index``.
    for group, traced in zip(optimizer.param_groups, traced_groups):
        if index in traced["params"]:
            return group
    raise AssertionError(f"no param group holds the parameter {index}")


def _optimizer_state_problem(
    tensor: object, what: str, signature: _Signature
) -> str | None:
    shape, dtype, device = tuple(signature[0]), str(signature[1]), str(signature[2])
    if not isinstance(tensor, torch.Tensor):
        return (
            f"{what} is a {type(tensor).__name__}, but the traced step read a tensor. "
            "Pass an optimizer whose state its own steps created."
        )
    if tuple(tensor.shape) != shape or str(tensor.dtype) != dtype:
        return (
            f"{what} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, but the "
            f"traced step read {shape} and {dtype}. Pass an optimizer whose state was "
            "created for this model, or capture again with it."
        )
    if str(tensor.device) != device:
        return (
            f"{what} is on device {str(tensor.device)!r}, but the traced step read it "
            f"on {device!r}. Move the optimizer's state there, or capture again on "
            "this device."
        )
    return None


# The optimizer arguments as traced: built at the first call.
_optimizer_arguments: list[_OptimizerArguments] = []


def _optimizers() -> _OptimizerArguments:
    if not _optimizer_arguments:
        _optimizer_arguments.append(
            _OptimizerArguments(
                OPTIMIZERS,
                ARGUMENT_NAMES,
                _SIGNATURE,
                _STATE_NAMES,
                GRAD_PARAM_INDICES,
                GRAD_RESETS,
                globals().get("DEFERRED_STEPS", []),
            )
        )
    return _optimizer_arguments[0]


def _checked_steps(args: tuple[object, ...], state: _CheckedState) -> list[_Step]:
    """Each optimizer argument held to the traced one; changes nothing."""
    steps = _optimizers().checked_steps(args, state.tensors)
    if isinstance(steps, str):
        _fail(steps)
    return steps


def _check_optimizer_layouts(steps: list[_Step], state: _CheckedState) -> None:
    # The state tensors' strides, which Inductor's kernels specialise on.
    problem = _optimizers().layout_problem(steps, state.tensors)
    if problem is not None:
        _fail(_layout_message(*problem))


def _optimizer_inputs(steps: list[_Step], state: _CheckedState) -> list[torch.Tensor]:
    return _optimizers().inputs(steps, state.tensors)


def _finish_steps(steps: list[_Step], state: _CheckedState) -> None:
    _optimizers().finish(steps, state.tensors)


def _replaced(
    params: list[torch.Tensor],
    indices: list[int],
    tensors: list[torch.Tensor],
    names: dict[int, str],
) -> list[str]:
    """The names of the model's parameters that are other tensors than the ones the
    optimizer holds in their places, if that is every difference and the others are
    the model's (a parameter replaced by a new one after the optimizer was built);
    else []."""
    if len(params) != len(indices):
        return []
    held = {id(param) for param in params}
    replaced = []
    for param, index in zip(params, indices):
        current = tensors[index]
        if param is current:
            continue
        if id(param) in names or id(current) in held:
            return []  # the model's own tensors, in another order
        replaced.append(names[id(current)])
    # Every one of them other: an optimizer built for another model.
    return replaced if len(replaced) < len(params) else []
