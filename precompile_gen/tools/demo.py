"""The built-in example: precompile a small CNN's whole training step (forward,
backward and AdamW's update), reload it in a fresh process and check two steps with a
learning-rate schedule against eager PyTorch.

Run ``precompile-gen demo``. The reload half runs as
``python -m precompile_gen.tools.demo DIR`` so that nothing from the precompiling
process (compiled kernels, imported modules) can help it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precompile_gen.tools import timings
from precompile_gen.tools.progress import Progress

ARTIFACT_NAME = "train_step.py"
CACHE_NAME = "train_step.cache"
# The fresh process's output, written only when its check fails.
RELOAD_LOG_NAME = "reload.log"


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            # No bias: the BatchNorm after it removes any, leaving it a gradient
            # of rounding noise, which Adam's update would amplify.
            nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))

    @classmethod
    def seeded(cls) -> SmallCNN:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return cls()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """The demo's step: the whole of it, optimizer included."""
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    return loss.detach()


def backward_step(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The step up to its backward, for the benchmarks that compare with
    torch.compiler.precompile, which has no optimizer step."""
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    return loss.detach()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def example() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The same model and batch in every process (fixed seed)."""
    return SmallCNN.seeded(), *batch(0)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(4, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 10, (4,), generator=generator)
    return images, labels


def run(
    backend: str, out_dir: Path, progress: Progress | None = None
) -> dict[str, Any]:
    """Precompile the example, write the pair, check it in a fresh process.

    Returns the check's results, the pair's paths and sizes, and each stage's seconds.
    """
    progress = progress if progress is not None else Progress()
    stages: list[tuple[str, float]] = []
    python_code, cache, times = _precompile_example(backend, progress, stages)
    artifact_path, cache_path = out_dir / ARTIFACT_NAME, out_dir / CACHE_NAME
    with progress.stage(f"writing {artifact_path} and {cache_path}"):
        start = time.perf_counter()
        out_dir.mkdir(parents=True, exist_ok=True)
        artifact_path.write_text(python_code, encoding="utf-8")
        cache_path.write_bytes(cache)
        stages.append(("write the pair", time.perf_counter() - start))
    report = _check_in_fresh_process(out_dir, progress, stages)
    report.update(
        backend=backend,
        artifact=str(artifact_path),
        cache=str(cache_path),
        precompile_seconds=stages[0][1],
        precompile_stages=list(times.seconds.items()),
        artifact_bytes=len(python_code.encode()),
        cache_bytes=len(cache),
        stages=stages,
    )
    return report


def _precompile_example(
    backend: str, progress: Progress, stages: list[tuple[str, float]]
) -> tuple[str, bytes, timings.StageTimes]:
    """The example's pair, with its seconds appended to ``stages`` and precompile's
    own stages recorded."""
    from precompile_gen import precompile

    model, images, labels = example()
    with (
        progress.stage(f"precompiling train_step (backend={backend!r})"),
        # precompile's own recording adds its stages (capture, lowering, ...) to
        # this one, so the report can break the precompile time down.
        timings.recording(f"demo precompile (backend {backend!r})") as times,
    ):
        start = time.perf_counter()
        python_code, cache = precompile(
            train_step, model, optimizer(model), images, labels, backend=backend
        )
        stages.append(("precompile", time.perf_counter() - start))
    return python_code, cache, times


def _check_in_fresh_process(
    out_dir: Path, progress: Progress, stages: list[tuple[str, float]]
) -> dict[str, Any]:
    """``check``'s report from a fresh process, with the process's stages appended
    to ``stages``."""
    with progress.stage("reloading in a fresh process and comparing with eager"):
        start = time.perf_counter()
        checked = subprocess.run(
            [sys.executable, "-m", "precompile_gen.tools.demo", str(out_dir)],
            capture_output=True,
            text=True,
            check=False,
        )
        fresh_process_seconds = time.perf_counter() - start
        if checked.returncode != 0:
            log_path = out_dir / RELOAD_LOG_NAME
            log_path.write_text(checked.stdout + checked.stderr, encoding="utf-8")
            lines = checked.stderr.strip().splitlines() or ["(no output)"]
            raise RuntimeError(
                f"the fresh-process check failed ({lines[-1]}); its whole output is "
                f"in {log_path}."
            )
    report: dict[str, Any] = json.loads(checked.stdout.strip().splitlines()[-1])
    in_child = report["reload_first_result_seconds"] + report["compare_seconds"]
    stages += [
        ("fresh process: start, imports", max(fresh_process_seconds - in_child, 0.0)),
        ("fresh process: load + first call", report["reload_first_result_seconds"]),
        ("fresh process: compare with eager", report["compare_seconds"]),
    ]
    return report


def _stage_rows(stages: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """precompile's stages as indented rows, each stage's passes ("capture: make_fx")
    under it and added into its row."""
    rows: list[tuple[str, float]] = []
    row_of: dict[str, int] = {}
    for stage, seconds in stages:
        outer, _, inner = stage.partition(": ")
        if inner and outer in row_of:
            name, total = rows[row_of[outer]]
            rows[row_of[outer]] = (name, total + seconds)
            rows.append((f"    {inner}", seconds))
        else:
            row_of[stage] = len(rows)
            rows.append((f"  {stage}", seconds))
    return rows


def format_report(report: dict[str, Any]) -> str:
    """The summary ``precompile-gen demo`` prints."""
    # precompile's own stages go under its row, indented, and capture's passes under
    # capture's, which shows them added in; only the top rows add up to the total.
    rows: list[tuple[str, float]] = []
    for name, seconds in report["stages"]:
        rows.append((name, seconds))
        if name == "precompile":
            rows += _stage_rows(report["precompile_stages"])
    width = max(len(name) for name, _ in rows)
    lines = [
        f"backend        {report['backend']}",
        f"artifact       {report['artifact']} ({report['artifact_bytes']:,} bytes)",
        f"cache          {report['cache']} ({report['cache_bytes']:,} bytes)",
        f"matches eager  {len(report['losses'])} steps with a learning-rate "
        "schedule (losses "
        + ", ".join(f"{loss:.4f}" for loss in report["losses"])
        + f"): {report['params_checked']} parameters and their grads, "
        f"{report['state_checked']} optimizer state tensors, "
        f"{report['buffers_checked']} buffers",
        "",
        f"{'stage'.ljust(width)}  seconds",
        *(f"{name.ljust(width)}  {seconds:7.2f}" for name, seconds in rows),
        f"{'total'.ljust(width)}  {sum(s for _, s in report['stages']):7.2f}",
    ]
    return "\n".join(lines) + "\n"


def check(out_dir: Path) -> dict[str, object]:
    """Load the pair and run two training steps with it and with eager PyTorch on
    copies of the example model, halving the learning rate in between; compare the
    losses, the parameters and their gradients, the optimizer's state and the
    BatchNorm buffers."""
    import copy
    import logging

    from precompile_gen import load

    # load() warns before executing unsigned code; the demo made the code itself.
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    model = SmallCNN.seeded()
    reference_model = copy.deepcopy(model)
    model_optimizer = optimizer(model)
    reference_optimizer = optimizer(reference_model)
    schedules = [
        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        for o in (model_optimizer, reference_optimizer)
    ]
    start = time.perf_counter()
    forward = load(
        (out_dir / ARTIFACT_NAME).read_text(encoding="utf-8"),
        (out_dir / CACHE_NAME).read_bytes(),
    )
    first_result_seconds = 0.0
    compare_seconds = 0.0
    losses = []
    for seed in range(2):
        images, labels = batch(seed)
        if seed:
            start = time.perf_counter()
        loss = forward(model, model_optimizer, images, labels)
        if not seed:
            first_result_seconds = time.perf_counter() - start
            start = time.perf_counter()
        expected = train_step(reference_model, reference_optimizer, images, labels)
        assert isinstance(loss, torch.Tensor)
        torch.testing.assert_close(loss, expected)
        losses.append(float(loss))
        for schedule in schedules:
            schedule.step()
        compare_seconds += time.perf_counter() - start
    start = time.perf_counter()
    state_checked = _compare_models(
        model, reference_model, model_optimizer, reference_optimizer
    )
    return {
        "losses": losses,
        "params_checked": len(list(model.parameters())),
        "state_checked": state_checked,
        "buffers_checked": len(list(model.buffers())),
        "reload_first_result_seconds": first_result_seconds,
        "compare_seconds": compare_seconds + time.perf_counter() - start,
    }


def _compare_models(
    model: nn.Module,
    reference_model: nn.Module,
    model_optimizer: torch.optim.Optimizer,
    reference_optimizer: torch.optim.Optimizer,
) -> int:
    """Compare the parameters, their gradients, the optimizer's state and the buffers
    with eager's; how many optimizer state tensors were compared."""
    state_checked = 0
    for (name, got), want in zip(
        model.named_parameters(), reference_model.parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, msg=name)
        assert got.grad is not None and want.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, msg=f"grad of {name}")
        state = model_optimizer.state[got]
        expected_state = reference_optimizer.state[want]
        assert list(state) == list(expected_state), name
        for key, value in expected_state.items():
            torch.testing.assert_close(state[key], value, msg=f"{key} of {name}")
            state_checked += 1
    for (name, got), (_, want) in zip(
        model.named_buffers(), reference_model.named_buffers(), strict=True
    ):
        torch.testing.assert_close(got, want, msg=f"buffer {name}")
    return state_checked


if __name__ == "__main__":
    print(json.dumps(check(Path(sys.argv[1]))))
