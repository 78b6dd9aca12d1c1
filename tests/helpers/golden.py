"""The golden captures, and the golden files as the tests read them.

A golden holds its runtime support's title in place of the support's text, which is
pinned once per part (tests/golden/runtime/<part>.py); ``full_artifact`` puts it
back. The eager cases capture live; the inductor ones render a hand-built
``CaptureResult`` around a canned Inductor module in tests/fixtures/, but for the
Triton training step, which captures live with Inductor's module replaced by its
canned one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
from torch import nn

import precompile_gen as pg
from helpers import triton_programs
from helpers.stubs import replace_convention
from precompile_gen.capture_result import (
    CallConvention,
    CompiledGraph,
    InductorGraph,
    InputLeaf,
    InputStrides,
    InputTree,
    KernelPayload,
    ModuleArgument,
    StateTensor,
)
from precompile_gen.codegen import render
from precompile_gen.codegen.sections import sections_by_key
from precompile_gen.lowering import inductor_imports, inductor_module, lower
from precompile_gen.runtime import kernel_binaries

TESTS_DIR = Path(__file__).resolve().parent.parent
GOLDEN_DIR = TESTS_DIR / "golden"
FIXTURE_DIR = TESTS_DIR / "fixtures"
RUNTIME_DIR = GOLDEN_DIR / "runtime"
# What a golden holds in place of the runtime support's text.
RUNTIME_PLACEHOLDER = (
    "# (its text: its parts in tests/golden/runtime/, pinned once for every golden)\n"
)
_RUNTIME_TITLE = re.compile(r"Runtime support: (.+) \(sha256 [0-9a-f]{64}\)")


def runtime_parts(text: str) -> tuple[str, ...]:
    """The runtime support's parts, as an artifact's (or golden's) title names them."""
    title = sections_by_key(text)["runtime"].title
    found = _RUNTIME_TITLE.fullmatch(title)
    assert found is not None, title
    return tuple(found.group(1).split(" + "))


def pinned_part(part: str) -> Path:
    return RUNTIME_DIR / f"{part}.py"


def pinned_runtime(parts: tuple[str, ...]) -> str:
    """The runtime support with these parts, as the pinned parts compose it."""
    texts = [pinned_part(part).read_text(encoding="utf-8") for part in parts]
    return render.compose_runtime(texts)


def split_runtime(text: str) -> tuple[str, str]:
    """An artifact as its golden holds it, and its runtime support's text."""
    runtime = sections_by_key(text)["runtime"]
    start = sum(len(line) for line in runtime.lines[:3])
    offset = text.index(runtime.text) + start
    body = runtime.body
    return text[:offset] + RUNTIME_PLACEHOLDER + text[offset + len(body) :], body


def full_artifact(golden: str) -> str:
    """The artifact a golden stands for: the pinned runtime support in its place."""
    body = pinned_runtime(runtime_parts(golden))
    assert golden.count(RUNTIME_PLACEHOLDER) == 1
    return golden.replace(RUNTIME_PLACEHOLDER, body)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    return loss.detach()


def two_towers(
    encoder: nn.Module, batch: dict[str, torch.Tensor], head: nn.Module
) -> dict[str, object]:
    features = encoder(batch["x"])
    return {"logits": head(features), "features": features, "count": 2}


def masked_twice(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # A tensor literal (with a non-finite value) and two arguments that may alias.
    mask = torch.tensor([0.0, float("-inf")])
    return torch.softmax(model(x) + mask, dim=-1) * y.sum()


def eager_literals_aliasing() -> pg.CaptureResult:
    x = torch.randn(3, 4)
    return pg.capture(masked_twice, _mlp(), x, x, backend="eager")


def eager_inference() -> pg.CaptureResult:
    return pg.capture(predict, _mlp(), torch.randn(3, 4), backend="eager")


def eager_train_step() -> pg.CaptureResult:
    return pg.capture(
        train_step, _mlp(), torch.randn(3, 4), torch.randn(3, 2), backend="eager"
    )


def eager_multi_module() -> pg.CaptureResult:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
    head = nn.Linear(6, 3)
    batch = {"x": torch.randn(5, 4)}
    return pg.capture(two_towers, encoder, batch, head, backend="eager")


Shape = tuple[int, ...]
# A parameter: its name, shape and stride.
Weight = tuple[str, Shape, Shape]
_LEAF = '{"type": null, "context": null, "children_spec": []}'


def inductor_inference() -> pg.CaptureResult:
    """``predict`` on the MLP, as the inductor backend captures it (written out by
    hand; the graph is the canned module, its imports rewritten as lowering does)."""
    weights: list[Weight] = [("0.weight", (8, 4), (4, 1)), ("0.bias", (8,), (1,))]
    weights += [("2.weight", (2, 8), (8, 1)), ("2.bias", (2,), (1,))]
    # _mlp() as constructed: Sequential, Linear, ReLU, Linear in training mode.
    return _canned_inductor("inductor_mlp_graph.txt", weights, modules=4)


def inductor_triton_inference() -> pg.CaptureResult:
    """``predict`` on an MLP with LayerNorm and GELU, as the inductor backend
    captures it with Triton kernels (a GPU's tensors, or CPU ones under
    ``precompile_gen.testing.triton_interpreter``), around its canned module."""
    weights: list[Weight] = [("0.weight", (8, 4), (4, 1)), ("0.bias", (8,), (1,))]
    weights += [("1.weight", (8,), (1,)), ("1.bias", (8,), (1,))]
    weights += [("3.weight", (2, 8), (8, 1)), ("3.bias", (2,), (1,))]
    # Sequential, Linear, LayerNorm, GELU, Linear in training mode.
    return _canned_inductor("inductor_triton_mlp_graph.txt", weights, modules=5)


# How Inductor's module defines a Triton kernel, which lowering records by name.
_TRITON_KERNEL = re.compile(r"^(\w+) = async_compile\.triton\(", re.MULTILINE)


def _canned_inductor(
    fixture: str, weights: list[Weight], modules: int
) -> pg.CaptureResult:
    """A capture of ``predict`` on a model with these weights, called on a (3, 4)
    input, around the canned Inductor module ``fixture``."""
    canned = (FIXTURE_DIR / fixture).read_text("utf-8")
    source, rewritten_imports = inductor_imports.rewrite(canned, {"addmm": torch.addmm})
    input_names = [f"p_{name.replace('.', '_')}" for name, _, _ in weights] + ["x"]
    return pg.CaptureResult(
        backend="inductor",
        convention=CallConvention(
            fn_name="predict",
            num_positional_args=2,
            argument_names=["model", "x"],
            modules=[ModuleArgument(position=0, training=[True] * modules, hooks={})],
            global_module_hooks={},
            params=[
                StateTensor(name, shape, "torch.float32", "cpu", True)
                for name, shape, _ in weights
            ],
            buffers=[],
            in_tree=InputTree(
                '[1, {"type": "builtins.tuple", "context": "null", "children_spec": '
                f"[{_LEAF}]}}]",
                "(*,)",
                flat=True,
            ),
            leaves=[_input_leaf((3, 4))],
            input_names=input_names,
            aliased_inputs=[],
            out_spec=f"[1, {_LEAF}]",
            out_structure="*",
            grad_param_indices=[],
            scalar_outputs=[],
            python_values=[],
            optimizers=[],
            grad_resets=[],
        ),
        graph=CompiledGraph(
            # As lowering lays out a live module, which it reads first.
            source=inductor_module.unpacked_one_per_line(source),
            tensor_literals=[],
            # Every weight's, and the (3, 4) input's.
            input_strides=InputStrides(
                [stride for _, _, stride in weights], [], [(4, 1)], []
            ),
            backend_graph=InductorGraph(
                rewritten_imports=rewritten_imports,
                positional_names=[f"arg{i}_1" for i in range(len(input_names))],
                triton_kernels=_TRITON_KERNEL.findall(source),
                kernels=inductor_module.kernels(source),
                redefined_call=inductor_module.redefines_call(source),
            ),
        ),
        # The canned graph's kernels are not compiled here: nothing is pinned.
        payload=KernelPayload(),
    )


def inductor_triton_train_step() -> pg.CaptureResult:
    """The training step ``adamw_step`` (forward, backward and AdamW's update of an
    MLP with LayerNorm and GELU), as the inductor backend captures it with Triton
    kernels, around its canned module.

    Captured live, as the eager goldens are: tracing (the optimizer's state, the
    gradients and the order of the in-place updates included) does not depend on the
    machine. Only Inductor's compile is replaced, by the canned module it made of the
    same traced graph, which carries no kernel binary; lowering rewrites its imports
    and reads its inputs' names and layouts from it as from a live one."""
    canned = (FIXTURE_DIR / "inductor_triton_adamw_step_graph.txt").read_text("utf-8")
    # The kernels Inductor's module defines: its auto-tuning block, a string that
    # repeats them, dropped first.
    kernels = _TRITON_KERNEL.findall(inductor_imports.rewrite(canned, {})[0])
    # What the kernel scan finds in a module of Triton kernels: no binary.
    scanned = kernel_binaries.Collected(
        kernel_binaries.make_payload({}, kernels), {}, kernels
    )
    program = triton_programs.PROGRAMS["training"]
    with mock.patch.object(lower, "_inductor_graph", return_value=(canned, scanned)):
        cap = pg.capture(program.fn, *program.arguments(), backend="inductor")
    # The canned module is the traced graph's: it unpacks one input per graph input.
    made = cap.graph.backend_graph
    assert isinstance(made, InductorGraph)
    assert len(made.positional_names) == len(cap.convention.input_names)
    # The cache is not rendered, and the golden pins no binary.
    return dataclasses.replace(
        cap, payload=dataclasses.replace(cap.payload, cache_artifact=None)
    )


def _input_leaf(shape: Shape) -> InputLeaf:
    return InputLeaf(
        shape=shape,
        dtype="torch.float32",
        device="cpu",
        bounds=None,
        symbols=None,
        value=None,
    )


def reset_and_step(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    model.zero_grad()
    return train_step(model, x, target)


def eager_grad_resets() -> pg.CaptureResult:
    return pg.capture(
        reset_and_step, _mlp(), torch.randn(3, 4), torch.randn(3, 2), backend="eager"
    )


def sgd_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    target: torch.Tensor,
) -> torch.Tensor:
    optimizer.zero_grad()
    loss = train_step(model, x, target)
    optimizer.step()
    return loss


def eager_optimizer_step() -> pg.CaptureResult:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return pg.capture(
        sgd_step,
        model,
        optimizer,
        torch.randn(3, 4),
        torch.randn(3, 2),
        backend="eager",
    )


def scaled(model: nn.Module, x: torch.Tensor, scale: float, act: str) -> torch.Tensor:
    out = model(x) * scale
    return torch.relu(out) if act == "relu" else out


def eager_scalar_inputs() -> pg.CaptureResult:
    return pg.capture(scaled, _mlp(), torch.randn(3, 4), 0.5, "relu", backend="eager")


def inductor_dynamic_dims() -> pg.CaptureResult:
    """The inductor capture with its batch dim marked (``mark_unbacked(x, 0, min=2,
    max=64)``), written out by hand around the same canned module: only the driver
    and metadata are pinned here."""
    cap = inductor_inference()
    leaf = cap.convention.leaves[0]._replace(
        shape=(None, 4), bounds={0: (2, 64)}, symbols={0: "u0"}
    )
    # A leaf with a dynamic dim comes in any layout.
    graph = dataclasses.replace(
        cap.graph, input_strides=cap.graph.input_strides._replace(leaves=[None])
    )
    return replace_convention(dataclasses.replace(cap, graph=graph), leaves=[leaf])


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


class Scores(NamedTuple):
    logits: torch.Tensor
    total: torch.Tensor


def score_pair(model: nn.Module, pair: Pair) -> Scores:
    logits = model(pair.x) + model(pair.y)
    return Scores(logits, logits.sum())


def eager_pytree_types() -> pg.CaptureResult:
    pair = Pair(torch.randn(3, 4), torch.randn(3, 4))
    return pg.capture(score_pair, _mlp(), pair, backend="eager")


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # The ids are embedded and, shifted, the loss's targets: two index checks, the
    # second through a slice.
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def eager_index_checks() -> pg.CaptureResult:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    ids = torch.randint(0, 10, (2, 5))
    return pg.capture(next_token_loss, model, ids, backend="eager")


# One golden per combination of features that changes the emitted driver, so a
# template change shows in exactly the goldens whose feature it touches.
CASES: dict[str, Callable[[], pg.CaptureResult]] = {
    "eager_inference": eager_inference,
    "eager_train_step": eager_train_step,
    "eager_grad_resets": eager_grad_resets,
    "eager_optimizer_step": eager_optimizer_step,
    "eager_multi_module": eager_multi_module,
    "eager_scalar_inputs": eager_scalar_inputs,
    "eager_literals_aliasing": eager_literals_aliasing,
    "eager_pytree_types": eager_pytree_types,
    "eager_index_checks": eager_index_checks,
    "inductor_inference": inductor_inference,
    "inductor_dynamic_dims": inductor_dynamic_dims,
    "inductor_triton_inference": inductor_triton_inference,
    "inductor_triton_train_step": inductor_triton_train_step,
}
