"""Per-stage timings reach users through logging: one INFO line per precompile (or
capture called on its own), whose stages add up to the total."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import precompile_gen as pg
from precompile_gen.tools import timings


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "precompile_gen.tools.timings"]


def test_precompile_logs_its_stages(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="precompile_gen")
    pg.precompile(predict, nn.Linear(3, 2), torch.randn(4, 3), backend="eager")
    (record,) = _records(caplog)
    message = record.getMessage()
    assert message.startswith("precompile of 'predict' (backend 'eager'): ")
    stages = record.__dict__["stage_seconds"]
    # Capture's passes are stages of their own, named after it.
    assert list(stages) == [
        "capture",
        "capture: python values",
        "capture: make_fx",
        "lowering",
        "render",
        "cache",
    ]
    for name, seconds in stages.items():
        assert seconds >= 0
        assert f"{name} {seconds:.1f} s" in message


def test_capture_on_its_own_logs_capture_and_lowering(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="precompile_gen")
    pg.capture(predict, nn.Linear(3, 2), torch.randn(4, 3), backend="eager")
    (record,) = _records(caplog)
    assert record.getMessage().startswith("capture of 'predict' (backend 'eager')")
    assert list(record.__dict__["stage_seconds"]) == [
        "capture",
        "capture: python values",
        "capture: make_fx",
        "lowering",
    ]


def test_nothing_is_logged_at_the_default_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="precompile_gen")
    pg.precompile(predict, nn.Linear(3, 2), torch.randn(4, 3), backend="eager")
    assert _records(caplog) == []


def test_a_failed_precompile_logs_no_timings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="precompile_gen")
    with pytest.raises(RuntimeError):
        pg.precompile(predict, nn.Linear(3, 2), torch.randn(4, 5), backend="eager")
    assert _records(caplog) == []


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_a_nested_stage_counts_in_its_own_stage_only(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="precompile_gen")
    clock = FakeClock()
    monkeypatch.setattr(timings, "time", clock)
    with timings.recording("work") as times:
        with timings.stage("outer"):
            clock.now += 2
            with timings.stage("inner"):
                clock.now += 5
        with timings.stage("inner"):
            clock.now += 1
    assert times.seconds == {"outer": 2, "inner": 6}
    assert list(times.seconds) == ["outer", "inner"]
    (record,) = _records(caplog)
    assert record.__dict__["stage_seconds"] == times.seconds
    assert record.getMessage() == "work: 8.0 s: outer 2.0 s, inner 6.0 s"


def test_stages_outside_a_recording_are_not_timed() -> None:
    with timings.stage("alone"):
        pass
