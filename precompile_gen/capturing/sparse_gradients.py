"""Sparse gradients: ``nn.Embedding`` and ``nn.EmbeddingBag`` with ``sparse=True``.

Their backward builds a sparse COO gradient, which neither Inductor nor an optimizer
step traced in the capturable formulation can take. The graph is split where the
sparse tensors begin: it returns the dense tensors their backward builds them from
(the looked-up indices and the rows of the incoming gradient, or EmbeddingBag's
backward's operands), and the driver runs the ops that build the sparse gradients,
eagerly, with torch's own kernels, so ``.grad`` is the tensor eager leaves.

Their update runs outside the graph too: an optimizer argument's ``step()`` in the
traced function skips the parameters whose gradients are sparse (the graph updates
the others), and the driver steps those with the runtime optimizer once their
gradients are on ``.grad``, as eager's step would. A ``SparseAdam`` argument, whose
every parameter has a sparse gradient, is stepped by the driver as a whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from precompile_gen.capture_result import DeferredStep, SparseGradients
from precompile_gen.capturing import convention
from precompile_gen.runtime.errors import PrecompileError

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
# Optimizers whose step takes sparse gradients in eager: SGD's (with or without
# momentum), Adagrad's, and SparseAdam's, which takes nothing else.
_SPARSE_STEPPERS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def sparse_params(
    modules: list[torch.nn.Module], params: list[torch.Tensor]
) -> dict[int, str]:
    """Index into ``params`` -> the name of the module whose ``sparse=True`` makes
    that parameter's gradient sparse (``"emb"``, ``"m1.tables.0"``)."""
    index_of = {id(param): index for index, param in enumerate(params)}
    names: dict[int, str] = {}
    for mi, module in enumerate(modules):
        prefix = f"m{mi}." if len(modules) > 1 else ""
        for name, submodule in module.named_modules():
            if isinstance(submodule, _SPARSE_MODULES) and submodule.sparse:
                index = index_of.get(id(submodule.weight))
                if index is not None:
                    names.setdefault(index, prefix + (name or "<root>"))
    return names


def is_sparse_stepper(value: object) -> bool:
    """A ``SparseAdam`` argument: not lifted, its whole step runs in the driver."""
    return type(value) is torch.optim.SparseAdam


class Deferrals:
    """What the trace learned of the steps the driver takes: by optimizer position,
    the parameters (indices into the params) each leaves to it."""

    def __init__(self, arguments: list[str]) -> None:
        # The traced function's names for its arguments, which messages give.
        self.arguments = arguments
        self.steps: dict[int, tuple[str, list[int]]] = {}
        # Per deferred parameter, the graph's nodes when its step was deferred: a
        # node made later that reads the parameter would read it before the step.
        self.traced_before: dict[int, set[str]] = {}

    def add(self, position: int, name: str, indices: list[int]) -> None:
        known = self.steps.setdefault(position, (name, []))[1]
        if any(index in known for index in indices):
            raise PrecompileError(
                f"the function calls step() on the {name} at {self.where(position)} "
                "more than once, and the artifact takes the step of the parameters "
                "with sparse gradients once, after its graph. Step once per call "
                "(call the artifact once per step)."
            )
        known.extend(indices)
        mode = get_proxy_mode()
        if indices and mode is not None:
            names = {node.name for node in mode.tracer.graph.nodes}
            for index in indices:
                self.traced_before.setdefault(index, names)

    def where(self, position: int) -> str:
        """How messages name the optimizer argument at ``position``."""
        return convention.argument(position, self.arguments)

    def reject_reads_after_steps(
        self, gm: torch.fx.GraphModule, names: dict[int, str], param_names: list[str]
    ) -> None:
        """Refuse a function that reads a parameter whose step the driver takes
        after the graph, once it has stepped it (a forward after the step): the
        graph would read the value before the update."""
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        for index, before in self.traced_before.items():
            late = [u for u in placeholders[index].users if u.name not in before]
            if late:
                module = _module_of(names, index, param_names)
                raise PrecompileError(
                    f"the function reads {param_names[index]!r} (module {module!r}, "
                    "whose gradient is sparse) after the optimizer's step, which the "
                    "artifact takes after its graph has run, so the graph would read "
                    "the value from before the step. Read it after the precompiled "
                    f"function (or before the step), or build {module!r} with "
                    "sparse=False."
                )

    def records(self) -> list[DeferredStep]:
        return [
            DeferredStep(position, name, params)
            for position, (name, params) in sorted(self.steps.items())
        ]


