"""bench.slots: every slot-second of the window lands in exactly one bucket."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench import slots


@dataclass
class Rec:
    admission_id: str
    started_at: float
    ended_at: float
    outcome: str


def test_buckets_partition_the_window() -> None:
    # 2 slots, window [0, 10]. a: admitted 1, at the worker 2-5, released 6.
    # b: queued at 0, admitted 3, at the worker 4-7, preempted, released 6.5.
    # c: queued at 6.5, never admitted, timed out at 8.
    trace = [(0.0, "Q", "b", "system"), (1.0, "A", "a", "bulk"), (3.0, "A", "b", "system"),
             (6.0, "R", "a", "completed"), (6.5, "P", "b", "system"),
             (6.5, "R", "b", "preempted"), (6.5, "Q", "c", "bulk"), (8.0, "X", "c", "timeout")]
    recs = [Rec("a", 2.0, 5.0, "finished"), Rec("b", 4.0, 7.0, "cancelled")]
    b = slots.account(trace, recs, 2, 0.0, 10.0)
    assert b.per_class["bulk"] == {"to worker": 1.0, "served, done": 3.0,
                                   "served, preempted": 0.0, "held": 1.0}
    # b's worker ran past its release (6.5 -> 7): only the slot's part counts.
    assert b.per_class["system"] == {"to worker": 1.0, "served, done": 0.0,
                                     "served, preempted": 2.5, "held": 0.0}
    # Idle while waiting: [0,1) 2 free + [1,3) 1 free (b queued) + [6.5,8) 2 free (c queued).
    assert b.idle_waiting == pytest.approx(2.0 + 2.0 + 3.0)
    # Idle, none waiting: [6, 6.5) 1 free + [8, 10) 2 free.
    assert b.idle == pytest.approx(0.5 + 4.0)
    assert b.idle_reserved == 0.0
    # With 2 slots reserved for system, c (bulk) may take none of the 2 free slots.
    r = slots.account(trace, recs, 2, 0.0, 10.0, reserved={"system": 2})
    assert r.idle_waiting == pytest.approx(7.0)
    assert r.idle_reserved == pytest.approx(3.0)
    used = sum(b.total(k) for k in slots.BUCKETS)
    assert used + b.idle_waiting + b.idle == pytest.approx(b.slot_seconds)
