"""Precompile wall time: precompile_gen against torch.compiler.precompile.

    python benchmarks/precompile_time.py [--repeat N]

The same function (the built-in demo training step: a small CNN with BatchNorm) is
precompiled by both systems on both backends, each time in a fresh process:

- cold: with an empty TORCHINDUCTOR_CACHE_DIR (a fresh machine);
- warm: again with the cache folder the cold run filled (a repeated build).

The time is that of the ``precompile(...)`` call alone (imports and the example model
are made before the clock starts). Systems alternate run by run and each cell is the
median of ``--repeat`` runs, all in this one run of the script. precompile_gen's row
is split into its stages from its own log line (see ``precompile_gen.tools.timings``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SYSTEMS = ("precompile_gen", "torch.compiler.precompile")
TARGET = 1.1

_CHILD = r"""
import json, logging, sys, time
import torch
import precompile_gen
from precompile_gen import demo, timings

system, backend = sys.argv[1:3]
stages = {}


class Stages(logging.Handler):
    def emit(self, record):
        stages.update(getattr(record, "stage_seconds", {}))


timings.log.addHandler(Stages())
timings.log.setLevel(logging.INFO)
if system == "precompile_gen":
    precompile = precompile_gen.precompile
else:
    precompile = torch.compiler.precompile
model, images, labels = demo.example()
start = time.perf_counter()
precompile(demo.backward_step, model, images, labels, backend=backend)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "stages": stages}))
"""


def _run(system: str, backend: str, cache_dir: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, system, backend],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{system} ({backend}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    repeat = parser.parse_args().repeat
    results: dict[tuple[str, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for backend in ("eager", "inductor"):
            for run in range(repeat):
                for system in SYSTEMS:
                    folder = Path(scratch) / f"{backend}-{system}-{run}"
                    for when in ("cold", "warm"):
                        row = results.setdefault((backend, system, when), [])
                        row.append(_run(system, backend, folder))

    def median(backend: str, system: str, when: str) -> float:
        runs = results[backend, system, when]
        return statistics.median(r["seconds"] for r in runs)

    print(f"{'seconds':<18}{'precompile_gen':>16}{'torch precompile':>18}{'ratio':>8}")
    ratios = []
    for backend in ("eager", "inductor"):
        for when in ("cold", "warm"):
            ours, theirs = (median(backend, s, when) for s in SYSTEMS)
            ratios.append(ours / theirs)
            label = f"{backend}, {when}"
            print(f"{label:<18}{ours:>16.2f}{theirs:>18.2f}{ours / theirs:>8.2f}")
    verdict = "met" if max(ratios) <= TARGET else "NOT met"
    print(f"\nworst ratio {max(ratios):.2f} (target <= {TARGET}): {verdict}")
    print("\nprecompile_gen by stage (median seconds):")
    for backend in ("eager", "inductor"):
        for when in ("cold", "warm"):
            runs = results[backend, "precompile_gen", when]
            names = list(runs[0]["stages"])
            shown = ", ".join(
                f"{name} {statistics.median(r['stages'][name] for r in runs):.2f}"
                for name in names
            )
            print(f"  {backend}, {when}: {shown}")


if __name__ == "__main__":
    main()
