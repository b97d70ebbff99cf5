from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL
from sidecar.metrics import Metrics
from sidecar.scheduler import (
    BUILTIN_CLASSES,
    TRANSITIONS,
    Admitted,
    ClassSettings,
    ClassSnapshot,
    Decision,
    Leases,
    LegacyAdmission,
    Outcome,
    Preempted,
    Queued,
    Rejected,
    Released,
    ReleaseResult,
    Scheduler,
    Snapshot,
    State,
    capacity_pressure,
    desired_reservations,
    reservations_fit,
    scaled_reservations,
)
from tests.clock import FakeClock

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)


def flat(**per_class: dict[str, object]) -> dict[PriorityClass, ClassSettings]:
    """No reservations, generous queues, unless overridden per class."""
    base = ClassSettings(reserved_floor=0, reserved_per_slot=0.0, queue_size=10,
                       queue_timeout_secs=10.0, starvation_threshold_secs=5.0, can_preempt=False)
    out = {c: base for c in PriorityClass}
    for name, fields in per_class.items():
        cls = PriorityClass.from_name(name)
        assert cls is not None
        out[cls] = replace(base, **fields)  # type: ignore[arg-type]
    return out


def tuple4(d: dict[PriorityClass, int]) -> tuple[int, int, int, int]:
    return (d[S], d[I], d[D], d[B])


# ---------------------------------------------------------------- reservations


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [(256, (32, 128, 26, 0)), (200, (32, 128, 20, 0)), (800, (32, 200, 80, 0)),
     (100, (32, 100, 10, 0))],
)
def test_worked_reservations(capacity: int, expected: tuple[int, int, int, int]) -> None:
    assert tuple4(desired_reservations(BUILTIN_CLASSES, capacity)) == expected


def test_capacity_100_does_not_fit_so_legacy_serves() -> None:
    assert sum(desired_reservations(BUILTIN_CLASSES, 100).values()) == 142
    assert not reservations_fit(BUILTIN_CLASSES, 100)
    assert reservations_fit(BUILTIN_CLASSES, 256)


def test_huge_share_reserves_capacity_without_overflow() -> None:
    cfg = flat(default={"reserved_per_slot": 1e306})
    assert desired_reservations(cfg, 1000)[D] == 1000
    assert sum(scaled_reservations(cfg, 1000).values()) <= 1000


def test_share_rounding_is_decimal() -> None:
    cfg = flat(default={"reserved_per_slot": 0.1})
    assert desired_reservations(cfg, 300)[D] == 30  # 0.1*300 is 30.000000000000004 in binary


def test_proportional_shrink_and_restore() -> None:
    clock = FakeClock()
    s = Scheduler(BUILTIN_CLASSES, 256, clock)
    assert tuple4(dict(s.reserved)) == (32, 128, 26, 0)
    s.set_capacity(100)
    # desired 32/100/10 = 142 > 100 -> floor(d * 100 / 142)
    assert tuple4(dict(s.reserved)) == (22, 70, 7, 0)
    assert sum(s.reserved.values()) <= 100
    s.set_capacity(256)
    assert tuple4(dict(s.reserved)) == (32, 128, 26, 0)


@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 7, 50, 99, 100, 141, 142, 160, 1000])
def test_scaled_reservations_never_exceed_capacity(capacity: int) -> None:
    assert sum(scaled_reservations(BUILTIN_CLASSES, capacity).values()) <= capacity


# ---------------------------------------------------------------- admission


def test_free_slot_admits_and_release_frees() -> None:
    s = Scheduler(flat(), 2, FakeClock())
    d = s.arrive("a", D, "t")
    assert isinstance(d, Admitted) and not d.queued and d.waited == 0
    assert s.inflight() == 1 and s.inflight(D) == 1
    assert s.release("a") is ReleaseResult.RELEASED
    assert s.inflight() == 0
    events = s.take_events()
    assert [type(e) for e in events] == [Admitted, Released]


