"""Prints the sha256 of what this process renders for fixed inputs: a capture of
helpers.small_net's training step, both stubs and the hand-built capture, one
``NAME SHA256`` line each.

    python render_hashes_child.py
"""

from __future__ import annotations

import hashlib

from helpers.hand_built import hand_built_capture
from helpers.small_net import example, train_step
from helpers.stubs import stub_capture

import precompile_gen as pg


def main() -> None:
    model, batch = example()
    code, _ = pg.precompile(train_step, model, batch, backend="eager")
    texts = {
        "precompile": code,
        "stub-eager": pg.render_artifact(stub_capture("eager")),
        "stub-inductor": pg.render_artifact(stub_capture("inductor")),
        "hand-built": pg.render_artifact(hand_built_capture()),
    }
    for name, text in texts.items():
        print(name, hashlib.sha256(text.encode("utf-8")).hexdigest())


if __name__ == "__main__":
    main()
