"""Unit tests of every ledger operation, against a real valkey-server on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as redis

from devtools.valkey import ValkeyServer
from sidecar.classes import PriorityClass
from sidecar.coordination import ledger as ledger_module
from sidecar.coordination.ledger import (
    ArriveStatus,
    CancelResult,
    Event,
    FleetLedger,
    Holding,
    config_digest,
)
from sidecar.scheduler import (
    BUILTIN_CLASSES,
    ClassSettings,
    ReleaseReason,
    ReleaseResult,
    scaled_reservations,
)
from tests.clock import FakeClock
from tests.ledger_support import client, connect, valkey_server

__all__ = ["client", "valkey_server"]  # fixtures used by name

SYS, INT, DEF, BULK = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
                       PriorityClass.BULK)

# No reservations unless a test asks; queues of 4; bulk starves after 5 s; system preempts.
PLAIN: dict[PriorityClass, ClassSettings] = {
    SYS: ClassSettings(0, 0.0, 4, 10.0, 5.0, True),
    INT: ClassSettings(0, 0.0, 4, 10.0, 5.0, True),
    DEF: ClassSettings(0, 0.0, 4, 10.0, 5.0, False),
    BULK: ClassSettings(0, 0.0, 4, 3.0, 5.0, False),
}


async def replicas(c: redis.Redis, capacity: int, *names: str,
                   classes: dict[PriorityClass, ClassSettings] | None = None,
                   clock: FakeClock | None = None, ttl: float = 10.0) -> list[FleetLedger]:
    out = []
    for name in names:
        led = FleetLedger(c, "f", name, ttl=ttl, clock=clock)
        await led.register(classes or PLAIN, capacity)
        out.append(led)
    return out


async def test_register_reports_capacity_min_and_live_replicas(client: redis.Redis) -> None:
    a = FleetLedger(client, "f", "a")
    first = await a.register(BUILTIN_CLASSES, 400)
    assert not first.known and first.capacity == 400 and first.live_replicas == 1
    b = FleetLedger(client, "f", "b")
    await b.register(BUILTIN_CLASSES, 300)
    again = await a.heartbeat()
    assert again.known and again.capacity == 300 and again.live_replicas == 2
    assert again.degraded_share() == 150
    snap = await a.snapshot()
    assert snap.capacity == 300 and snap.replicas == ("a", "b")
    # The reservations are the Python core's, for the smallest report.
    assert dict(snap.reserved) == scaled_reservations(BUILTIN_CLASSES, 300)
    assert snap.digests == (config_digest(BUILTIN_CLASSES),)
    # B's capacity grows back: the minimum is A's again.
    assert (await b.heartbeat(500)).capacity == 400
    # Another fleet on the same server is independent.
    other = FleetLedger(client, "g", "a")
    assert (await other.register(BUILTIN_CLASSES, 7)).live_replicas == 1
    assert (await a.snapshot()).capacity == 400


async def test_config_digest_mismatch_is_visible(client: redis.Redis) -> None:
    a, b = await replicas(client, 4, "a", "b")
    changed = dict(PLAIN) | {BULK: ClassSettings(0, 0.0, 9, 3.0, 5.0, False)}
    await b.register(changed, 4)
    assert len((await a.snapshot()).digests) == 2
    # The last registration's settings are the fleet's: bulk's queue now holds 9.
    for i in range(4):
        await a.arrive(f"x{i}", BULK, "t")
    assert all([(await a.arrive(f"q{i}", BULK, "t")).status is ArriveStatus.QUEUED
                for i in range(9)])
    assert (await a.arrive("full", BULK, "t")).status is ArriveStatus.REJECTED_QUEUE_FULL


async def test_heartbeat_does_not_overwrite_config_but_restores_it(
        client: redis.Redis, valkey_server: ValkeyServer) -> None:
    a, b = await replicas(client, 1, "a", "b")
    small = dict(PLAIN) | {BULK: ClassSettings(0, 0.0, 1, 3.0, 5.0, False)}
    await b.register(small, 1)
    await a.heartbeat()  # a's settings differ, but a heartbeat does not force them
    await a.arrive("x", BULK, "t")
    assert (await a.arrive("q1", BULK, "t")).status is ArriveStatus.QUEUED
    assert (await a.arrive("q2", BULK, "t")).status is ArriveStatus.REJECTED_QUEUE_FULL


async def test_arrive_admits_queues_rejects(client: redis.Redis) -> None:
    (a,) = await replicas(client, 2, "a")
    assert (await a.arrive("r1", DEF, "t")).status is ArriveStatus.ADMITTED
    assert (await a.arrive("r2", DEF, "t")).status is ArriveStatus.ADMITTED
    queued = await a.arrive("r3", DEF, "t")
    assert queued.status is ArriveStatus.QUEUED and queued.timeout == 10.0
    assert (await a.arrive("r3", DEF, "t")).status is ArriveStatus.DUPLICATE
    assert (await a.arrive("r1", DEF, "t")).status is ArriveStatus.DUPLICATE
    for i in range(3):
        assert (await a.arrive(f"q{i}", DEF, "t")).status is ArriveStatus.QUEUED
    assert (await a.arrive("q9", DEF, "t")).status is ArriveStatus.REJECTED_QUEUE_FULL
    snap = await a.snapshot()
    assert snap.inflight[DEF] == 2 and snap.queue_depth[DEF] == 4
    stranger = FleetLedger(client, "f", "nobody")
    assert (await stranger.arrive("z", DEF, "t")).status is ArriveStatus.UNREGISTERED


async def test_tenant_with_spaces_round_trips(client: redis.Redis) -> None:
    clock = FakeClock()
    (a,) = await replicas(client, 0, "a", clock=clock)
    assert (await a.arrive("q", DEF, "tenant with spaces")).status is ArriveStatus.QUEUED
    await a.heartbeat(1)
    assert await a.take_events() == [Event("grant", "q", 0.0)]
    assert (await a.snapshot()).inflight[DEF] == 1
    assert (await a.reregister([Holding("h", BULK, " lead and trail ")])).inflight == 2
    assert (await client.hget("pg:{f}:adm", "h") or "").endswith(" lead and trail ")


async def test_release_exactly_once_across_replicas(client: redis.Redis) -> None:
    a, b = await replicas(client, 8, "a", "b")
    for i in range(8):
        await a.arrive(f"r{i}", BULK, "t")
    results = await asyncio.gather(*(led.release(f"r{i}") for i in range(8) for led in (a, b)))
    assert results.count(ReleaseResult.RELEASED) == 8
    assert results.count(ReleaseResult.ALREADY_RELEASED) == 8
    assert await b.release("never") is ReleaseResult.UNKNOWN
    assert (await a.snapshot()).total_inflight == 0


async def test_release_grants_a_waiter_on_another_replica(client: redis.Redis) -> None:
    a, b = await replicas(client, 1, "a", "b")
    await a.arrive("held", DEF, "t")
    assert (await b.arrive("waits", DEF, "t")).status is ArriveStatus.QUEUED
    assert await a.release("held") is ReleaseResult.RELEASED
    (grant,) = await b.take_events()
    assert grant.kind == "grant" and grant.id == "waits" and grant.waited >= 0
    assert not grant.starvation and not grant.preempted
    assert await a.take_events() == []
    assert (await a.snapshot()).inflight[DEF] == 1


async def test_blocking_pop_delivers_a_grant_across_replicas(client: redis.Redis,
                                                            valkey_server: ValkeyServer) -> None:
    a, b = await replicas(client, 1, "a", "b")
    await a.arrive("held", DEF, "t")
    await b.arrive("waits", DEF, "t")
    listener = connect(valkey_server)  # a blocking pop holds its own connection
    try:
        pending = asyncio.create_task(b.next_events(5.0, client=listener))
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        await a.release("held")
        events = await asyncio.wait_for(pending, 5.0)
        elapsed = time.perf_counter() - start
    finally:
        await listener.aclose()
    assert [e.id for e in events] == ["waits"]
    assert elapsed < 1.0, f"grant took {elapsed * 1000:.1f} ms to reach its owner"
    assert await b.next_events(0.01) == []


async def test_fifo_by_arrival_across_replicas(client: redis.Redis) -> None:
    a, b, c = await replicas(client, 1, "a", "b", "c")
    await a.arrive("held", DEF, "t")
    order = [("w1", b), ("w2", c), ("w3", a), ("w4", b)]
    for id, led in order:
        await led.arrive(id, DEF, "t")
    granted = []
    holder = "held"
    for _ in order:
        await a.release(holder)
        got = [e for led in (a, b, c) for e in await led.take_events()]
        assert len(got) == 1
        granted.append(got[0].id)
        holder = got[0].id
    assert granted == ["w1", "w2", "w3", "w4"]


async def test_strict_priority_and_reservations_fleet_wide(client: redis.Redis) -> None:
    classes = dict(PLAIN) | {INT: ClassSettings(2, 0.0, 4, 10.0, 5.0, False)}
    a, b = await replicas(client, 4, "a", "b", classes=classes)
    # Bulk on A may take only capacity minus interactive's unused reservation.
    assert (await a.arrive("b1", BULK, "t")).status is ArriveStatus.ADMITTED
    assert (await a.arrive("b2", BULK, "t")).status is ArriveStatus.ADMITTED
    assert (await a.arrive("b3", BULK, "t")).status is ArriveStatus.QUEUED
    # Interactive on B still finds its reserved slots.
    assert (await b.arrive("i1", INT, "t")).status is ArriveStatus.ADMITTED
    assert (await b.arrive("i2", INT, "t")).status is ArriveStatus.ADMITTED
    assert (await b.arrive("i3", INT, "t")).status is ArriveStatus.QUEUED
    # A freed slot goes to the higher class first, whichever replica holds it.
    await a.release("b1")
    assert [e.id for e in await b.take_events()] == ["i3"]
    assert await a.take_events() == []


async def test_preemption_picks_the_fleet_wide_victim(client: redis.Redis) -> None:
    a, b = await replicas(client, 3, "a", "b")
    await a.arrive("bulk-old", BULK, "t")
    await a.arrive("bulk-new", BULK, "t")
    await b.arrive("def", DEF, "t")
    # Nothing reachable yet: no victim, the system request queues.
    assert (await b.arrive("s0", SYS, "t")).status is ArriveStatus.QUEUED
    assert await b.cancel("s0") is CancelResult.CANCELLED
    assert await a.mark_preemptible("bulk-old", "bulk-new", "unknown") == 2
    assert await b.mark_preemptible("def") == 1
    assert await a.mark_first_byte("bulk-new") == 1
    assert await a.mark_first_byte("bulk-new") == 0
    assert await a.mark_preemptible("bulk-new") == 0  # past its first byte: never a victim
    got = await b.arrive("s1", SYS, "t")
    # Lowest class first: bulk-old (bulk-new has sent its first byte).
    assert (got.status, got.victim, got.victim_owner) == (ArriveStatus.ADMITTED, "bulk-old", "a")
    assert await a.take_events() == [Event("preempt", "bulk-old", by_class=SYS)]
    assert await a.release("bulk-old") is ReleaseResult.ALREADY_RELEASED
    # The next victim is the default request on B (bulk-new is past its first byte).
    got = await a.arrive("s2", SYS, "t")
    assert got.victim == "def" and got.victim_owner == "b"
    assert await b.take_events() == [Event("preempt", "def", by_class=SYS)]
    # A class that may not preempt never does.
    assert (await a.arrive("d2", DEF, "t")).status is ArriveStatus.QUEUED


async def test_most_recent_candidate_is_the_victim(client: redis.Redis) -> None:
    a, b = await replicas(client, 2, "a", "b")
    await a.arrive("x1", BULK, "t")
    await b.arrive("x2", BULK, "t")
    await b.mark_preemptible("x2")
    await a.mark_preemptible("x1")
    got = await a.arrive("s", SYS, "t")
    assert got.victim == "x1"  # the most recent candidate


async def test_queued_head_preempts_once_a_victim_is_reachable(client: redis.Redis) -> None:
    clock = FakeClock()
    a, b = await replicas(client, 1, "a", "b", clock=clock)
    await a.arrive("bulk", BULK, "t")
    assert (await b.arrive("sys", SYS, "t")).status is ArriveStatus.QUEUED
    clock.advance(0.5)
    assert await a.mark_preemptible("bulk") == 1
    assert await a.take_events() == [Event("preempt", "bulk", by_class=SYS)]
    assert await b.take_events() == [Event("grant", "sys", 0.5, preempted=True)]


async def test_timeout_expires_the_waiter_and_tick_says_when(client: redis.Redis) -> None:
    clock = FakeClock()
    a, b = await replicas(client, 1, "a", "b", clock=clock)
    await a.arrive("held", DEF, "t")
    await b.arrive("bulk", BULK, "t")  # times out after 3 s, starves after 5 s
    assert await b.tick() == 3.0
    clock.advance(2.0)
    assert await a.tick() == 1.0
    assert await b.take_events() == []
    clock.advance(1.0)
    assert await a.tick() is None
    assert await b.take_events() == [Event("expired", "bulk", 3.0)]
    assert await b.cancel("bulk") is CancelResult.UNKNOWN
    assert (await a.snapshot()).queue_depth[BULK] == 0


async def test_starved_head_ignores_reservations_never_capacity(client: redis.Redis) -> None:
    clock = FakeClock()
    classes = dict(PLAIN) | {
        SYS: ClassSettings(1, 0.0, 4, 10.0, 5.0, True),
        DEF: ClassSettings(0, 0.0, 4, 60.0, 2.0, False),
    }
    (a,) = await replicas(client, 2, "a", classes=classes, clock=clock)
    await a.arrive("d1", DEF, "t")
    assert (await a.arrive("d2", DEF, "t")).status is ArriveStatus.QUEUED  # sys holds 1
    clock.advance(2.0)
    await a.tick()
    assert await a.take_events() == [Event("grant", "d2", 2.0, starvation=True)]
    assert (await a.arrive("d3", DEF, "t")).status is ArriveStatus.QUEUED
    clock.advance(2.0)
    await a.tick()
    assert await a.take_events() == []  # starved, but the fleet is full
    await a.release("d1")
    assert await a.take_events() == [Event("grant", "d3", 2.0, starvation=True)]


async def test_cancel_queued_granted_unknown(client: redis.Redis) -> None:
    a, b = await replicas(client, 1, "a", "b")
    await a.arrive("held", DEF, "t")
    await b.arrive("w1", DEF, "t")
    await b.arrive("w2", DEF, "t")
    assert await b.cancel("w1") is CancelResult.CANCELLED
    assert await b.cancel("w1") is CancelResult.UNKNOWN
    await a.release("held")
    # The grant won the race with the owner's cancel: the owner holds the slot.
    assert await b.cancel("w2") is CancelResult.ADMITTED
    assert await b.release("w2", ReleaseReason.CANCELLED) is ReleaseResult.RELEASED
    assert (await a.snapshot()).total_inflight == 0


async def test_dead_replica_loses_admissions_and_waiters(client: redis.Redis) -> None:
    clock = FakeClock()
    a, b = await replicas(client, 2, "a", "b", clock=clock, ttl=8.0)
    await b.arrive("b1", DEF, "t")
    await b.arrive("b2", DEF, "t")
    await b.arrive("bq", DEF, "t")
    await a.arrive("aq", DEF, "t")
    await b.mark_preemptible("b1")
    clock.advance(6.0)
    await a.heartbeat()
    clock.advance(2.0)  # b's last heartbeat was 8 s ago
    await a.tick()
    snap = await a.snapshot()
    assert snap.replicas == ("a",) and snap.inflight[DEF] == 1 and snap.queue_depth[DEF] == 0
    # b's waiter went with it; a's waiter is next (starved by now: 8 s > 5 s).
    assert await a.take_events() == [Event("grant", "aq", 8.0, starvation=True)]
    assert await client.exists("pg:{f}:ev:b", "pg:{f}:own:b") == 0
    # B comes back: unknown to the ledger until it registers (and learns it must reregister).
    assert (await b.arrive("b3", DEF, "t")).status is ArriveStatus.UNREGISTERED
    assert await b.release("b1") is ReleaseResult.ALREADY_RELEASED
    assert not (await b.heartbeat()).known


async def test_reregister_after_data_loss_is_idempotent(client: redis.Redis,
                                                       valkey_server: ValkeyServer) -> None:
    a, b = await replicas(client, 3, "a", "b")
    await a.arrive("a1", BULK, "t")
    await a.arrive("a2", SYS, "t")
    await b.arrive("done", DEF, "t")
    await b.release("done")
    await b.arrive("b1", DEF, "t")
    valkey_server.restart()  # no persistence: every key and the loaded script are gone
    await client.connection_pool.disconnect()
    assert not (await a.heartbeat()).known  # the client reloads the script by itself
    holdings_a = [Holding("a1", BULK, "t", preemptible=True), Holding("a2", SYS, "t", True)]
    status = await a.reregister(holdings_a)
    assert status.inflight == 2 and status.known
    assert (await a.reregister(holdings_a)).inflight == 2  # never double counted
    status = await b.reregister([Holding("b1", DEF, "x y")])
    assert status.inflight == 3 and status.live_replicas == 2
    snap = await a.snapshot()
    assert (snap.inflight[BULK], snap.inflight[DEF], snap.inflight[SYS]) == (1, 1, 1)
    # a1 came back preemptible, a2 past its first byte.
    assert (await b.arrive("s", SYS, "t")).victim == "a1"


async def test_a_resync_after_a_loss_starts_one_settling_window_for_the_fleet(
        client: redis.Redis, valkey_server: ValkeyServer) -> None:
    """The first resync of a replica the ledger does not know starts the fleet's settling
    on the ledger's clock; everyone's reply says how long is left; a later one within the
    window does not extend it; a replica it knows never starts one."""
    clock = FakeClock()
    a, b = await replicas(client, 4, "a", "b", clock=clock)
    assert (await a.resync([], settle=3.0)).settling == 0.0  # known: nothing to settle
    await a.arrive("a1", BULK, "t")
    valkey_server.restart()  # no persistence: every key is gone
    await client.connection_pool.disconnect()
    status = await a.resync([Holding("a1", BULK, "t")], settle=3.0)
    assert not status.known and status.settling == 3.0 and status.inflight == 1
    clock.advance(1.0)
    assert (await b.register(PLAIN, 4)).settling == 2.0  # a fresh start is told too
    later = await b.resync([], settle=3.0)  # known since its register: no new window
    assert later.known and later.settling == 2.0
    clock.advance(2.0)
    assert (await a.resync([Holding("a1", BULK, "t")], settle=3.0)).settling == 0.0
    # Settled: a replica whose registration lapsed later starts a new window.
    clock.advance(11.0)
    await b.heartbeat()
    assert (await a.resync([Holding("a1", BULK, "t")], settle=3.0)).settling == 3.0
    assert (await b.heartbeat()).settling == 3.0


async def test_a_returning_replica_admits_nothing_through_the_ledger_until_settled(
        client: redis.Redis, valkey_server: ValkeyServer) -> None:
    """Registered by a call that found it unknown (settle > 0), a replica's arrivals answer
    "unregistered" until a resync of its own finds the fleet settled: a request pipelined
    right behind that call is not admitted against a ledger still missing admissions. A
    first start (settle 0) is not returning."""
    clock = FakeClock()
    (a,) = await replicas(client, 4, "a", clock=clock)
    valkey_server.restart()
    await client.connection_pool.disconnect()
    assert not (await a.register(PLAIN, 4, settle=3.0)).known
    assert (await a.arrive("x", DEF, "t")).status is ArriveStatus.UNREGISTERED
    clock.advance(1.0)
    assert (await a.resync([], settle=3.0)).settling == 2.0  # not settled: still returning
    assert (await a.arrive("y", DEF, "t")).status is ArriveStatus.UNREGISTERED
    clock.advance(2.0)
    assert (await a.resync([], settle=3.0)).settling == 0.0
    assert (await a.arrive("z", DEF, "t")).status is ArriveStatus.ADMITTED
    fresh = FleetLedger(client, "f", "fresh", clock=clock)
    await fresh.register(PLAIN, 4)
    assert (await fresh.arrive("w", DEF, "t")).status is ArriveStatus.ADMITTED


async def test_a_resync_keeps_an_in_flight_arrival_only_if_it_was_admitted(
        client: redis.Redis) -> None:
    """After an outage a resync drops what the replica does not list (min_age 0); an arrival
    it still waits for is listed as in flight: an admission the ledger already made for it
    is kept (not ended while it is about to run), a waiter is dropped."""
    (a,) = await replicas(client, 2, "a")
    assert (await a.arrive("in-flight", DEF, "t")).status is ArriveStatus.ADMITTED
    await a.arrive("gone", DEF, "t")
    assert (await a.arrive("queued", DEF, "t")).status is ArriveStatus.QUEUED
    status = await a.resync([], in_flight=["in-flight", "queued"])
    assert status.held == 1
    snap = await a.snapshot()
    # The queued one is dropped: its requester moved to the local queue, and a grant for
    # it would be a slot nobody uses (or a preemption for nobody).
    assert snap.total_inflight == 1 and snap.queue_depth[DEF] == 0
    assert await a.release("in-flight") is ReleaseResult.RELEASED
    assert await a.release("gone") is ReleaseResult.ALREADY_RELEASED
    assert await a.take_events() == []


async def test_reregister_refuses_what_ended_and_readds_what_was_reaped(
        client: redis.Redis) -> None:
    clock = FakeClock()
    a, b = await replicas(client, 4, "a", "b", clock=clock, ttl=5.0)
    await b.arrive("kept", DEF, "t")
    await b.arrive("done", DEF, "t")
    await b.release("done")
    clock.advance(5.0)
    await a.heartbeat()  # reaps b: "kept" ended with its replica
    assert (await a.snapshot()).total_inflight == 0
    status = await b.reregister([Holding("kept", DEF, "t"), Holding("done", DEF, "t")])
    assert not status.known and status.refused == ("done",)
    assert status.inflight == 1


async def test_capacity_growth_dispatches_and_shrink_admits_nothing(client: redis.Redis) -> None:
    a, b = await replicas(client, 1, "a", "b")
    await a.arrive("x", DEF, "t")
    await b.arrive("y", DEF, "t")
    await a.heartbeat(2)
    assert await b.take_events() == []  # b still reports 1: the minimum holds
    await b.heartbeat(2)
    assert [e.id for e in await b.take_events()] == ["y"]
    await a.heartbeat(1)
    assert (await a.arrive("z", DEF, "t")).status is ArriveStatus.QUEUED
    snap = await a.snapshot()
    assert snap.capacity == 1 and snap.total_inflight == 2  # drains, nothing new admitted


async def test_server_time_is_the_clock_in_production(client: redis.Redis) -> None:
    (a,) = await replicas(client, 0, "a")
    before = time.time()
    await a.arrive("q", DEF, "t")
    snap = await a.snapshot()
    assert before - 1.0 <= snap.now <= time.time() + 1.0
    left = await a.tick()
    assert left is not None and 4.0 < left <= 5.0  # starvation of the head, 5 s


async def test_a_caller_supplied_clock_is_refused_by_the_production_library(
        client: redis.Redis) -> None:
    # Anyone reaching the server could call the production function with a clock of 1e18:
    # that used to reap every replica and expire every waiter. Only the test build (its own
    # library name, loaded only by a FleetLedger given a clock) takes one.
    a, _ = await replicas(client, 2, "a", "b")
    assert (await a.arrive("x", DEF, "t")).status is ArriveStatus.ADMITTED
    with pytest.raises(redis.ResponseError, match="caller clock is refused"):
        await client.fcall(ledger_module.FUNCTION, 1, "pg:{f}", "tick", "1e18")
    snap = await a.snapshot()
    assert snap.replicas == ("a", "b") and snap.total_inflight == 1
    assert ledger_module.TEST_FUNCTION != ledger_module.FUNCTION
    assert "TEST_CLOCK" not in ledger_module.TEST_LUA
    assert "--[[TEST_CLOCK" in ledger_module.LUA  # the branch is a comment in production
    # The test build takes it (and a fake clock far ahead reaps everyone, as it should).
    with_clock = FleetLedger(client, "f", "a", clock=lambda: 1e18)
    await with_clock.tick()
    assert (await a.snapshot()).replicas == ()


async def test_every_key_is_in_the_fleet_hash_slot(client: redis.Redis) -> None:
    a, b = await replicas(client, 1, "a", "b")
    await a.arrive("x", BULK, "t")
    await b.arrive("y", SYS, "t")
    await a.mark_preemptible("x")
    await b.arrive("z", DEF, "t")
    await a.release("x")
    keys = await client.keys("*")
    assert keys and all(k.startswith("pg:{f}:") for k in keys)
    slots = {await client.execute_command("CLUSTER", "KEYSLOT", k) for k in keys}
    assert len(slots) == 1


async def test_ended_ids_are_remembered_for_a_bounded_time(client: redis.Redis) -> None:
    clock = FakeClock()
    led = FleetLedger(client, "f", "a", ttl=1000.0, remember_ended_secs=60.0, clock=clock)
    await led.register(PLAIN, 4)
    for i in range(10):
        await led.arrive(f"old{i}", DEF, "t")
        await led.release(f"old{i}")
    assert await led.release("old0") is ReleaseResult.ALREADY_RELEASED
    clock.advance(61.0)
    # Each later end forgets up to two expired memories, with no heartbeat needed.
    for i in range(5):
        await led.arrive(f"new{i}", DEF, "t")
        await led.release(f"new{i}")
    assert await client.zcard("pg:{f}:endq") == 5
    assert await led.release("old0") is ReleaseResult.UNKNOWN
    assert await led.release("new0") is ReleaseResult.ALREADY_RELEASED


async def test_concurrent_replicas_keep_the_fleet_within_capacity(
        client: redis.Redis, valkey_server: ValkeyServer) -> None:
    """Three replicas, 450 requests at once, owners fed by blocking pops, random aborts."""
    import random

    rng = random.Random(7)
    capacity = 6
    # 450 callers share 32 connections: a blocking pool queues callers, as the sidecar will.
    pooled = redis.Redis(connection_pool=redis.BlockingConnectionPool(
        port=valkey_server.port, max_connections=32, decode_responses=True))
    leds = await replicas(pooled, capacity, "a", "b", "c", classes={
        SYS: ClassSettings(1, 0.0, 64, 10.0, 5.0, True),
        INT: ClassSettings(1, 0.0, 64, 10.0, 5.0, True),
        DEF: ClassSettings(0, 0.0, 64, 10.0, 0.2, False),
        BULK: ClassSettings(0, 0.0, 64, 10.0, 0.2, False),
    })
    waiting: dict[str, asyncio.Future[Event]] = {}
    preempted: set[str] = set()
    lost: set[str] = set()
    outcome = {"admitted": 0, "released": 0, "rejected": 0, "cancelled": 0}
    peak = 0
    done = asyncio.Event()
    # Grants seen fleet-wide: an impatient client's patience is counted in them, not in
    # seconds, so how many give up does not hang on how fast the box is.
    grants = 0
    progress = asyncio.Event()

    def granted() -> None:
        nonlocal grants, progress
        grants += 1
        progress.set()
        progress = asyncio.Event()

    async def impatient(fut: asyncio.Future[Event]) -> None:
        """Until the fleet granted 0-12 more requests (or this one's grant came)."""
        target = grants + rng.randint(0, 12)
        while not fut.done() and grants < target:
            step = asyncio.ensure_future(progress.wait())
            await asyncio.wait([fut, step], timeout=8.0,
                               return_when=asyncio.FIRST_COMPLETED)
            step.cancel()

    async def consume(led: FleetLedger) -> None:
        conn = connect(valkey_server)
        try:
            while not done.is_set():
                for e in await led.next_events(0.05, client=conn):
                    if e.kind == "preempt":
                        preempted.add(e.id)
                    elif e.id in waiting and not waiting[e.id].done():
                        waiting[e.id].set_result(e)
                        if e.kind != "expired":
                            granted()
        finally:
            await conn.aclose()

    async def monitor() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, (await leds[0].snapshot()).total_inflight)
            await asyncio.sleep(0.002)

    async def request(led: FleetLedger, n: int) -> None:
        id = f"{led.replica}-{n}"
        cls = rng.choice(list(PriorityClass))
        waiting[id] = asyncio.get_running_loop().create_future()
        got = await led.arrive(id, cls, "t")
        if got.status is ArriveStatus.REJECTED_QUEUE_FULL:
            outcome["rejected"] += 1
            return
        if got.status is ArriveStatus.ADMITTED:
            granted()
        if got.status is ArriveStatus.QUEUED:
            # Half the clients give up soon (cancels racing grants), half wait for their
            # turn.
            if rng.random() < 0.5:
                await impatient(waiting[id])
            else:
                await asyncio.wait([waiting[id]], timeout=8.0)
            if waiting[id].done():
                event = waiting[id].result()
            else:  # the client gives up
                if await led.cancel(id) is CancelResult.CANCELLED:
                    outcome["cancelled"] += 1
                    return
                event = await waiting[id]  # the grant won the race: we hold a slot
            if event.kind == "expired":
                outcome["rejected"] += 1
                return
        outcome["admitted"] += 1
        await led.mark_preemptible(id)
        await asyncio.sleep(rng.uniform(0, 0.01))
        if await led.release(id) is ReleaseResult.RELEASED:
            outcome["released"] += 1
        else:
            lost.add(id)  # preempted: its notification may still be on the way

    tasks = [asyncio.create_task(consume(led)) for led in leds]
    tasks.append(asyncio.create_task(monitor()))
    try:
        await asyncio.wait_for(
            asyncio.gather(*(request(led, n) for n in range(150) for led in leds)), 30.0)
    finally:
        done.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        await pooled.aclose()
    assert lost == preempted
    snap = await FleetLedger(client, "f", "a").snapshot()
    assert snap.total_inflight == 0 and sum(snap.queue_depth.values()) == 0
    assert 0 < peak <= capacity
    assert outcome["admitted"] == outcome["released"] + len(preempted)
    assert sum(outcome.values()) - outcome["released"] == 450
    print(f"outcomes {outcome}, peak {peak}")
    assert outcome["admitted"] > 50 and outcome["cancelled"] > 0, outcome
    assert preempted, outcome


