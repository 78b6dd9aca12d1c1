"""What Inductor's lowering prints: torch's extension loader logs a guess of the CUDA
toolkit at captures on a machine without a GPU, which says nothing about the
capture; it is kept out of the user's terminal unless the user asked for torch's
logs."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from precompile_gen.lowering import lower

GUESS = "No CUDA runtime is found, using CUDA_HOME='%s'"


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def loader_log() -> Iterator[Kept]:
    logger = logging.getLogger("torch.utils.cpp_extension")
    kept = Kept()
    logger.addHandler(kept)
    yield kept
    logger.removeHandler(kept)


def log_while_lowering() -> None:
    logger = logging.getLogger("torch.utils.cpp_extension")
    with lower._quiet_cuda_home_guess():
        logger.warning(GUESS, "/usr/local")
        logger.warning("g++ failed: %s", "exit status 1")


def test_the_cuda_home_guess_is_kept_out_and_nothing_else(
    loader_log: Kept, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    log_while_lowering()
    assert loader_log.messages == ["g++ failed: exit status 1"]
    # Only while lowering.
    logging.getLogger("torch.utils.cpp_extension").warning(GUESS, "/usr/local")
    assert (
        loader_log.messages[-1]
        == "No CUDA runtime is found, using CUDA_HOME='/usr/local'"
    )


def test_the_guess_shows_where_the_user_asked_for_torchs_logs(
    loader_log: Kept, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_LOGS", "+inductor")
    log_while_lowering()
    assert len(loader_log.messages) == 2
