"""Python that branches on a tensor's value, captured as a ``torch.cond`` over the
rest of ``fn``.

``if not torch.isfinite(loss):`` reads a value, and make_fx follows one path through
the Python: the example's. Capture therefore traces ``fn`` once per path. The first
trace follows the example's values and notes each branch it reads (``read``). Then,
for each branch a trace read, fn is traced again with the branches before it held
to that trace's outcomes and this one to the other outcome; the branches after it
follow the example's values, and are explored in turn (``explore``).

Up to a branch, the traces of its two sides ran the same Python on the same values,
so their graphs agree op for op; ``merge`` checks that and builds one graph: the
common ops, the branch's predicate, and a ``torch.cond`` whose subgraphs are the
rest of each side's trace, backward and optimizer step included. A later branch
becomes a ``torch.cond`` inside its side's subgraph. Each call then takes the side
its values decide, both compiled as a user's own ``torch.cond`` is, and the driver's
checks, gradients and optimizer state stay those of one graph: the sides must agree
on them (what fn returns, which parameters get gradients, which optimizers step),
but for a side that skips the step (an early return on a bad batch), which the
graph's last output tells the driver of. A side one graph cannot serve is a
subgraph that refuses the call that takes it, naming the branch.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.func import functionalize
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from precompile_gen.capturing import convention, graph_names, tensor_literals
from precompile_gen.runtime.errors import PrecompileError

log = logging.getLogger(__name__)

# How many paths through fn's branches capture traces, at most: each is a trace, and
# each branch's subgraphs are compiled. A loop whose count a value decides reads a
# branch per iteration, and would have no end.
MAX_PATHS = 8
_FIX = (
    "Select with torch.where(condition, a, b) where both sides compute the same "
    "things, or move the branch out of the function, after the precompiled call."
)


@dataclass(frozen=True)
class BranchRead:
    """A branch fn took on a tensor's value while traced."""

    # The user's line, and the library line that reads the value, if another.
    where: str
    # The side this trace took.
    outcome: bool
    # The name of the predicate's node (a bool tensor of one element) in the trace.
    node: str


@dataclass
class _Path:
    """The outcomes a trace is held to, and the branches it read."""

    forced: tuple[bool, ...]
    reads: list[BranchRead] = field(default_factory=list)


_FOLLOWING: list[_Path] = []


@contextlib.contextmanager
def following(forced: tuple[bool, ...]) -> Generator[list[BranchRead]]:
    """While fn is traced: its branches on tensor values take the outcomes
    ``forced``, in order, then the example's; yields the branches it read."""
    path = _Path(forced)
    _FOLLOWING.append(path)
    try:
        yield path.reads
    finally:
        _FOLLOWING.pop()


def read(tensor: torch.Tensor, where: str) -> bool | None:
    """``bool(tensor)`` as the path being traced takes it, its predicate recorded
    in the graph; None where no path is followed (a symbolic trace has no values to
    follow, and refuses the read)."""
    if not _FOLLOWING or proxy_tensor.is_fake(tensor):
        return None
    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return None
    path = _FOLLOWING[-1]
    with proxy_tensor.disable_proxy_modes_tracing():
        example = bool(tensor)  # raises as eager does for several elements
    if len(path.reads) >= MAX_PATHS:
        raise PrecompileError(
            f"fn branches on tensor values more than {MAX_PATHS} times on one path "
            f"(the last at {where}): a loop whose number of iterations a value "
            f"decides cannot be captured. {_FIX}"
        )
    number = len(path.reads)
    outcome = path.forced[number] if number < len(path.forced) else example
    predicate = torch.ne(tensor.reshape(()), 0)
    node = proxy_tensor.get_proxy_slot(predicate, mode.tracer).proxy.node
    path.reads.append(BranchRead(where, outcome, node.name))
    return outcome


