"""Fair queuing in the ledger where the single-replica differential test does not reach:
waiters that leave with their replica, lost keys, a mixed-version fleet's class config.

Each compares with the in-process :class:`Scheduler` given the same arrivals, a dead
replica's waiters leaving as cancelled ones do (``TenantQueue.discard``: its tenant's
next waiter keeps the turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import redis.asyncio as redis

from sidecar.classes import PriorityClass
from sidecar.coordination.ledger import ArriveStatus, FleetLedger
from sidecar.scheduler import BUILTIN_CLASSES, Admitted, ClassSettings, Queued, Scheduler
from tests.clock import FakeClock
from tests.ledger_support import client, valkey_server

__all__ = ["client", "valkey_server"]  # fixtures used by name

B = PriorityClass.BULK
FAIR: dict[PriorityClass, ClassSettings] = {
    c: replace(v, reserved_floor=0, reserved_per_slot=0.0, queue_size=20,
               queue_timeout_secs=1e6, starvation_threshold_secs=1e6, fair_queuing=True,
               max_queued_per_tenant=5, tenant_weights={"H": 2.0, "L": 0.5})
    for c, v in BUILTIN_CLASSES.items()
}


def core_with(arrivals: list[tuple[str, str]], gone: Sequence[str] = ()) -> list[str]:
    """The core's grant order after ``arrivals`` (id, tenant) queued behind a blocker and
    ``gone`` cancelled, served one by one."""
    s = Scheduler(FAIR, 1, FakeClock())
    assert isinstance(s.arrive("blocker", B, "x"), Admitted)
    for rid, tenant in arrivals:
        assert isinstance(s.arrive(rid, B, tenant), Queued)
    for rid in gone:
        assert s.cancel(rid)
    s.take_events()
    order: list[str] = []
    holder = "blocker"
    while True:
        s.release(holder)
        granted = [e.admission.id for e in s.take_events() if isinstance(e, Admitted)]
        if not granted:
            return order
        holder = granted[0]
        order.append(holder)


async def serve(owner: FleetLedger, others: list[FleetLedger], holder: str) -> list[str]:
    """Release ``holder``, then each grant in turn (read from whichever replica got it)."""
    order: list[str] = []
    while True:
        await owner.release(holder)
        granted: list[str] = []
        for led in (owner, *others):
            granted += [e.id for e in await led.take_events() if e.kind == "grant"]
        if not granted:
            return order
        assert len(granted) == 1
        holder = granted[0]
        order.append(holder)


ARRIVALS = [("a0", "A"), ("h0", "H"), ("a1", "A"), ("l0", "L"), ("h1", "H"), ("b0", "B"),
            ("a2", "A"), ("h2", "H"), ("l1", "L"), ("b1", "B"), ("h3", "H")]


async def test_a_dead_replicas_waiters_leave_the_fair_queue_as_cancelled_ones(
        client: redis.Redis) -> None:
    clock = FakeClock()
    a = FleetLedger(client, "f", "a", ttl=5.0, clock=clock)
    d = FleetLedger(client, "f", "d", ttl=5.0, clock=clock)
    await a.register(FAIR, 1)
    await d.register(FAIR, 1)
    assert (await a.arrive("blocker", B, "x")).status is ArriveStatus.ADMITTED
    on_d = {"h0", "h1", "a1", "b0"}  # a tenant's head, and H losing two of its waiters
    for rid, tenant in ARRIVALS:
        led = d if rid in on_d else a
        assert (await led.arrive(rid, B, tenant)).status is ArriveStatus.QUEUED
    for _ in range(3):  # d stops; a stays registered until d is reaped
        clock.advance(2.0)
        await a.heartbeat()
    assert (await a.snapshot()).replicas == ("a",)
    got = await serve(a, [], "blocker")
    assert got == core_with(ARRIVALS, gone=sorted(on_d))


async def test_lost_fair_queue_keys_are_rebuilt_and_no_waiter_is_stranded(
        client: redis.Redis) -> None:
    a, b = (FleetLedger(client, "f", r, ttl=3600.0) for r in ("a", "b"))
    await a.register(FAIR, 1)
    await b.register(FAIR, 1)
    assert (await a.arrive("blocker", B, "x")).status is ArriveStatus.ADMITTED
    for i, (rid, tenant) in enumerate(ARRIVALS):
        assert (await (a, b)[i % 2].arrive(rid, B, tenant)).status is ArriveStatus.QUEUED
    # The turns lost (eviction, an operator's DEL): rebuilt from the class queue by
    # arrival, as a reload re-sorts it; every waiter is still served, each tenant FIFO.
    await client.delete("pg:{f}:turn:0")
    got = await serve(a, [b], "blocker")
    assert sorted(got) == sorted(rid for rid, _ in ARRIVALS)
    assert got == core_with(ARRIVALS)  # nobody had been served: the re-sort is the same
    # The per-tenant settings lost: the next heartbeat stores them again, limit included.
    await client.delete("pg:{f}:tcfg")
    await a.heartbeat()
    assert (await a.arrive("c0", B, "C")).status is ArriveStatus.ADMITTED
    for i in range(5):
        assert (await b.arrive(f"c{i + 1}", B, "C")).status is ArriveStatus.QUEUED
    assert (await b.arrive("c6", B, "C")).status is ArriveStatus.REJECTED_QUEUE_FULL


async def test_the_class_config_older_libraries_read_keeps_its_format(
        client: redis.Redis) -> None:
    """A rolling upgrade runs two library versions on one fleet's keys: P:cfg keeps the six
    fields older libraries parse (can_preempt last); fairness lives in keys of its own."""
    a = FleetLedger(client, "f", "a", ttl=3600.0)
    await a.register(FAIR, 1)
    fields = str(await client.hget("pg:{f}:cfg", str(int(PriorityClass.SYSTEM)))).split(" ")
    assert len(fields) == 6 and fields[5] == "1"
    assert await client.hgetall("pg:{f}:wt:0") == {"H": "2.0", "L": "0.5"}


async def test_a_lost_tenant_fifo_is_rebuilt_at_the_next_heartbeat(client: redis.Redis) -> None:
    a = FleetLedger(client, "f", "a", ttl=3600.0)
    await a.register(FAIR, 1)
    assert (await a.arrive("blocker", B, "x")).status is ArriveStatus.ADMITTED
    for rid, tenant in ARRIVALS:
        assert (await a.arrive(rid, B, tenant)).status is ArriveStatus.QUEUED
    await client.delete("pg:{f}:tq:0:H")  # H's waiters would be stranded until timeout
    await a.heartbeat()
    got = await serve(a, [], "blocker")
    assert got == core_with(ARRIVALS)  # re-sorted by arrival: nobody had been served
