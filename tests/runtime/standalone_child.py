"""Runs the artifact file ARTIFACT (a capture of helpers.small_net's training step)
against eager PyTorch, executing it as a plain script would, without importing
precompile_gen; prints STANDALONE-OK.

    python standalone_child.py ARTIFACT
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from helpers.small_net import example, train_step


def main(artifact_path: Path) -> None:
    model, batch = example()
    eager_model = copy.deepcopy(model)
    artifact: dict[str, object] = {"__name__": "artifact"}
    source = artifact_path.read_text(encoding="utf-8")
    exec(compile(source, str(artifact_path), "exec"), artifact)
    forward = artifact["forward"]
    assert callable(forward)
    for _ in range(2):
        expected = train_step(eager_model, batch)
        got = forward(model, batch)
        torch.testing.assert_close(got, expected)
    for (name, ours), (_, theirs) in zip(
        model.named_parameters(), eager_model.named_parameters(), strict=True
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


if __name__ == "__main__":
    main(Path(sys.argv[1]))
