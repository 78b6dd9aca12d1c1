"""inspect's report written out for people: the summary, the model and its
optimizers, the inputs, the graph's kernels or operators and the sections, as the
``inspect`` command prints them (``inspection.inspect_artifact`` reads the report).
"""

from __future__ import annotations

import textwrap
from typing import Any


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of ``inspect_artifact``'s result."""
    out = [
        *_summary_lines(report),
        *_module_lines(report),
        *_optimizer_lines(report),
        *_process_group_lines(report),
        *_python_value_lines(report),
        *_state_lines(report),
        *_user_input_lines(report),
        *_aliased_input_lines(report),
        *_dtensor_lines(report),
        *_graph_lines(report),
        *_section_lines(report),
    ]
    return "\n".join(out) + "\n"


def _summary_lines(report: dict[str, Any]) -> list[str]:
    """The artifact, its function's signature, backend and what a call returns."""
    output = report["output"]
    result = f"{output['structure']} ({_count(output['leaves'], 'leaf', 'leaves')})"
    if output["harvested_grads"]:
        result += (
            f", plus {_count(output['harvested_grads'], 'parameter gradient')} "
            "added to .grad"
        )
    return [
        f"artifact   {report['artifact']}",
        f"function   {report['signature']}",
        f"backend    {report['backend']}",
        f"returns    {result}",
        "",
    ]


def _module_lines(report: dict[str, Any]) -> list[str]:
    rows = [
        [
            str(m["position"]),
            f"{m['prefix']}*",
            str(m["mode"]),
            str(m["hooks"]),
            str(m["parameters"]),
            str(m["buffers"]),
            f"{m['elements']:,}",
        ]
        for m in report["modules"]
    ]
    headers = ["argument", "names", "mode", "hooks", "parameters", "buffers"]
    return ["modules", *_table([*headers, "elements"], rows), ""]


def _optimizer_lines(report: dict[str, Any]) -> list[str]:
    if not report["optimizers"]:
        return []
    rows = [
        _optimizer_group_row(o, number, group)
        for o in report["optimizers"]
        for number, group in enumerate(o["groups"])
    ]
    return [
        "optimizers (each call passes every group's lr; the rest is fixed)",
        *_table(["argument", "class", "group", "parameters", "state", "options"], rows),
        "",
    ]


def _optimizer_group_row(
    optimizer: dict[str, Any], number: int, group: dict[str, Any]
) -> list[str]:
    """One parameter group's row; the optimizer's own cells only on its first."""
    options = ", ".join(f"{k}={v!r}" for k, v in group["options"].items())
    parameters = _count(len(group["params"]), "parameter")
    if number != 0:
        return ["", "", str(number), parameters, "", options]
    state = (
        f"{optimizer['state_tensors']} tensors: "
        + ", ".join(optimizer["state_keys"] or ["none"])
        if optimizer["steps"]
        else "zero_grad() only"
    )
    return [
        str(optimizer["position"]),
        optimizer["class"],
        str(number),
        parameters,
        state,
        options,
    ]


def _process_group_lines(report: dict[str, Any]) -> list[str]:
    if not report["process_groups"]:
        return []
    rows = [
        [
            g["name"],
            g["backend"],
            str(g["ranks"]),
            ", ".join(
                f"argument {d['position']} (bucket_cap_mb={d['bucket_cap_mb']})"
                for d in report["data_parallel"]
                if d["group"] == g["name"]
            )
            or "-",
        ]
        for g in report["process_groups"]
    ]
    return [
        "process groups the graph communicates over (each call must have them)",
        *_table(["name", "backend", "global ranks", "DistributedDataParallel"], rows),
        "",
    ]


def _python_value_lines(report: dict[str, Any]) -> list[str]:
    if not report["python_values"]:
        return []
    return [
        "Python values built into the graph (each call must bring the same)",
        *_table(["path", "value"], report["python_values"]),
        "",
    ]


def _state_lines(report: dict[str, Any]) -> list[str]:
    state = report["module_state"]
    extra = _extra_keys(state, {"name", "kind", "shape", "stride", "dtype", "device"})
    rows = [
        [
            s["name"],
            s["kind"],
            _shape_text(s["shape"]),
            _shape_text(s["stride"]),
            s["dtype"],
            s["device"],
            *(_cell(s.get(key)) for key in extra),
            "-" if s["kind"] == "buffer" else s["grad"],
        ]
        for s in state
    ]
    headers = ["name", "kind", "shape", "stride", "dtype", "device", *extra, "grad"]
    return ["parameters and buffers", *(_table(headers, rows) or ["  (none)"]), ""]


