"""The names the artifact gives the traced function's arguments and the graph's inputs.

The graph's inputs are named as torch.export names its placeholders, from what the
capture knows of each: a parameter ``p_<name>`` and a buffer ``b_<name>`` by their
calling-convention names (``p_0_weight``, ``b_bn_running_mean``, ``p_m1_fc_weight``
with several modules), an input leaf by the traced function's parameter name and its
pytree path (``x``, ``batch_input_ids``, ``xs_0``). An optimizer's state tensor is
named by the optimizer's argument, the parameter and the key (``opt_0_weight_step``),
each group's lr and values tensor by the optimizer and the group (``opt_group0_lr``,
``opt_group0_values``), and a tensor literal keeps its name (``literal0``).

Each name is made a valid Python identifier that shadows neither a builtin, a keyword
nor a name fx's code reads (``torch``, ``device``, ...), and unique, the way fx makes
a node's name, so that the eager graph's code can take them as its parameters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.fx.graph import _Namespace

from precompile_gen.capture_result import OptimizerArgument


def argument_names(fn: Callable[..., object], count: int) -> list[str]:
    """The traced function's name for each of its ``count`` positional arguments:
    its parameters' names, ``args_0``, ``args_1``, ... for those a ``*args`` takes,
    and ``arg<i>`` where its signature cannot be read."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some callable objects
        parameters = []
    names: list[str] = []
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names += [f"{parameter.name}_{k}" for k in range(count - len(names))]
        elif parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names.append(parameter.name)
        if len(names) >= count:
            break
    names = names[:count]
    return names + [f"arg{i}" for i in range(len(names), count)]


def graph_input_names(
    arguments: list[str],
    param_names: list[str],
    buffer_names: list[str],
    user_inputs: Sequence[tuple[int, object]],
    optimizers: list[OptimizerArgument],
    literals: list[str],
) -> list[str]:
    """One name per graph input, in graph-input order: the module state, the input
    leaves of ``user_inputs`` (position, argument), the optimizers' state, their
    groups' lrs and values tensors, then the tensor literals."""
    candidates = [f"p_{name}" for name in param_names]
    candidates += [f"b_{name}" for name in buffer_names]
    for position, argument in user_inputs:
        candidates += _leaf_names(arguments[position], argument)
    for optimizer in optimizers:
        owner = arguments[optimizer.position]
        candidates += [
            f"{owner}_{param_names[t.param]}_{t.key}" for t in optimizer.state
        ]
    for optimizer in optimizers:
        owner = arguments[optimizer.position]
        candidates += [f"{owner}_group{g}_lr" for g in range(len(optimizer.groups))]
    for optimizer in optimizers:
        owner = arguments[optimizer.position]
        candidates += [
            f"{owner}_group{g}_values"
            for g, group in enumerate(optimizer.groups)
            if group.values
        ]
    candidates += literals
    namespace = _Namespace()
    # fx's code takes the GraphModule as ``self`` before the inputs.
    namespace.create_name("self", None)
    return [namespace.create_name(candidate, None) for candidate in candidates]


def _leaf_names(argument_name: str, argument: object) -> list[str]:
    """Each pytree leaf of ``argument`` named by its path below ``argument_name``."""
    try:
        paths = [path for path, _ in pytree.tree_flatten_with_path(argument)[0]]
    except (ValueError, NotImplementedError):
        # A container type registered without keys: its leaves by index.
        count = len(pytree.tree_leaves(argument))
        return [f"{argument_name}_{i}" for i in range(count)]
    return ["_".join([argument_name, *map(_key_text, path)]) for path in paths]


def _key_text(key: object) -> str:
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return str(key)


def name_inputs(gm: torch.fx.GraphModule, input_names: list[str]) -> None:
    """Give the graph's inputs ``input_names`` (valid, unique identifiers), as its
    function's parameters. make_fx's graph takes one list, ``flat``, and unpacks it by
    a spec into ``flat_1``, ``flat_2``, ...; the graph is copied into one with fx's
    plain code instead, its inputs created first so that they keep their names and
    the nodes after them give way. The ops and their order are unchanged."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(input_names):
        raise RuntimeError(
            f"the graph has {len(placeholders)} inputs, but {len(input_names)} names"
        )
    graph = torch.fx.Graph(owning_module=gm)
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, name in zip(placeholders, input_names, strict=True):
        copied[node] = graph.placeholder(name, type_expr=node.type)
        copied[node].meta = dict(node.meta)
    graph.output(graph.graph_copy(gm.graph, copied))
    gm.graph = graph
    gm.recompile()
