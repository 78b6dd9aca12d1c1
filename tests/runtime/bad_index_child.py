"""A training step called with an out-of-range token id, then with good batches:
prints what the failed call raised and left behind, and how the next steps compare
with eager, as JSON. Run as ``python bad_index_child.py BACKEND SHIFT``: the model
embeds ``ids + SHIFT``, which the graph computes. A batch of 64 makes Inductor run its
embedding kernel in parallel threads, where a kernel's own bounds check would abort
the process."""

from __future__ import annotations

import copy
import json
import sys
from typing import cast

import torch
from helpers.token_classifier import TokenClassifier, classification_step

import precompile_gen as pg


def main(backend: str, shift: int) -> None:
    torch.manual_seed(0)
    model = TokenClassifier(shift=shift)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    ids, y = torch.randint(0, 50 - shift, (64, 12)), torch.randint(0, 4, (64,))
    forward = pg.load(
        *pg.precompile(classification_step, model, opt, ids, y, backend=backend)
    )
    bad = ids.clone()
    bad[1, 3] = 50 - shift
    before = [p.detach().clone() for p in model.parameters()]
    try:
        forward(model, opt, bad, y)
        raised = None
    except pg.PrecompileError as error:
        raised = str(error)
    report: dict[str, object] = {
        "raised": raised,
        "optimizer_state": len(opt.state),
        "parameters_unchanged": all(
            torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
        ),
    }
    losses = []
    for _ in range(2):
        loss = cast(torch.Tensor, forward(model, opt, ids, y))
        expected = classification_step(twin, twin_opt, ids, y)
        losses.append([float(loss), float(expected)])
    report["losses"] = losses
    report["max_parameter_difference"] = max(
        (p - q).abs().max().item()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
