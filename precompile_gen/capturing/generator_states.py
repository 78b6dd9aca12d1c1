"""The generator states ``fn`` saves and restores while it is traced: activation
checkpointing's recompute draws its random numbers again from the state the forward
drew them from.

Eager's ``torch.utils.checkpoint`` (reentrant or not, ``checkpoint_sequential``,
selective checkpointing, a library's gradient checkpointing) saves the global
generator's state before the checkpointed forward and, when the backward recomputes
that forward, sets the state back for the recompute and restores the later state
after it (``preserve_rng_state``). The trace sees only the ops: without more, the
graph's recompute would draw the next numbers of the stream, a dropout mask other than
the forward's, and leave the generator one recompute ahead of eager's.

While make_fx runs, ``recording`` notes where in the graph ``fn`` reads, sets or seeds
a generator's state. ``repeat_first_draws`` then follows each generator through the
graph, a state being the draws made since a known point, and finds every draw made
from a state the stream had already passed: a repeat of the first draw made from it.
A repeat of the same op on the same shapes and values draws the same numbers, so the
graph keeps the first draw's numbers and the repeat reads them instead of drawing:
the generator moves as eager's does, and the graph holds plain ops, which both
backends run as they run any (``torch.compile`` too keeps a checkpointed region's
dropout mask for its backward). A repeat the graph cannot prove to be one (another op
or shape, inputs the region updates in place), and any other change of a generator's
state inside ``fn`` (a seed, a state set from outside, draws whose stream is then
discarded), is refused, naming the line.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.experimental import proxy_tensor

from precompile_gen.capturing import data_dependent, refusals, update_order
from precompile_gen.runtime.errors import PrecompileError

_FIX = (
    "Seed and set torch's generator outside the function, before the call "
    "(torch.manual_seed), or draw outside it and pass the random tensor in as an "
    "argument. Activation checkpointing's own saving and restoring of the state "
    "(preserve_rng_state) is supported."
)


@dataclass
class _Event:
    """A read, set or seed of one generator's state, after ``after`` in the graph."""

    kind: str  # "save", "restore" or "seed"
    device: str
    after: torch.fx.Node | None
    line: str
    # The state tensor read or set; a seed's value.
    value: object = None


@dataclass
class Recorded:
    """What ``fn`` did to the generators' states while it was traced."""

    events: list[_Event] = field(default_factory=list)

    def note(self, kind: str, device: str, value: object) -> None:
        mode = proxy_tensor.get_proxy_mode()
        if mode is not None:
            after = _last_kept(mode.tracer.graph)
        else:
            # Tracing paused (no op is recorded meanwhile): where the last event was.
            after = self.events[-1].after if self.events else None
        line = data_dependent.user_line(code=False)
        self.events.append(_Event(kind, device, after, line, value))