async def test_batch_runs_releases_and_marks_in_one_pipeline_even_after_a_script_flush(
        client: redis.Redis) -> None:
    a = FleetLedger(client, "f", "a")
    await a.register(PLAIN, 3)
    for aid in ("x", "y", "z"):
        assert (await a.arrive(aid, BULK, "t")).status is ArriveStatus.ADMITTED
    await client.script_flush()  # a restarted server has no scripts loaded...
    await client.function_flush()  # ...and no functions
    replies = await a.batch([("mark_preemptible", ["x", "y"]), ("release", ["x", "completed"]),
                             ("release", ["x", "completed"]), ("mark_first_byte", ["y"])])
    assert replies == [2, "released", "already_released", 1]
    snap = await a.snapshot()
    assert snap.total_inflight == 2
    assert await client.zcard("pg:{f}:pre:0") == 0  # y streams now, x ended
    # A batch with an op the ledger does not know is refused whole: nothing of it ran.
    with pytest.raises(redis.ResponseError, match="unknown ledger op"):
        await a.batch([("release", ["y", "completed"]), ("nonsense", [])])
    assert (await a.snapshot()).total_inflight == 2


async def test_resync_makes_the_ledger_hold_exactly_what_the_replica_lists(
        client: redis.Redis) -> None:
    a = FleetLedger(client, "f", "a")
    await a.register(PLAIN, 4)
    for aid in ("kept", "ended", "lost-reply", "also-ended"):
        assert (await a.arrive(aid, BULK, "t")).status is ArriveStatus.ADMITTED
    status = await a.resync([Holding("kept", BULK, "t"), Holding("local", DEF, "t")],
                            waiting=[])
    assert status.known
    snap = await a.snapshot()
    assert snap.inflight[BULK] == 1 and snap.inflight[DEF] == 1
    assert snap.total_inflight == 2
    assert await a.release("ended") is ReleaseResult.ALREADY_RELEASED
    # A fresh admission whose reply may still be on its way survives a steady-state resync.
    await a.arrive("fresh", BULK, "t")
    await a.resync([Holding("kept", BULK, "t"), Holding("local", DEF, "t")], min_age=60)
    assert (await a.snapshot()).total_inflight == 3


