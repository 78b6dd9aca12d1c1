"""Render: ``CaptureResult`` -> artifact text, through the templates only.

The templates are rendered with a one-line marker where the compiled graph goes, and
the graph is spliced in afterwards: the graph never passes through Jinja or black, and
the cost of a huge graph is one string copy.

The templates emit code exactly as black (pinned version) formats it, and tests hold
them to it, so a render does not run black. What of the artifact's layout depends on
the capture (the metadata literals, comments and docstrings filled to the line) is
laid out by ``layout``, the one place that knows black's style.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import jinja2

from precompile_gen.capture_result import (
    CallConvention,
    CaptureResult,
    EagerGraph,
    ImportRewrite,
    InductorGraph,
    InputLeaf,
    KernelEntry,
    SparseGradients,
    StateTensor,
    TensorLiteral,
)
from precompile_gen.codegen.features import DriverFeatures, driver_features
from precompile_gen.codegen.layout import (
    assignment,
    columns,
    comment_lines,
    comment_text,
    docstring,
    literal,
    section_rule,
    statement_blocks,
)
from precompile_gen.lowering import inductor_imports
from precompile_gen.metadata import emitted, metadata_constants

# A comment line, which black leaves alone at module level; replaced by the graph.
GRAPH_MARKER = "# <precompile_gen: compiled graph>"
_FIRST_NON_NEWLINE = re.compile(r"[^\n]")


def template_dir() -> Path:
    """Where the templates are: inside an installed wheel, or at the source root."""
    package = Path(__file__).parents[1]
    packaged = package / "templates"
    if packaged.is_dir():
        return packaged
    return package.parent / "templates"


def runtime_support_dir() -> Path:
    """Where the runtime support's parts are: the ``precompile_gen.runtime_support``
    package, wherever it is installed."""
    return Path(__file__).parents[1] / "runtime_support"


# The code every artifact of this version carries verbatim, as its last section: the
# modules of ``precompile_gen.runtime_support``, which ruff and pyrefly check as they
# are, read as text and never rendered. The base part is in every artifact; a
# feature's part follows it, in this order, in the artifacts with that feature, from
# its first heading line on (above it, imports of the names it reads from the rest of
# the artifact, for checking it as a module), so each combination of parts is one
# known text.
RUNTIME_PARTS: tuple[str, ...] = (
    "support",
    "pytree_types",
    "gradients",
    "dict_inputs",
    "calls",
    "dtensors",
    "layouts",
    "index_checks",
    "deferred_steps",
    "skipped_steps",
    "optimizers",
    "process_groups",
    "captured_graph",
    "compiled_graph",
)
# The parts every artifact carries; the others come with the features that call them
# (``features.FEATURES``).
BASE_PARTS = ("support", "calls")
# The parts that read no metadata when executed: capture and inspect run them.
CONVENTION_PARTS = ("support", "pytree_types", "gradients")
_PART_HEADING = "\n# --- "


def runtime_parts(features: DriverFeatures) -> tuple[str, ...]:
    """The runtime support's parts that an artifact with ``features`` carries: the
    base parts, and those its features' steps call."""
    wanted = {*BASE_PARTS, *features.parts()}
    return tuple(part for part in RUNTIME_PARTS if part in wanted)


@functools.cache
def runtime_support(parts: tuple[str, ...] = ("support",)) -> str:
    """The runtime support's text, as every artifact of this version with these
    parts carries it."""
    texts = []
    for part in parts:
        source = (runtime_support_dir() / f"{part}.py").read_text(encoding="utf-8")
        if part != "support":
            source = source[source.index(_PART_HEADING) + 1 :]
        texts.append(source)
    return compose_runtime(texts)


def compose_runtime(texts: list[str]) -> str:
    """The runtime support made of its parts' carried texts, in order."""
    return "\n\n".join(texts)


