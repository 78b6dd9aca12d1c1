"""The same capture gives the same bytes wherever Inductor's cache folder is, and
wherever torch is installed: no path of the capturing machine in the artifact's text
(no cache folder, home or temporary folder), and kernel binaries without the paths
gcc's line tables, ``__FILE__`` and the sources' names would write into them
(``lowering/kernel_builds.py``). Each capture runs in a process of its own, with a
cache folder of its own, so that each compiles its kernels: C++ kernels, and Triton
kernels under Triton's interpreter. The second finds torch in another folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers.processes import env_with_helpers

HERE = Path(__file__).resolve().parent
CHILDREN = {
    "C++": [str(HERE / "reproducible_capture_child.py")],
    "Triton": [str(HERE.parent / "end_to_end" / "triton_capture_child.py"), "training"],
}


def torch_elsewhere(folder: Path) -> dict[str, str]:
    """An environment whose Python finds this torch installed in ``folder``: a link
    to its package, first on the path."""
    folder.mkdir()
    (folder / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    env = env_with_helpers()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    found = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert found.stdout.strip() == str(folder / "torch" / "__init__.py")
    return env


def capture(
    kind: str, cache_folder: Path, out: Path, env: dict[str, str] | None = None
) -> tuple[str, bytes]:
    out.mkdir()
    done = subprocess.run(
        [sys.executable, *CHILDREN[kind], str(out)],
        capture_output=True,
        text=True,
        check=False,
        env={
            **(env or env_with_helpers()),
            "TORCHINDUCTOR_CACHE_DIR": str(cache_folder),
        },
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return (out / "code.py").read_text(encoding="utf-8"), (
        out / "cache.bin"
    ).read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CHILDREN))
def test_two_cache_folders_and_torch_folders_give_the_same_bytes(
    kind: str, tmp_path: Path
) -> None:
    first = tmp_path / "inductor-cache"
    # (Inductor cannot compile C++ in a folder whose path holds a space.)
    second = tmp_path / "another" / "inductor-cache-elsewhere"
    code, cache = capture(kind, first, tmp_path / "first")
    env = torch_elsewhere(tmp_path / "site-packages-elsewhere")
    other_code, other_cache = capture(kind, second, tmp_path / "second", env)
    torch_folder = Path(torch.__file__).parent
    for folder in (
        first,
        second,
        tmp_path,
        Path(tempfile.gettempdir()),
        Path.home(),
        torch_folder,
        Path(sys.prefix),
    ):
        assert f"{folder}/" not in code, f"the artifact holds the path {folder}"
    if kind == "Triton":
        # Each kernel's file is still named, within the cache folder.
        assert "# kernel path: $TORCHINDUCTOR_CACHE_DIR/" in code
    assert other_code == code, "the artifact's text depends on the folders"
    assert other_cache == cache, "the cache depends on the folders"
    if kind == "C++":
        # A loss that checks its targets' bounds in a kernel: a value check whose
        # message names its source file, which is in the cache folder.
        assert "TORCH_CHECK(" in code
