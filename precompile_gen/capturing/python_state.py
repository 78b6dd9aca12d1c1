"""Python state: the values a trace reads and specialises on, the writes it refuses.

make_fx records only tensor operations: a Python value the traced code reads (a
module's ``temperature``, a config flag, a global ``SCALE``, ``nn.Dropout.p``) is
built into the graph as a constant, and a Python effect (a counter incremented, an
entry appended, a global rebound) happens once, at capture. Neither shows in the
graph, so neither is visible to the driver. (A draw from ``random`` or NumPy is
``refused_draws``' business; the pass refuses it too.)

What was read is learnt from Dynamo's guards, gathered over one extra run of ``fn`` at
capture on deep copies of the arguments, with numbers specialised as make_fx does:
each guard that pins a plain value says where the value came from (its source) and
what it was. Dynamo also tracks every mutation of an object that existed before the
call, which is how effects are found, before the frame that makes them runs. The
loading process never sees Dynamo: it reads the values by their paths (the artifact's
``PYTHON_VALUES``, checked by the runtime support's ``_python_values_hold``) and
compares their ``repr``.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import logging
import re
import sys
import sysconfig
import types
import warnings
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from precompile_gen.capture_result import PythonValue
from precompile_gen.capturing import (
    convention,
    data_parallel,
    graph_names,
    refusals,
    refused_draws,
)
from precompile_gen.capturing.graph_inputs import function_name
from precompile_gen.runtime.errors import listed
from precompile_gen.tools import timings

log = logging.getLogger(__name__)

# Whose module globals are the library's own state, not the program's: torch reads
# its flags and registries on every call, and the other checks cover what matters
# of them (modes, hooks, grad mode).
_LIBRARY_MODULES = ("torch", "precompile_gen")
# Where a frame is not the user's: torch, this package, and what is installed
# (transformers, timm, the standard library). A message names the innermost frame
# outside these; and what they write is theirs (libraries keep caches and context
# state of their own, set and reset within a call), not refused.
_LIBRARY_FILES = tuple(
    str(module.__file__).rsplit("/", 1)[0] + "/"
    for module in (torch, sys.modules[__name__.split(".", 1)[0]])
) + tuple(
    sorted(
        {
            path.rstrip("/") + "/"
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (path := sysconfig.get_paths().get(key))
        }
    )
)


@dataclass
class _Reads:
    """What the Dynamo pass saw, frame by frame."""

    # Each argument and submodule of a module argument, by id, with its position
    # and accessor path: where the values read through it are said to come from.
    paths: dict[int, tuple[int, str]]
    # The ids of the objects that existed before the call (those, and what the
    # function's closure holds): writing to one, or to anything reached through one,
    # is an effect.
    roots: set[int]
    values: dict[str, PythonValue] = field(default_factory=dict)
    # Paths of values kept by the artifact that no call can check (fn's own closure).
    unresolved: list[str] = field(default_factory=list)
    effects: list[tuple[str, str]] = field(default_factory=list)


def observe(
    fn: Callable[..., object], example_inputs: tuple[object, ...]
) -> list[PythonValue]:
    """The Python values ``fn(*example_inputs)`` reads and specialises on, each with
    a path from the call's arguments or a module's globals; a ``PrecompileError`` if
    it writes Python state that existed before the call."""
    try:
        copied_fn, copies = _copies(fn, example_inputs)
    except Exception as error:
        _warn_unrecorded(fn, f"its arguments cannot be deep-copied ({error})")
        return []
    paths = _argument_paths(copies)
    reads = _Reads(paths=paths, roots=_roots(copied_fn, paths))
    try:
        with (
            timings.stage("capture: python values"),
            _dynamo_pass(reads, fn, copied_fn, copies) as compiled,
        ):
            compiled(*copies)
    except Exception as error:
        refusal = refusals.refusal_in(error)
        if refusal is not None:
            raise refusal from None
        if reads.effects:
            _refuse_effects(fn, reads.effects)
        # fn failing here fails the trace too, with the message the user needs; one
        # that only Dynamo cannot run leaves its reads unknown.
        _warn_unrecorded(fn, f"Dynamo could not run it ({type(error).__name__})")
        return []
    if reads.unresolved:
        log.warning(
            "%r reads values that the artifact keeps as traced and no call can "
            "check, since the artifact is not given the function: %s. Pass them as "
            "arguments, or keep them as module attributes or globals, to have them "
            "checked.",
            function_name(fn),
            listed(reads.unresolved, str),
        )
    return sorted(reads.values.values())


@contextlib.contextmanager
def kept_as_found(
    example_inputs: tuple[object, ...], values: list[PythonValue]
) -> Generator[None]:
    """Each value of ``values`` that sits in an argument set back, after the block,
    to the object it held before: the trace runs the function once on the real
    arguments, and a write the function makes to what it reads (transformers sets
    its config's ``problem_type`` on the first call that has labels) must not outlive
    the capture, which leaves the model as it found it. The graph was traced with
    the value read, which the artifact checks at every call."""
    places = []
    for value in values:
        place = convention.python_value_holder(example_inputs, value.path)
        if place is not None:
            places.append((value.path, *place, _held(*place)))
    try:
        yield
    finally:
        for path, holder, attribute, key, before in places:
            if _held(holder, attribute, key) is not before:
                try:
                    _set_held(holder, attribute, key, before)
                except (AttributeError, LookupError, TypeError) as error:
                    # A read-only place (a property) the function changed anyway.
                    log.warning("capture could not set %s back: %s", path, error)


_ABSENT = object()


def _held(holder: Any, attribute: str, key: object) -> object:
    try:
        return getattr(holder, attribute) if attribute else holder[key]
    except (AttributeError, LookupError, TypeError):
        return _ABSENT


def _set_held(holder: Any, attribute: str, key: object, value: object) -> None:
    if attribute and value is _ABSENT:
        delattr(holder, attribute)
    elif attribute:
        setattr(holder, attribute, value)
    elif value is _ABSENT:
        del holder[key]
    else:
        holder[key] = value


def _copies(
    fn: Callable[..., object], example_inputs: tuple[object, ...]
) -> tuple[Callable[..., object], tuple[object, ...]]:
    """Copies of the arguments, and ``fn`` over copies of the objects its closure
    and its globals hold (an optimizer, a loss module, a list), all made together so
    that they share what the originals share: the extra run must change nothing of
    the caller's, and may run ``fn`` in full."""
    memo: dict[int, object] = {}
    copies = copy.deepcopy(example_inputs, memo)
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn, copies
    cells = tuple(
        types.CellType(_copy_or_share(cell.cell_contents, memo))
        for cell in fn.__closure__ or ()
    )
    namespace = dict(fn.__globals__)
    for name in code.co_names:
        if name in namespace and isinstance(namespace[name], _STATEFUL):
            namespace[name] = _copy_or_share(namespace[name], memo)
    copied = types.FunctionType(code, namespace, fn.__name__, fn.__defaults__, cells)
    copied.__kwdefaults__ = fn.__kwdefaults__
    _steps_unobserved(memo.values())
    return copied, copies


def _steps_unobserved(copies: Iterable[object]) -> None:
    """Each copied optimizer of torch.optim's own steps without Dynamo in the pass:
    what its step reads through it is the optimizer checks' business (OPTIMIZERS),
    and what it writes is its own, so Dynamo tracing it (seconds, for a large model's
    AdamW) would record nothing. A step given a closure still runs under Dynamo, as
    does an optimizer of a class of the user's or one with step hooks: the user's
    code they run may read the user's state."""
    from torch.optim import optimizer

    if optimizer._global_optimizer_pre_hooks or optimizer._global_optimizer_post_hooks:
        return
    for copied in copies:
        if (
            isinstance(copied, torch.optim.Optimizer)
            and type(copied).__module__.startswith("torch.optim.")
            and not copied._optimizer_step_pre_hooks
            and not copied._optimizer_step_post_hooks
        ):
            copied.step = _stepping_eagerly(copied.step)


def _stepping_eagerly(step: Callable[..., Any]) -> Callable[..., Any]:
    eagerly = torch._dynamo.disable(step)

    def stepping(closure: Callable[[], Any] | None = None) -> Any:
        return eagerly() if closure is None else step(closure)

    return stepping


# Globals worth copying: what a function may change in place.
_STATEFUL = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, list, dict, set)