class Step(NamedTuple):
    """What a path's step does that the driver finishes: the parameters that get
    gradients (and which of them are sparse), the ``.grad`` resets, and whether each
    optimizer steps."""

    grads: list[int]
    sparse: list[int]
    resets: list[tuple[int, bool]]
    steps: list[bool]


@dataclass
class PathTrace:
    """One trace of fn: its graph, the branches it read, what it returned of the
    driver's convention (``agreement``), which every path must share, and its step,
    which a path may skip (``skips_step``: it returns before it)."""

    gm: torch.fx.GraphModule
    reads: list[BranchRead]
    agreement: dict[str, object]
    step: Step
    payload: object
    skips_step: bool = False


@dataclass
class Exploration:
    """The paths through fn's branches that one graph serves, the example's first,
    and the sides it cannot serve, by the outcomes that lead to each (the branches'
    before it, then its own), with why."""

    paths: list[PathTrace]
    refused: dict[tuple[bool, ...], str]


def explore(trace: Callable[[tuple[bool, ...]], PathTrace]) -> Exploration:
    """Every path through fn's branches: ``trace(forced)`` traces fn with its first
    branches held to ``forced``. A side whose trace fails, or that returns or updates
    other things than the example's path (but for skipping its step), is refused at
    the call that takes it."""
    found = Exploration([trace(())], {})
    pending = [(found.paths[0], 0)]
    while pending:
        path, start = pending.pop(0)
        outcomes = tuple(branch.outcome for branch in path.reads)
        for number in range(start, len(outcomes)):
            if len(found.paths) + len(found.refused) == MAX_PATHS:
                raise PrecompileError(
                    f"fn has more than {MAX_PATHS} paths through its branches on "
                    f"tensor values (the last at {path.reads[number].where}), each "
                    "a trace and a compiled subgraph; a loop whose number of "
                    f"iterations a value decides has no end of them. {_FIX}"
                )
            flipped = (*outcomes[:number], not outcomes[number])
            side = _side(trace, flipped, path.reads[: number + 1], found.paths[0])
            if isinstance(side, str):
                found.refused[flipped] = side
            else:
                found.paths.append(side)
                pending.append((side, number + 1))
    return found


def _side(
    trace: Callable[[tuple[bool, ...]], PathTrace],
    outcomes: tuple[bool, ...],
    held: list[BranchRead],
    first: PathTrace,
) -> PathTrace | str:
    """The trace of the side ``outcomes`` leads to, or why one graph cannot serve
    it."""
    branch = held[-1]
    side = f"the side of the branch at {branch.where} where it is {outcomes[-1]}"
    try:
        path = trace(outcomes)
    except Exception as error:
        log.warning(
            "%s raised %s when traced: a call that takes it will be refused. %s",
            side,
            type(error).__name__,
            error,
        )
        return f"{type(error).__name__} when traced"
    _check_held(path, held)
    for key, value in first.agreement.items():
        if path.agreement[key] != value:
            log.warning(
                "%s differs from the example's path in %s: a call that takes it "
                "will be refused.",
                side,
                key,
            )
            return f"its sides differ in {key}"
    if path.step != first.step:
        if not _skips(path.step, first.step):
            log.warning(
                "%s computes gradients, resets .grad fields or steps optimizers "
                "other than the example's path does, and skips no step: a call "
                "that takes it will be refused.",
                side,
            )
            return "its sides differ in their gradients, resets or optimizer steps"
        path.skips_step = True
    return path


def _skips(step: Step, taken: Step) -> bool:
    """Whether ``step`` is ``taken`` skipped: no gradients, no optimizer steps, and
    either the same ``.grad`` resets (made before the branch) or none."""
    return (
        not step.grads
        and not any(step.steps)
        and step.resets in ([], taken.resets)
        and not taken.sparse
        and bool(taken.grads or any(taken.steps) or taken.resets)
    )


