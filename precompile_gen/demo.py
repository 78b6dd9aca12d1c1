"""The built-in example: precompile a small CNN training step, reload it in a fresh
process and check it against eager PyTorch.

Run ``precompile-gen demo``. The reload half runs as ``python -m precompile_gen.demo
DIR`` so that nothing from the precompiling process (compiled kernels, imported
modules) can help it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ARTIFACT_NAME = "train_step.py"
CACHE_NAME = "train_step.cache"


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def train_step(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    return loss.detach()


def example() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The same model and batch in every process (fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = SmallCNN()
    images = torch.randn(4, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 10, (4,), generator=generator)
    return model, images, labels


def run(
    backend: str, out_dir: Path, progress: Callable[[str], None] = print
) -> dict[str, object]:
    """Precompile the example, write the pair, check it in a fresh process."""
    from precompile_gen import precompile

    model, images, labels = example()
    progress(f"precompiling train_step (backend={backend!r}) ...")
    start = time.perf_counter()
    python_code, cache = precompile(train_step, model, images, labels, backend=backend)
    precompile_seconds = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ARTIFACT_NAME).write_text(python_code, encoding="utf-8")
    (out_dir / CACHE_NAME).write_bytes(cache)
    progress(f"wrote {out_dir / ARTIFACT_NAME} and {out_dir / CACHE_NAME}")
    progress("reloading in a fresh process and comparing with eager ...")
    checked = subprocess.run(
        [sys.executable, "-m", "precompile_gen.demo", str(out_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    if checked.returncode != 0:
        raise RuntimeError(
            f"the fresh-process check failed:\n{checked.stderr.strip()[-4000:]}"
        )
    report = json.loads(checked.stdout.strip().splitlines()[-1])
    report["precompile_seconds"] = precompile_seconds
    report["artifact_bytes"] = len(python_code.encode())
    report["cache_bytes"] = len(cache)
    return report


def check(out_dir: Path) -> dict[str, object]:
    """Load the pair, run one training step with it and with eager PyTorch on two
    copies of the example model, and compare loss, gradients and buffers."""
    import copy
    import logging

    from precompile_gen import load

    # load() warns before executing unsigned code; the demo made the code itself.
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    model, images, labels = example()
    reference_model = copy.deepcopy(model)
    start = time.perf_counter()
    forward = load(
        (out_dir / ARTIFACT_NAME).read_text(encoding="utf-8"),
        (out_dir / CACHE_NAME).read_bytes(),
    )
    loss = forward(model, images, labels)
    first_result_seconds = time.perf_counter() - start
    expected = train_step(reference_model, images, labels)
    assert isinstance(loss, torch.Tensor)
    torch.testing.assert_close(loss, expected)
    for (name, got), (_, want) in zip(
        model.named_parameters(), reference_model.named_parameters(), strict=True
    ):
        assert got.grad is not None and want.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, msg=f"grad of {name}")
    for (name, got), (_, want) in zip(
        model.named_buffers(), reference_model.named_buffers(), strict=True
    ):
        torch.testing.assert_close(got, want, msg=f"buffer {name}")
    return {
        "loss": float(loss),
        "params_checked": len(list(model.parameters())),
        "buffers_checked": len(list(model.buffers())),
        "reload_first_result_seconds": first_result_seconds,
    }


if __name__ == "__main__":
    print(json.dumps(check(Path(sys.argv[1]))))
