"""The asyncio adapter on a fake clock: leases, cancellation, denial, exactly-once release."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest

from sidecar.admission import AdmissionController, Denied
from sidecar.classes import PriorityClass
from sidecar.metrics import NullPoolRecorder
from sidecar.ratelimit import TokenBucket
from sidecar.scheduler import (
    LEASE_EXPIRED,
    Admitted,
    ClassSettings,
    Event,
    Outcome,
    Released,
    ReleaseResult,
    Scheduler,
)
from tests.clock import FakeClock

D, B = PriorityClass.DEFAULT, PriorityClass.BULK
CFG = {c: ClassSettings(0, 0.0, 2, 5.0, 100.0, False) for c in PriorityClass}


@dataclass
class Stats(NullPoolRecorder):
    """What the controller reports through the metrics verbs, as lists."""

    allowed: list[bool] = field(default_factory=list)
    expired: list[PriorityClass] = field(default_factory=list)
    adoptions: list[PriorityClass] = field(default_factory=list)

    def on_events(self, events: Iterable[Event]) -> None:
        for e in events:
            if isinstance(e, Released) and e.reason == LEASE_EXPIRED:
                self.expired.append(e.admission.cls)
            elif isinstance(e, Admitted) and e.adopted:
                self.adoptions.append(e.admission.cls)

    def rate_limit(self, allowed: bool) -> None:
        self.allowed.append(allowed)


def make(capacity: int = 1, lease: float = 10.0, bucket: TokenBucket | None = None
         ) -> tuple[AdmissionController, FakeClock, Stats]:
    clock = FakeClock()
    ids = (f"id{i}" for i in itertools.count())
    stats = Stats()
    ctl = AdmissionController(Scheduler(CFG, capacity, clock), lease_secs=lease, clock=clock,
                              metrics=stats, bucket=bucket, id_factory=lambda: next(ids))
    return ctl, clock, stats


async def test_lease_expires_exactly_at_ttl_and_renewal_extends() -> None:
    ctl, clock, stats = make(capacity=2, lease=10.0)
    a = (await ctl.admit(B, "t")).admission.id
    b = (await ctl.admit(B, "t")).admission.id
    clock.advance(6.0)
    assert ctl.renew_or_adopt(a)
    clock.advance(3.999)
    ctl.tick()
    assert ctl.core.is_admitted(b)
    clock.advance(0.001)  # b's lease: exactly 10 s old
    ctl.tick()
    assert not ctl.core.is_admitted(b) and ctl.core.is_admitted(a)
    assert stats.expired == [B]
    clock.advance(6.0)  # a: renewed at 6 s, so it expires at 16 s
    ctl.tick()
    assert not ctl.core.is_admitted(a) and stats.expired == [B, B]
    assert ctl.lease_count == 0
    # a completion arriving after reclaim is a duplicate and changes nothing (the router
    # counts it: tests/test_pools.py)
    assert ctl.release(a) is ReleaseResult.ALREADY_RELEASED
    ctl.close()


async def test_queued_waiter_is_woken_by_release_and_gets_a_lease() -> None:
    ctl, clock, _ = make()
    first = await ctl.admit(D, "t")
    waiter = asyncio.ensure_future(ctl.admit(D, "t"))
    await asyncio.sleep(0)
    assert ctl.waiting == 1
    clock.advance(1.5)
    ctl.release(first.admission.id)
    got = await asyncio.wait_for(waiter, 1)
    assert got.queued and got.waited == pytest.approx(1.5)
    assert ctl.lease_count == 1
    ctl.release(got.admission.id)
    assert ctl.lease_count == 0 and ctl.waiting == 0
    ctl.close()


async def test_queue_timeout_raises_denied() -> None:
    ctl, clock, _ = make()
    await ctl.admit(D, "t")
    waiter = asyncio.ensure_future(ctl.admit(D, "t"))
    await asyncio.sleep(0)
    clock.advance(5.0)
    ctl.tick()
    with pytest.raises(Denied) as err:
        await asyncio.wait_for(waiter, 1)
    assert err.value.outcome is Outcome.REJECTED_QUEUE_TIMEOUT and not err.value.legacy
    assert err.value.waited == pytest.approx(5.0)
    ctl.close()


async def test_queue_full_raises_denied_at_once() -> None:
    ctl, _, _ = make()
    await ctl.admit(D, "t")
    waiters = [asyncio.ensure_future(ctl.admit(D, "t")) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Denied) as err:
        await ctl.admit(D, "t")
    assert err.value.outcome is Outcome.REJECTED_QUEUE_FULL
    for w in waiters:
        w.cancel()
    ctl.close()


async def test_cancel_while_queued_removes_the_waiter() -> None:
    ctl, _, _ = make()
    first = await ctl.admit(D, "t")
    waiter = asyncio.ensure_future(ctl.admit(D, "t"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ctl.waiting == 0 and ctl.core.snapshot().classes[D].queue_depth == 0
    ctl.release(first.admission.id)
    assert ctl.core.snapshot().inflight == 0  # nobody was admitted behind our back
    ctl.close()


async def test_cancel_in_the_same_instant_as_admission_gives_the_slot_back() -> None:
    ctl, _, _ = make()
    first = await ctl.admit(D, "t")
    waiter = asyncio.ensure_future(ctl.admit(D, "t"))
    await asyncio.sleep(0)
    ctl.release(first.admission.id)  # resolves the waiter's future...
    waiter.cancel()  # ...but the client left before the handler resumed
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ctl.core.snapshot().inflight == 0 and ctl.lease_count == 0
    ctl.close()


async def test_rate_limit_denies_before_the_core() -> None:
    clock = FakeClock()
    ctl, _, stats = make(capacity=10, bucket=TokenBucket(1, 1.0, clock))
    await ctl.admit(D, "t")
    with pytest.raises(Denied) as err:
        await ctl.admit(D, "t")
    assert err.value.rate_limited and err.value.outcome is Outcome.REJECTED_QUEUE_FULL
    assert stats.allowed == [True, False]
    ctl.close()


async def test_adoption_creates_a_lease() -> None:
    ctl, clock, stats = make(lease=10.0)
    assert ctl.renew_or_adopt("old", B, "t")
    assert stats.adoptions == [B] and ctl.lease_count == 1
    clock.advance(10.0)
    ctl.tick()
    assert stats.expired == [B] and ctl.core.snapshot().inflight == 0
    # Its lease was reclaimed but Envoy says it still runs: counted again.
    assert ctl.renew_or_adopt("old", B, "t") and stats.adoptions == [B, B]
    ctl.release("old")
    assert not ctl.renew_or_adopt("old", B, "t")  # completed here: never adopted again
    ctl.close()


async def test_queued_interactive_preempts_once_a_victim_is_watched() -> None:
    clock = FakeClock()
    cfg = dict(CFG)
    cfg[PriorityClass.INTERACTIVE] = ClassSettings(0, 0.0, 2, 5.0, 100.0, True)
    ctl = AdmissionController(Scheduler(cfg, 1, clock),
                              lease_secs=10.0, clock=clock)
    bulk = await ctl.admit(B, "t")
    queued = asyncio.ensure_future(ctl.admit(PriorityClass.INTERACTIVE, "t"))
    await asyncio.sleep(0)
    assert ctl.waiting == 1
    watch = ctl.open_stop_channel(bulk.admission.id)  # the bulk request's ext_proc opens
    assert watch is not None and watch.done()  # the victim is told at once...
    got = await asyncio.wait_for(queued, 1)  # ...and the interactive request admitted
    assert got.preempted and got.admission.cls is PriorityClass.INTERACTIVE
    assert ctl.release(bulk.admission.id) is ReleaseResult.ALREADY_RELEASED
    ctl.close()