def test_reservation_hold_back() -> None:
    # capacity 256 with defaults: a bulk request may not eat system 32 + interactive 128
    # + default 26 unused reservations, so bulk gets at most 70 slots.
    s = Scheduler(BUILTIN_CLASSES, 256, FakeClock())
    assert s.available(B) == 256 - 32 - 128 - 26
    for i in range(70):
        assert isinstance(s.arrive(f"b{i}", B, "t"), Admitted)
    assert isinstance(s.arrive("b70", B, "t"), Queued)
    # default may use its own 26 plus nothing of interactive/system
    for i in range(26):
        assert isinstance(s.arrive(f"d{i}", D, "t"), Admitted)
    assert isinstance(s.arrive("d26", D, "t"), Queued)
    for i in range(128):
        assert isinstance(s.arrive(f"i{i}", I, "t"), Admitted)
    # interactive now used its reservation; the only free slots are system's 32
    assert s.available(I) == 0
    assert s.available(S) == 32


def test_higher_class_may_use_lower_free_slots() -> None:
    s = Scheduler(flat(bulk={"reserved_floor": 2}), 3, FakeClock())
    # bulk's reservation is not held back from higher classes
    for i in range(3):
        assert isinstance(s.arrive(f"s{i}", S, "t"), Admitted)


def test_queue_full_rejects_and_zero_queue_never_queues() -> None:
    s = Scheduler(flat(bulk={"queue_size": 1}, default={"queue_size": 0}), 1, FakeClock())
    assert isinstance(s.arrive("a", B, "t"), Admitted)
    assert isinstance(s.arrive("b", B, "t"), Queued)
    r = s.arrive("c", B, "t")
    assert isinstance(r, Rejected) and r.outcome is Outcome.REJECTED_QUEUE_FULL
    r = s.arrive("d", D, "t")
    assert isinstance(r, Rejected) and r.outcome is Outcome.REJECTED_QUEUE_FULL
    assert s.queue_depth(B) == 1 and s.queue_depth(D) == 0


def test_queue_timeout() -> None:
    clock = FakeClock()
    s = Scheduler(flat(default={"queue_timeout_secs": 2.0, "starvation_threshold_secs": 100.0}),
                  1, clock)
    s.arrive("a", D, "t")
    s.arrive("b", D, "t")
    s.take_events()
    assert s.next_deadline() == clock.now + 2.0
    clock.advance(1.999)
    s.tick()
    assert s.take_events() == []
    clock.advance(0.001)
    s.tick()
    (ev,) = s.take_events()
    assert isinstance(ev, Rejected) and ev.outcome is Outcome.REJECTED_QUEUE_TIMEOUT
    assert ev.id == "b" and ev.waited == pytest.approx(2.0)
    assert s.queue_depth(D) == 0 and s.next_deadline() is None


def test_cancel_removes_waiter() -> None:
    s = Scheduler(flat(), 1, FakeClock())
    s.arrive("a", D, "t")
    s.arrive("b", D, "t")
    s.take_events()
    assert s.cancel("b") is True
    (ev,) = s.take_events()
    assert isinstance(ev, Rejected) and ev.outcome is Outcome.CLIENT_CANCELLED
    assert s.cancel("b") is False
    assert s.cancel("a") is False  # admitted, not queued: the adapter releases it instead
    s.release("a")
    assert s.inflight() == 0 and s.queue_depth(D) == 0


def test_release_is_idempotent() -> None:
    s = Scheduler(flat(), 1, FakeClock())
    s.arrive("a", D, "t")
    s.arrive("b", D, "t")
    assert s.release("a") is ReleaseResult.RELEASED
    assert s.inflight() == 1  # b dispatched
    assert s.release("a") is ReleaseResult.ALREADY_RELEASED
    assert s.release("nobody") is ReleaseResult.UNKNOWN
    assert s.inflight() == 1 and s.is_admitted("b")


