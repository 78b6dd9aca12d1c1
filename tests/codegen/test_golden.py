"""Golden artifacts: the emitted text, pinned byte for byte.

A template change shows up here as a diff of tests/golden/; review it like code.
The runtime support, the same in every artifact with the same parts, is pinned once
per part (tests/golden/runtime/<part>.py, the text the artifact carries): each golden
holds its section's title, which names the parts and gives the stamp, in place of its
text. Regenerate after an intended change with

    python -m pytest tests/codegen/test_golden.py --update-goldens

Eager goldens come from live captures (fx's code does not depend on the machine). The
inductor goldens splice a canned Inductor module (tests/fixtures/inductor_mlp_graph.txt,
or inductor_triton_mlp_graph.txt and inductor_triton_adamw_step_graph.txt for Triton
kernels), because live Inductor output differs by machine: most render a hand-built
``CaptureResult`` around it, and no tracing happens for them; the Triton training
step is traced live, with Inductor's compile replaced by its canned module.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.golden import (
    CASES,
    GOLDEN_DIR,
    RUNTIME_DIR,
    full_artifact,
    inductor_inference,
    pinned_part,
    pinned_runtime,
    runtime_parts,
    split_runtime,
)
from helpers.stubs import STUBS

import precompile_gen as pg
from precompile_gen.capture_result import BACKENDS, Backend
from precompile_gen.codegen import render
from precompile_gen.codegen.sections import Section, sections_by_key


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str, update_goldens: bool) -> None:
    rendered, body = split_runtime(pg.render_artifact(CASES[name]()))
    path = GOLDEN_DIR / f"{name}.py"
    texts = [render.runtime_support((part,)) for part in runtime_parts(rendered)]
    assert body == render.compose_runtime(texts)
    if update_goldens:
        path.write_text(rendered, encoding="utf-8")
        return
    _assert_pinned(path, rendered)


def test_each_runtime_part_is_pinned_once(update_goldens: bool) -> None:
    # Each part's carried text, whether or not a golden artifact carries it (a stub
    # renders every part: the runtime tests below check those too).
    for part in render.RUNTIME_PARTS:
        text = render.runtime_support((part,))
        if update_goldens:
            RUNTIME_DIR.mkdir(exist_ok=True)
            pinned_part(part).write_text(text, encoding="utf-8")
        else:
            _assert_pinned(pinned_part(part), text)


def _assert_pinned(path: Path, rendered: str) -> None:
    assert path.exists(), f"{path} is missing; run pytest with --update-goldens"
    expected = path.read_text(encoding="utf-8")
    if rendered != expected:
        name = path.relative_to(GOLDEN_DIR).as_posix()
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                rendered.splitlines(keepends=True),
                fromfile=f"golden/{name}",
                tofile="rendered",
            )
        )
        pytest.fail(
            f"rendered artifact differs from golden/{name}; if intended, rerun "
            f"with --update-goldens and review the diff:\n{diff}",
            pytrace=False,
        )


def test_runtime_golden_is_the_text_its_stamp_names() -> None:
    variants = set()
    goldens = [(GOLDEN_DIR / f"{name}.py").read_text("utf-8") for name in CASES]
    stubs = [split_runtime(text)[0] for text in _stub_artifacts().values()]
    for golden in [*goldens, *stubs]:
        parts = runtime_parts(golden)
        body = pinned_runtime(parts)
        stamp = hashlib.sha256(body.encode("utf-8")).hexdigest()
        assert sections_by_key(golden)["runtime"].stamp == stamp
        assert sections_by_key(full_artifact(golden))["runtime"].body == body
        variants.add(parts)
    # Between them they carry each part, and what every artifact carries alone.
    assert {part for parts in variants for part in parts} == set(render.RUNTIME_PARTS)
    assert ("support", "calls", "captured_graph") in variants


@functools.cache
def _stub_artifacts() -> dict[tuple[str, Backend], str]:
    """Each stub artifact (every driver feature on, and none), by stub and backend."""
    return {
        (name, backend): pg.render_artifact(make(backend))
        for name, make in STUBS.items()
        for backend in BACKENDS
    }


def _section_texts(text: str) -> dict[str, str]:
    return {key: section.text for key, section in sections_by_key(text).items()}


EDIT = "\n\ndef _edited() -> None:\n    pass\n"


@pytest.fixture(scope="module")
def unedited_stubs() -> dict[tuple[str, Backend], str]:
    """The stub artifacts as the templates render them, before any edit."""
    return _stub_artifacts()


@pytest.fixture(scope="module")
def captures() -> dict[str, pg.CaptureResult]:
    """Each golden's capture, made once: every edited part renders them all again."""
    return {name: case() for name, case in CASES.items()}