def step_resets(found: Exploration) -> list[tuple[int, bool]] | None:
    """None where no path skips the step; else the resets of the step's path that a
    skipping path does not make (none where it makes them all). A capture whose
    skipping paths reset differently is refused."""
    skipping = {tuple(p.step.resets) for p in found.paths if p.skips_step}
    if not skipping:
        return None
    if len(skipping) > 1:
        raise PrecompileError(
            "fn has paths through its branches on tensor values that skip its step "
            "and reset other .grad fields. Reset them (zero_grad()) before the "
            "branch, or move the branch out of the function."
        )
    return [] if skipping.pop() else found.paths[0].step.resets


def _check_held(path: PathTrace, expected: list[BranchRead]) -> None:
    """The trace read the branches it was held to, at the same lines."""
    taken = [(branch.where, branch.outcome) for branch in path.reads]
    wanted = [(branch.where, branch.outcome) for branch in expected]
    wanted[-1] = (wanted[-1][0], not wanted[-1][1])
    if taken[: len(wanted)] != wanted:
        raise PrecompileError(
            f"fn took other branches when traced again ({_lines(path.reads)}) "
            f"than the first time ({_lines(expected)}): its Python depends on "
            "something besides its arguments (a global, a counter), which the "
            f"artifact cannot follow. {_FIX}"
        )


def _lines(reads: list[BranchRead]) -> str:
    return ", ".join(f"{b.where}: {b.outcome}" for b in reads) or "no branches"


# --- One graph from the paths ---------------------------------------------------------


@dataclass
class Merged:
    """The graph serving every path, each branch it holds as the artifact's header
    describes it (in the order the merge met them), and, where a path skips the
    step, the step's resets that it does not make (``step_resets``)."""

    gm: torch.fx.GraphModule
    branches: list[str]
    step_resets: list[tuple[int, bool]] | None


def merge(found: Exploration) -> Merged:
    """One graph serving every path: the example's, with each branch a torch.cond
    over the rest of its sides' traces (a refusing subgraph for a side refused)."""
    notes: list[str] = []
    if any(path.skips_step for path in found.paths):
        _mark_steps(found.paths)
    gm = _merged([(p.gm, p.reads) for p in found.paths], found.refused, (), notes)
    return Merged(gm, list(dict.fromkeys(notes)), step_resets(found))


_Side = tuple[torch.fx.GraphModule, list[BranchRead]]


def _mark_steps(paths: list[PathTrace]) -> None:
    """Give each path's graph a last output that says whether it took the step; a
    path that skips it returns blanks where the step's gradients are."""
    first = paths[0]
    num_grads = len(first.step.grads)
    grad_vals = _output_vals(first.gm)[len(_output_vals(first.gm)) - num_grads :]
    for path in paths:
        graph = path.gm.graph
        output = graph.output_node()
        outputs = _output_nodes(output)
        with graph.inserting_before(output):
            if path.skips_step:
                outputs += [_blank_node(graph, value) for value in grad_vals]
            taken = graph.call_function(
                torch.ops.aten.scalar_tensor.default,
                (float(not path.skips_step),),
                {"dtype": torch.bool},
            )
        taken.meta["val"] = torch.empty((), dtype=torch.bool)
        output.args = ([*outputs, taken],)
        path.gm.recompile()


def _blank_node(graph: torch.fx.Graph, value: object) -> torch.fx.Node:
    """An op of ``graph`` that gives a tensor shaped like ``value``, its values
    unset."""
    assert isinstance(value, torch.Tensor)
    node = graph.call_function(
        torch.ops.aten.empty_strided.default,
        (list(value.shape), list(value.stride())),
        {"dtype": value.dtype, "device": value.device},
    )
    node.meta["val"] = value
    return node