def test_strict_priority_and_fifo_dispatch() -> None:
    s = Scheduler(flat(), 1, FakeClock())
    s.arrive("x", D, "t")
    for id, cls in [("b1", B), ("d1", D), ("b2", B), ("s1", S), ("i1", I), ("d2", D)]:
        assert isinstance(s.arrive(id, cls, "t"), Queued)
    s.take_events()
    order = []
    current = "x"
    for _ in range(6):
        s.release(current)
        admitted = [e for e in s.take_events() if isinstance(e, Admitted)]
        assert len(admitted) == 1
        current = admitted[0].admission.id
        order.append(current)
    assert order == ["s1", "i1", "d1", "d2", "b1", "b2"]


def test_new_arrival_does_not_overtake_its_class_queue() -> None:
    s = Scheduler(flat(), 2, FakeClock())
    s.arrive("a", D, "t")
    s.arrive("b", D, "t")
    assert isinstance(s.arrive("c", D, "t"), Queued)
    s.release("a")  # c admitted
    assert s.is_admitted("c")


def test_starvation_promotes_lowest_class_first_ignoring_reservations() -> None:
    clock = FakeClock()
    cfg = flat(interactive={"reserved_floor": 2}, bulk={"starvation_threshold_secs": 3.0},
               default={"starvation_threshold_secs": 3.0})
    s = Scheduler(cfg, 3, clock)
    s.arrive("d0", D, "t")  # available(D) = 3 - 0 - 2 = 1
    assert isinstance(s.arrive("b0", B, "t"), Queued)
    assert isinstance(s.arrive("d1", D, "t"), Queued)
    s.take_events()
    assert s.next_deadline() == pytest.approx(clock.now + 3.0)
    clock.advance(3.0)
    s.tick()
    events = s.take_events()
    admitted = [e for e in events if isinstance(e, Admitted)]
    # two free slots (held for interactive) exist; starvation ignores reservations:
    # bulk first (lowest class first), then default.
    assert [e.admission.id for e in admitted] == ["b0", "d1"]
    assert all(e.starvation and e.queued for e in admitted)
    assert s.inflight() == 3  # never beyond capacity


def test_starved_head_waits_for_capacity() -> None:
    clock = FakeClock()
    s = Scheduler(flat(bulk={"starvation_threshold_secs": 1.0}), 1, clock)
    s.arrive("a", D, "t")
    s.arrive("b", B, "t")
    clock.advance(2.0)
    s.tick()
    assert not s.is_admitted("b")  # no slot at all: starvation never exceeds capacity
    # the head is starved: the next deadline is its timeout, not a busy timer
    assert s.next_deadline() == pytest.approx(clock.now - 2.0 + 10.0)
    s.release("a")
    assert s.is_admitted("b")


def test_system_is_excluded_from_starvation() -> None:
    clock = FakeClock()
    # system queue head starved by... system can only wait if capacity is full
    cfg = flat(system={"starvation_threshold_secs": 1.0}, bulk={"reserved_floor": 0})
    s = Scheduler(cfg, 2, clock)
    s.arrive("a", B, "t")
    s.arrive("b", B, "t")
    s.arrive("s", S, "t")
    clock.advance(5.0)
    s.tick()
    assert not s.is_admitted("s") and s.inflight() == 2


def test_starvation_does_not_bypass_when_strict_would_admit_anyway() -> None:
    clock = FakeClock()
    s = Scheduler(flat(bulk={"starvation_threshold_secs": 1.0}), 1, clock)
    s.arrive("x", S, "t")
    s.arrive("b", B, "t")
    s.arrive("i", I, "t")
    clock.advance(1.5)
    s.release("x")
    # the starved bulk head goes first, ahead of the interactive request
    assert s.is_admitted("b") and not s.is_admitted("i")


# ---------------------------------------------------------------- preemption


def preempt_cfg() -> dict[PriorityClass, ClassSettings]:
    return flat(interactive={"can_preempt": True}, system={"can_preempt": True})