def _module_of(names: dict[int, str], index: int, param_names: list[str]) -> str:
    return names.get(index, param_names[index].rpartition(".")[0] or "<root>")


@contextlib.contextmanager
def deferring(
    lifted: list[tuple[int, torch.optim.Optimizer]],
    sparse_steppers: list[tuple[int, torch.optim.Optimizer]],
    params: list[torch.Tensor],
    copies: list[torch.Tensor],
    names: dict[int, str],
    param_names: list[str],
    deferrals: Deferrals,
) -> Generator[None]:
    """While ``fn`` is traced: a lifted optimizer's step leaves out the parameters
    whose gradients are sparse (recorded in ``deferrals``), and a ``SparseAdam``
    argument's step does nothing but record its parameters. ``params`` are the
    module arguments' parameters and ``copies`` the trace's, index-aligned."""
    copy_index = {id(copy): index for index, copy in enumerate(copies)}
    param_index = {id(param): index for index, param in enumerate(params)}
    position_of = {id(optimizer): position for position, optimizer in lifted}
    narrowed: dict[int, list[tuple[dict[str, Any], list[torch.Tensor]]]] = {}

    def pre_hook(optimizer: torch.optim.Optimizer, *_: object) -> None:
        position = position_of.get(id(optimizer))
        if position is None:
            return
        saved = []
        for group in optimizer.param_groups:
            sparse = [
                p for p in group["params"] if p.grad is not None and p.grad.is_sparse
            ]
            if not sparse:
                continue
            indices = [copy_index[id(p)] for p in sparse]
            where = deferrals.where(position)
            _check_stepper(optimizer, group, where, indices, names, param_names)
            deferrals.add(position, type(optimizer).__name__, indices)
            saved.append((group, group["params"]))
            group["params"] = [p for p in group["params"] if not _has_sparse_grad(p)]
        narrowed[id(optimizer)] = saved

    def post_hook(optimizer: torch.optim.Optimizer, *_: object) -> None:
        for group, group_params in narrowed.pop(id(optimizer), []):
            group["params"] = group_params

    with contextlib.ExitStack() as stack:
        stack.enter_context(_removing(register_optimizer_step_pre_hook(pre_hook)))
        stack.enter_context(_removing(register_optimizer_step_post_hook(post_hook)))
        for position, optimizer in sparse_steppers:
            # Listed even if fn does not step it: it is no input of the graph.
            deferrals.add(position, "SparseAdam", [])
            indices = _stepper_params(
                optimizer, deferrals.where(position), param_index, names
            )
            stack.enter_context(
                _recording_step(optimizer, position, indices, deferrals)
            )
        try:
            yield
        finally:
            for saved in narrowed.values():
                for group, group_params in saved:
                    group["params"] = group_params


def _has_sparse_grad(param: torch.Tensor) -> bool:
    return param.grad is not None and param.grad.is_sparse


@contextlib.contextmanager
def _removing(handle: Any) -> Generator[None]:
    try:
        yield
    finally:
        handle.remove()