def _last_kept(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The graph's last node that the trace keeps: a symbolic trace erases the
    nodes of size arithmetic nothing reads (``sym_size``, ``eq``) when it ends."""
    for node in reversed(graph.nodes):
        if not isinstance(
            node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)
        ):
            return node
    return None


@contextlib.contextmanager
def recording() -> Generator[Recorded]:
    """Note every read, set and seed of torch's generators' states while the block
    runs (make_fx tracing ``fn``); the functions still do what they do."""
    recorded = Recorded()
    with contextlib.ExitStack() as stack:
        for owner, name, replacement in _recorders(recorded):
            stack.enter_context(refusals.patched(owner, name, replacement))
        yield recorded


def _recorders(recorded: Recorded) -> list[tuple[object, str, Callable[..., Any]]]:
    get_cpu, set_cpu = torch.random.get_rng_state, torch.random.set_rng_state
    seed_cpu = torch.random.manual_seed
    get_cuda, set_cuda = torch.cuda.get_rng_state, torch.cuda.set_rng_state

    def get_rng_state() -> torch.Tensor:
        state = get_cpu()
        recorded.note("save", "cpu", state)
        return state

    def set_rng_state(new_state: torch.Tensor) -> None:
        recorded.note("restore", "cpu", new_state)
        set_cpu(new_state)

    def manual_seed(seed: int) -> torch.Generator:
        # torch.manual_seed seeds every device's default generator.
        for device in ("cpu", *_cuda_devices()):
            recorded.note("seed", device, seed)
        return seed_cpu(seed)

    def cuda_get_rng_state(device: int | str | torch.device = "cuda") -> torch.Tensor:
        state = get_cuda(device)
        recorded.note("save", _cuda_name(device), state)
        return state

    def cuda_set_rng_state(
        new_state: torch.Tensor, device: int | str | torch.device = "cuda"
    ) -> None:
        recorded.note("restore", _cuda_name(device), new_state)
        set_cuda(new_state, device)

    return [
        (torch, "get_rng_state", get_rng_state),
        (torch.random, "get_rng_state", get_rng_state),
        (torch, "set_rng_state", set_rng_state),
        (torch.random, "set_rng_state", set_rng_state),
        (torch, "manual_seed", manual_seed),
        (torch.random, "manual_seed", manual_seed),
        (torch.cuda, "get_rng_state", cuda_get_rng_state),
        (torch.cuda, "set_rng_state", cuda_set_rng_state),
    ]


def _cuda_devices() -> list[str]:
    if not torch.cuda.is_initialized():
        return []
    return [f"cuda:{index}" for index in range(torch.cuda.device_count())]


def _cuda_name(device: int | str | torch.device) -> str:
    device = torch.device(device) if not isinstance(device, int) else device
    index = device if isinstance(device, int) else device.index
    return f"cuda:{torch.cuda.current_device() if index is None else index}"


# --- Following the generators through the graph -------------------------------------


@dataclass
class _Stream:
    """One generator as the trace moved it and as the graph moves it. A state is the
    draws made since a known point, interned as a number; the graph's state moves
    only with the draws it makes anew."""

    states: dict[tuple[object, ...], int]
    current: int
    graph: int
    # The first draw the graph made from each state, for its repeats to draw from.
    first_draws: dict[int, torch.fx.Node] = field(default_factory=dict)
    # The event that last set ``current`` to a state the graph has not reached.
    moved_by: _Event | None = None

    def state(self, key: tuple[object, ...]) -> int:
        return self.states.setdefault(key, len(self.states))


@dataclass
class _Replays:
    """Each first draw the graph makes again, with the draws that repeat it."""

    of: dict[torch.fx.Node, list[torch.fx.Node]] = field(default_factory=dict)


def _follow(graph: torch.fx.Graph, recorded: Recorded, fn_name: str) -> _Replays:
    after: dict[torch.fx.Node | None, list[_Event]] = {}
    for event in recorded.events:
        after.setdefault(event.after, []).append(event)
    streams: dict[str, _Stream] = {}
    saved: dict[int, tuple[str, int]] = {}
    replays = _Replays()

    def stream(device: str) -> _Stream:
        if device not in streams:
            states: dict[tuple[object, ...], int] = {}
            start = states.setdefault(("start", device), 0)
            streams[device] = _Stream(states, start, start)
        return streams[device]

    def apply(events: list[_Event]) -> None:
        for event in events:
            _apply_event(event, stream(event.device), saved, fn_name)

    apply(after.pop(None, []))
    for node in graph.nodes:
        if _draws(node):
            _apply_draw(node, stream(_device(node)), replays, fn_name)
        apply(after.pop(node, []))
    _check_ends(streams, after, fn_name)
    return replays


def _check_ends(
    streams: dict[str, _Stream],
    unplaced: dict[torch.fx.Node | None, list[_Event]],
    fn_name: str,
) -> None:
    """Refuse a trace whose generators end elsewhere than the graph leaves them, or
    whose events lost their place in it."""
    if unplaced:
        # An event's place was erased from the graph: following the generators
        # without it could pair the wrong draws.
        raise PrecompileError(
            f"capture lost track of where {fn_name!r} saved or restored torch's "
            "generator state in the graph, so it cannot make activation "
            "checkpointing's recompute draw what the forward drew. Capture without "
            "mark_unbacked dims, or without checkpointing the region that draws."
        )
    for stream in streams.values():
        if stream.current != stream.graph:
            raise _unrepeatable(
                fn_name,
                stream.moved_by,
                "ends the call with the generator elsewhere than the draws the graph "
                "makes would leave it",
            )


def _apply_event(
    event: _Event, stream: _Stream, saved: dict[int, tuple[str, int]], fn_name: str
) -> None:
    if event.kind == "save":
        saved[id(event.value)] = (event.device, stream.current)
        return
    known = saved.get(id(event.value)) if event.kind == "restore" else None
    if known is not None and known[0] == event.device:
        stream.current = known[1]
    else:
        # A seed, or a state from outside the call: a point the graph cannot reach.
        stream.current = stream.state(("set", id(event), event.device))
    if stream.current != stream.graph:
        stream.moved_by = event


def _apply_draw(
    node: torch.fx.Node, stream: _Stream, replays: _Replays, fn_name: str
) -> None:
    drawn_from = stream.current
    stream.current = stream.state((drawn_from, _signature(node)))
    if drawn_from == stream.graph:
        stream.graph = stream.current
        stream.first_draws.setdefault(drawn_from, node)
    elif drawn_from in stream.first_draws:
        replays.of.setdefault(stream.first_draws[drawn_from], []).append(node)
    else:
        raise _unrepeatable(
            fn_name, stream.moved_by, f"draws with {node.target} from that state"
        )


def _unrepeatable(fn_name: str, event: _Event | None, then: str) -> PrecompileError:
    what = {
        "seed": "seeds torch's generator",
        "restore": "sets torch's generator to a saved state",
        "save": "reads torch's generator state",
    }[event.kind if event is not None else "restore"]
    where = f" at {event.line}" if event is not None else ""
    return PrecompileError(
        f"{fn_name!r} {what}{where} and then {then}, which the artifact cannot do "
        "as eager does: it repeats only the draws that activation checkpointing's "
        "recompute makes again from the forward's saved state, and no other change "
        f"of a generator's state inside the function. {_FIX}"
    )


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws from a global generator (a generator of the function's
    own, ``generator=g``, is refused by ``python_state``)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in target.tags
        and node.kwargs.get("generator") is None
    )


def _device(node: torch.fx.Node) -> str:
    value = _first_tensor(node.meta.get("val"))
    if value is None or value.device.type == "cpu":
        return "cpu"
    return str(value.device)


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def _signature(node: torch.fx.Node) -> tuple[object, ...]:
    """What decides how far a draw moves the generator: the op, its arguments'
    shapes and types, and its other arguments' values."""

    def describe(argument: object) -> object:
        if isinstance(argument, torch.fx.Node):
            value = argument.meta.get("val")
            if isinstance(value, torch.Tensor):
                return (_sizes(value.shape), value.dtype, str(value.device))
            return repr(value)
        if isinstance(argument, (list, tuple)):
            return tuple(describe(a) for a in argument)
        return repr(argument)

    kwargs = tuple(sorted((k, describe(v)) for k, v in node.kwargs.items()))
    return (str(node.target), describe(node.args), kwargs)


# --- Reading the first draw's numbers where a repeat drew ----------------------------

# Ops that return their argument's value: a repeat may read the first draw's inputs
# through them (the saved tensors checkpointing unpacks, the inputs reentrant
# checkpointing detaches).
_SAME_VALUE = {
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.clone.default,
}


def repeat_first_draws(
    gm: torch.fx.GraphModule, recorded: Recorded, fn_name: str
) -> int:
    """Make every draw the trace made again from a restored state read the numbers
    the first draw from that state drew; refuse what the graph cannot repeat. The
    number of repeats."""
    replays = _follow(gm.graph, recorded, fn_name)
    if not replays.of:
        return 0
    graph = gm.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    writes = update_order.write_positions(graph)
    for first, repeats in replays.of.items():
        for repeat in repeats:
            _check_repeat(first, repeat, order, writes, fn_name)
    for first, repeats in replays.of.items():
        kept = _keep(graph, first, order, writes)
        for repeat in repeats:
            _read_kept(graph, kept, repeat)
    graph.lint()
    gm.recompile()
    return sum(len(repeats) for repeats in replays.of.values())


def _check_repeat(
    first: torch.fx.Node,
    repeat: torch.fx.Node,
    order: dict[torch.fx.Node, int],
    writes: dict[torch.fx.Node, list[int]],
    fn_name: str,
) -> None:
    """Refuse ``repeat`` unless it draws what ``first`` drew: the same op on the same
    layouts and values (inputs computed alike, none updated in place between)."""
    read: set[torch.fx.Node] = set()
    same = first.target == repeat.target and len(first.args) == len(repeat.args)
    if same:
        templates = _layout_only(first)
        pairs = [
            *zip(first.args, repeat.args, strict=True),
            *((first.kwargs.get(k), repeat.kwargs.get(k)) for k in first.kwargs),
        ]
        same = set(first.kwargs) == set(repeat.kwargs) and all(
            _same_layout(a, b) if index in templates else _same_argument(a, b, read)
            for index, (a, b) in enumerate(pairs)
        )
    if same:
        start = min((order[node] for node in read), default=order[repeat])
        same = not any(
            max(start, order[node]) < at < order[repeat]
            for node in read
            for at in writes.get(node, [])
        )
    if not same:
        raise PrecompileError(
            f"in {fn_name!r}, activation checkpointing recomputes the random op "
            f"{first.target} from "
            "the forward's saved generator state, and the artifact cannot show that "
            "the recompute draws what the forward drew: it runs "
            f"{repeat.target} on other shapes or values, or on a tensor updated in "
            "place in between. Keep the checkpointed region's random ops on "
            "tensors the region computes without in-place updates, or move the "
            "random op out of the checkpointed function."
        )


def _layout_only(draw: torch.fx.Node) -> set[int]:
    """The positions of the arguments whose layout, not value, the draw reads: the
    tensor an in-place fill writes, or a ``*_like`` op copies the shape of."""
    target = draw.target
    assert isinstance(target, torch._ops.OpOverload)
    first = target._schema.arguments[0] if target._schema.arguments else None
    fills = first is not None and first.alias_info is not None
    likes = target._schema.name.endswith("_like")
    return {0} if fills or likes or target in _FILL_VARIANTS else set()


# Out-of-place fills: their first argument gives the result's layout only.
_FILL_VARIANTS = {
    torch.ops.aten.bernoulli.p,
    torch.ops.aten.uniform.default,
    torch.ops.aten.normal_functional.default,
    torch.ops.aten.exponential.default,
    torch.ops.aten.cauchy.default,
    torch.ops.aten.log_normal.default,
    torch.ops.aten.geometric.default,
}


def _same_layout(a: object, b: object) -> bool:
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    x, y = a.meta.get("val"), b.meta.get("val")
    return (
        isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and (_sizes(x.shape), _sizes(x.stride()), x.dtype, x.device)
        == (_sizes(y.shape), _sizes(y.stride()), y.dtype, y.device)
    )


def _sizes(sizes: Sequence[int | torch.SymInt]) -> tuple[str, ...]:
    # A mark_unbacked dim is a symbol: equal where it is the same one, compared as
    # text, which asks the shape environment nothing (nor records a guard).
    return tuple(str(size) for size in sizes)


def _same_argument(a: object, b: object, read: set[torch.fx.Node]) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(
            _same_argument(x, y, read) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
        return _computed_alike(a, b, read)
    return type(a) is type(b) and a == b


def _computed_alike(
    a: torch.fx.Node, b: torch.fx.Node, read: set[torch.fx.Node]
) -> bool:
    """Whether ``a`` and ``b`` are one value: one node, or the same pure op on
    arguments computed alike. ``read`` gathers the nodes whose memory must then not
    be written between the reads."""
    a, b = _through_copies(a), _through_copies(b)
    read.update((a, b))
    if a is b:
        return True
    if not (_pure(a) and a.target == b.target and len(a.args) == len(b.args)):
        return False
    if set(a.kwargs) != set(b.kwargs):
        return False
    return all(
        _same_argument(x, y, read)
        for x, y in (
            *zip(a.args, b.args, strict=True),
            *((a.kwargs[k], b.kwargs[k]) for k in a.kwargs),
        )
    )


def _through_copies(node: torch.fx.Node) -> torch.fx.Node:
    while node.target in _SAME_VALUE and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _pure(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    return (
        isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and not update_order.writes(node)
    )


def _keep(
    graph: torch.fx.Graph,
    first: torch.fx.Node,
    order: dict[torch.fx.Node, int],
    writes: dict[torch.fx.Node, list[int]],
) -> list[torch.fx.Node | None]:
    """The first draw's numbers, one node a result: a copy taken right after the
    draw where the graph writes them later (dropout scales its mask in place)."""
    if isinstance(first.meta.get("val"), torch.Tensor):
        results: list[torch.fx.Node | None] = [first]
    else:
        results = [
            _item(graph, first, index) for index in range(len(first.meta["val"]))
        ]
    kept: list[torch.fx.Node | None] = []
    for result in results:
        if result is None or not any(
            at > order[first] for at in writes.get(result, [])
        ):
            kept.append(result)
            continue
        with graph.inserting_after(result):
            copy = graph.call_function(torch.ops.aten.clone.default, (result,))
        copy.meta = dict(result.meta)
        kept.append(copy)
    return kept


def _item(
    graph: torch.fx.Graph, node: torch.fx.Node, index: int
) -> torch.fx.Node | None:
    """The node of item ``index`` of a draw with several results (native_dropout's
    output and mask), made if the graph has none; None for a result that is no
    tensor."""
    value = node.meta["val"][index]
    if not isinstance(value, torch.Tensor):
        return None
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = value
    return item


def _read_kept(
    graph: torch.fx.Graph, kept: list[torch.fx.Node | None], repeat: torch.fx.Node
) -> None:
    """Replace the draw ``repeat`` by copies of the numbers ``kept``: written into the
    tensor an in-place fill fills, or as each result a reader takes."""
    if len(kept) == 1 and kept[0] is not None:
        target = repeat.target
        assert isinstance(target, torch._ops.OpOverload)
        fills = _layout_only(repeat) and target._schema.arguments[0].alias_info
        with graph.inserting_before(repeat):
            copy = (
                graph.call_function(
                    torch.ops.aten.copy_.default, (repeat.args[0], kept[0])
                )
                if fills
                else graph.call_function(torch.ops.aten.clone.default, (kept[0],))
            )
        copy.meta = dict(repeat.meta)
        repeat.replace_all_uses_with(copy)
    else:
        for user in list(repeat.users):
            index = user.args[1]
            assert user.target is operator.getitem and isinstance(index, int)
            source = kept[index]
            assert source is not None
            with graph.inserting_before(user):
                copy = graph.call_function(torch.ops.aten.clone.default, (source,))
            copy.meta = dict(user.meta)
            user.replace_all_uses_with(copy)
            graph.erase_node(user)
    graph.erase_node(repeat)