def _copy_or_share(value: object, memo: dict[int, object]) -> object:
    # What cannot be copied (a logger, a file) is shared: the run may use it, as
    # the trace after it does.
    try:
        return copy.deepcopy(value, memo)
    except Exception:
        return value


def _roots(fn: Callable[..., object], paths: dict[int, tuple[int, str]]) -> set[int]:
    roots = {id(fn), *paths}
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        roots.add(id(value))
        if isinstance(value, torch.nn.Module):
            roots.update(map(id, value.modules()))
    return roots


def _warn_unrecorded(fn: object, why: str) -> None:
    log.warning(
        "the Python values %r reads (module attributes, config fields, globals) "
        "could not be recorded, because %s: the artifact keeps the values it was "
        "traced with and cannot check them at call time.",
        function_name(fn),
        why,
    )


@contextlib.contextmanager
def _dynamo_pass(
    reads: _Reads,
    fn: Callable[..., object],
    copied_fn: Callable[..., object],
    copies: tuple[object, ...],
) -> Generator[Callable[..., object]]:
    import torch._dynamo

    compiled_codes: list[types.CodeType] = []
    patches, keep = _recording_patches(reads, fn, copied_fn, compiled_codes)
    entry, run_eagerly = _pass_entry(copied_fn), _pass_backend()
    with contextlib.ExitStack() as stack:
        for owner, name, replacement in patches:
            stack.enter_context(refusals.patched(owner, name, replacement))
        stack.enter_context(
            torch._dynamo.config.patch(
                # make_fx builds every number into the graph: so must the guards.
                specialize_int=True,
                specialize_float=True,
                assume_static_by_default=True,
                automatic_dynamic_shapes=False,
                suppress_errors=False,
                # A frame Dynamo gives up on runs unobserved: say so instead.
                fail_on_recompile_limit_hit=True,
            )
        )
        stack.enter_context(refused_draws.refusing_python_rng(fn))
        stack.enter_context(_distribution_validation_kept())
        stack.enter_context(_dynamo_quiet())
        try:
            yield torch.compile(
                entry, backend=run_eagerly, options={"guard_filter_fn": keep}
            )
        finally:
            # Release the pass's compiled frames: their guards hold the copies, and
            # each capture of the same function would add to their count.
            for code in compiled_codes:
                torch._dynamo.eval_frame.reset_code(code)