def runtime_title(parts: tuple[str, ...], text: str) -> str:
    """The runtime support section's title: its parts, and its text's stamp."""
    return f"Runtime support: {' + '.join(parts)} (sha256 {runtime_stamp(text)})"


def runtime_stamp(text: str) -> str:
    """The sha256 that the runtime support section's title gives for ``text``."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["literal"] = literal
    env.filters["assignment"] = assignment
    env.filters["comment_text"] = comment_text
    env.filters["columns"] = columns
    env.filters["comment_lines"] = comment_lines
    env.filters["section_rule"] = section_rule
    return env


def _argument_kinds(conv: CallConvention) -> list[str]:
    """Each positional argument's kind: "module", "optimizer" or "input"."""
    modules = {module.position for module in conv.modules}
    optimizers = {
        optimizer.position for optimizer in [*conv.optimizers, *conv.deferred_steps]
    }
    return [
        "module" if i in modules else "optimizer" if i in optimizers else "input"
        for i in range(conv.num_positional_args)
    ]


def _user_positions(conv: CallConvention) -> list[int]:
    return [i for i, kind in enumerate(_argument_kinds(conv)) if kind == "input"]


@dataclass(frozen=True)
class DriverSection:
    """What section 3 writes out for this capture: its convention beyond the
    metadata, and the text of forward()'s lines that differ between captures."""

    # The traced call, e.g. "train_step(model, optimizer, x, y)".
    call: str
    # Positions of the non-module arguments, and the call's arguments by the traced
    # function's own names ("model, optimizer, x, y").
    user_positions: list[int]
    signature: str
    # forward()'s docstring, laid out as black leaves it (quotes included).
    docstring: list[str]
    # The sparse gradients the driver builds from the graph's last outputs.
    sparse_gradients: SparseGradients | None


def driver_section(cap: CaptureResult, features: DriverFeatures) -> DriverSection:
    conv = cap.convention
    names = ", ".join(conv.argument_names)
    call = f"{_identifier_text(conv.fn_name)}({names})"
    outcomes = ["Returns the function's result"]
    if features.gradients:
        outcomes.append("gradients it computed are added to the model's .grad fields")
    if features.optimizers:
        outcomes.append(
            "the optimizer's step updates the parameters and its state in place"
        )
    graph = "compiled graph" if features.compiled else "captured ATen graph"
    text = (
        f"Run {call} as captured: each call is held to the capture (section 2) "
        f"before the {graph} runs. " + "; ".join(outcomes) + "."
    )
    return DriverSection(
        call=call,
        user_positions=_user_positions(conv),
        signature=", ".join(conv.argument_names),
        docstring=docstring(text, indent=4),
        sparse_gradients=conv.sparse_gradients,
    )


def _identifier_text(name: str) -> str:
    # A function's qualified name, kept to what cannot end a docstring or a comment.
    return "".join(ch if ch.isalnum() or ch in "_.<>" else "?" for ch in name)


@dataclass(frozen=True)
class GraphSection:
    """What the graph section of a capture holds, and the tables that name the
    graph's inputs: the facts the graph and metadata templates branch on, read from
    the capture here rather than from text in the templates."""

    # Eager: fx's imports, in runs black separates with a blank line (after an
    # import, before a statement that is not one).
    import_blocks: list[list[str]]
    # Inductor: the import lines rewritten, and the stand-ins the rewrites bind,
    # each defined by the section only where it is bound.
    rewritten_imports: list[ImportRewrite]
    async_compile: bool
    simple_namespace: bool
    assert_tensor_metadata: bool
    # Inductor's compile-time auto-tuning block was dropped.
    autotuning_block: bool
    # The Triton kernels the module defines, by name, as lowering found them.
    triton_kernels: list[str]
    # Inductor: the table of its kernels, as comment lines.
    kernel_lines: list[str]
    # AOTAutograd's module defines ``call`` again, over Inductor's inner one.
    redefined_call: bool
    # What ``call`` takes and does, in words: the docstring of the eager section's
    # ``call``, the comment opening Inductor's.
    call_docstring: list[str]
    call_comment: list[str]
    # Per graph input: (Inductor's name for it, where it has one,) its name and what
    # it is; a header row first.
    input_rows: list[list[str]]
    # The graph's own records the graph templates write out as they are.
    tensor_literals: list[TensorLiteral]
    positional_names: list[str]
    emulate_precision_casts: bool
    branches: list[str]