def arrive_reachable(s: Scheduler, id: str, cls: PriorityClass) -> Decision:
    """Arrive, and open the stop channel at once if admitted, as the sidecar's ext_proc does."""
    decision = s.arrive(id, cls, "t")
    s.mark_preemptible(id)
    return decision


def test_preempts_most_recent_lowest_class_without_first_byte() -> None:
    s = Scheduler(preempt_cfg(), 4, FakeClock())
    arrive_reachable(s, "d1", D)
    arrive_reachable(s, "b1", B)
    arrive_reachable(s, "b2", B)
    arrive_reachable(s, "b3", B)
    s.mark_first_byte("b3")  # streaming already: not preemptible
    s.take_events()
    d = s.arrive("i1", I, "t")
    assert isinstance(d, Admitted) and d.preempted
    events = s.take_events()
    pre = [e for e in events if isinstance(e, Preempted)]
    assert len(pre) == 1 and pre[0].victim.id == "b2" and pre[0].by_class is I
    rel = [e for e in events if isinstance(e, Released)]
    assert [(r.admission.id, r.reason) for r in rel] == [("b2", "preempted")]
    assert s.inflight() == 4 and not s.is_admitted("b2")
    # a late completion for the victim is a duplicate, not a stranger
    assert s.release("b2") is ReleaseResult.ALREADY_RELEASED


def test_preemption_takes_lowest_class_before_recency() -> None:
    s = Scheduler(preempt_cfg(), 2, FakeClock())
    arrive_reachable(s, "b1", B)
    arrive_reachable(s, "d1", D)  # more recent but a higher class than b1
    s.arrive("s1", S, "t")
    assert not s.is_admitted("b1") and s.is_admitted("d1")


def test_preemption_only_strictly_lower_and_at_most_one() -> None:
    s = Scheduler(preempt_cfg(), 2, FakeClock())
    arrive_reachable(s, "i1", I)
    arrive_reachable(s, "i2", I)
    assert isinstance(s.arrive("i3", I, "t"), Queued)  # same class: no victim
    s.take_events()
    assert isinstance(s.arrive("s1", S, "t"), Admitted)  # one interactive preempted
    assert sum(isinstance(e, Preempted) for e in s.take_events()) == 1
    assert s.inflight() == 2


def test_no_preemption_without_permission_or_victim() -> None:
    s = Scheduler(preempt_cfg(), 1, FakeClock())
    arrive_reachable(s, "b1", B)
    assert isinstance(s.arrive("d1", D, "t"), Queued)  # default cannot preempt
    s.mark_first_byte("b1")
    assert isinstance(s.arrive("i1", I, "t"), Queued)  # victim already streaming


def test_preemption_keeps_fifo_within_class() -> None:
    s = Scheduler(preempt_cfg(), 2, FakeClock())
    s.arrive("b1", B, "t")
    s.arrive("b2", B, "t")
    s.mark_first_byte("b1")
    s.mark_first_byte("b2")
    assert isinstance(s.arrive("i1", I, "t"), Queued)
    s.arrive("b3", B, "t")  # queued behind
    s.release("b1")  # i1 admitted
    s.arrive("b4", B, "t")
    s.release("b2")  # i... nothing queued in I; b3 admitted
    assert s.is_admitted("b3")
    s.mark_preemptible("b3")
    # now b3 has no first byte; a new interactive arrival with i2 queued ahead
    s.take_events()
    assert isinstance(s.arrive("i2", I, "t"), Admitted)  # preempts b3, I queue empty


def test_no_preemption_when_over_capacity_after_shrink() -> None:
    s = Scheduler(preempt_cfg(), 3, FakeClock())
    for i in range(3):
        arrive_reachable(s, f"b{i}", B)
    s.set_capacity(1)
    assert isinstance(s.arrive("i1", I, "t"), Queued)  # one victim would not make room
    assert s.inflight() == 3  # in-flight requests drain, not cancelled