def _recording_patches(
    reads: _Reads,
    fn: Callable[..., object],
    copied_fn: Callable[..., object],
    compiled_codes: list[types.CodeType],
) -> tuple[list[tuple[object, str, object]], Callable[[Sequence[Any]], list[bool]]]:
    """The replacements of Dynamo's methods that note each compiled frame's scope
    and every mutation into ``reads``, and the guard filter that records a frame's
    guards as reads."""
    from torch._dynamo import guards, side_effects

    frame: dict[str, Any] = {}
    build_guards = guards.CheckFunctionManager.__init__

    def record_scope(self: Any, code: Any, output_graph: Any, *a: Any, **k: Any):
        # The frame whose guards follow: ``G[...]`` means its module's globals.
        frame["globals"] = output_graph.global_scope
        compiled_codes.append(code)
        build_guards(self, code, output_graph, *a, **k)

    def keep(entries: Sequence[Any]) -> list[bool]:
        if reads.effects:
            _refuse_effects(fn, reads.effects)
        _record(reads, entries, frame["globals"], copied_fn)
        return [True] * len(entries)

    store_attr = side_effects.SideEffects.store_attr
    mutation = side_effects.SideEffects.mutation

    def recording_store_attr(self: Any, item: Any, name: str, *a: Any, **k: Any):
        _note_effect(reads, item, name)
        return store_attr(self, item, name, *a, **k)

    def recording_mutation(self: Any, var: Any) -> None:
        _note_effect(reads, var, None)
        return mutation(self, var)

    patches: list[tuple[object, str, object]] = [
        (guards.CheckFunctionManager, "__init__", record_scope),
        (side_effects.SideEffects, "store_attr", recording_store_attr),
        (side_effects.SideEffects, "mutation", recording_mutation),
    ]
    return patches, keep


def _pass_backend() -> Callable[..., Any]:
    """A backend of the pass's own, new for each pass: Dynamo reuses a frame it
    compiled before (fn's own, after a graph break in it) only for the same backend,
    and a reused frame would not pass through the guard filter again."""

    # It runs each graph with its collectives computed locally: the pass runs on one
    # rank's copies, and must not wait for the other ranks (precompile_once captures
    # on one rank only).
    def run_eagerly(gm: torch.fx.GraphModule, example_inputs: object) -> Any:
        return data_parallel.locally(gm)

    return run_eagerly


def _pass_entry(copied_fn: Callable[..., object]) -> Callable[..., object]:
    """What the pass compiles: ``copied_fn`` behind a fresh code object, for the
    same reason as its backend."""

    def entry(*args: object) -> object:
        return copied_fn(*args)

    entry.__code__ = entry.__code__.replace()
    return entry