def _check_stepper(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    where: str,
    indices: list[int],
    names: dict[int, str],
    param_names: list[str],
) -> None:
    name = type(optimizer).__name__
    module = _module_of(names, indices[0], param_names)
    if isinstance(optimizer, _SPARSE_STEPPERS):
        if group.get("weight_decay", 0) != 0:
            raise PrecompileError(
                f"the optimizer {name} at {where} steps the parameter "
                f"{param_names[indices[0]]!r}, whose gradient is sparse (module "
                f"{module!r} has sparse=True), with weight_decay="
                f"{group['weight_decay']}, which eager's step cannot add to a "
                "sparse gradient (it raises). Put that module's parameters in a "
                "param group with weight_decay=0, or build it with sparse=False."
            )
        return
    raise PrecompileError(
        f"the optimizer {name} at {where} steps the parameter "
        f"{param_names[indices[0]]!r}, whose gradient is sparse (module {module!r} "
        f"has sparse=True), and {name} does not take sparse gradients (eager's step "
        "raises). Step that module's parameters with torch.optim.SparseAdam, SGD or "
        f"Adagrad, and the rest with {name}, or build {module!r} with sparse=False."
    )


def _stepper_params(
    optimizer: torch.optim.Optimizer,
    where: str,
    param_index: dict[int, int],
    names: dict[int, str],
) -> list[int]:
    """The SparseAdam's parameters as indices into the params; each must have a
    sparse gradient, which is all SparseAdam's step takes."""
    indices = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            index = param_index.get(id(param))
            if index is None or index not in names:
                raise PrecompileError(
                    f"the SparseAdam at {where} holds a tensor of shape "
                    f"{tuple(param.shape)} that is not the weight of an nn.Embedding "
                    "or nn.EmbeddingBag with sparse=True of a module argument, and "
                    "SparseAdam steps only sparse gradients. Build it from those "
                    "weights alone, and step the other parameters with another "
                    "optimizer."
                )
            indices.append(index)
    return indices


@contextlib.contextmanager
def _recording_step(
    optimizer: torch.optim.Optimizer,
    position: int,
    indices: list[int],
    deferrals: Deferrals,
) -> Generator[None]:
    # Its parameters are the example's own, not the trace's copies: its real step
    # would update the example model. The driver takes it at every call instead.
    instance = vars(optimizer)
    missing = object()
    previous = instance.get("step", missing)

    def step(closure: object = None) -> None:
        if closure is not None:
            raise PrecompileError(
                "the function calls step(closure) on the SparseAdam at "
                f"{deferrals.where(position)}; the artifact cannot re-run the "
                "closure. Call step() without one."
            )
        deferrals.add(position, "SparseAdam", indices)

    instance["step"] = step
    try:
        yield
    finally:
        if previous is missing:
            del instance["step"]
        else:
            instance["step"] = previous


class _Tail:
    """The nodes that compute on sparse tensors, and the dense ones they read."""

    def __init__(self) -> None:
        self.nodes: list[torch.fx.Node] = []
        self.pieces: list[torch.fx.Node] = []