async def test_resync_replacing_what_ended_grants_no_waiter_the_replacements_slots(
        client: redis.Redis) -> None:
    """A degraded replica's admissions ended locally and new ones took their slots; its
    resync drops the old and adds the new in one step. The freed slots are never handed to
    a waiter in between (the replacements would then be counted on top: over capacity)."""
    a, b = await replicas(client, 2, "a", "b")
    for aid in ("old1", "old2"):
        assert (await a.arrive(aid, BULK, "t")).status is ArriveStatus.ADMITTED
    assert (await b.arrive("wb", INT, "t")).status is ArriveStatus.QUEUED
    status = await a.resync([Holding("new1", BULK, "t"), Holding("new2", BULK, "t")])
    assert status.inflight == 2 and status.held == 2
    snap = await a.snapshot()
    assert snap.total_inflight == 2 and snap.queue_depth[INT] == 1
    assert await b.take_events() == []
    # The slot goes to the waiter only when one of the replacements really ends.
    assert await a.release("new1") is ReleaseResult.RELEASED
    assert [e.id for e in await b.take_events() if e.kind == "grant"] == ["wb"]
    assert (await a.snapshot()).total_inflight == 2


async def test_resync_keeps_listed_waiters_and_drops_unlisted_ones(client: redis.Redis) -> None:
    a = FleetLedger(client, "f", "a")
    await a.register(PLAIN, 1)
    await a.arrive("x", BULK, "t")
    assert (await a.arrive("w1", BULK, "t")).status is ArriveStatus.QUEUED
    assert (await a.arrive("w2", BULK, "t")).status is ArriveStatus.QUEUED
    await a.resync([Holding("x", BULK, "t")], waiting=["w2"])
    snap = await a.snapshot()
    assert snap.queue_depth[BULK] == 1 and snap.total_inflight == 1
    await a.release("x")  # the kept waiter is granted, never admitted twice
    assert [e.id for e in await a.take_events() if e.kind == "grant"] == ["w2"]
    assert (await a.snapshot()).total_inflight == 1


