"""The artifact outside the process that made it.

It must run in a fresh interpreter that never imports precompile_gen, and the same
capture must render the same bytes in any process (the golden files and reviewers'
diffs rely on that).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import precompile_gen as pg
from precompile_gen.capture_result import (
    InputLeaf,
    ModuleArgument,
    StateTensor,
    metadata_constants,
)
from precompile_gen.codegen.stubs import stub_capture

# Executed both here and in the child processes, so both sides build the same model
# and batch from the same seeds.
MODEL_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class SmallNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, kernel_size=3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.head = nn.Linear(4, 3)

        def forward(self, images):
            features = torch.relu(self.bn(self.conv(images)))
            return self.head(features.mean((2, 3)))


    def train_step(model, batch):
        logits = model(batch["images"])
        loss = nn.functional.cross_entropy(logits, batch["labels"])
        loss.backward()
        return {"loss": loss.detach(), "logits": logits.detach()}


    def example():
        torch.manual_seed(0)
        model = SmallNet()
        generator = torch.Generator().manual_seed(1)
        batch = {
            "labels": torch.randint(0, 3, (4,), generator=generator),
            "images": torch.randn(4, 2, 6, 6, generator=generator),
        }
        return model, batch
    """
)

# Runs the artifact file against eager PyTorch, importing nothing from precompile_gen.
STANDALONE_RUNNER = textwrap.dedent(
    """
    import copy
    import sys

    import torch

    artifact_path, model_path = sys.argv[1], sys.argv[2]
    model_namespace = {}
    exec(open(model_path).read(), model_namespace)
    model, batch = model_namespace["example"]()
    eager_model = copy.deepcopy(model)

    artifact = {"__name__": "artifact"}
    with open(artifact_path) as file:
        exec(compile(file.read(), artifact_path, "exec"), artifact)
    forward = artifact["forward"]

    for _ in range(2):
        expected = model_namespace["train_step"](eager_model, batch)
        got = forward(model, batch)
        torch.testing.assert_close(got, expected)
    for (name, ours), (_, theirs) in zip(
        model.named_parameters(), eager_model.named_parameters()
    ):
        assert ours.grad is not None, name
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
    torch.testing.assert_close(
        dict(model.named_buffers()), dict(eager_model.named_buffers())
    )
    loaded = sorted(name for name in sys.modules if name.startswith("precompile_gen"))
    assert "precompile_gen" not in sys.modules, loaded
    assert not loaded, loaded
    print("STANDALONE-OK")
    """
)

