"""Loads the pairs in FOLDER (0.py and 0.cache, 1.py and 1.cache, ...) for the
concurrency jobs NAME..., calls each once, and prints, as one JSON line, what loading
and calling changed in torch's and logging's process-wide state.

    python process_state_child.py FOLDER NAME...
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
from helpers.concurrency_jobs import JOBS

import precompile_gen as pg


def configs() -> dict[str, str]:
    modules = [torch._dynamo.config, torch._functorch.config, torch._inductor.config]
    return {
        f"{m.__name__}.{k}": repr(v)
        for m in modules
        for k, v in m.get_config_copy().items()
    }


def loggers() -> dict[str, list[Any]]:
    manager = logging.root.manager
    found = {"<root>": logging.root, **manager.loggerDict}
    return {
        name: [
            logger.level,
            logger.propagate,
            logger.disabled,
            # torch's structured-trace handler removes itself the first time
            # anything in torch emits a trace event, as inductor does.
            0 if name == "torch.__trace" else len(logger.handlers),
        ]
        for name, logger in found.items()
        if isinstance(logger, logging.Logger)
    }


def state() -> dict[str, Any]:
    return {
        "default dtype": str(torch.get_default_dtype()),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly mode": torch.is_anomaly_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(),
        "logging disable": logging.root.manager.disable,
        "warning filters": repr(warnings.filters),
        # Inductor points its compiled kernels at a function of this process through
        # this variable whenever it loads one: part of loading kernels, not state a
        # caller sets.
        "environment": {
            k: v
            for k, v in os.environ.items()
            if k != "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"
        },
        "config": configs(),
        "loggers": loggers(),
    }


def differences(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in before:
        if isinstance(before[key], dict):
            changed = {
                k: [before[key].get(k), after[key].get(k)]
                for k in before[key].keys() | after[key].keys()
                if before[key].get(k) != after[key].get(k)
            }
            # A logger first created by an import (torch registers its own) counts
            # only if it was given a level or a handler.
            if key == "loggers":
                changed = {
                    k: v
                    for k, v in changed.items()
                    if v[0] is not None or v[1][0] != 0 or v[1][3] != 0
                }
            if changed:
                out[key] = changed
        elif before[key] != after[key]:
            out[key] = [before[key], after[key]]
    return out


def main(folder: Path, names: list[str]) -> None:
    before, rng = state(), torch.get_rng_state()
    forwards = {
        name: pg.load(folder / f"{i}.py", folder / f"{i}.cache", key=JOBS[name].key)
        for i, name in enumerate(names)
    }
    after_load, rng_after_load = state(), torch.get_rng_state()
    for name, forward in forwards.items():
        model, batch = JOBS[name].example()
        forward(model, *batch)
    after_calls = state()
    report = {
        "load": differences(before, after_load),
        "rng consumed by load": not torch.equal(rng, rng_after_load),
        "calls": differences(before, after_calls),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