def graph_section(cap: CaptureResult, features: DriverFeatures) -> GraphSection:
    graph = cap.graph
    made = graph.backend_graph
    eager = made if isinstance(made, EagerGraph) else EagerGraph([])
    inductor = made if isinstance(made, InductorGraph) else InductorGraph([])
    rewritten = [
        rewrite
        for rewrite in inductor.rewritten_imports
        if rewrite.original != inductor_imports.AUTOTUNING_BLOCK
    ]
    stand_ins = {rewrite.stand_in for rewrite in rewritten}
    inputs, outputs = _input_groups(cap, features), _output_groups(features)
    return GraphSection(
        import_blocks=statement_blocks(eager.imports),
        rewritten_imports=rewritten,
        async_compile="_AsyncCompile" in stand_ins,
        simple_namespace="SimpleNamespace" in stand_ins,
        assert_tensor_metadata="_assert_tensor_metadata" in stand_ins,
        autotuning_block=len(rewritten) < len(inductor.rewritten_imports),
        triton_kernels=inductor.triton_kernels,
        kernel_lines=[
            line
            for kernel in inductor.kernels
            for line in [
                f"#   {comment_text(kernel.name)}",
                *comment_lines(_kernel_entry(kernel), lead=6),
            ]
        ],
        redefined_call=inductor.redefined_call,
        call_docstring=docstring(
            f"Run the captured graph on ``{inputs}``; return ``{outputs}``.", indent=4
        ),
        call_comment=_call_comment(inputs, outputs, features),
        input_rows=_input_rows(cap, inductor.positional_names),
        tensor_literals=graph.tensor_literals,
        positional_names=inductor.positional_names,
        emulate_precision_casts=inductor.emulate_precision_casts,
        branches=eager.branches,
    )


def _input_rows(cap: CaptureResult, positional_names: list[str]) -> list[list[str]]:
    """Per graph input: (Inductor's name for it,) its name and what it is."""
    names = cap.convention.input_names
    roles = _input_roles(cap)
    if len(names) != len(roles):
        raise ValueError(
            f"the CaptureResult names {len(names)} graph inputs "
            f"(convention.input_names), but its records make {len(roles)}: one per "
            "parameter, buffer, input leaf, optimizer state tensor, lr, values "
            "tensor and tensor literal."
        )
    if positional_names:
        return [["inductor", "input", "what"]] + [
            list(row) for row in zip(positional_names, names, roles, strict=True)
        ]
    return [["input", "what"]] + [list(row) for row in zip(names, roles, strict=True)]


class MetadataEntry(NamedTuple):
    """One constant as section 2 writes it: the comment lines above its assignment."""

    comment: list[str]
    name: str
    annotation: str
    value: object


_INPUTS_AT_A_GLANCE = (
    "The graph's inputs at a glance (the constants below are the record): each "
    "parameter, buffer and input leaf, by the name the graph gives it."
)


def metadata_entries(cap: CaptureResult) -> list[MetadataEntry]:
    """Section 2: each constant ``cap``'s artifact emits (``metadata.CONSTANTS``),
    its comment filled to the line and followed by what this capture draws there."""
    values = metadata_constants(cap)
    drawings = _metadata_drawings(cap)
    entries = []
    for constant in emitted(values):
        comment = constant.comment
        text = comment[cap.backend] if isinstance(comment, dict) else comment
        entries.append(
            MetadataEntry(
                [*comment_lines(text), *drawings.get(constant.name, [])],
                constant.name,
                constant.annotation,
                values[constant.name],
            )
        )
    return entries