def _merged(
    sides: list[_Side],
    refused: dict[tuple[bool, ...], str],
    outcomes: tuple[bool, ...],
    notes: list[str],
) -> torch.fx.GraphModule:
    """The sides' graphs (which agree up to their first branch, reached by
    ``outcomes``) as one: the branch a torch.cond whose subgraphs write nothing (the
    writes the rest of a side makes to values before the branch follow the cond, as
    copies of what it returns). A side one graph cannot serve is a subgraph that
    refuses the call, and the other side's writes wait for it."""
    gm, reads = sides[0]
    if not reads:
        return gm
    branch = reads[0]
    nodes = list(gm.graph.nodes)
    split = next(i for i, n in enumerate(nodes) if n.name == branch.node) + 1
    for other_gm, _ in sides[1:]:
        _check_same_prefix(nodes[:split], list(other_gm.graph.nodes), branch)
    # The predicate too: a refusing side asserts it.
    operands = _operands(sides, {n.name for n in nodes[:split]}, split)
    operands += [] if branch.node in operands else [branch.node]
    constants = _constants(sides, split)
    operands += list(constants)
    groups = {
        outcome: [side for side in sides if side[1][0].outcome == outcome]
        for outcome in (branch.outcome, not branch.outcome)
    }
    # Described before the branches inside its sides, which the header lists after.
    note = len(notes)
    notes.append("")
    subgraphs = {
        outcome: _side_graph(
            group, split, operands, constants, refused, (*outcomes, outcome), notes
        )
        for outcome, group in groups.items()
        if group
    }
    written = sorted({index for g in subgraphs.values() for index in g.written})
    for subgraph in subgraphs.values():
        _return_written(subgraph, written)
    reason = refused.get((*outcomes, not branch.outcome))
    other = subgraphs.get(not branch.outcome)
    if other is not None and _shapes(other.gm) != _shapes(subgraphs[branch.outcome].gm):
        reason = "its sides give tensors of other shapes or dtypes"
    if reason is None:
        notes[note] = f"{branch.where}: both sides"
    else:
        notes[note] = (
            f"{branch.where}: the side where it is {not branch.outcome} is refused "
            f"at the call that takes it ({reason})"
        )
        subgraphs[not branch.outcome] = _refusing(
            subgraphs[branch.outcome], operands, branch, reason
        )
    return _with_cond(
        gm, split, operands, constants, subgraphs, branch.outcome, written
    )


class _Constant(NamedTuple):
    """A tensor the rest of a side's trace reads as a constant, passed in as an
    operand; ``fresh``: the op that copies it (a ``torch.tensor(...)``'s
    ``lift_fresh_copy``), taken before the cond, or None."""

    tensor: torch.Tensor
    fresh: Any


def _constants(sides: list[_Side], split: int) -> dict[str, _Constant]:
    """The tensors the rest of the sides' traces read as constants, by the operand
    name each is passed as (a torch.cond's branch reads no tensor but its
    operands): the node that reads it is marked with that name."""
    found: dict[str, _Constant] = {}
    for gm, _ in sides:
        for node in list(gm.graph.nodes)[split:]:
            value = (
                getattr(gm, str(node.target), None) if node.op == "get_attr" else None
            )
            if not isinstance(value, torch.Tensor):
                continue
            copies = {user.target for user in node.users}
            fresh = copies.pop() if len(copies) == 1 else None
            if fresh not in tensor_literals.FRESH_TENSOR_OPS:
                fresh = None
            readers = [node] if fresh is None else list(node.users)
            name = f"branch_constant_{len(found)}"
            found[name] = _Constant(value, fresh)
            for reader in readers:
                reader.meta["branch_operand"] = name
    return found


def _side_graph(
    group: list[_Side],
    split: int,
    operands: list[str],
    constants: dict[str, _Constant],
    refused: dict[tuple[bool, ...], str],
    outcomes: tuple[bool, ...],
    notes: list[str],
) -> _Functional:
    """The subgraph of one side: the rest of its paths' traces, merged."""
    tails = [(_tail(gm, split, operands, constants), reads[1:]) for gm, reads in group]
    return _functional(_merged(tails, refused, outcomes, notes), operands)