# ---------------------------------------------------------------- capacity


def test_capacity_growth_dispatches_queued() -> None:
    s = Scheduler(flat(), 1, FakeClock())
    s.arrive("a", D, "t")
    s.arrive("b", D, "t")
    s.arrive("c", B, "t")
    s.set_capacity(3)
    assert s.is_admitted("b") and s.is_admitted("c")


def test_shrink_drains_without_cancelling() -> None:
    s = Scheduler(flat(), 3, FakeClock())
    for i in range(3):
        s.arrive(f"a{i}", D, "t")
    s.set_capacity(1)
    assert s.inflight() == 3
    assert isinstance(s.arrive("x", D, "t"), Queued)
    s.release("a0")
    s.release("a1")
    assert not s.is_admitted("x")
    s.release("a2")
    assert s.is_admitted("x")


def test_update_config_keeps_queue_place() -> None:
    s = Scheduler(flat(), 1, FakeClock())
    s.arrive("a", D, "t")
    s.arrive("b", D, "t")
    s.update_config(flat(default={"queue_size": 1}))
    assert s.queued_ids(D) == ["b"]
    r = s.arrive("c", D, "t")
    assert isinstance(r, Rejected) and r.outcome is Outcome.REJECTED_QUEUE_FULL


def test_snapshot() -> None:
    s = Scheduler(BUILTIN_CLASSES, 256, FakeClock())
    s.arrive("a", I, "t")
    snap = s.snapshot()
    assert snap.capacity == 256 and snap.inflight == 1
    assert snap.classes[I].inflight == 1 and snap.classes[I].reserved == 128
    assert snap.classes[B].queue_limit == 1024


# ---------------------------------------------------------------- capacity pressure


def snap(capacity: int, **per_class: tuple[int, int, int, int]) -> Snapshot:
    """Per class (inflight, queue_depth, queue_limit, reserved); unnamed classes idle."""
    classes = {c: ClassSnapshot(0, 0, 10, 0) for c in PriorityClass}
    for name, values in per_class.items():
        cls = PriorityClass.from_name(name)
        assert cls is not None
        classes[cls] = ClassSnapshot(*values)
    return Snapshot(capacity, sum(c.inflight for c in classes.values()), classes)


def test_capacity_pressure_worked_numbers() -> None:
    # Capacity 256 with the built-in reservations 32/128/26/0.
    s = snap(256, system=(0, 0, 64, 32), interactive=(100, 0, 256, 128),
             default=(40, 0, 512, 26), bulk=(50, 10, 1024, 0))
    assert capacity_pressure(s, S) == 0.0  # inside its reservation, queue empty
    assert capacity_pressure(s, I) == 0.0
    # default: 14 beyond its own 26, over what system and interactive leave: 256-32-128 = 96
    assert capacity_pressure(s, D) == pytest.approx(14 / 96)
    # bulk: 50 beyond 0, over 256-32-128-26 = 70; its queue fill 10/1024 is lower
    assert capacity_pressure(s, B) == pytest.approx(50 / 70)


def test_capacity_pressure_queue_fill_and_bounds() -> None:
    assert capacity_pressure(snap(8, bulk=(0, 3, 4, 0)), B) == pytest.approx(0.75)
    assert capacity_pressure(snap(8, bulk=(0, 9, 4, 0)), B) == 1.0  # never above 1
    assert capacity_pressure(snap(8, bulk=(0, 5, 0, 0)), B) == 0.0  # limit 0: no fill term
    # Nothing left above (capacity 0 after a shrink): divide by 1, capped at 1.
    assert capacity_pressure(snap(0, bulk=(3, 0, 4, 0)), B) == 1.0
    assert capacity_pressure(snap(10, system=(0, 0, 4, 10), bulk=(0, 0, 4, 0)), B) == 0.0