def _metadata_drawings(cap: CaptureResult) -> dict[str, list[str]]:
    """The comment lines drawn above a constant for this capture: the graph's
    inputs as a table, and the specs as treespec_pprint draws them."""
    convention = cap.convention
    drawings = {"OUT_SPEC": [f"# OUT_SPEC: {comment_text(convention.out_structure)}"]}
    if convention.in_tree.structure is not None:
        structure = comment_text(convention.in_tree.structure)
        drawings["IN_SPEC"] = [f"# IN_SPEC: {structure}"]
    rows = _tensor_rows(cap)
    if len(rows) > 1:
        drawings["PARAM_NAMES"] = [
            *comment_lines(_INPUTS_AT_A_GLANCE),
            *(f"#   {line}" for line in columns(rows)),
        ]
    return drawings


def _kernel_entry(kernel: KernelEntry) -> str:
    # Inductor comments the call of a C++ kernel only where no other call's comment
    # takes its ops: most rows on CPU give the size alone.
    size = f"{kernel.lines} lines"
    if not kernel.aten_ops:
        return size
    return f"{size}: {', '.join(op.removeprefix('aten.') for op in kernel.aten_ops)}"


def _call_comment(inputs: str, outputs: str, features: DriverFeatures) -> list[str]:
    updates = (
        ", updates the parameters and the optimizer state in place, and "
        if features.optimizers
        else " and "
    )
    return comment_lines(
        "Spliced from aot_autograd.compile_to_python. `call(flat_inputs)` takes "
        f"`{inputs}`{updates}returns `{outputs}`."
    )


def _output_groups(features: DriverFeatures) -> str:
    """The graph's outputs as groups, in the order the driver takes them apart: the
    function's own, the gradients it adds to .grad, the dense pieces it builds
    sparse gradients from, whether the call's path took the step."""
    groups = ["*function_outputs"]
    if features.gradients:
        groups.append("*parameter_gradients")
    if features.sparse_gradients:
        groups.append("*sparse_gradient_pieces")
    if features.skippable_step:
        groups.append("step_taken")
    return f"[{', '.join(groups)}]"


def _input_groups(cap: CaptureResult, features: DriverFeatures) -> str:
    """The graph's inputs as groups, in the order ``_input_roles`` lists them one by
    one: those the capture has beyond the module state and the input leaves."""
    groups = ["*params", "*buffers", "*user_input_leaves"]
    if features.optimizers:
        groups += ["*optimizer_state", "*lrs"]
    optimizers = cap.convention.optimizers
    if any(group.values for optimizer in optimizers for group in optimizer.groups):
        groups.append("*group_values")
    if features.tensor_literals:
        groups.append("*tensor_literals")
    return f"[{', '.join(groups)}]"


def _input_roles(cap: CaptureResult) -> list[str]:
    """What each graph input is, in graph-input order."""
    conv = cap.convention
    params = [t.name for t in conv.params]
    roles = [f"parameter {name}" for name in params]
    roles += [f"buffer {t.name}" for t in conv.buffers]
    roles += [f"input leaf {i}" for i in range(len(conv.leaves))]
    for optimizer in conv.optimizers:
        roles += [
            f"argument {optimizer.position}: state {t.key!r} of {params[t.param]}"
            for t in optimizer.state
        ]
    for optimizer in conv.optimizers:
        roles += [
            f"argument {optimizer.position}: lr of param group {g}"
            for g in range(len(optimizer.groups))
        ]
    for optimizer in conv.optimizers:
        roles += [
            f"argument {optimizer.position}: values of param group {g} "
            f"({', '.join(_value_name(*entry) for entry in group.values)})"
            for g, group in enumerate(optimizer.groups)
            if group.values
        ]
    roles += [f"tensor literal {lit.name}" for lit in cap.graph.tensor_literals]
    return roles


def _value_name(key: str, index: int | None) -> str:
    return key if index is None else f"{key}[{index}]"