def _refusing(
    served: _Functional, operands: list[str], branch: BranchRead, reason: str
) -> _Functional:
    """The subgraph of a side one graph cannot serve: it asserts that the call's
    value takes the other side, and returns tensors shaped as ``served`` does
    (blanks, and the operands it writes as they are)."""
    graph = torch.fx.Graph()
    served_inputs = list(served.gm.graph.find_nodes(op="placeholder"))
    inputs = []
    for name, node in zip(operands, served_inputs, strict=True):
        inputs.append(graph.placeholder(name))
        inputs[-1].meta = dict(node.meta)
    predicate = inputs[operands.index(branch.node)]
    held = (
        predicate
        if branch.outcome
        else graph.call_function(torch.ops.aten.logical_not.default, (predicate,))
    )
    message = convention.refused_side_message(branch.where, not branch.outcome, reason)
    graph.call_function(
        torch.ops.aten._assert_async.msg, (held, assertion_message(message))
    )
    values = _output_vals(served.gm)[: served.num_outputs]
    outputs = [_blank_node(graph, value) for value in values]
    outputs += _unaliased(graph, [inputs[index] for index in served.written])
    graph.output(tuple(outputs))
    gm = torch.fx.GraphModule({}, graph)
    return _Functional(gm, served.written, served.num_outputs)


def assertion_message(text: str) -> str:
    """``text`` as an assertion in the graph may carry it: Inductor writes it into a
    C++ string literal."""
    return " ".join(text.replace("\\", "/").replace('"', "'").split())


def _check_same_prefix(
    prefix: list[torch.fx.Node], other: list[torch.fx.Node], branch: BranchRead
) -> None:
    """Both sides' traces recorded the same ops before the branch, on the same
    values (compared by position: a name may differ where each trace added others
    after)."""
    position = {node: i for i, node in enumerate(prefix)}
    theirs_at = {node: i for i, node in enumerate(other[: len(prefix)])}

    def shape(node: torch.fx.Node, at: dict[torch.fx.Node, int]) -> str:
        args = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n: f"%{at.get(n, n.name)}"
        )
        return f"{node.op} {node.target} {args!r}"

    others: list[torch.fx.Node | None] = list(other[: len(prefix)])
    others += [None] * (len(prefix) - len(others))
    for mine, theirs in zip(prefix, others, strict=True):
        if theirs is None or shape(mine, position) != shape(theirs, theirs_at):
            raise PrecompileError(
                f"fn recorded other tensor operations before the branch at "
                f"{branch.where} when traced again for its other side ({mine} "
                f"then, {theirs} now): its Python depends on something besides its "
                f"arguments, which the artifact cannot follow. {_FIX}"
            )