# The error path without precompile_gen importable: the driver falls back to its own
# PrecompileError.
NO_PACKAGE_RUNNER = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "precompile_gen":
                raise ImportError("precompile_gen is blocked in this process")
            return None


    sys.meta_path.insert(0, Block())
    artifact_path, model_path = sys.argv[1], sys.argv[2]
    model_namespace = {}
    exec(open(model_path).read(), model_namespace)
    model, batch = model_namespace["example"]()
    artifact = {"__name__": "artifact"}
    exec(open(artifact_path).read(), artifact)
    try:
        artifact["forward"](model)
    except RuntimeError as error:
        assert type(error).__name__ == "PrecompileError", type(error)
        assert type(error).__module__ == "artifact", type(error).__module__
        assert "positional arguments" in str(error), str(error)
        assert "precompile_gen" not in sys.modules
        print("LOCAL-ERROR-OK")
    """
)

# Prints the sha256 of what this process renders for fixed inputs.
DETERMINISM_RUNNER = textwrap.dedent(
    """
    import hashlib
    import sys

    import precompile_gen as pg
    from precompile_gen.codegen.stubs import stub_capture

    # This test module, for the same model source and hand-built capture.
    sys.path.insert(0, sys.argv[1])
    from test_standalone import example_namespace, hand_built_capture

    model_namespace = example_namespace()
    model, batch = model_namespace["example"]()
    train_step = model_namespace["train_step"]
    code, _ = pg.precompile(train_step, model, batch, backend="eager")
    texts = {
        "precompile": code,
        "stub-eager": pg.render_artifact(stub_capture("eager")),
        "stub-inductor": pg.render_artifact(stub_capture("inductor")),
        "hand-built": pg.render_artifact(hand_built_capture()),
    }
    for name, text in texts.items():
        print(name, hashlib.sha256(text.encode("utf-8")).hexdigest())
    """
)


def hand_built_capture() -> pg.CaptureResult:
    """A capture no tracer made: dicts and non-ASCII text exercise the literal
    renderer's ordering and escaping."""
    return dataclasses.replace(
        stub_capture("eager"),
        fn_name="hand_built",
        num_positional_args=3,
        modules=[
            ModuleArgument(0, [True], {}),
            ModuleArgument(2, [False, True], {"1": {"forward hook": 2}}),
        ],
        params=[
            StateTensor("m0.w\u00e9ight", (4, 4), (4, 1), "torch.float32", "cpu", True),
            StateTensor("m1.bias", (4,), (1,), "torch.bfloat16", "cpu", True),
        ],
        grad_param_indices=[1],
        leaves=[
            InputLeaf(
                (None, 4),
                "torch.float32",
                "cpu",
                {1: (None, 9), 0: (1, 64)},
                {0: "u0"},
                None,
                None,
            ),
            InputLeaf(None, None, None, None, None, None, 0.1),
        ],
        graph=dataclasses.replace(
            stub_capture("eager").graph,
            input_names=["p_m0_w", "p_m1_bias", "b_running_mean", "x", "y", "lit0"],
        ),
    )


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def run_python(
    args: list[str], cwd: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def example_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(MODEL_SOURCE, "<model source>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def artifact_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("standalone")
    namespace = example_namespace()
    model, batch = namespace["example"]()
    code, _ = pg.precompile(namespace["train_step"], model, batch, backend="eager")
    artifact = directory / "train_step_artifact.py"
    artifact.write_text(code, encoding="utf-8")
    model_file = directory / "model_source.py"
    model_file.write_text(MODEL_SOURCE, encoding="utf-8")
    return artifact, model_file


def test_artifact_runs_in_a_fresh_interpreter_without_precompile_gen(
    artifact_files: tuple[Path, Path], tmp_path: Path
) -> None:
    artifact, model_file = artifact_files
    runner = tmp_path / "runner.py"
    runner.write_text(STANDALONE_RUNNER, encoding="utf-8")
    result = run_python([str(runner), str(artifact), str(model_file)], tmp_path)
    assert result.stdout.strip().splitlines()[-1] == "STANDALONE-OK"


@pytest.mark.slow
def test_inductor_artifact_runs_in_a_fresh_interpreter_without_precompile_gen(
    artifact_files: tuple[Path, Path], tmp_path: Path
) -> None:
    # Executed without load, nothing says where kernel binaries are: the rewritten
    # module hands every kernel to Inductor, which compiles it from the artifact.
    _, model_file = artifact_files
    namespace = example_namespace()
    model, batch = namespace["example"]()
    code, _ = pg.precompile(namespace["train_step"], model, batch)
    assert "AsyncCompile = _AsyncCompile" in code
    artifact = tmp_path / "inductor_artifact.py"
    artifact.write_text(code, encoding="utf-8")
    runner = tmp_path / "runner.py"
    runner.write_text(STANDALONE_RUNNER, encoding="utf-8")
    result = run_python(
        [str(runner), str(artifact), str(model_file)],
        tmp_path,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
    )
    assert result.stdout.strip().splitlines()[-1] == "STANDALONE-OK"
    assert list((tmp_path / "inductor-cache").rglob("*.main.cpp"))


def test_artifact_errors_without_precompile_gen_use_a_local_precompile_error(
    artifact_files: tuple[Path, Path], tmp_path: Path
) -> None:
    artifact, model_file = artifact_files
    runner = tmp_path / "runner.py"
    runner.write_text(NO_PACKAGE_RUNNER, encoding="utf-8")
    result = run_python([str(runner), str(artifact), str(model_file)], tmp_path)
    assert result.stdout.strip().splitlines()[-1] == "LOCAL-ERROR-OK"


def test_artifact_run_as_a_script_prints_how_to_call_it(
    artifact_files: tuple[Path, Path], tmp_path: Path
) -> None:
    artifact, _ = artifact_files
    result = run_python(["-X", "importtime", str(artifact)], tmp_path)
    assert "defines forward()" in result.stdout
    assert "forward(model, x)" in result.stdout
    imported = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "precompile_gen" in line
    ]
    assert imported == []


def test_same_capture_renders_the_same_bytes_in_any_process(
    artifact_files: tuple[Path, Path], tmp_path: Path
) -> None:
    runner = tmp_path / "runner.py"
    runner.write_text(DETERMINISM_RUNNER, encoding="utf-8")
    tests_dir = str(Path(__file__).parent)
    # Two processes at once, with different hash seeds (str hashing, set order).
    children = [
        subprocess.Popen(
            [sys.executable, str(runner), tests_dir],
            cwd=tmp_path,
            env=child_env(PYTHONHASHSEED=seed),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("0", "4242")
    ]
    outputs = []
    for child in children:
        stdout, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, stdout + stderr
        outputs.append(stdout)
    first = dict(line.split() for line in outputs[0].strip().splitlines())
    second = dict(line.split() for line in outputs[1].strip().splitlines())
    assert set(first) == {"precompile", "stub-eager", "stub-inductor", "hand-built"}
    assert first == second

    def sha(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    # This process (with its own hash seed and import history) agrees too.
    assert first["precompile"] == sha(artifact_files[0].read_text(encoding="utf-8"))
    assert first["stub-eager"] == sha(pg.render_artifact(stub_capture("eager")))
    assert first["stub-inductor"] == sha(pg.render_artifact(stub_capture("inductor")))
    assert first["hand-built"] == sha(pg.render_artifact(hand_built_capture()))


def test_hand_built_capture_renders_its_own_metadata() -> None:
    cap = hand_built_capture()
    text = pg.render_artifact(cap)
    assert pg.parse_metadata(text) == metadata_constants(cap)
    assert "USER_INPUT_BOUNDS" in text
    assert "{0: (1, 64), 1: (None, 9)}" in text