def _tensor_rows(cap: CaptureResult) -> list[list[str]]:
    conv = cap.convention
    names = conv.input_names
    state = [*conv.params, *conv.buffers]
    num_state = len(state)
    num_inputs = num_state + len(conv.leaves)
    strides = cap.graph.input_strides
    return [
        ["input", "name", "shape", "stride", "dtype", "device", "requires grad"],
        *(
            _state_row(name, tensor, stride)
            for name, tensor, stride in zip(
                names[:num_state],
                state,
                [*strides.params, *strides.buffers],
                strict=True,
            )
        ),
        *(
            _leaf_row(name, index, leaf, stride)
            for index, (name, leaf, stride) in enumerate(
                zip(
                    names[num_state:num_inputs],
                    conv.leaves,
                    strides.leaves,
                    strict=True,
                )
            )
        ),
    ]


def _state_row(
    name: str, tensor: StateTensor, stride: tuple[int, ...] | None
) -> list[str]:
    return [
        name,
        tensor.name,
        _tuple_text(tensor.shape),
        _stride_text(stride),
        tensor.dtype.removeprefix("torch."),
        tensor.device,
        "yes" if tensor.requires_grad else "no",
    ]


def _leaf_row(
    name: str, index: int, leaf: InputLeaf, stride: tuple[int, ...] | None
) -> list[str]:
    if leaf.number:
        # A float the driver passes as the 0-dim tensor it was traced as.
        value = "()" if leaf.value is None else f"= {leaf.value!r}"
        return [name, f"input leaf {index}", value, "()", "float64", "cpu", "-"]
    if leaf.shape is None:
        value = "-" if leaf.value is None else f"= {leaf.value!r}"
        return [name, f"input leaf {index}", value, "-", "-", "-", "-"]
    # A dynamic dim by its symbol: dims that share one have equal sizes.
    symbols = leaf.symbols or {}
    shape = [
        symbols.get(dim, "?") if size is None else size
        for dim, size in enumerate(leaf.shape)
    ]
    return [
        name,
        f"input leaf {index}",
        _tuple_text(tuple(shape)),
        _stride_text(stride),
        (leaf.dtype or "-").removeprefix("torch."),
        leaf.device or "-",
        "-",
    ]


def _stride_text(stride: tuple[int, ...] | None) -> str:
    # None: the compiled graph takes any layout there.
    return "any" if stride is None else _tuple_text(stride)


def _tuple_text(values: tuple[object, ...]) -> str:
    return "(" + ", ".join(map(str, values)) + ("," if len(values) == 1 else "") + ")"


# Where each section the header names starts: the text ending the line before it (a
# title's rule, ``section_title``), and whether that is before the compiled graph.
_SECTION_STARTS = {
    "graph": ("=\n# 1. ", True),
    "metadata": ("=\n# 2. ", False),
    "driver": ("=\n# 3. ", False),
    "forward": ("\ndef forward(", False),
    "support": ("=\n# 4. ", False),
}


def _check_strides(cap: CaptureResult) -> None:
    """A capture's strides belong to its records one to one (a hand-built
    ``CaptureResult`` may not)."""
    conv = cap.convention
    records = [
        ("parameters", "parameter", len(conv.params)),
        ("buffers", "buffer", len(conv.buffers)),
        ("input leaves", "input leaf", len(conv.leaves)),
        (
            "optimizer state tensors",
            "optimizer state tensor",
            sum(len(optimizer.state) for optimizer in conv.optimizers),
        ),
    ]
    for (what, each, count), strides in zip(
        records, cap.graph.input_strides, strict=True
    ):
        if len(strides) != count:
            raise ValueError(
                f"the CompiledGraph's input_strides hold {len(strides)} strides for "
                f"its {what}, but its convention has {count}: one per {each}."
            )