@contextlib.contextmanager
def _dynamo_quiet() -> Generator[None]:
    # What Dynamo says of the code it runs (graph breaks, builtins it cannot trace)
    # is about this pass, not the user's program: the trace after it speaks for that.
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        dynamo_log.setLevel(level)


@contextlib.contextmanager
def _distribution_validation_kept() -> Generator[None]:
    # Dynamo's first compile in a process turns torch.distributions' argument
    # validation off for everyone; the user's eager code keeps its own setting.
    validate = torch.distributions.Distribution._validate_args
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)


def _note_effect(reads: _Reads, item: Any, name: str | None) -> None:
    from torch._dynamo import side_effects
    from torch._dynamo.variables import TensorVariable

    existing = (
        side_effects.AttributeMutationExisting,
        side_effects.ValueMutationExisting,
    )
    # An object created during the call is the call's own business; a tensor's
    # attributes (.grad) are the gradient machinery's, which the artifact repeats.
    if not isinstance(item.mutation_type, existing) or isinstance(item, TensorVariable):
        return
    # "Existing" is per frame: an object fn created before a graph break is an
    # input of the frame compiled after it, and writing to it is fn's own business.
    if item.source is not None and not _existed_before_the_call(item.source, reads):
        return
    line = _writing_line()
    if line is None:
        return
    if item.source is None:
        target = "an object that existed before the call"
    else:
        target = _effect_target(item.source.name + (f".{name}" if name else ""))
    reads.effects.append((target, line))


def _existed_before_the_call(source: Any, reads: _Reads) -> bool:
    """Whether the object at ``source`` is, or is reached through, one that existed
    before the call: a module global, or one of ``reads.roots``."""
    from torch._dynamo.source import GlobalSource
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    scope = {"L": tx.f_locals, "G": tx.f_globals}
    while source is not None:
        if isinstance(source, GlobalSource):
            return True
        try:
            value = eval(source.name, dict(scope))
        except Exception:  # a name Dynamo writes with helpers of its own
            return True
        if id(value) in reads.roots:
            return True
        source = getattr(source, "base", None)
    return False


def _writing_line() -> str | None:
    """The user's line that makes the write Dynamo is tracing, or None where the
    write is the library's own (an optimizer's step creating its state, which the
    artifact handles itself)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._guards import TracingContext

    frames = [(s.filename, s.lineno, s.name) for s in TracingContext.extract_stack()]
    if not frames:
        tx = InstructionTranslator.current_tx()
        frames = [(tx.f_code.co_filename, tx.lineno, tx.f_code.co_name)]
    # nn.Module.__setattr__ makes the write of ``self.count = ...``.
    while (
        len(frames) > 1 and frames[-1][2] == "__setattr__" and _library(frames[-1][0])
    ):
        frames.pop()
    filename, lineno, name = frames[-1]
    # A dataclass's generated __init__ (compiled from "<string>") writes the fields
    # of the object being constructed, which is new, though Dynamo, compiling that
    # frame on its own, sees it as existing: DTensor's dispatch builds such records
    # on every op, a transformers model its ModelOutput.
    if filename == "<string>" and name == "__init__":
        return None
    return None if _library(filename) else f"{filename}:{lineno}"


def _library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_FILES)


_MEMBER_ITEM = re.compile(r"\._(?:modules|parameters|buffers)\['(\w+)'\]")
_GLOBAL = re.compile(r"G\['(\w+)'\]\.?(\w*)(.*)")
# The copied globals of the traced function, a dict Dynamo installs under a name of
# its own.
_COPIED_GLOBAL = re.compile(r"G\['___unnamed_scope_\w+'\]\['(\w+)'\](.*)")


def _effect_target(dynamo_name: str) -> str:
    """A written object in the words of PYTHON_VALUES' paths. Dynamo names what the
    pass's entry received ``L['args'][N]``, another module's globals
    ``G['__import_<module, its dots spelt _dot_>']``, the traced function's copied
    ones ``G['___unnamed_scope_<id>']``."""
    text = _MEMBER_ITEM.sub(r".\1", dynamo_name)
    if text.startswith("L['args']["):
        position, _, rest = text.removeprefix("L['args'][").partition("]")
        return f"argument {position}: {rest}" if rest else f"argument {position}"
    copied = _COPIED_GLOBAL.fullmatch(text)
    if copied is not None:
        name, rest = copied.groups()
        return f"global {name}{': ' + rest if rest else ''}"
    match = _GLOBAL.fullmatch(text)
    if match is None:
        # A local of a frame compiled on its own: L['self'].seen -> self.seen
        return re.sub(r"^L\['(\w+)'\]", r"\1", text)
    first, second, rest = match.groups()
    if not first.startswith("__import_"):
        return f"the global {first}"
    module = first.removeprefix("__import_").replace("_dot_", ".")
    return f"global {second} (module {module}){': ' + rest if rest else ''}"


def _refuse_effects(fn: object, effects: list[tuple[str, str]]) -> None:
    target, line = effects[0]
    name = function_name(fn)
    raise refusals.refusal(
        f"{name!r} changes Python state that exists outside the call: it writes "
        f"{_in_words(fn, target)} at {line}. The trace would make that write once, "
        "at capture, and the artifact never again, so a counter or a log kept this "
        "way would silently stop changing. Move the write out of the function "
        "(before or after the call, using what it returns), or keep the state in a "
        "tensor buffer (register_buffer) updated in place."
    )


def _in_words(fn: object, target: str) -> str:
    # An argument's part as messages name it: "argument 0 (`model.calls`)".
    head, _, rest = target.partition(": ")
    if not head.startswith("argument "):
        return target
    position = int(head.removeprefix("argument "))
    names = graph_names.argument_names(cast(Any, fn), position + 1)
    return convention.argument(position, names, rest)


# --- Reads --------------------------------------------------------------------------
class _Unresolved(Exception):
    """A source this module cannot express as a path from a call's arguments."""