async def test_a_resync_that_runs_after_a_newer_one_of_its_process_changes_nothing(
        client: redis.Redis) -> None:
    """Found by the deterministic fleet simulation (seed 20261204): a server pause outlasted
    replica a's registration. The connection a gave up on still held its recovery resync,
    listing nothing; on resume its new connection's resync re-added the two streams a was
    running, then the old one ran (min_age 0) and dropped them: the ledger counted a as
    holding nothing while both ran on, and the fleet ran 7 of 6. A resync older than one
    of its process already applied now changes nothing: not its list, not its capacity
    report."""
    clock = FakeClock()
    a, b = await replicas(client, 9, "a", "b", clock=clock)
    late = a._resync_args([], 9)  # sent first (a held nothing), run last
    clock.advance(2.0)
    running = [Holding("s1", DEF, "t", first_byte=True), Holding("s2", BULK, "t")]
    fresh = a._status(await a._call("resync", *a._resync_args(running, 3)))
    assert fresh.held == 2 and fresh.capacity == 3
    clock.advance(0.001)
    stale = a._status(await a._call("resync", *late))
    snap = await a.snapshot()
    assert snap.total_inflight == 2 and snap.capacity == 3  # the newer list and report
    assert not stale.known  # ("stale": nobody reads it, its caller gave up)
    # So b gets the one slot left, not three.
    assert (await b.arrive("b1", DEF, "t")).status is ArriveStatus.ADMITTED
    assert (await b.arrive("b2", DEF, "t")).status is ArriveStatus.QUEUED
    # The next resync of a's applies, as does a new process's first one (its numbers start
    # again: the order is kept per incarnation).
    assert (await a.resync(running[:1])).held == 1
    a2 = FleetLedger(client, "f", "a", ttl=10.0, clock=clock)
    await a2.register(PLAIN, 3)
    assert a2.resyncs == 0
    assert (await a2.resync([])).held == 0
    assert (await b.snapshot()).total_inflight == 2  # b1, and b2 granted


