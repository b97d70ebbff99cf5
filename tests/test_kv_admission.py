"""Admission by KV capacity (``tokens.admit_by_kv``), in the pure core and its readings.

The promise: each admitted request holds its token estimate (the pool passes it as the
arrival's ``cost``) against the KV capacity its workers report, until it is released; the
sum held never passes the capacity because of an admission, and a request that does not
fit waits in its class queue. Its liveness twin: whenever the next request in dispatch
order fits (a slot for its class and its tokens), it is admitted, at once. The head-of-line
rule: a head that has a slot but not the tokens waits, and nothing behind it goes first
(neither in its class, nor below it, nor a new arrival), so a stream of small requests
cannot keep a large one waiting for ever.

The property test counts what is held from the core's own events (outside its state),
with random arrivals, releases, cancels, timeouts and capacity changes; a gate that
admits nothing fails its liveness half, one that ignores the capacity its safety half.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sidecar.capacity import CapacityPolicy, ProbeStatus, WorkerProbe
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler import (
    BUILTIN_CLASSES,
    Admitted,
    ClassSettings,
    Queued,
    Rejected,
    Released,
    Scheduler,
)
from tests.clock import FakeClock

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)

settings.register_profile("ci", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def plain(**kw: Any) -> dict[PriorityClass, ClassSettings]:
    """Every class without reservations, preemption or starvation (a queue is served by
    priority alone), with ``kw`` over each."""
    base = dict(reserved_floor=0, reserved_per_slot=0.0, queue_size=100,
                queue_timeout_secs=60.0, starvation_threshold_secs=1e9, can_preempt=False)
    return {c: ClassSettings(**{**base, **kw}) for c in PriorityClass}


def make(capacity: int = 8, kv: int | None = 1000, **kw: Any) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    s = Scheduler(plain(**kw), capacity, clock)
    s.set_kv_capacity(kv)
    return s, clock


def admitted(s: Scheduler) -> set[str]:
    return {e.admission.id for e in s.take_events() if isinstance(e, Admitted)}


# ------------------------------------------------------------------- the rule, by hand


def test_a_request_that_does_not_fit_waits_until_tokens_free() -> None:
    s, _ = make(kv=1000)
    assert isinstance(s.arrive("a", D, "t", cost=600), Admitted)
    assert isinstance(s.arrive("b", D, "t", cost=500), Queued)  # 1100 > 1000: slots free
    assert s.snapshot().kv_held == 600 and s.inflight() == 1
    s.take_events()
    s.release("a")
    assert admitted(s) == {"b"}
    assert s.snapshot().kv_held == 500


def test_exactly_the_capacity_fits() -> None:
    s, _ = make(kv=1000)
    assert isinstance(s.arrive("a", D, "t", cost=400), Admitted)
    assert isinstance(s.arrive("b", D, "t", cost=600), Admitted)
    assert isinstance(s.arrive("c", D, "t", cost=1), Queued)


def test_small_requests_fill_the_slots_when_the_tokens_allow() -> None:
    s, _ = make(capacity=8, kv=1000)
    for i in range(8):
        assert isinstance(s.arrive(f"r{i}", D, "t", cost=100), Admitted)
    assert isinstance(s.arrive("r8", D, "t", cost=100), Queued)  # slots, not tokens
    assert s.snapshot().kv_held == 800


def test_the_head_waits_and_nothing_behind_it_overtakes() -> None:
    """Strict: a large head waiting for tokens holds its class, the classes below it and
    new arrivals, even those that would fit; once it fits it goes first."""
    s, _ = make(kv=1000)
    assert isinstance(s.arrive("small0", D, "t", cost=300), Admitted)
    assert isinstance(s.arrive("big", I, "t", cost=900), Queued)
    # Each of these would fit (300 + 100 <= 1000), yet each waits behind "big".
    assert isinstance(s.arrive("same_class", I, "t", cost=100), Queued)
    assert isinstance(s.arrive("lower", D, "t", cost=100), Queued)
    assert isinstance(s.arrive("bulk", B, "t", cost=100), Queued)
    s.take_events()
    s.tick()
    assert admitted(s) == set()
    s.release("small0")
    # "big" first (900), then "same_class" fits (1000); nothing else does.
    assert admitted(s) == {"big", "same_class"}
    assert s.snapshot().kv_held == 1000
    s.release("same_class")
    assert admitted(s) == {"lower"}


def test_a_higher_class_arrival_is_not_held_by_a_lower_head() -> None:
    """Priority: a lower class's head waiting for tokens does not hold a higher class."""
    s, _ = make(kv=1000)
    assert isinstance(s.arrive("a", B, "t", cost=500), Admitted)
    assert isinstance(s.arrive("big_bulk", B, "t", cost=800), Queued)
    assert isinstance(s.arrive("inter", I, "t", cost=400), Admitted)
    assert s.snapshot().kv_held == 900