def _operands(sides: list[_Side], prefix: set[str], split: int) -> list[str]:
    """The values before the branch that the rest of any side reads, in order: a
    view's base rather than the view, for a torch.cond's operands must not alias
    each other (the subgraph takes the view again)."""
    used: set[str] = set()
    for gm, _ in sides:
        for node in list(gm.graph.nodes)[split:]:
            used.update(_base(n).name for n in node.all_input_nodes if n.name in prefix)
    first = list(sides[0][0].graph.nodes)[:split]
    return [node.name for node in first if node.name in used]


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``node`` is a view of, through any chain of views; else itself."""
    while _is_view(node):
        node = node.args[0]  # type: ignore[assignment]
    return node


def _is_view(node: torch.fx.Node) -> bool:
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and node.target.is_view
        and isinstance(node.args[0], torch.fx.Node)
    )


def _tail(
    gm: torch.fx.GraphModule,
    split: int,
    operands: list[str],
    constants: dict[str, _Constant],
) -> torch.fx.GraphModule:
    """The rest of ``gm`` after its first ``split`` nodes, as a graph of
    ``operands`` (among them the ``constants`` it reads); a view before the branch
    that it reads is taken again there."""
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    old = {node.name: node for node in gm.graph.nodes}
    for name in operands:
        env[name] = graph.placeholder(name)
        constant = constants.get(name)
        example = old[name].meta["val"] if constant is None else constant.tensor
        env[name].meta = {"val": example}
    for node in list(gm.graph.nodes)[split:]:
        if "branch_operand" in node.meta:  # a constant, passed in (``_constants``)
            env[node.name] = env[node.meta["branch_operand"]]

    def value(node: torch.fx.Node) -> torch.fx.Node:
        if node.name not in env:  # a view before the branch, of an operand
            env[node.name] = graph.node_copy(node, value)
        return env[node.name]

    attributes: dict[str, Any] = {}
    for node in list(gm.graph.nodes)[split:]:
        if node.op == "output":
            graph.output(tuple(value(n) for n in _output_nodes(node)))
            break
        if node.name in env or (
            node.op == "get_attr"
            and not isinstance(getattr(gm, str(node.target)), torch.nn.Module)
        ):
            continue  # passed in, or a constant whose copies are
        env[node.name] = graph.node_copy(node, value)
        if node.op == "get_attr":
            attributes[str(node.target)] = getattr(gm, str(node.target))
    return torch.fx.GraphModule(attributes, graph)


@dataclass
class _Functional:
    """A side's subgraph that writes none of its inputs: it returns the values it
    wrote to the operands ``written`` (indices) after its own outputs."""

    gm: torch.fx.GraphModule
    written: list[int]
    num_outputs: int


def _functional(gm: torch.fx.GraphModule, names: list[str]) -> _Functional:
    """``gm`` (whose inputs are the operands ``names``) traced again without its
    writes to its inputs (functionalized, as torch.cond requires of a branch)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    blanks = [_blank(node.meta["val"]) for node in placeholders]
    traced = make_fx(functionalize(gm, remove="mutations"), tracing_mode="fake")(
        *blanks
    )
    graph_names.name_inputs(traced, names)
    inputs = list(traced.graph.find_nodes(op="placeholder"))
    writes: dict[int, torch.fx.Node] = {}
    for node in list(traced.graph.nodes):
        if node.target is torch.ops.aten.copy_.default and node.args[0] in inputs:
            writes[inputs.index(node.args[0])] = node.args[1]  # type: ignore[index]
            traced.graph.erase_node(node)
    output = traced.graph.output_node()
    outputs = _output_nodes(output)
    written = sorted(writes)
    output.args = (tuple(outputs + [writes[index] for index in written]),)
    traced.graph.eliminate_dead_code()  # functionalization's unused view copies
    traced.recompile()
    return _Functional(traced, written, len(outputs))


def _blank(value: torch.Tensor) -> torch.Tensor:
    # Fake tracing reads only the layout of what it is given.
    return torch.empty_strided(
        value.shape, value.stride(), dtype=value.dtype, device=value.device
    )


def _return_written(subgraph: _Functional, written: list[int]) -> None:
    """Have ``subgraph`` return a value for each operand in ``written``: the one it
    wrote, or a copy of the operand where it wrote none; no output an alias."""
    graph = subgraph.gm.graph
    output = graph.output_node()
    values = _output_nodes(output)
    outputs, own = values[: subgraph.num_outputs], values[subgraph.num_outputs :]
    inputs = list(graph.find_nodes(op="placeholder"))
    mine = dict(zip(subgraph.written, own, strict=True))
    values = outputs + [mine.get(index, inputs[index]) for index in written]
    with graph.inserting_before(output):
        output.args = (tuple(_unaliased(graph, values)),)
    subgraph.gm.recompile()
    subgraph.written = written


def _output_nodes(output: torch.fx.Node) -> list[torch.fx.Node]:
    (values,) = output.args
    nodes = []
    for value in values if isinstance(values, (list, tuple)) else [values]:
        if not isinstance(value, torch.fx.Node):
            raise PrecompileError(
                f"fn returns a Python value ({value!r}) after a branch on a tensor's "
                f"value. Return tensors there, or return the value before it. {_FIX}"
            )
        nodes.append(value)
    return nodes