async def test_after_a_loss_the_others_registrations_say_whether_they_heard(
        client: redis.Redis) -> None:
    """c registered after a and b last read a reply (unheard 2); the server restarted
    empty before their next heartbeat. c's first call finds the loss alone in the new
    ledger (unheard 0: nobody else is registered yet, which says nothing about a and b:
    the replica does not take a share from a status answered while the fleet settles,
    sidecar/coordination/replica.py). Once a and b are back and the fleet has settled,
    their own calls tell: not heard until a call of theirs carries a generation after
    c's registration."""
    clock = FakeClock()
    a, b = await replicas(client, 9, "a", "b", clock=clock)
    c = FleetLedger(client, "f", "c", ttl=10.0, clock=clock)
    for led in (a, b, c):
        led.settle = 3.0  # the window a call that finds a loss opens (as the controller's)
    assert (await c.register(PLAIN, 9)).unheard == 2
    await client.flushall()  # a restart without persistence (the library stays loaded)
    lost = await c.resync([], settle=3.0)
    assert lost.settling > 0 and lost.live_replicas == 1 and lost.unheard == 0
    for led in (a, b):  # they re-register within the window, from what they last read
        assert not (await led.resync([], settle=3.0)).known
    clock.advance(3.1)
    assert (await c.resync([], settle=3.0)).unheard == 2  # settled: neither has heard
    for led in (a, b):  # their next calls carry a generation after c's registration
        await led.resync([], settle=3.0)
    assert (await c.resync([], settle=3.0)).unheard == 0