def test_a_starved_head_waiting_for_tokens_holds_what_comes_after_it() -> None:
    clock = FakeClock()
    classes = plain()
    classes[B] = replace(classes[B], starvation_threshold_secs=5.0)
    s = Scheduler(classes, 8, clock)
    s.set_kv_capacity(1000)
    assert isinstance(s.arrive("a", I, "t", cost=500), Admitted)
    assert isinstance(s.arrive("big_bulk", B, "t", cost=800), Queued)
    clock.advance(6.0)  # now starved: the next in dispatch order
    s.tick()
    assert isinstance(s.arrive("inter", I, "t", cost=100), Queued)  # would fit: waits
    s.take_events()
    s.release("a")
    events = s.take_events()
    starved = [e for e in events if isinstance(e, Admitted)]
    assert [e.admission.id for e in starved] == ["big_bulk", "inter"]
    assert starved[0].starvation


def test_preemption_only_where_the_victims_tokens_make_room() -> None:
    classes = plain()
    classes[S] = replace(classes[S], can_preempt=True)
    clock = FakeClock()
    s = Scheduler(classes, 1, clock, preemptible_on_admit=True)
    s.set_kv_capacity(1000)
    assert isinstance(s.arrive("victim", B, "t", cost=300), Admitted)
    # A slot is needed and the victim frees one; with its 300 tokens back, 1000 fits.
    d = s.arrive("sys", S, "t", cost=1000)
    assert isinstance(d, Admitted) and d.preempted
    assert s.snapshot().kv_held == 1000
    s.release("sys")
    s.take_events()
    # Two victims' worth would be needed: no preemption for tokens; it waits.
    assert isinstance(s.arrive("v2", B, "t", cost=300), Admitted)
    s2 = Scheduler(classes, 2, clock, preemptible_on_admit=True)
    s2.set_kv_capacity(1000)
    assert isinstance(s2.arrive("x", B, "t", cost=500), Admitted)
    assert isinstance(s2.arrive("y", B, "t", cost=400), Admitted)
    d = s2.arrive("sys", S, "t", cost=700)  # no slot; one victim frees 400 at most
    assert isinstance(d, Queued)
    assert s2.inflight() == 2 and s2.snapshot().kv_held == 900


def test_a_capacity_change_dispatches_and_a_smaller_one_drains_first() -> None:
    s, _ = make(kv=1000)
    assert isinstance(s.arrive("a", D, "t", cost=800), Admitted)
    assert isinstance(s.arrive("b", D, "t", cost=800), Queued)
    s.take_events()
    s.set_kv_capacity(2000)
    assert admitted(s) == {"b"}
    s.set_kv_capacity(500)  # in flight keeps what it holds: 1600 > 500, nothing new
    assert isinstance(s.arrive("c", D, "t", cost=1), Queued)
    s.release("a")
    s.release("b")
    assert "c" in admitted(s)


def test_off_gates_nothing_and_a_cancel_or_timeout_holds_nothing() -> None:
    s, clock = make(kv=None)
    for i in range(8):
        assert isinstance(s.arrive(f"r{i}", D, "t", cost=10**9), Admitted)
    g, clock = make(kv=1000, queue_timeout_secs=2.0)
    assert isinstance(g.arrive("a", D, "t", cost=900), Admitted)
    assert isinstance(g.arrive("b", D, "t", cost=900), Queued)
    assert isinstance(g.arrive("c", D, "t", cost=900), Queued)
    assert g.cancel("b")
    clock.advance(3.0)
    g.tick()
    assert g.snapshot().kv_held == 900
    assert [e.outcome.value for e in g.take_events() if isinstance(e, Rejected)] == [
        "client_cancelled", "rejected_queue_timeout"]


# ------------------------------------------------------------------ the property


OPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(list(PriorityClass)),
              st.integers(0, 700)),
    st.tuples(st.just("release"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("kv"), st.sampled_from([None, 0, 300, 1000, 2500]), st.just(0)),
    st.tuples(st.just("slots"), st.integers(0, 6), st.just(0)),
    st.tuples(st.just("time"), st.integers(1, 40), st.just(0)),
), max_size=120)