def _is_sparse(node: object) -> bool:
    """Whether ``node`` computes a sparse tensor: make_fx records no value for one
    (it keeps a snapshot of dense results only)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or "val" not in node.meta:
        return False
    returns = target._schema.returns
    return (
        node.meta["val"] is None
        and len(returns) == 1
        and str(returns[0].type) == "Tensor"
    )


def split(
    gm: torch.fx.GraphModule,
    grad_param_indices: list[int],
    positions: list[int],
    names: dict[int, str],
    param_names: list[str],
) -> SparseGradients | None:
    """Cut the sparse gradients (at ``positions`` among the gradient outputs) out of
    ``gm``: it returns, in their place at the end of its outputs, the dense tensors
    they are built from; the returned record holds the code that builds them. None
    when no gradient is sparse."""
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    num_results = len(outputs) - len(grad_param_indices)
    if not positions:
        return None
    _drop_dead_sparse_reads(graph)
    tail = _collect_tail(graph, [outputs[num_results + k] for k in positions])
    _reject_escapes(tail, output, grad_param_indices, positions, names, param_names)
    params = [grad_param_indices[k] for k in positions]
    source = _tail_source(tail, [outputs[num_results + k] for k in positions])
    kept = [node for k, node in enumerate(outputs) if k - num_results not in positions]
    output.args = ([*kept, *tail.pieces],)
    for node in reversed(tail.nodes):
        graph.erase_node(node)
    _reject_sparse_values(graph, _module_of(names, params[0], param_names))
    _reflatten_outputs(gm, len(output.args[0]))
    gm.recompile()
    return SparseGradients(params, positions, len(tail.pieces), source)


# Reads of a sparse tensor's parts that autograd's bookkeeping records and nobody
# uses.
_DEAD_READS = {
    torch.ops.aten._indices.default,
    torch.ops.aten._values.default,
    torch.ops.aten.alias.default,
}


def _drop_dead_sparse_reads(graph: torch.fx.Graph) -> None:
    for node in reversed(list(graph.nodes)):
        if node.target in _DEAD_READS and not node.users:
            graph.erase_node(node)


def _collect_tail(graph: torch.fx.Graph, roots: list[torch.fx.Node]) -> _Tail:
    tail = _Tail()
    inside: set[torch.fx.Node] = set()
    pieces: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in inside:
            continue
        inside.add(node)
        for arg in node.all_input_nodes:
            if _is_sparse(arg):
                stack.append(arg)
            elif arg not in pieces:
                pieces.add(arg)
    order = {node: position for position, node in enumerate(graph.nodes)}
    tail.nodes = sorted(inside, key=order.__getitem__)
    tail.pieces = sorted(pieces, key=order.__getitem__)
    return tail


def _reject_escapes(
    tail: _Tail,
    output: torch.fx.Node,
    grad_param_indices: list[int],
    positions: list[int],
    names: dict[int, str],
    param_names: list[str],
) -> None:
    """Every use of a sparse tensor must be on the way to a gradient output: a
    dense computation from one (the gradient read or changed inside the function)
    would have to run after the driver built it."""
    inside = set(tail.nodes)
    for node in tail.nodes:
        for user in node.users:
            if user in inside or user is output:
                continue
            index = grad_param_indices[positions[0]]
            module = _module_of(names, index, param_names)
            raise PrecompileError(
                f"the function computes with the sparse gradient of module "
                f"{module!r} ({user.target}) inside the traced step, which the "
                "artifact builds only after its graph has run (sparse tensors stay "
                "out of the compiled graph). Read or change the gradient after the "
                f"precompiled function, or build {module!r} with sparse=False."
            )


def _reject_sparse_values(graph: torch.fx.Graph, module: str) -> None:
    for node in graph.nodes:
        if _is_sparse(node):
            raise PrecompileError(
                f"the function computes a sparse tensor ({node.target}) that is "
                "not a parameter's gradient (next to the sparse gradient of module "
                f"{module!r}); the artifact keeps only sparse "
                "gradients of nn.Embedding and nn.EmbeddingBag (sparse=True) out of "
                "the graph. Compute with dense tensors, or build the module with "
                "sparse=False."
            )


def _tail_source(tail: _Tail, roots: list[torch.fx.Node]) -> str:
    from precompile_gen.codegen.layout import format_python

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for number, piece in enumerate(tail.pieces):
        env[piece] = graph.placeholder(f"piece{number}")
    for node in tail.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output([env[root] for root in roots])
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    code = module.code.strip("\n").replace(
        "def forward(self, ", "def _sparse_gradients(", 1
    )
    return format_python(code + "\n")


def _reflatten_outputs(gm: torch.fx.GraphModule, count: int) -> None:
    # make_fx's code repacks the flat outputs through its out_spec, which must say
    # how many there are now.
    codegen = cast(Any, gm.graph._codegen)
    info = getattr(codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        spec = pytree.tree_flatten(list(range(count)))[1]
        codegen.pytree_info = info._replace(out_spec=spec)
        gm._out_spec = spec