def _user_input_lines(report: dict[str, Any]) -> list[str]:
    inputs = report["user_inputs"]
    leaves = inputs["leaves"]
    base = {"leaf", "tensor", "shape", "dynamic", "stride", "dtype", "device"}
    extra = _extra_keys(leaves, base)
    rows = [
        [
            leaf["leaf"],
            _shape_text(leaf["shape"]),
            _dynamic_text(leaf["dynamic"]),
            _shape_text(leaf["stride"]),
            leaf["dtype"] or "-",
            leaf["device"] or "-",
            *(_cell(leaf.get(key)) for key in extra),
        ]
        for leaf in leaves
    ]
    headers = ["leaf", "shape", "dynamic dims", "stride", "dtype", "device", *extra]
    return [
        f"user inputs (structure {inputs['structure']})",
        *(_table(headers, rows) or ["  (none)"]),
        "",
    ]


def _aliased_input_lines(report: dict[str, Any]) -> list[str]:
    out = [
        f"aliased inputs: {', '.join(group)} share one storage (as traced)"
        for group in report["aliased_inputs"]
    ]
    return [*out, ""] if out else []


def _dtensor_lines(report: dict[str, Any]) -> list[str]:
    out = [
        f"DTensor input: {name}, placements ({', '.join(placements)}) on a mesh "
        f"of shape {tuple(mesh_shape)}"
        for name, mesh_shape, placements in report["dtensors"]
    ]
    shard_inputs, shard_outputs = report["local_shards"]
    if shard_inputs:
        out.append(
            f"local shards: the compiled graph takes {shard_inputs} DTensor inputs' "
            f"local shards and returns {shard_outputs} DTensor results' (as traced)"
        )
    # The blank line closes the DTensor inputs' lines: shards come only with them.
    if report["dtensors"]:
        out.append("")
    return out


def _graph_lines(report: dict[str, Any]) -> list[str]:
    graph = report["graph"]
    out = ["graph", *_kernel_lines(report)]
    if graph["extern_kernel_calls"]:
        out.append(f"  extern kernels     {_counts(graph['extern_kernel_calls'])}")
    out += _op_call_lines(graph["op_calls"])
    out += _pinned_binary_lines(report)
    return [*out, ""]


def _kernel_lines(report: dict[str, Any]) -> list[str]:
    graph = report["graph"]
    kernels = graph["kernels"]
    if not kernels:
        why = (
            " (the eager backend runs ATen operators)"
            if report["backend"] == "eager"
            else ""
        )
        return [f"  kernels            none{why}"]
    kinds = _counts(graph["kernel_kinds"])
    return [
        f"  kernels            {len(kernels)}: {kinds}",
        *(
            f"                     {k['name']} ({k['kind']}, "
            f"{k['source_chars']:,} characters, "
            + (f"binary {k['binary']})" if k["binary"] else "no pinned binary)")
            for k in kernels
        ),
    ]


def _op_call_lines(ops: dict[str, int]) -> list[str]:
    if not ops:
        return []
    return [
        f"  operator calls     {_count(sum(ops.values()), 'call')} of "
        f"{_count(len(ops), 'operator')}:",
        *textwrap.wrap(
            _counts(ops),
            width=88,
            initial_indent=" " * 21,
            subsequent_indent=" " * 21,
            break_on_hyphens=False,
        ),
    ]


def _pinned_binary_lines(report: dict[str, Any]) -> list[str]:
    pinned = report["kernel_binaries"]
    if pinned:
        return [
            f"  pinned binaries    {_count(len(pinned), 'file')} a cache may bring "
            "(KERNEL_BINARIES):",
            *(
                f"                     {b['file']}  sha256 {b['sha256'][:16]}..."
                for b in pinned
            ),
        ]
    if report["backend"] == "inductor":
        return ["  pinned binaries    none: kernels always compile from source"]
    return []


def _section_lines(report: dict[str, Any]) -> list[str]:
    rows = [
        [s["name"], str(s["first_line"]), str(s["lines"]), f"{s['bytes']:,}"]
        for s in report["sections"]
    ]
    return ["sections", *_table(["section", "first line", "lines", "bytes"], rows)]


def _extra_keys(rows: list[dict[str, Any]], shown: set[str]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [key for key in row if key not in shown and key != "grad"]
    return list(dict.fromkeys(keys))


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _count(n: int | None, singular: str, plural: str | None = None) -> str:
    if n is None:
        return f"? {plural or singular + 's'}"
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} x{n}" for name, n in counts.items())


def _shape_text(shape: list[int | str] | None) -> str:
    if shape is None:
        return "-"
    return (
        "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    )


def _dynamic_text(dynamic: list[dict[str, Any]]) -> str:
    shown = []
    for dim in dynamic:
        symbol = dim["symbol"] or f"dim {dim['dim']}"
        low, high = dim["min"], dim["max"]
        if low is not None and high is not None:
            shown.append(f"{low} <= {symbol} <= {high}")
        elif low is not None:
            shown.append(f"{symbol} >= {low}")
        elif high is not None:
            shown.append(f"{symbol} <= {high}")
        else:
            shown.append(f"{symbol} unbounded")
    return "; ".join(shown) or "-"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return [
        "  "
        + "  ".join(
            cell.ljust(width) for cell, width in zip(row, widths, strict=True)
        ).rstrip()
        for row in [headers, *rows]
    ]