def _record(
    reads: _Reads,
    entries: Sequence[Any],
    frame_globals: dict[str, object],
    fn: Callable[..., object],
) -> None:
    values_by_name = {
        e.orig_guard.originating_source.name: e.value for e in entries if e.has_value
    }
    for entry in entries:
        if not entry.has_value or not _is_plain_guard(entry):
            continue
        source = entry.orig_guard.originating_source
        base = getattr(source, "base", None)
        if base is not None and isinstance(values_by_name.get(base.name), torch.Tensor):
            continue  # a tensor's .grad or flags: the tensor checks' business
        try:
            path = _path(source, values_by_name, reads.paths, frame_globals, fn)
        except _Unresolved:
            continue
        if path is None:
            continue
        if path.startswith("closure ") and path not in reads.unresolved:
            reads.unresolved.append(path)
        reads.values[path] = PythonValue(path, repr(entry.value))


def _is_plain_guard(entry: Any) -> bool:
    if entry.guard_type == "CONSTANT_MATCH":
        return " at 0x" not in repr(entry.value)
    return entry.guard_type == "ID_MATCH" and isinstance(entry.value, enum.Enum)


def _argument_paths(copies: tuple[object, ...]) -> dict[int, tuple[int, str]]:
    """By identity: each argument, and each submodule of a module argument, with
    (position, accessor path from the argument); an optimizer's path is
    "<optimizer>", since its values are the optimizer checks' business."""
    paths: dict[int, tuple[int, str]] = {}
    for position, argument in enumerate(copies):
        if isinstance(argument, torch.optim.Optimizer):
            paths[id(argument)] = (position, "<optimizer>")
        if not isinstance(argument, torch.nn.Module):
            paths.setdefault(id(argument), (position, ""))
            continue
        for name, module in argument.named_modules(remove_duplicate=False):
            prefix = "".join(f".{part}" for part in name.split(".") if part)
            paths.setdefault(id(module), (position, prefix))
    return paths


def _path(
    source: Any,
    values_by_name: dict[str, object],
    roots: dict[int, tuple[int, str]],
    frame_globals: dict[str, object],
    fn: Callable[..., object],
) -> str | None:
    """The readable path of the value at ``source``, or None when another check of
    the artifact already covers it (a module's mode, an input leaf, an optimizer)."""
    from torch._dynamo import source as sources

    steps: list[str] = []
    while True:
        wrapper = isinstance(
            source, (sources.NNModuleSource, sources.UnspecializedParamBufferSource)
        ) and not isinstance(source, sources.AttrSource)
        known = values_by_name.get(source.name)
        if known is not None and id(known) in roots and steps:
            return _argument_path(known, roots[id(known)], steps)
        if wrapper:
            source = cast(Any, source).base
            continue
        if isinstance(source, sources.LocalSource):
            return _closure_path(source.local_name, values_by_name, fn, steps)
        if isinstance(source, sources.GlobalSource):
            return _global_path(source.global_name, frame_globals, steps)
        steps.append(_step(source))
        source = source.base
        _collapse_member_dicts(steps)


