"""Progress for long command-line stages: a live line on a terminal, else log lines.

On a terminal a stage shows as one line with a spinner and the elapsed seconds,
rewritten in place, then replaced by its result. Anywhere else (CI logs, pipes,
files) carriage returns would pile up into noise, so each stage writes a plain line
when it starts and one when it ends.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Generator
from typing import TextIO

_SPINNER = "|/-\\"
_TICK_SECONDS = 0.1


class Progress:
    """Reports stages on ``stream`` (stderr by default) and records their durations."""

    def __init__(
        self, stream: TextIO | None = None, *, interactive: bool | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = (
            _is_terminal(self.stream) if interactive is None else interactive
        )
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def stage(self, label: str) -> Generator[None]:
        """Time the body as stage ``label``; shown while it runs."""
        start = time.perf_counter()
        done = threading.Event()
        spinner = None
        if self.interactive:
            spinner = threading.Thread(
                target=self._spin, args=(label, start, done), daemon=True
            )
            spinner.start()
        else:
            self._line(f"{label} ...")
        outcome = "failed"
        try:
            yield
            outcome = "done"
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[label] = elapsed
            done.set()
            if spinner is not None:
                spinner.join()
            mark = ("ok " if outcome == "done" else "!! ") if self.interactive else ""
            self._line(f"{mark}{label}: {outcome} in {elapsed:.1f} s")

    def note(self, message: str) -> None:
        self._line(message)

    def _line(self, text: str) -> None:
        with self._lock:
            if self.interactive:
                # Replace the spinner line, whatever its length.
                self.stream.write(f"\r\x1b[K{text}\n")
            else:
                elapsed = time.perf_counter() - self._started
                self.stream.write(f"[{elapsed:6.1f} s] {text}\n")
            self.stream.flush()

    def _spin(self, label: str, start: float, done: threading.Event) -> None:
        frame = 0
        while not done.wait(_TICK_SECONDS if frame else 0):
            with self._lock:
                elapsed = time.perf_counter() - start
                self.stream.write(
                    f"\r\x1b[K{_SPINNER[frame % len(_SPINNER)]} {label} {elapsed:.1f} s"
                )
                self.stream.flush()
            frame += 1


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream
        return False