@dataclass(frozen=True)
class HeaderPlan:
    """What the header says of this capture."""

    fn_name: str
    backend: str
    # Each input's memory layout is held to the example's (the compiled graph's
    # kernels specialise on it).
    layouts: bool
    value_branches: list[str]


@dataclass(frozen=True)
class ArtifactPlan:
    """Everything the templates read to write one artifact, and all they read: the
    header, the graph section's template and facts, the metadata constants, the
    driver's template, features and text, and the runtime support."""

    header: HeaderPlan
    graph_template: str
    graph: GraphSection
    metadata: list[MetadataEntry]
    driver_template: str
    features: DriverFeatures
    driver: DriverSection
    runtime_title: str
    runtime_support: str
    # Placeholders the renderer replaces: the compiled graph, the sections' lines.
    graph_marker: str
    section_lines: dict[str, str]


def artifact_plan(cap: CaptureResult) -> ArtifactPlan:
    """The plan of ``cap``'s artifact."""
    _check_strides(cap)
    features = driver_features(cap)
    parts = runtime_parts(features)
    support = runtime_support(parts)
    conv = cap.convention
    return ArtifactPlan(
        header=HeaderPlan(
            fn_name=conv.fn_name,
            backend=cap.backend,
            layouts=features.compiled,
            value_branches=conv.value_branches,
        ),
        graph_template=f"{cap.backend}_graph.py.j2",
        graph=graph_section(cap, features),
        metadata=metadata_entries(cap),
        driver_template=f"{cap.backend}_driver.py.j2",
        features=features,
        driver=driver_section(cap, features),
        runtime_title=runtime_title(parts, support),
        runtime_support=support,
        graph_marker=GRAPH_MARKER,
        section_lines={name: f"@{name}@" for name in _SECTION_STARTS},
    )


def render_skeleton(cap: CaptureResult) -> str:
    """The artifact's text with ``GRAPH_MARKER`` where the compiled graph goes.

    The templates emit black-formatted code, so the skeleton is final as rendered
    (tests check that black leaves it unchanged).
    """
    plan = artifact_plan(cap)
    skeleton = (
        environment()
        .get_template("artifact.py.j2")
        .render({field.name: getattr(plan, field.name) for field in fields(plan)})
    )
    if skeleton.count(GRAPH_MARKER) != 1:
        raise RuntimeError("artifact.py.j2 must place the graph marker exactly once")
    return skeleton


def render_artifact(cap: CaptureResult) -> str:
    """The artifact's text for ``cap``; the same capture always gives the same bytes."""
    if not isinstance(cap, CaptureResult):
        raise ValueError(
            "render_artifact takes the CaptureResult that precompile_gen.capture() "
            f"returns, got {type(cap).__name__}."
        )
    before, after = render_skeleton(cap).split(GRAPH_MARKER)
    # The graph is copied once, into the result, whatever its size: its trailing
    # newlines count towards the two blank lines after it, so that only leading blank
    # lines or more than three trailing newlines cost a copy to drop them first.
    graph = cap.graph.source
    first = _FIRST_NON_NEWLINE.search(graph)
    begin = first.start() if first else len(graph)
    end = len(graph)
    while end > begin and graph[end - 1] == "\n":
        end -= 1
    if begin == 0 and len(graph) - end <= 3:
        ending = "\n" * (3 - (len(graph) - end))
    else:
        graph, ending = graph[begin:end], "\n\n\n"
    # Two blank lines on each side, as black puts around a top-level def.
    before, after = before.rstrip("\n") + "\n\n\n", ending + after.lstrip("\n")
    # The header, in ``before``, names the line each section starts on.
    lines_before_after = before.count("\n") + graph.count("\n")
    for name, (text, in_head) in _SECTION_STARTS.items():
        if in_head:
            line = before.count("\n", 0, before.index(text)) + 2
        else:
            line = lines_before_after + after.count("\n", 0, after.index(text)) + 2
        before = before.replace(f"@{name}@", str(line), 1)
    return "".join([before, graph, after])
