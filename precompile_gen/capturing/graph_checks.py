"""What a traced graph may hold: the ops the artifact cannot carry (control flow,
effectful ops) are refused, and the profiler's markers dropped.
"""

from __future__ import annotations

from typing import cast

import torch

from precompile_gen.runtime.errors import PrecompileError


def check_graph_ops(gm: torch.fx.GraphModule) -> None:
    """Refuse the ops the artifact cannot carry; drop the profiler's markers first,
    which it has no use for."""
    _reject_control_flow(gm)
    _drop_profiler_ranges(gm)
    _reject_effectful_ops(gm)


def _reject_control_flow(gm: torch.fx.GraphModule) -> None:
    # torch.cond's branches travel with the graph (each a GraphModule it reads by
    # name, which lowering writes out); the bodies of other control-flow operators
    # do not, nor a tensor a branch reads besides its operands.
    for module in gm.modules():
        for node in cast(torch.fx.GraphModule, module).graph.find_nodes(op="get_attr"):
            if isinstance(getattr(module, str(node.target)), torch.fx.GraphModule):
                _reject_loop_body(node)
            elif module is not gm:
                raise PrecompileError(
                    "a torch.cond branch reads a tensor that is not one of its "
                    "operands, e.g. a torch.tensor(...) created inside the branch. "
                    "Create it before torch.cond and pass it in the operands."
                )


def _reject_loop_body(subgraph: torch.fx.Node) -> None:
    for user in subgraph.users:
        if user.target is not torch.ops.higher_order.cond:
            raise PrecompileError(
                f"the function uses the control-flow operator {user.target} "
                "(torch.while_loop, torch.map, scan, ...), whose body the artifact "
                "cannot carry; only torch.cond is supported. Compute with a fixed "
                "number of steps, or move the loop out of the function."
            )


# The ranges torch.profiler records around an optimizer's step: markers for a
# profiler, which an artifact's graph has no use for.
_PROFILER_OPS = (
    torch.ops.profiler._record_function_exit._RecordFunction,
    torch.ops.profiler._record_function_enter_new.default,
)


def _drop_profiler_ranges(gm: torch.fx.GraphModule) -> None:
    graph = gm.graph
    dropped = False
    for target in _PROFILER_OPS:
        for node in list(graph.find_nodes(op="call_function", target=target)):
            if not node.users:
                graph.erase_node(node)
                dropped = True
    if dropped:
        gm.recompile()


def _reject_effectful_ops(gm: torch.fx.GraphModule) -> None:
    from torch._higher_order_ops.effects import _get_effect

    for node in gm.graph.nodes:
        is_op = node.op == "call_function" and isinstance(
            node.target, torch._ops.OpOverload
        )
        if is_op and _get_effect(node.target) is not None:
            raise PrecompileError(
                f"the function calls the effectful operator {node.target} (it has side "
                "effects that must be ordered, such as printing), which cannot be "
                "captured into a functional artifact. Move it out of the function."
            )
