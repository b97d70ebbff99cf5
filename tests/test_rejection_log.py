"""Rejections at info: one throttled summary line, never a line per rejection.

A flood is shed at thousands of Checks a second; the per-rejection ``rejected`` line
is at debug, and :class:`sidecar.logs.RejectionSummary` gives the operator one
``rejections`` line per interval with the counts by class and outcome and the
tenants most rejected. Pure logic: injected clock and scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

from structlog.testing import capture_logs

from sidecar import logs as sidecar_logs
from tests.clock import FakeClock


class Timers:
    """What ``call_later`` would run, run by hand."""

    def __init__(self) -> None:
        self.armed: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay: float, fn: Callable[[], None]) -> None:
        self.armed.append((delay, fn))

    def fire(self) -> float:
        delay, fn = self.armed.pop(0)
        fn()
        return delay


def summary(clock: FakeClock, timers: Timers) -> sidecar_logs.RejectionSummary:
    return sidecar_logs.RejectionSummary(sidecar_logs.get("t"), interval=10.0, clock=clock,
                                         schedule=timers)


def test_first_rejection_at_once_then_one_line_per_interval_with_the_counts() -> None:
    clock, timers = FakeClock(), Timers()
    s = summary(clock, timers)
    with capture_logs() as logs:
        s.add("bulk", "rejected_queue_full", "anonymous")  # after quiet: logged at once
        for i in range(1000):
            s.add("bulk", "rejected_queue_full", "anonymous" if i % 4 else "auth:acme")
        s.add("default", "rejected_queue_timeout", "auth:acme")
        assert len(logs) == 1 and len(timers.armed) == 1  # one flush armed, not 1,001
        clock.advance(10.0)
        assert timers.fire() == 10.0
    first, second = logs
    assert (first["event"], first["log_level"], first["total"]) == ("rejections", "info", 1)
    assert first["by_class_outcome"] == {"bulk/rejected_queue_full": 1}
    assert second["total"] == 1001
    assert second["by_class_outcome"] == {"bulk/rejected_queue_full": 1000,
                                          "default/rejected_queue_timeout": 1}
    assert second["top_tenants"] == {"anonymous": 750, "auth:acme": 251}
    assert second["interval_secs"] == 10.0


def test_quiet_interval_logs_nothing_and_the_next_rejection_is_at_once() -> None:
    clock, timers = FakeClock(), Timers()
    s = summary(clock, timers)
    with capture_logs() as logs:
        s.add("bulk", "rejected_queue_full", "t")
        clock.advance(25.0)  # nothing for longer than an interval
        s.add("interactive", "client_cancelled", "t")
    assert [e["by_class_outcome"] for e in logs] == [{"bulk/rejected_queue_full": 1},
                                                     {"interactive/client_cancelled": 1}]
    assert timers.armed == []
    s.flush()  # nothing counted since: no line
    assert len(logs) == 2


def test_tenants_beyond_the_cap_count_as_other() -> None:
    clock, timers = FakeClock(), Timers()
    s = summary(clock, timers)
    s.add("bulk", "rejected_queue_full", "first")  # logged at once, outside the capture
    cap = sidecar_logs.RejectionSummary.MAX_TENANTS
    with capture_logs() as logs:
        for i in range(cap + 50):
            s.add("bulk", "rejected_queue_full", f"t{i}")
        for _ in range(3):
            s.add("bulk", "rejected_queue_full", "t1")  # already counted: keeps its name
        timers.fire()
    [line] = logs
    assert line["total"] == cap + 53
    assert line["top_tenants"]["other"] == 50 and line["top_tenants"]["t1"] == 4
    assert len(line["top_tenants"]) == sidecar_logs.RejectionSummary.TOP_TENANTS