def test_metrics_report_the_contract_capacity_pressure() -> None:
    s = Scheduler(BUILTIN_CLASSES, 256, FakeClock())
    for i in range(40):
        s.arrive(f"d{i}", D, "t")
    metrics = Metrics(tenant_top_n=32)
    metrics.pool(DEFAULT_POOL).admission_started(legacy=False, snapshot=s.snapshot)
    value = metrics.registry.get_sample_value("smg_scheduler_class_capacity_pressure",
                                              {"class": "default"})
    assert value == pytest.approx(14 / 96) == capacity_pressure(s.snapshot(), D)


# ---------------------------------------------------------------- leases


def test_leases_expire_at_ttl_in_renewal_order() -> None:
    leases = Leases(10.0)
    leases.grant("a", 0.0)
    leases.grant("b", 1.0)
    assert leases.next_expiry() == 10.0
    assert leases.renew("a", 5.0) and not leases.renew("stranger", 5.0)
    assert leases.next_expiry() == 11.0  # b is now the earliest
    assert leases.pop_expired(10.999) == []
    assert leases.pop_expired(11.0) == ["b"]  # due exactly at its TTL
    leases.drop("a")
    assert len(leases) == 0 and leases.next_expiry() is None and "a" not in leases


# ---------------------------------------------------------------- legacy


def test_legacy_limit_queue_timeout() -> None:
    clock = FakeClock()
    core = LegacyAdmission(limit=1, queue_size=1, queue_timeout_secs=5.0, clock=clock)
    assert isinstance(core.arrive("a", S, "t"), Admitted)
    assert isinstance(core.arrive("b", B, "t"), Queued)
    r = core.arrive("c", S, "t")
    assert isinstance(r, Rejected) and r.outcome is Outcome.REJECTED_QUEUE_FULL and r.legacy
    core.take_events()
    clock.advance(5.0)
    core.tick()
    (ev,) = core.take_events()
    assert isinstance(ev, Rejected) and ev.outcome is Outcome.REJECTED_QUEUE_TIMEOUT and ev.legacy
    assert core.release("a") is ReleaseResult.RELEASED
    assert core.release("a") is ReleaseResult.ALREADY_RELEASED


def test_legacy_fifo_ignores_class() -> None:
    core = LegacyAdmission(limit=1, queue_size=5, queue_timeout_secs=5.0, clock=FakeClock())
    core.arrive("a", B, "t")
    core.arrive("b", B, "t")
    core.arrive("c", S, "t")
    core.release("a")
    assert core.is_admitted("b") and not core.is_admitted("c")


def test_legacy_unlimited_and_zero_queue() -> None:
    core = LegacyAdmission(limit=None, queue_size=0, queue_timeout_secs=5.0, clock=FakeClock())
    for i in range(1000):
        assert isinstance(core.arrive(str(i), D, "t"), Admitted)
    core = LegacyAdmission(limit=1, queue_size=0, queue_timeout_secs=5.0, clock=FakeClock())
    core.arrive("a", D, "t")
    assert isinstance(core.arrive("b", D, "t"), Rejected)


def test_legacy_cancel() -> None:
    core = LegacyAdmission(limit=1, queue_size=5, queue_timeout_secs=5.0, clock=FakeClock())
    core.arrive("a", D, "t")
    core.arrive("b", D, "t")
    assert core.cancel("b") and not core.cancel("b")
    core.release("a")
    assert core.snapshot().inflight == 0


def test_preemption_candidates_only_once_reachable() -> None:
    s = Scheduler(preempt_cfg(), 2, FakeClock())
    s.arrive("b1", B, "t")
    s.arrive("b2", B, "t")
    assert isinstance(s.arrive("i1", I, "t"), Queued)  # no stop channel: no victim
    assert s.mark_preemptible("b1")
    assert isinstance(s.arrive("i2", I, "t"), Queued)  # FIFO: i1 takes the freed slot
    assert s.is_admitted("i1") and not s.is_admitted("b1")
    s.mark_first_byte("b2")
    assert not s.mark_preemptible("b2")  # streaming already
    assert not s.mark_preemptible("nobody")


