"""Where a precompile's time goes, logged per stage.

``precompile`` and ``capture`` each log one INFO line on the ``precompile_gen`` logger
when they finish, e.g.::

    precompile of 'train_step' (backend 'inductor'): 10.3 s: capture 1.2 s,
    lowering 8.0 s, cache 0.9 s, render 0.1 s

A stage nested in another (collecting kernel binaries happens inside lowering) is
counted in its own stage only, so the stages add up to the total. Enable the lines with
``logging.getLogger("precompile_gen").setLevel(logging.INFO)`` (and a handler); each
record also carries the numbers as ``record.stage_seconds``, a dict of seconds by stage.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Generator

log = logging.getLogger(__name__)


class StageTimes:
    """Seconds per stage, in the order the stages first ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        # Per open stage, the seconds its nested stages took, to subtract from it.
        self._nested: list[float] = []

    def summary(self) -> str:
        total = sum(self.seconds.values())
        stages = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"{total:.1f} s: {stages}"


_current: contextvars.ContextVar[StageTimes | None] = contextvars.ContextVar(
    "precompile_gen_stage_times", default=None
)


@contextlib.contextmanager
def recording(what: str) -> Generator[StageTimes]:
    """Collect the stages that run inside, and log them when the outermost recording
    ends without an error; an inner recording adds to the outer one."""
    outer = _current.get()
    if outer is not None:
        yield outer
        return
    times = StageTimes()
    token = _current.set(times)
    try:
        yield times
    finally:
        _current.reset(token)
    log.info(
        "%s: %s", what, times.summary(), extra={"stage_seconds": dict(times.seconds)}
    )


@contextlib.contextmanager
def stage(name: str) -> Generator[None]:
    """Time the body as stage ``name`` of the current recording, if any."""
    times = _current.get()
    if times is None:
        yield
        return
    times.seconds.setdefault(name, 0.0)  # stages are listed in the order they start
    start = time.perf_counter()
    times._nested.append(0.0)
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        nested = times._nested.pop()
        times.seconds[name] += elapsed - nested
        if times._nested:
            times._nested[-1] += elapsed