@pytest.fixture(params=sorted(render.RUNTIME_PARTS))
def edited_part(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A runtime support whose part has one more function, rendered from."""
    part: str = request.param
    parts = tmp_path / "runtime_support"
    shutil.copytree(render.runtime_support_dir(), parts)
    source = parts / f"{part}.py"
    source.write_text(source.read_text(encoding="utf-8") + EDIT, encoding="utf-8")
    monkeypatch.setattr(render, "runtime_support_dir", lambda: parts)
    render.environment.cache_clear()
    render.runtime_support.cache_clear()
    yield part
    render.environment.cache_clear()
    render.runtime_support.cache_clear()


def test_a_runtime_change_changes_only_the_runtime_golden(
    unedited_stubs: dict[tuple[str, Backend], str],
    captures: dict[str, pg.CaptureResult],
    edited_part: str,
) -> None:
    # The goldens, and the stubs (which carry every part), rendered again.
    pinned = {
        **{name: (GOLDEN_DIR / f"{name}.py").read_text("utf-8") for name in CASES},
        **{
            f"{n} stub, {b}": split_runtime(t)[0]
            for (n, b), t in unedited_stubs.items()
        },
    }
    rendered = {
        **{name: pg.render_artifact(cap) for name, cap in captures.items()},
        **{
            f"{name} stub, {backend}": pg.render_artifact(STUBS[name](backend))
            for name, backend in unedited_stubs
        },
    }
    changed = 0
    for name, text in rendered.items():
        golden, body = split_runtime(text)
        parts = runtime_parts(pinned[name])
        texts = [pinned_part(part).read_text(encoding="utf-8") for part in parts]
        texts = [
            text + EDIT if part == edited_part else text
            for part, text in zip(parts, texts, strict=True)
        ]
        assert body == render.compose_runtime(texts), name
        if edited_part not in parts:
            assert golden == pinned[name], name
            continue
        changed += 1
        old_stamp = sections_by_key(pinned[name])["runtime"].stamp
        assert old_stamp is not None
        new_stamp = hashlib.sha256(body.encode("utf-8")).hexdigest()
        assert new_stamp != old_stamp
        # Every section but the runtime support's title (its stamp) is unchanged.
        assert golden == pinned[name].replace(old_stamp, new_stamp), name
        after, before = _section_texts(golden), _section_texts(pinned[name])
        assert {k for k in after if after[k] != before[k]} == {"runtime"}
        assert after["driver"] == before["driver"]
    assert changed


def _import_time_names(statement: ast.stmt) -> set[str]:
    """The names a module-level statement reads while the module is executed: a
    function's decorators, defaults and annotations, not its body."""
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
        arguments = statement.args
        annotated = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        parts: list[ast.AST] = [
            *statement.decorator_list,
            *arguments.defaults,
            *[d for d in arguments.kw_defaults if d is not None],
            *[a.annotation for a in annotated if a.annotation is not None],
        ]
        if statement.returns is not None:
            parts.append(statement.returns)
    else:
        parts = [statement]
    return {
        node.id
        for part in parts
        for node in ast.walk(part)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }


def _defined_names(statements: list[ast.stmt]) -> set[str]:
    names = set()
    for statement in statements:
        if isinstance(statement, ast.FunctionDef | ast.ClassDef):
            names.add(statement.name)
        elif isinstance(statement, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in statement.names}
        else:
            for node in ast.walk(statement):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
    return names


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_runs_runtime_support_before_it_is_defined(backend: Backend) -> None:
    # The runtime support comes after section 3: while the artifact is executed,
    # section 3 may define functions that call it, but read none of its names.
    for make in STUBS.values():
        cap = make(backend)
        text = pg.render_artifact(cap)
        module = ast.parse(text)
        sections = sections_by_key(text)
        runtime = sections["runtime"]
        before = [s for s in module.body if s.lineno < runtime.first_line]
        after = [s for s in module.body if s.lineno >= runtime.first_line]
        only_later = _defined_names(after) - _defined_names(before)
        assert "_remember" in only_later
        if cap.convention.optimizers:
            assert "_OptimizerArguments" in only_later
        for statement in before:
            read = _import_time_names(statement) & only_later
            assert not read, (statement.lineno, read)


def test_the_kernel_importer_is_runtime_support() -> None:
    # The graph section keeps only the stand-in that defers each kernel; what imports
    # or compiles them is the same in every artifact, so it is the runtime support's.
    text = pg.render_artifact(STUBS["all_features"]("inductor"))
    sections = sections_by_key(text)
    graph = _defined_names(list(ast.parse(sections["graph"].text).body))
    runtime = _defined_names(list(ast.parse(sections["runtime"].body).body))
    assert {"_AsyncCompile", "_DeferredKernel", "_DEFERRED_KERNEL_SCOPES"} <= graph
    assert {"_resolve_kernels", "_KernelBuilder", "_import_kernel"} <= runtime
    assert not graph & {"_resolve_kernels", "_KernelBuilder", "_import_kernel"}
    assert "_KERNEL_BINARY_PATHS" not in text


# What a reviewer reads for one capture: its section 3, in non-blank lines.
SECTION_3_BUDGET = {"eager_inference": 200, "eager_train_step": 320}


@pytest.mark.parametrize("name", sorted(SECTION_3_BUDGET))
def test_section_3_holds_only_what_the_capture_needs(name: str) -> None:
    driver: Section = sections_by_key(pg.render_artifact(CASES[name]()))["driver"]
    lines = sum(1 for line in driver.lines if line.strip())
    assert lines <= SECTION_3_BUDGET[name], lines


def test_inductor_golden_splices_the_graph_verbatim() -> None:
    cap = inductor_inference()
    text = pg.render_artifact(cap)
    assert cap.graph.source.strip("\n") in text
    names = [param.name for param in cap.convention.params]
    assert pg.parse_metadata(text)["PARAM_NAMES"] == names


def test_goldens_have_no_stale_files() -> None:
    on_disk = {path.stem for path in GOLDEN_DIR.glob("*.py")}
    assert on_disk == set(CASES)
    pinned = sorted(RUNTIME_DIR.iterdir())
    assert pinned == sorted(pinned_part(part) for part in render.RUNTIME_PARTS)


def test_renderer_never_reads_python_source(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every artifact line comes from a template or the CaptureResult, never from
    # reading code out of a live module.
    import inspect

    captures = [case() for case in CASES.values()]

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the renderer read Python source with inspect")

    for name in ("getsource", "getsourcelines", "findsource"):
        monkeypatch.setattr(inspect, name, forbidden)
    for cap in captures:
        assert pg.parse_metadata(pg.render_artifact(cap))["BACKEND"] == cap.backend


def _golden(name: str) -> str:
    return (GOLDEN_DIR / f"{name}.py").read_text(encoding="utf-8")


# The runtime support every artifact of a backend carries.
ALWAYS = {
    "eager": {"support", "calls", "captured_graph"},
    "inductor": {"support", "calls", "compiled_graph"},
}
# The step each feature adds to section 3's forward().
FEATURE_STEPS = {
    "gradients": "flat_outputs = _scatter_gradients(state, flat_outputs)",
    "grad_resets": "_reset_grads(state)",
    "optimizers": "steps = _checked_steps(args, state)",
    "layouts": "_check_state_layouts",
}


@pytest.mark.parametrize(
    ("name", "features"),
    [
        ("eager_inference", set()),
        ("eager_train_step", {"gradients"}),
        ("eager_grad_resets", {"gradients", "grad_resets"}),
        ("eager_optimizer_step", {"gradients", "grad_resets", "optimizers"}),
        ("eager_scalar_inputs", set()),
        ("eager_multi_module", {"dict_inputs"}),
        ("eager_pytree_types", {"pytree_types"}),
        ("eager_literals_aliasing", set()),
        ("inductor_inference", {"layouts"}),
        ("inductor_dynamic_dims", {"layouts"}),
        ("inductor_triton_inference", {"layouts"}),
        (
            "inductor_triton_train_step",
            {"gradients", "grad_resets", "optimizers", "layouts"},
        ),
    ],
)
def test_each_artifact_carries_exactly_its_features_code(
    name: str, features: set[str]
) -> None:
    # A feature's code is its runtime part (grad resets: the gradients part) and
    # its step in forward(); an artifact without the feature carries neither.
    golden = _golden(name)
    backend = "inductor" if name.startswith("inductor") else "eager"
    parts = set(runtime_parts(golden)) - ALWAYS[backend]
    assert ALWAYS[backend] <= set(runtime_parts(golden))
    assert parts == features - {"grad_resets"}
    driver = sections_by_key(golden)["driver"].text
    steps = {feature for feature, step in FEATURE_STEPS.items() if step in driver}
    assert steps == features & set(FEATURE_STEPS)