def test_state_of_follows_the_lifecycle_table() -> None:
    s = Scheduler(preempt_cfg(), 1, FakeClock())
    s.arrive("b1", B, "t")
    assert s.state_of("b1") is State.ADMITTED  # the sidecar's mode: no stop channel yet
    assert s.mark_preemptible("b1") and s.state_of("b1") is State.PREEMPTIBLE
    assert isinstance(s.arrive("d1", D, "t"), Queued) and s.state_of("d1") is State.QUEUED
    assert s.mark_first_byte("b1") and s.state_of("b1") is State.STREAMING
    assert not s.mark_preemptible("b1")  # STREAMING has no way back
    s.release("b1")
    assert s.state_of("b1") is None and s.state_of("d1") is State.ADMITTED
    assert set(TRANSITIONS) == set(State)


def test_preemptible_on_admit_makes_every_admission_a_candidate_at_once() -> None:
    s = Scheduler(preempt_cfg(), 1, FakeClock(), preemptible_on_admit=True)
    s.arrive("b1", B, "t")
    assert s.state_of("b1") is State.PREEMPTIBLE
    d = s.arrive("i1", I, "t")
    assert isinstance(d, Admitted) and d.preempted and not s.is_admitted("b1")


def test_adopt_counts_running_streams_after_restart() -> None:
    s = Scheduler(preempt_cfg(), 2, FakeClock())
    assert s.adopt("old1", B, "t") and s.adopt("old2", B, "t")
    assert s.inflight() == 2
    assert not s.adopt("old1", B, "t")  # already known
    assert isinstance(s.arrive("new", D, "t"), Queued)  # the slots are really in use
    assert isinstance(s.arrive("i1", I, "t"), Queued)  # adopted streams are not victims
    admitted = [e for e in s.take_events() if isinstance(e, Admitted)]
    assert [e.admission.id for e in admitted] == ["old1", "old2"]
    assert all(e.adopted and e.admission.first_byte for e in admitted)
    s.release("old1")
    assert s.is_admitted("i1")  # strict priority: interactive before the queued default
    assert not s.adopt("old1", B, "t")  # ended here: a late periodic entry adopts nothing


def test_adopt_may_exceed_capacity_like_a_shrink() -> None:
    s = Scheduler(flat(), 1, FakeClock())
    s.arrive("a", D, "t")
    assert s.adopt("old", B, "t")
    assert s.inflight() == 2 > s.capacity
    s.release("a")
    assert isinstance(s.arrive("b", D, "t"), Queued)  # still full until "old" ends


def test_legacy_adopt() -> None:
    core = LegacyAdmission(limit=1, queue_size=1, queue_timeout_secs=5.0, clock=FakeClock())
    assert core.adopt("old", B, "t")
    assert isinstance(core.arrive("a", D, "t"), Queued)
    assert not core.adopt("old", B, "t")


def test_queued_preempting_head_uses_a_victim_that_becomes_reachable() -> None:
    # The victims' stop channels open just after they are admitted: an interactive
    # request queued in between must not wait for its timeout.
    s = Scheduler(preempt_cfg(), 2, FakeClock())
    s.arrive("b1", B, "t")
    s.arrive("b2", B, "t")
    assert isinstance(s.arrive("i1", I, "t"), Queued)
    s.take_events()
    assert s.mark_preemptible("b1")
    events = s.take_events()
    assert [type(e) for e in events] == [Preempted, Released, Admitted]
    assert s.is_admitted("i1") and not s.is_admitted("b1")
    admitted = events[2]
    assert isinstance(admitted, Admitted) and admitted.preempted and admitted.queued


