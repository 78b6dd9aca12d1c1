"""Cold start: time to the first result in a fresh process, with and without the cache.

    python benchmarks/cold_start.py

For precompile_gen and torch.compiler.precompile side by side, on the built-in demo
training step (a small CNN with BatchNorm), every row a fresh process with its own
TORCHINDUCTOR_CACHE_DIR:

- precompile: ``precompile(...)`` starting from an empty cache folder;
- cache: ``load(code, cache)`` + first call, empty cache folder (a fresh machine);
- no cache: the same with the cache's artifact stripped (compiles from python_code);
- warm: the same with a cache folder a previous load filled (same-machine reload);
- other path: ``load`` + first call with the cache, empty cache folder, in another
  environment at another path (the same installation reached through a symlinked
  prefix, so torch and Python's headers are seen under other folders, as in a second
  virtualenv), as when a pair built in CI's virtualenv serves from production's.

All rows are measured in this one run, after one untimed precompile that warms the
operating system's file cache; the ratios compare rows of that run. For the cache
row, a second table breaks the fresh process down by wall clock, from the moment it
is started: the interpreter with ``import torch``, importing precompile_gen (which
the demo model comes from, for both systems), ``load`` (for precompile_gen: prime,
writing the binaries into place, and executing the artifact), and the first call; and
compares the whole with a bare ``python -c "import torch"`` timed in the same run.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SYSTEMS = ("precompile_gen", "torch.compiler.precompile")

_CHILD = r"""
import time
import torch
imported_torch = time.time()
import json, sys
import precompile_gen
from precompile_gen.tools import demo
imported_precompile_gen = time.time()

system, step, code_path, cache_path = sys.argv[1:5]
priming = [0.0]
if system == "precompile_gen":
    precompile, load = precompile_gen.precompile, precompile_gen.load
    # Time the part of load that writes the binaries into place.
    from precompile_gen.runtime import kernel_binaries
    prime = kernel_binaries.prime
    def timed_prime(*args, **kwargs):
        begun = time.perf_counter()
        try:
            return prime(*args, **kwargs)
        finally:
            priming[0] += time.perf_counter() - begun
    kernel_binaries.prime = timed_prime
else:
    precompile, load = torch.compiler.precompile, torch.compiler.precompile.load
model, images, labels = demo.example()
start, started_load = time.perf_counter(), time.time()
if step == "precompile":
    code, cache = precompile(demo.backward_step, model, images, labels)
    open(code_path, "w", encoding="utf-8").write(code)
    open(cache_path, "wb").write(cache)
else:
    code = open(code_path, encoding="utf-8").read()
    forward = load(code, open(cache_path, "rb").read())
    loaded = time.time()
    forward(model, images, labels)
    called = time.time()
