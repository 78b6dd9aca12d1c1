"""The inductor backend on CUDA tensors, checked against eager, in one prepared run.

    python benchmarks/gpu_check.py

With a CUDA device, on CUDA tensors, each compared with eager:

- an MLP with LayerNorm and GELU, inference;
- a training step with AdamW inside, three steps (losses and parameters);
- dropout in training mode, under the same ``torch.manual_seed``;
- a training step whose activation-checkpointed half holds a dropout, whose
  backward's recompute must draw the forward's mask, three seeded steps;
- a batch dim marked with ``mark_unbacked``, called at other batch sizes;
- a float argument (a temperature) at three values;
- a training step that branches on its batch's values between two losses, each
  side with the backward and the AdamW step, called on both sides;
- (CUDA only) inference under ``torch.cuda.stream`` of a side stream, and a 0-dim
  CPU tensor beside CUDA tensors;
- a fresh process loading the training step's pair with an empty
  ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``: what it compiled (the kernel
  sources Inductor wrote, the kernels Triton built rather than found in the folders
  load wrote from the cache) and its load plus first call, next to a fresh process
  loading the code without the cache;
- resnet18 (torchvision, random weights) and GPT-2 small (transformers'
  ``GPT2Config()``, random weights), each a whole training step with AdamW inside,
  against ``torch.compile`` of the same step: median step time and
  ``torch.cuda.max_memory_allocated`` over one step.

Without one, the first line says so, and the seven cases run on CPU tensors with
Inductor's Triton kernels executed by Triton's interpreter
(``precompile_gen.testing.triton_interpreter``), in a child process that has
``TRITON_INTERPRET=1`` set before torch is imported. No line it prints then is a
GPU result.

What has run where: the interpreter path has run, on a machine without a GPU. The
CUDA path has not yet run on a GPU; no number in the documentation comes from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.decorators import mark_unbacked
from torch.utils.checkpoint import checkpoint

import precompile_gen as pg
from precompile_gen.tools import rebuild

STEPS = 3
ROUNDS = 10


def mlp(width: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(width, 2 * width), nn.LayerNorm(2 * width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(2 * width, width)).to(device)


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def adamw_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _randn(*shape: int, device: str, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _compiled(fn: Callable[..., object], *example: object) -> Callable[..., object]:
    code, cache = pg.precompile(fn, *example, backend="inductor")
    # Both paths are meant to run Triton kernels; C++ kernels would check nothing.
    if "@triton.jit" not in code:
        raise RuntimeError("the artifact holds no Triton kernel")
    return pg.load(code, cache)


# --- The cases, on any device: each raises if the artifact differs from eager ---------


def check_inference(device: str, width: int) -> str:
    model, x = mlp(width, device), _randn(16, width, device=device)
    forward = _compiled(predict, model, x)
    torch.testing.assert_close(forward(model, x), model(x))
    return "output matches eager"


def check_training(device: str, width: int) -> str:
    def arguments() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(width, device)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    x, y = _randn(16, width, device=device), _randn(16, width, device=device, seed=2)
    forward = _compiled(adamw_step, *arguments(), x, y)
    compiled, reference = arguments(), arguments()
    for _ in range(STEPS):
        torch.testing.assert_close(
            forward(*compiled, x, y), adamw_step(*reference, x, y)
        )
    for got, want in zip(
        compiled[0].parameters(), reference[0].parameters(), strict=True
    ):
        torch.testing.assert_close(got, want)
    return f"{STEPS} steps: losses and parameters match eager"


def check_dropout(device: str, width: int) -> str:
    model = nn.Sequential(mlp(width, device), nn.Dropout(0.5)).train()
    x = _randn(16, width, device=device)
    forward = _compiled(predict, model, x)
    for seed in (3, 4):
        torch.manual_seed(seed)
        got = forward(model, x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, model(x))
    return "two seeds: the same draws as eager"


class CheckpointedBlock(nn.Module):
    """An MLP whose second half is activation-checkpointed with dropout inside: on
    CUDA eager drops out with the fused ``native_dropout``, whose recompute the
    artifact must show to be the forward's."""

    def __init__(self, width: int, device: str) -> None:
        super().__init__()
        self.first = mlp(width, device)
        self.second = nn.Sequential(mlp(width, device), nn.Dropout(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return h + checkpoint(self.second, h, use_reentrant=False)


def check_checkpointed_dropout(device: str, width: int) -> str:
    def arguments() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = CheckpointedBlock(width, device).train()
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def generators() -> list[torch.Tensor]:
        cuda = [torch.cuda.get_rng_state()] if device == "cuda" else []
        return [torch.get_rng_state(), *cuda]

    x, y = _randn(16, width, device=device), _randn(16, width, device=device, seed=2)
    forward = _compiled(adamw_step, *arguments(), x, y)
    compiled, reference = arguments(), arguments()
    for seed in range(STEPS):
        torch.manual_seed(seed)
        got, got_state = forward(*compiled, x, y), generators()
        torch.manual_seed(seed)
        torch.testing.assert_close(got, adamw_step(*reference, x, y))
        for mine, eager in zip(got_state, generators(), strict=True):
            if not torch.equal(mine, eager):
                raise AssertionError("the generator is not where eager leaves it")
    for got, want in zip(
        compiled[0].parameters(), reference[0].parameters(), strict=True
    ):
        torch.testing.assert_close(got, want)
    return f"{STEPS} seeded steps: losses, parameters and generators match eager"


def check_unbacked_batch(device: str, width: int) -> str:
    model, x = mlp(width, device), _randn(8, width, device=device)
    mark_unbacked(x, 0, min=1, max=64)
    forward = _compiled(predict, model, x)
    sizes = (3, 17, 64)
    for rows in sizes:
        other = _randn(rows, width, device=device, seed=rows)
        torch.testing.assert_close(forward(model, other), model(other))
    return f"batch sizes {sizes}: outputs match eager"


def sample(model: nn.Module, x: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(model(x) / temperature, dim=-1)


def check_float_argument(device: str, width: int) -> str:
    """A float argument is a number of the graph: a 0-dim CPU float64 tensor, which
    Inductor's wrapper passes to the kernels as a scalar."""
    model, x = mlp(width, device).eval(), _randn(16, width, device=device)
    forward = _compiled(sample, model, x, 1.0)
    temperatures = (1.0, 0.5, 2.0)
    with torch.no_grad():
        for temperature in temperatures:
            torch.testing.assert_close(
                forward(model, x, temperature), sample(model, x, temperature)
            )
    return f"temperatures {temperatures}: outputs match eager"


def robust_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    out = model(x)
    if y.abs().max() > 1:  # noqa: SIM108 (a branch on the call's values: a torch.cond)
        loss = F.smooth_l1_loss(out, y)
    else:
        loss = F.mse_loss(out, y)
    loss.backward()
    opt.step()
    return loss.detach()


def check_value_branch(device: str, width: int) -> str:
    """Both sides of a branch on a tensor's value, each with the backward and the
    AdamW step inside: Inductor's wrapper reads the predicate and runs the side's
    kernels."""

    def arguments() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(width, device)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    x, y = _randn(16, width, device=device), _randn(16, width, device=device, seed=2)
    forward = _compiled(robust_step, *arguments(), x, y * 0.1)
    compiled, reference = arguments(), arguments()
    spreads = (0.1, 3.0, 0.1, 3.0)
    for spread in spreads:
        torch.testing.assert_close(
            forward(*compiled, x, y * spread), robust_step(*reference, x, y * spread)
        )
    for got, want in zip(
        compiled[0].parameters(), reference[0].parameters(), strict=True
    ):
        torch.testing.assert_close(got, want)
    return f"sides taken {spreads}: losses and parameters match eager"


CASES: dict[str, Callable[[str, int], str]] = {
    "MLP, LayerNorm + GELU, inference": check_inference,
    "training step, AdamW inside": check_training,
    "dropout under a seed": check_dropout,
    "checkpointed dropout, AdamW inside": check_checkpointed_dropout,
    "mark_unbacked batch dim": check_unbacked_batch,
    "a float argument at three values": check_float_argument,
    "a branch on a value, both sides": check_value_branch,
}


def run_cases(
    device: str, width: int, cases: dict[str, Callable[[str, int], str]]
) -> bool:
    passed = True
    for label, check in cases.items():
        start = time.perf_counter()
        try:
            result = "ok: " + check(device, width)
        except Exception as error:  # a failing case is reported, the others still run
            passed = False
            result = f"FAILED: {type(error).__name__}: {str(error)[:300]}"
        seconds = time.perf_counter() - start
        print(f"  {label:<34} {seconds:6.1f} s  {result}", flush=True)
    return passed


# --- A fresh process loading the pair (CUDA only) -------------------------------------


def write_training_pair(folder: Path, width: int) -> None:
    model = mlp(width, "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = _randn(16, width, device="cuda"), _randn(16, width, device="cuda", seed=2)
    code, cache = pg.precompile(adamw_step, model, opt, x, y, backend="inductor")
    (folder / "code.py").write_text(code, encoding="utf-8")
    (folder / "cache.bin").write_bytes(cache)


def load_child(folder: Path, with_cache: bool, width: int) -> None:
    """Loads the pair (or the code alone) and calls it once; prints one JSON line."""
    start = time.perf_counter()
    cache = (folder / "cache.bin").read_bytes() if with_cache else None
    forward = pg.load((folder / "code.py").read_text(encoding="utf-8"), cache)
    model = mlp(width, "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = _randn(16, width, device="cuda"), _randn(16, width, device="cuda", seed=2)
    forward(model, opt, x, y)
    torch.cuda.synchronize()
    print(json.dumps({"seconds": time.perf_counter() - start}))


def fresh_load(folder: Path, with_cache: bool, width: int) -> dict[str, float]:
    kernels = Path(tempfile.mkdtemp(dir=folder))
    environment = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(kernels / "inductor"),
        "TRITON_CACHE_DIR": str(kernels / "triton"),
    }
    mode = "with-cache" if with_cache else "without-cache"
    command = [sys.executable, __file__, "--load-child", str(folder), mode]
    command += ["--width", str(width)]
    done = subprocess.run(
        command, env=environment, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the fresh load failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # What was compiled: the kernel sources Inductor wrote, and the folders Triton's
    # cache holds (one per compiled kernel configuration) that load did not write
    # from the cache's payload.
    report["cpp sources"] = len(list(kernels.rglob("*.cpp")))
    folders = {path.parent.name for path in kernels.rglob("__grp__*.json")}
    carried = _carried_triton_folders(folder) if with_cache else set()
    report["triton kernels"] = len(folders - carried)
    report["triton carried"] = len(carried)
    return report


def _carried_triton_folders(folder: Path) -> set[str]:
    """The Triton cache folders (by key) the pair's cache carries."""
    envelope = torch.load(folder / "cache.bin", weights_only=True)
    files = envelope["artifact"]["files"] if envelope["artifact"] else {}
    return {name.split("/")[2] for name in files if name.startswith("triton/")}


def report_fresh_loads(width: int) -> None:
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        write_training_pair(folder, width)
        for with_cache in (True, False):
            report = fresh_load(folder, with_cache, width)
            label = "load + first call, " + ("with" if with_cache else "without")
            compiled = report["cpp sources"] + report["triton kernels"]
            print(
                f"  {label + ' the cache':<40} {report['seconds']:6.2f} s  compiled "
                f"{report['triton kernels']:.0f} Triton kernels, "
                f"{report['cpp sources']:.0f} C++ sources; "
                f"{report['triton carried']:.0f} Triton kernels from the cache",
                flush=True,
            )
            if with_cache:
                verdict = "compiled nothing" if compiled == 0 else "COMPILED KERNELS"
                print(f"  fresh load with the cache: {verdict}", flush=True)


# --- The same pair from two cache folders (CUDA only) --------------------------------


def report_same_bytes(width: int) -> None:
    """Two captures of the training step, each in a process of its own with its own
    Inductor cache folder: the same artifact and cache, byte for byte, and neither
    folder named in them (Triton's files are built without line tables)."""
    with tempfile.TemporaryDirectory() as name:
        pairs, folders = [], []
        for index, kernels in enumerate(("kernels", "other/kernels-elsewhere")):
            folder = Path(name) / f"capture{index}"
            folder.mkdir()
            folders.append(str(Path(name) / kernels))
            environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": folders[-1]}
            environment.pop("TRITON_CACHE_DIR", None)
            command = [sys.executable, __file__, "--write-child", str(folder)]
            command += ["--width", str(width)]
            done = subprocess.run(
                command, env=environment, capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"the capture failed:\n{done.stderr[-3000:]}")
            pairs.append(
                ((folder / "code.py").read_bytes(), (folder / "cache.bin").read_bytes())
            )
        same = "the same bytes" if pairs[0] == pairs[1] else "DIFFERENT BYTES"
        named = [
            kernels
            for kernels in folders
            if any(kernels.encode() in data for pair in pairs for data in pair)
        ]
        where = f"NAME {', '.join(named)}" if named else "name neither cache folder"
        triton = len(_carried_triton_folders(Path(name) / "capture0"))
        print(
            f"  two captures, two cache folders: {same}; they {where}; "
            f"{triton} Triton kernel folders carried",
            flush=True,
        )
        # verify --rebuild on the first pair: each kernel built again from the
        # artifact's text in fresh folders, against the cache's pinned files.
        report = rebuild.rebuild_report(pairs[0][0].decode(), pairs[0][1])
        results = [kernel["result"] for kernel in report["kernels"]]
        counted = ", ".join(f"{results.count(r)} {r}" for r in sorted(set(results)))
        print(f"  verify --rebuild of that pair: {counted}", flush=True)


# --- Whole training steps against torch.compile (CUDA only) --------------------------


def classify_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def language_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss.detach()


def resnet18_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    images = torch.randn(32, 3, 224, 224)
    return resnet18(), images, torch.randint(0, 1000, (32,))


def gpt2_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Without a cache the output holds no DynamicCache, which an artifact cannot
    # return; the computation is the same.
    config = GPT2Config(use_cache=False)
    tokens = torch.randint(0, config.vocab_size, (8, 513))
    return GPT2LMHeadModel(config), tokens[:, :-1], tokens[:, 1:]


Build = Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]
MODELS: dict[str, tuple[Build, Callable[..., torch.Tensor]]] = {
    "resnet18, batch 32x3x224x224": (resnet18_batch, classify_step),
    "GPT-2 small, batch 8x512": (gpt2_batch, language_step),
}


def measure(
    system: str, build: Build, step: Callable[..., torch.Tensor]
) -> tuple[float, float]:
    """The median step time (s) and the peak of torch.cuda.max_memory_allocated over
    one step (GiB), model and optimizer state included, for one system."""
    model, x, y = build()
    model, x, y = model.cuda().train(), x.cuda(), y.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if system == "torch.compile":
        run: Callable[..., object] = torch.compile(step)
    else:
        run = _compiled(step, model, opt, x, y)
    for _ in range(STEPS):  # torch.compile compiles here
        run(model, opt, x, y)
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(model, opt, x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    torch.cuda.reset_peak_memory_stats()
    run(model, opt, x, y)
    torch.cuda.synchronize()
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def report_models() -> None:
    systems = ("torch.compile", "precompile_gen")
    for label, (build, step) in MODELS.items():
        results = {}
        for system in systems:
            try:
                results[system] = measure(system, build, step)
            except Exception as error:  # reported, and the next system still runs
                print(f"  {label}: {system} FAILED: {type(error).__name__}: {error}")
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        cells = [
            f"{system} {seconds * 1e3:7.1f} ms {gib:6.2f} GiB"
            for system, (seconds, gib) in results.items()
        ]
        print(f"  {label:<30} " + " | ".join(cells), flush=True)


# --- The run ----------------------------------------------------------------------


def check_side_stream(device: str, width: int) -> str:
    """The kernels launch on the stream current at the call (Inductor's wrapper
    asks for it at each call), as eager's ops do."""
    model = mlp(width, device).eval()
    x = _randn(16, width, device=device)
    forward = _compiled(predict, model, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        got = forward(model, x)
        want = predict(model, x)
    side.synchronize()
    torch.testing.assert_close(got, want)
    return "output on a side stream matches eager's on it"


def check_cpu_scalar(device: str, width: int) -> str:
    """A 0-dim CPU tensor next to CUDA tensors, which eager's ops accept."""
    model = mlp(width, device).eval()
    x = _randn(16, width, device=device)

    def scaled(model: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return model(x) * scale

    forward = _compiled(scaled, model, x, torch.tensor(0.5))
    for value in (0.5, 3.0):
        scale = torch.tensor(value)
        torch.testing.assert_close(forward(model, x, scale), scaled(model, x, scale))
    return "a CPU scalar tensor beside CUDA tensors: two values match eager"


def on_gpu() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\ncases on CUDA tensors, inductor backend, against eager:")
    cuda_only = {
        "inference on a side stream": check_side_stream,
        "a CPU scalar tensor beside CUDA ones": check_cpu_scalar,
    }
    run_cases("cuda", width=256, cases=CASES | cuda_only)
    print("\na fresh process loading the training step (empty kernel folders):")
    report_fresh_loads(width=256)
    print("\nthe training step's pair, captured in two cache folders:")
    report_same_bytes(width=256)
    print("\nwhole training steps, AdamW inside (median step, peak allocated):")
    report_models()


def without_gpu() -> None:
    print(
        "NO GPU: torch.cuda.is_available() is False, so nothing ran on a GPU and no "
        "line below is a GPU result."
    )
    print(
        "Instead: the cases on CPU tensors, Inductor's Triton kernels run by "
        "Triton's interpreter (NumPy), in a child process with TRITON_INTERPRET=1."
    )
    print(
        "Not run (they need a GPU): a side stream, a CPU scalar beside CUDA "
        "tensors, the fresh-process load, the pair from two cache folders, "
        "resnet18 and GPT-2.\n"
    )
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, __file__, "--interpreted"]
    done = subprocess.run(command, env=environment, check=False)
    if done.returncode != 0:
        sys.exit(done.returncode)


def interpreted() -> None:
    from precompile_gen.testing import triton_interpreter

    # The interpreter computes masked-off lanes too (sqrt of garbage): not a result.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    print("cases on CPU tensors, Triton interpreter, against eager:", flush=True)
    with triton_interpreter():
        passed = run_cases("cpu", width=8, cases=CASES)
    sys.exit(0 if passed else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpreted", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--write-child", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # load() warns before executing unsigned code; this script made the code itself.
    logging.getLogger("precompile_gen").setLevel(logging.ERROR)
    if args.load_child:
        folder, mode = args.load_child
        load_child(Path(folder), mode == "with-cache", args.width)
    elif args.write_child:
        write_training_pair(Path(args.write_child), args.width)
    elif args.interpreted:
        interpreted()
    elif torch.cuda.is_available():
        on_gpu()
    else:
        without_gpu()


if __name__ == "__main__":
    main()