def test_slot_freed_by_preemption_goes_to_the_preempting_class() -> None:
    clock = FakeClock()
    cfg = flat(interactive={"can_preempt": True, "queue_timeout_secs": 100.0},
               bulk={"starvation_threshold_secs": 1.0, "queue_timeout_secs": 100.0})
    s = Scheduler(cfg, 2, clock)
    s.arrive("b1", B, "t")
    s.arrive("b2", B, "t")
    s.arrive("bq", B, "t")  # will be starved
    s.arrive("i1", I, "t")
    clock.advance(5.0)
    s.tick()
    s.mark_preemptible("b2")
    # b2 was preempted for the interactive head, not for the starved bulk request
    assert s.is_admitted("i1") and not s.is_admitted("bq")
    assert s.queued_ids(B) == ["bq"]


def test_shorter_timeout_after_reload_expires_newer_waiters_on_time() -> None:
    clock = FakeClock()
    s = Scheduler(flat(bulk={"queue_timeout_secs": 300.0, "starvation_threshold_secs": 1e6}),
                  1, clock)
    s.arrive("x", B, "t")
    s.arrive("old", B, "t")
    s.update_config(flat(bulk={"queue_timeout_secs": 10.0, "starvation_threshold_secs": 1e6}))
    clock.advance(1.0)
    s.arrive("new", B, "t")
    s.take_events()
    assert s.next_deadline() == pytest.approx(clock.now + 10.0)
    clock.advance(10.0)
    s.tick()
    (ev,) = s.take_events()
    assert isinstance(ev, Rejected) and ev.id == "new"
    assert ev.outcome is Outcome.REJECTED_QUEUE_TIMEOUT
    assert s.queued_ids(B) == ["old"]  # the old waiter keeps its place and its deadline
    assert s.next_deadline() == pytest.approx(clock.now - 11.0 + 300.0)


def test_deadline_heap_stays_bounded_under_churn() -> None:
    s = Scheduler(flat(bulk={"queue_size": 10}), 1, FakeClock())
    s.arrive("x", B, "t")
    for i in range(10_000):
        s.arrive(f"w{i}", B, "t")
        s.cancel(f"w{i}")
    assert len(s._queues.deadlines) <= 2 * 1 + 64 + 1


def test_queued_head_does_not_undo_a_starvation_promotion() -> None:
    clock = FakeClock()
    cfg = flat(interactive={"can_preempt": True, "queue_timeout_secs": 100.0},
               bulk={"starvation_threshold_secs": 2.0, "queue_timeout_secs": 100.0})
    s = Scheduler(cfg, 1, clock)
    s.arrive("d", D, "t")
    s.mark_first_byte("d")  # streaming: not a victim
    s.arrive("b", B, "t")
    clock.advance(1.0)
    s.arrive("i", I, "t")  # queued: no victim
    clock.advance(1.5)  # b is starved
    s.release("d")
    assert s.is_admitted("b")  # the starvation rule goes first
    s.mark_preemptible("b")  # b was admitted after i queued: i may not take it back
    assert s.is_admitted("b") and s.queued_ids(I) == ["i"]


def test_preempting_arrival_dispatches_classes_below() -> None:
    # A system arrival fills its own unused reservation by preempting, which lowers
    # the hold-back for the classes below: the queued interactive head can now
    # preempt too, at once rather than at some later event.
    cfg = flat(system={"reserved_floor": 3, "can_preempt": True},
               interactive={"can_preempt": True})
    s = Scheduler(cfg, 10, FakeClock())
    for rid, cls in [("s1", S), ("s2", S), ("b1", B), ("b2", B)]:
        arrive_reachable(s, rid, cls)
    s.set_capacity(4)  # full, with one system slot still held back
    assert s.available(I) == -1
    assert isinstance(s.arrive("i1", I, "t"), Queued)
    assert isinstance(s.arrive("s3", S, "t"), Admitted)  # preempts b2
    assert s.is_admitted("i1")  # ...and i1 preempted b1 in the same step
    assert not s.is_admitted("b1") and not s.is_admitted("b2")
    assert s.inflight() == 4