print(json.dumps({
    "seconds": time.perf_counter() - start,
    "imported_torch": imported_torch,
    "imported_precompile_gen": imported_precompile_gen,
    "started_load": started_load,
    "loaded": loaded if step != "precompile" else None,
    "prime": priming[0],
    "called": called if step != "precompile" else None,
}))
"""


def _child(
    system: str,
    step: str,
    code: Path,
    cache: Path,
    cache_dir: Path,
    python: str = sys.executable,
) -> dict[str, float]:
    """Run one row in a fresh process; its report, with ``spawned`` (wall clock)."""
    spawned = time.time()
    done = subprocess.run(
        [python, "-c", _CHILD, system, step, str(code), str(cache)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{system} {step} failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "spawned": spawned}


def _bare_import_torch() -> float:
    spawned = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.time() - spawned


def _strip_artifact(cache: bytes) -> bytes:
    envelope = torch.load(io.BytesIO(cache), weights_only=True)
    envelope["artifact"] = None
    buffer = io.BytesIO()
    torch.save(envelope, buffer)
    return buffer.getvalue()


def _other_environment(work: Path) -> str:
    """This interpreter reached through a symlink to its prefix: a second
    environment whose torch folder and include folder have other paths."""
    prefix, python = Path(sys.prefix), Path(sys.executable)
    other = work / "other-environment"
    if not other.exists():
        other.symlink_to(prefix, target_is_directory=True)
    other_python = str(other / python.relative_to(prefix))
    where = "import os, torch; print(os.path.dirname(torch.__file__))"
    torch_dir = subprocess.run(
        [other_python, "-c", where], capture_output=True, text=True, check=True
    ).stdout.strip()
    if torch_dir == os.path.dirname(torch.__file__):
        raise RuntimeError(f"the other environment sees torch at {torch_dir} too")
    return other_python


def _measure(system: str, work: Path) -> dict[str, float]:
    folder = work / system
    folder.mkdir()
    code, cache, stripped = folder / "code.py", folder / "cache", folder / "stripped"

    def load(payload: Path, cache_dir: str, python: str = sys.executable) -> float:
        return _child(system, "load", code, payload, folder / cache_dir, python)[
            "seconds"
        ]

    precompiled = _child(system, "precompile", code, cache, folder / "c0")
    seconds = {"precompile": precompiled["seconds"]}
    stripped.write_bytes(_strip_artifact(cache.read_bytes()))
    report = _child(system, "load", code, cache, folder / "c1")
    seconds["cache"] = report["seconds"]
    seconds["interpreter + import torch"] = report["imported_torch"] - report["spawned"]
    seconds["import precompile_gen"] = (
        report["imported_precompile_gen"] - report["imported_torch"]
    )
    seconds["load"] = report["loaded"] - report["started_load"]
    seconds["  prime"] = report["prime"]
    seconds["  execute"] = seconds["load"] - report["prime"]
    seconds["first call"] = report["called"] - report["loaded"]
    seconds["start to first result"] = report["called"] - report["spawned"]
    seconds["no cache"] = load(stripped, "c2")
    load(cache, "c3")  # fills c3
    seconds["warm"] = load(cache, "c3")
    seconds["other path"] = load(cache, "c4", _other_environment(work))
    seconds["cache bytes"] = cache.stat().st_size
    return seconds


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        # One untimed precompile first, so that no row pays for reading torch's
        # libraries and the compiler's headers from disk for the first time (the
        # row measured first would otherwise be slower for that reason alone).
        warmup = Path(scratch) / "warmup"
        warmup.mkdir()
        _child(SYSTEMS[0], "precompile", warmup / "code.py", warmup / "cache", warmup)
        rows = {system: _measure(system, Path(scratch)) for system in SYSTEMS}
        bare = min(_bare_import_torch() for _ in range(3))
    ours, theirs = rows["precompile_gen"], rows["torch.compiler.precompile"]
    print(f"{'seconds':<24}{'precompile_gen':>16}{'torch precompile':>18}")
    for row in ("precompile", "cache", "no cache", "warm", "other path"):
        print(f"{row:<24}{ours[row]:>16.2f}{theirs[row]:>18.2f}")
    size = "cache size (bytes)"
    print(f"{size:<24}{ours['cache bytes']:>16,.0f}{theirs['cache bytes']:>18,.0f}")
    print()
    for label, r in (("precompile_gen", ours), ("torch precompile", theirs)):
        print(
            f"{label}: cache / no cache = {r['cache'] / r['no cache']:.2f}x "
            f"(target <= 0.25x); cache / warm = {r['cache'] / r['warm']:.2f}x "
            "(target <= 1.5x)"
        )
        print(
            f"{label}: other path / cache = {r['other path'] / r['cache']:.2f}x "
            f"(target <= 1.2x); no cache / other path = "
            f"{r['no cache'] / r['other path']:.1f}x (target >= 4x)"
        )
    print()
    header = "fresh process, with cache"
    print(f"{header:<28}{'precompile_gen':>16}{'torch precompile':>18}")
    for row in (
        "interpreter + import torch",
        "import precompile_gen",
        "load",
        "  prime",
        "  execute",
        "first call",
        "start to first result",
    ):
        print(f"{row:<28}{ours[row]:>16.2f}{theirs[row]:>18.2f}")
    print(f"{'bare import torch':<28}{bare:>16.2f}")
    for label, r in (("precompile_gen", ours), ("torch precompile", theirs)):
        ratio = r["start to first result"] / bare
        print(
            f"{label}: start to first result / bare import torch = {ratio:.2f}x "
            "(target <= 1.6x, stretch 1.5x)"
        )


if __name__ == "__main__":
    main()