@seed(20260713)
@given(ops=OPS, preempt=st.booleans(), starve=st.booleans())
def test_what_is_held_never_passes_the_capacity_and_what_fits_is_admitted(
        ops: list[tuple[str, Any, int]], preempt: bool, starve: bool) -> None:
    clock = FakeClock()
    classes = dict(BUILTIN_CLASSES) if preempt or starve else plain()
    if not starve:
        classes = {c: replace(k, starvation_threshold_secs=1e9) for c, k in classes.items()}
    s = Scheduler(classes, 4, clock, preemptible_on_admit=preempt)
    cap: int | None = 1000
    s.set_kv_capacity(cap)
    cost: dict[str, int] = {}
    held: dict[str, int] = {}  # counted here from the events, outside the core
    queued: list[str] = []
    n = 0
    for op, a, b in ops:
        before = sum(held.values())
        if op == "arrive":
            rid = f"r{n}"
            n += 1
            cost[rid] = b
            if isinstance(s.arrive(rid, a, "t", cost=float(b)), Queued):
                queued.append(rid)
        elif op == "release" and held:
            s.release(sorted(held)[a % len(held)])
        elif op == "cancel" and queued:
            s.cancel(queued[a % len(queued)])
        elif op == "kv":
            cap = a
            s.set_kv_capacity(cap)
        elif op == "slots":
            s.set_capacity(a)
        elif op == "time":
            clock.advance(float(a))
            s.tick()
        grew = False
        for e in s.take_events():
            if isinstance(e, Admitted):
                held[e.admission.id] = cost[e.admission.id]
                grew = True
            elif isinstance(e, Released):
                held.pop(e.admission.id)
            elif isinstance(e, Rejected) and e.id in queued:
                queued.remove(e.id)
        queued = [q for q in queued if q not in held]
        total = sum(held.values())
        assert s.snapshot().kv_held == total  # the core's own sum agrees with the events
        # Safety: a step that admitted leaves the sum within the capacity in force; one
        # that admitted nothing never raised it (a smaller capacity drains first).
        if grew and cap is not None:
            assert total <= cap, (total, cap, before)
        if not grew:
            assert total <= before
        # Liveness: the next request in dispatch order is waiting only because it has no
        # slot or its tokens do not fit (a refuse-everything gate fails here).
        head = _next_in_order(s, clock())
        if head is not None and cap is not None:
            cls, rid = head
            fits_slot = (s.available(cls) >= 1 if not _starved(s, cls, clock())
                         else s.inflight() < s.capacity)
            assert not fits_slot or total + cost[rid] > cap, (
                f"{rid} ({cost[rid]} tokens) waits with a slot and {cap - total} tokens free")


def _starved(s: Scheduler, cls: PriorityClass, now: float) -> bool:
    ids = s.queued_ids(cls)
    if cls is S or not ids:
        return False
    oldest = s._queue[cls].oldest()  # the core's queue: its oldest waiter ages it
    threshold = s.config[cls].starvation_threshold_secs
    return oldest is not None and now - oldest.enqueued_at >= threshold


def _next_in_order(s: Scheduler, now: float) -> tuple[PriorityClass, str] | None:
    """The waiter dispatch serves next: a starved head (lowest class first) while a slot
    is free, else the highest class's head."""
    if s.inflight() < s.capacity:
        for cls in reversed(HIGH_TO_LOW):
            head = s._queue[cls].head()
            if head is not None and _starved(s, cls, now):
                return cls, head.id
    for cls in HIGH_TO_LOW:
        head = s._queue[cls].head()
        if head is not None:
            return cls, head.id
    return None


# ------------------------------------------------------------------ the readings


def test_a_readings_kv_capacity_is_the_sum_of_the_workers_that_report_one() -> None:
    policy = CapacityPolicy(fallback=64, default_cap=8, saturation_guard=False,
                            clock=lambda: 0.0)

    def read(*kv: int | None) -> tuple[int | None, int]:
        r = policy.decide([WorkerProbe(f"w{i}", ProbeStatus.HEALTHY, "vllm", cap=4,
                                       kv_tokens=k) for i, k in enumerate(kv)])
        return r.kv_tokens, r.kv_unreported

    assert read(1000) == (1000, 0)
    assert read(1000, 3000) == (4000, 0)
    # One that reports none adds slots but no tokens (never more than can run).
    assert read(1000, None) == (1000, 1)
    assert read(None, None) == (None, 2)
    unhealthy = policy.decide([WorkerProbe("a", ProbeStatus.HEALTHY, "vllm", cap=4,
                                           kv_tokens=500),
                               WorkerProbe("b", ProbeStatus.UNHEALTHY)])
    assert unhealthy.kv_tokens == 500 and unhealthy.kv_unreported == 0
    assert policy.decide(None).kv_tokens == 500  # a held reading holds its tokens too