def _unaliased(
    graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node]
) -> list[torch.fx.Node]:
    """``nodes`` as a torch.cond branch may return them: an input, a view of one, or
    a second view of one base (a returned ``loss.detach()`` and ``loss``) copied,
    for a branch's outputs alias neither its inputs nor each other."""
    bases: set[torch.fx.Node] = set()
    distinct = []
    for node in nodes:
        base = _base(node)
        if base.op == "placeholder" or base in bases:
            copy = graph.call_function(torch.ops.aten.clone.default, (node,))
            copy.meta = dict(node.meta)
            node = copy
        else:
            bases.add(base)
        distinct.append(node)
    return distinct


def _shapes(gm: torch.fx.GraphModule) -> list[tuple[object, ...]]:
    """The shape, dtype and device of each tensor ``gm`` returns."""
    return [_described(value) for value in _output_vals(gm)]


def _output_vals(gm: torch.fx.GraphModule) -> list[object]:
    return [node.meta.get("val") for node in _output_nodes(gm.graph.output_node())]


def _described(value: object) -> tuple[object, ...]:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    return (type(value),)


def _with_cond(
    gm: torch.fx.GraphModule,
    split: int,
    operands: list[str],
    constants: dict[str, _Constant],
    subgraphs: dict[bool, _Functional],
    example: bool,
    written: list[int],
) -> torch.fx.GraphModule:
    """``gm``'s first ``split`` nodes, then a torch.cond on the last of them (the
    branch's predicate) between ``subgraphs``, whose outputs gm returns but for the
    last ``written``: the new values of those operands, copied into them. The
    ``constants`` among the operands are attributes of the new graph; the example's
    side (``example``) gives the outputs' metadata."""
    graph = torch.fx.Graph()
    # make_fx's graph takes its inputs as one list (fx's pytree codegen); a
    # subgraph takes them one by one.
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[str, torch.fx.Node] = {}
    attributes: dict[str, Any] = {}
    nodes = list(gm.graph.nodes)
    for node in nodes[:split]:
        env[node.name] = graph.node_copy(node, lambda n: env[n.name])
        if node.op == "get_attr":
            attributes[str(node.target)] = getattr(gm, str(node.target))
    for name, constant in constants.items():
        attributes[name] = constant.tensor
        env[name] = graph.get_attr(name)
        if constant.fresh is not None:
            env[name] = graph.call_function(constant.fresh, (env[name],))
    number = sum(name.startswith("true_graph_") for name in attributes)
    sides = []
    for outcome in (True, False):
        name = f"{str(outcome).lower()}_graph_{number}"
        attributes[name] = subgraphs[outcome].gm
        sides.append(graph.get_attr(name))
    predicate = env[nodes[split - 1].name]
    cond = graph.call_function(
        torch.ops.higher_order.cond,
        (predicate, *sides, tuple(env[name] for name in operands)),
    )
    items = []
    for index, value in enumerate(_output_vals(subgraphs[example].gm)):
        item = graph.call_function(operator.getitem, (cond, index))
        item.meta["val"] = value
        items.append(item)
    outputs = items[: len(items) - len(written)]
    for index, value in zip(written, items[len(outputs) :], strict=True):
        graph.call_function(torch.ops.aten.copy_.default, (env[operands[index]], value))
    graph.output(outputs)
    codegen = graph._codegen
    if isinstance(codegen, torch.fx.graph._PyTreeCodeGen):
        # The outputs may be more than the trace's: a path's step taken or not.
        spec = pytree.tree_structure(list(outputs))
        codegen.pytree_info = codegen.pytree_info._replace(out_spec=spec)
    return torch.fx.GraphModule(attributes, graph)
