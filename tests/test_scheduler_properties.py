"""Property tests: random arrive/release/cancel/first-byte/capacity/time sequences.

Invariants checked after every step (stated precisely):
* Σinflight ≤ capacity after any step that admitted something; a step that admitted
  nothing never raises Σinflight (a shrink may leave Σinflight > capacity: those
  requests drain, nothing new is admitted until Σinflight < capacity). Adopting a
  stream of an earlier process is the one other way past capacity, by exactly one.
* An admission outside the starvation rule happens only when available(cls) ≥ 1, i.e. it
  never eats the unused reservation of a higher class; a starvation admission happens only
  when Σinflight < capacity.
* Dispatch from a class queue is FIFO (cancelled and timed-out waiters leave the order).
* Every admission ends in exactly one release; a release of an ended or unknown id changes
  nothing.
* Queue depth ≤ queue_size for every class.
* Every arrival gets exactly one decision: admitted, or rejected (full, timeout, cancel).
* Every move of every request is an arrow of the lifecycle table (``TRANSITIONS``), and
  the core's ``state_of`` agrees with the states those moves lead to.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler import (
    TRANSITIONS,
    Admitted,
    ClassSettings,
    Outcome,
    Preempted,
    Queued,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
    Scheduler,
    State,
)
from sidecar.scheduler.lifecycle import HOLDS_A_SLOT
from tests.clock import FakeClock
from tests.strategies import classes, configs


def drain(s: Scheduler, clock: FakeClock, live: list[str], queued: Sized,
          absorb: Callable[[list[Any]], None]) -> None:
    """Release the oldest live admission, or let a second pass when none is live, until
    nothing is live or queued (``absorb`` keeps both up to date); bounded."""
    for _ in range(1000):
        if not live and not queued:
            break
        if live:
            s.release(live[0])
        else:
            clock.advance(1.0)
            s.tick()
        absorb(s.take_events())


class CheckedScheduler(Scheduler):
    """Asserts the admission rule at the moment of every admission."""

    def _admit(self, id: str, cls: PriorityClass, tenant: str, now: float, **kw: Any) -> Admitted:
        if kw.get("starvation"):
            assert self.inflight() < self.capacity, "starvation admitted past capacity"
        else:
            assert self.available(cls) >= 1, f"{cls.label} ate a higher class's reservation"
        return super()._admit(id, cls, tenant, now, **kw)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), classes),
        st.tuples(st.just("release"), st.integers(0, 1000)),
        st.tuples(st.just("release_bogus"), st.integers(0, 3)),
        st.tuples(st.just("cancel"), st.integers(0, 1000)),
        st.tuples(st.just("first_byte"), st.integers(0, 1000)),
        st.tuples(st.just("capacity"), st.integers(0, 12)),
        st.tuples(st.just("adopt"), classes),
        st.tuples(st.just("reachable"), st.integers(0, 1000)),
        st.tuples(st.just("advance"), st.sampled_from([0.1, 0.5, 1.0, 2.5, 6.0])),
    ),
    max_size=80,
)


@given(cfg=configs, capacity=st.integers(0, 12), steps=ops, on_admit=st.booleans())
def test_invariants(cfg: dict[PriorityClass, ClassSettings], capacity: int,
                    steps: list[tuple[str, Any]], on_admit: bool) -> None:
    clock = FakeClock()
    # on_admit False is the sidecar's mode: candidates only once a stop channel exists.
    s = CheckedScheduler(cfg, capacity, clock, preemptible_on_admit=on_admit)
    fifo: dict[PriorityClass, list[str]] = {c: [] for c in PriorityClass}
    queued: set[str] = set()
    admitted: list[str] = []
    live: list[str] = []
    released: dict[str, int] = {}
    decided: dict[str, str] = {}
    state: dict[str, State] = {}
    seq = 0
    on_admit_state = State.PREEMPTIBLE if on_admit else State.ADMITTED

    def move(rid: str, new: State) -> None:
        old = state.get(rid, State.NEW)
        assert new in TRANSITIONS[old], f"{rid}: {old.name} -> {new.name} is not in the table"
        state[rid] = new

    def absorb(events: list[Any]) -> None:
        for e in events:
            if isinstance(e, Admitted):
                aid = e.admission.id
                move(aid, State.STREAMING if e.adopted else on_admit_state)
                assert aid not in decided, "second decision"
                decided[aid] = "admitted"
                if e.queued:
                    head = fifo[e.admission.cls][0]
                    assert head == aid, "FIFO violated"
                    fifo[e.admission.cls].pop(0)
                    queued.discard(aid)
                admitted.append(aid)
                live.append(aid)
            elif isinstance(e, Rejected):
                move(e.id, State(e.outcome.value))
                assert e.id not in decided, "second decision"
                decided[e.id] = e.outcome.value
                if e.id in queued:
                    queued.discard(e.id)
                    fifo[e.cls].remove(e.id)
                    if e.outcome is Outcome.REJECTED_QUEUE_TIMEOUT:
                        assert e.waited >= cfg[e.cls].queue_timeout_secs - 1e-9
            elif isinstance(e, Released):
                if e.reason is ReleaseReason.PREEMPTED:  # its Preempted event moved it
                    assert state[e.admission.id] is State.PREEMPTED
                else:
                    move(e.admission.id, State(e.reason.value))
                released[e.admission.id] = released.get(e.admission.id, 0) + 1
                live.remove(e.admission.id)
            elif isinstance(e, Preempted):
                move(e.victim.id, State.PREEMPTED)
                assert e.victim.cls < e.by_class and not e.victim.first_byte

    for op, arg in steps:
        before = s.inflight()
        if op == "arrive":
            seq += 1
            rid = f"r{seq}"
            d = s.arrive(rid, arg, "t")
            if isinstance(d, Queued):
                move(rid, State.QUEUED)
                fifo[arg].append(rid)
                queued.add(rid)
        elif op == "release" and live:
            assert s.release(live[arg % len(live)]) is ReleaseResult.RELEASED
        elif op == "release_bogus":
            target = admitted[arg % len(admitted)] if admitted and arg else "bogus"
            if target not in live:
                snap = s.snapshot()
                assert s.release(target) is not ReleaseResult.RELEASED
                assert s.snapshot() == snap
        elif op == "cancel" and queued:
            target = sorted(queued)[arg % len(queued)]
            assert s.cancel(target)
        elif op == "first_byte" and live:
            target = live[arg % len(live)]
            if s.mark_first_byte(target):
                move(target, State.STREAMING)
        elif op == "reachable" and live:
            target = live[arg % len(live)]
            was = state[target]
            if s.mark_preemptible(target) and was is not State.PREEMPTIBLE:
                move(target, State.PREEMPTIBLE)
        elif op == "capacity":
            s.set_capacity(arg)
        elif op == "adopt":
            seq += 1
            assert s.adopt(f"r{seq}", arg, "t")
        elif op == "advance":
            clock.advance(arg)
            s.tick()
        events = s.take_events()
        absorb(events)
        if op == "adopt":
            assert s.inflight() == before + 1
        elif any(isinstance(e, Admitted) for e in events):
            assert s.inflight() <= s.capacity
        else:
            assert s.inflight() <= before
        for c in HIGH_TO_LOW:
            assert s.queue_depth(c) <= cfg[c].queue_size
            assert s.queued_ids(c) == fifo[c]
        assert sum(s.inflight(c) for c in PriorityClass) == s.inflight() == len(live)
        for rid, where in state.items():
            live_state = where is State.QUEUED or where in HOLDS_A_SLOT
            assert s.state_of(rid) == (where if live_state else None)

    # Drain: time passes until every queue empties; releases end every admission once.
    drain(s, clock, live, queued, absorb)
    assert not live and not queued and s.inflight() == 0
    assert all(n == 1 for n in released.values())
    assert set(released) == set(admitted)
    assert seq == len(decided)
    assert all(not TRANSITIONS[where] for where in state.values()), "a request did not end"


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 4000), shrink_to=st.integers(0, 4000))
def test_reservations_after_any_capacity_change(capacity: int, shrink_to: int) -> None:
    from sidecar.scheduler import BUILTIN_CLASSES

    s = Scheduler(BUILTIN_CLASSES, capacity, FakeClock())
    s.set_capacity(shrink_to)
    assert sum(s.reserved.values()) <= shrink_to
    s.set_capacity(capacity)
    fresh = Scheduler(BUILTIN_CLASSES, capacity, FakeClock())
    assert dict(s.reserved) == dict(fresh.reserved)