def _argument_path(
    known: object, root: tuple[int, str], steps: list[str]
) -> str | None:
    """The path of a value reached from an argument (or a submodule of one) at
    ``root``, or None when another check of the artifact covers it."""
    position, prefix = root
    if prefix == "<optimizer>":
        return None
    accessors = prefix + "".join(reversed(steps))
    if prefix == "" and "." not in accessors:
        return None  # a leaf of an input, which the leaf checks cover
    if accessors.endswith(".training") and isinstance(known, torch.nn.Module):
        return None
    return f"argument {position}: {accessors}"


def _step(source: Any) -> str:
    """The accessor ``source`` applies to its base, as the path writes it."""
    from torch._dynamo import source as sources

    if isinstance(source, sources.CellContentsSource):
        return ".cell_contents"
    if isinstance(source, sources.AttrSource):
        return f".{source.member}"
    if isinstance(source, sources.ClosureSource):
        return ".__closure__"
    if isinstance(source, (sources.GetItemSource, sources.DictGetItemSource)):
        return _item(source.index)
    raise _Unresolved(source.name)


_MEMBER_DICTS = (".__dict__", "._modules", "._parameters", "._buffers")


def _collapse_member_dicts(steps: list[str]) -> None:
    # Steps are gathered innermost first: [..., "['lin']", "._modules"].
    if len(steps) >= 2 and steps[-1] in _MEMBER_DICTS and steps[-2].startswith("["):
        key = steps[-2][2:-2]
        if key.isidentifier() or key.isdigit():
            steps[-2:] = [f".{key}"]


def _item(index: object) -> str:
    if type(index) is int or (type(index) is str and "]" not in index):
        return f"[{index!r}]"
    raise _Unresolved(repr(index))


def _closure_path(
    name: str,
    values_by_name: dict[str, object],
    fn: Callable[..., object],
    steps: list[str],
) -> str:
    """A path through the closure of ``fn``: from the pass's entry, which holds
    ``fn`` as its own closure variable (``fn.__closure__[i].cell_contents``), or
    from ``fn``'s frame, where a closure variable is a local."""
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None) or ()
    if code is None:
        raise _Unresolved(name)
    accessors = list(reversed(steps))
    if values_by_name.get(f"L['{name}']") is fn:
        if accessors[:1] != [".__closure__"] or accessors[2:3] != [".cell_contents"]:
            raise _Unresolved(name)
        name = code.co_freevars[int(accessors[1][1:-1])]
        accessors = accessors[3:]
    elif name in code.co_freevars:
        cell = closure[code.co_freevars.index(name)]
        if values_by_name.get(f"L['{name}']", cell.cell_contents) is not (
            cell.cell_contents
        ):
            raise _Unresolved(name)
    else:
        raise _Unresolved(name)
    rest = "".join(accessors)
    owner = function_name(fn)
    return f"closure variable {name} of {owner}{': ' + rest if rest else ''}"


def _global_path(
    name: str, frame_globals: dict[str, object], steps: list[str]
) -> str | None:
    value = frame_globals.get(name)
    if isinstance(value, types.ModuleType):
        # Dynamo reaches another module's globals through an alias it installs:
        # G['__import_othermod'].FACTOR is FACTOR of othermod.
        if not steps:
            return None
        module, first = value.__name__, steps.pop()[1:]
        return _global_path_in(module, first, steps)
    if isinstance(value, dict) and "__name__" in value and steps:
        # And a globals dict that is no module's (the extra run's function holds
        # copies of the globals it may change) through another:
        # G['___unnamed_scope_..']['SCALE'] is SCALE of that dict's module.
        module, first = str(value["__name__"]), steps.pop()[2:-2]
        return _global_path_in(module, first, steps)
    return _global_path_in(str(frame_globals.get("__name__")), name, steps)


def _global_path_in(module: str, name: str, steps: list[str]) -> str | None:
    # An installed library's module globals are its own configuration (feature
    # flags, enums, constants), as torch's are.
    if module.split(".")[0] in _LIBRARY_MODULES or _library(
        str(getattr(sys.modules.get(module), "__file__", None) or "")
    ):
        return None
    accessors = "".join(reversed(steps))
    return f"global {name} (module {module}){': ' + accessors if accessors else ''}"
