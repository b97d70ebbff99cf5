"""The ledger after it lost writes: a restored older copy, a lost key, a restarted process.

Against a real valkey-server (production build: the server's clock). Ground truth is
counted here, outside the code under test: what each replica was told it holds (admitted
minus released), never the ledger's own counters.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as redis
from structlog.testing import capture_logs

from devtools.valkey import ValkeyServer
from sidecar.classes import PriorityClass
from sidecar.coordination.ledger import ArriveStatus, FleetLedger, Holding, ReplicaIdInUse
from sidecar.scheduler import ClassSettings, ReleaseReason
from tests.ledger_faults import copy_keyspace, restore_keyspace
from tests.ledger_support import client, keyspace, valkey_server

__all__ = ["client", "valkey_server"]  # fixtures used by name

SYS, INT, DEF, BULK = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
                       PriorityClass.BULK)
PLAIN: dict[PriorityClass, ClassSettings] = {
    SYS: ClassSettings(0, 0.0, 4, 10.0, 5.0, True),
    INT: ClassSettings(0, 0.0, 4, 10.0, 5.0, True),
    DEF: ClassSettings(0, 0.0, 4, 10.0, 5.0, False),
    BULK: ClassSettings(0, 0.0, 4, 3.0, 5.0, False),
}
SETTLE = 0.6
FLEET = "f"


class Truth:
    """What replicas were told they hold: admitted (answer or grant) minus released."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}

    def admit(self, led: FleetLedger, aid: str) -> None:
        self.held.setdefault(led.replica, set()).add(aid)

    def release(self, led: FleetLedger, aid: str) -> None:
        self.held[led.replica].discard(aid)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.held.values())

    def holdings(self, led: FleetLedger) -> list[Holding]:
        return [Holding(a, DEF, "t") for a in sorted(self.held.get(led.replica, ()))]


class Losses:
    def __init__(self, *leds: FleetLedger) -> None:
        self.seen: list[tuple[str, str]] = []
        for led in leds:
            led.settle = SETTLE
            led.on_loss = lambda cause, _seen, r=led.replica: self.seen.append((r, cause))


async def fleet(c: redis.Redis, capacity: int, *names: str) -> list[FleetLedger]:
    out = []
    for name in names:
        led = FleetLedger(c, FLEET, name)
        await led.register(PLAIN, capacity)
        out.append(led)
    return out


async def arrive(led: FleetLedger, truth: Truth, aid: str) -> ArriveStatus:
    status = (await led.arrive(aid, DEF, "t")).status
    if status is ArriveStatus.ADMITTED:
        truth.admit(led, aid)
    return status


async def test_a_restored_older_copy_is_a_loss_nobody_admits_until_settled(
        client: redis.Redis, valkey_server: ValkeyServer) -> None:
    # Capacity 4. A holds 2 when the copy is taken; B then takes the other 2. The server
    # comes back with the copy (it knows only A's 2): admitting through it would run 5+ of
    # 4. The first call of either replica finds the generation behind what it saw.
    a, b = await fleet(client, 4, "a", "b")
    losses = Losses(a, b)
    truth = Truth()
    for i in range(2):
        assert await arrive(a, truth, f"a{i}") is ArriveStatus.ADMITTED
    copy = await copy_keyspace(valkey_server, FLEET)
    for i in range(2):
        assert await arrive(b, truth, f"b{i}") is ArriveStatus.ADMITTED
    await a.heartbeat()
    await restore_keyspace(valkey_server, FLEET, copy)

    got = [await arrive(r, truth, f"x{r.replica}{i}") for i in range(2) for r in (a, b)]
    assert truth.total == 4, (got, truth.held)
    assert set(got) == {ArriveStatus.UNREGISTERED}
    assert losses.seen[:1] in ([("a", "stale_copy")], [("b", "stale_copy")])
    # Every replica's heartbeat says "new" (re-register) until the fleet settled.
    for r in (a, b):
        st = await r.resync(truth.holdings(r), settle=SETTLE)
        assert not st.known and st.settling > 0
    assert (await a.snapshot()).total_inflight == truth.total == 4
    await asyncio.sleep(SETTLE + 0.05)
    for r in (a, b):
        assert (await r.resync(truth.holdings(r), settle=SETTLE)).known
    assert await arrive(a, truth, "later") is ArriveStatus.QUEUED  # full: 4 of 4
    assert len(losses.seen) == 1  # found once, by one call


async def test_a_restored_waiter_that_was_granted_since_is_not_granted_again(
        client: redis.Redis, valkey_server: ValkeyServer) -> None:
    # W waits in the copy; after the copy it was granted (A runs it) and A's slot "a0"
    # was released. The copy comes back: W is a waiter there again. A's resync lists W as
    # held: the waiter record goes and W is counted as admitted, once.
    (a,) = await fleet(client, 1, "a")
    losses = Losses(a)
    truth = Truth()
    assert await arrive(a, truth, "a0") is ArriveStatus.ADMITTED
    assert await arrive(a, truth, "w") is ArriveStatus.QUEUED
    copy = await copy_keyspace(valkey_server, FLEET)
    await a.release("a0")
    truth.release(a, "a0")
    assert [e.kind for e in await a.take_events()] == ["grant"]
    truth.admit(a, "w")
    await restore_keyspace(valkey_server, FLEET, copy)
    st = await a.resync(truth.holdings(a), settle=SETTLE)
    assert losses.seen == [("a", "stale_copy")] and not st.known
    snap = await a.snapshot()
    # a0 dropped (not listed), W counted once as admitted, no waiter left to grant.
    assert snap.total_inflight == truth.total == 1 and sum(snap.queue_depth.values()) == 0
    await asyncio.sleep(SETTLE + 0.05)
    st = await a.resync(truth.holdings(a), settle=SETTLE)
    assert st.known and st.inflight == truth.total == 1
    await a.tick()
    assert [e for e in await a.take_events() if e.kind == "grant"] == []


async def test_a_lost_inflight_key_is_recomputed_from_the_admission_records(
        client: redis.Redis) -> None:
    a, b = await fleet(client, 4, "a", "b")
    losses = Losses(a, b)
    truth = Truth()
    for i in range(4):
        await arrive((a, b)[i % 2], truth, f"r{i}")
    await client.delete(f"pg:{{{FLEET}}}:inflight")  # evicted, or an operator's DEL
    assert await arrive(b, truth, "more") is ArriveStatus.QUEUED
    assert truth.total == 4 and losses.seen == [("b", "counters_lost")]
    await b.cancel("more")
    for aid in sorted(truth.held["a"]):
        await a.release(aid)
        truth.release(a, aid)
    snap = await a.snapshot()
    assert snap.total_inflight == truth.total == 2 and min(snap.inflight.values()) >= 0


async def test_lost_admission_records_are_rebuilt_and_admission_stays_exact(
        client: redis.Redis) -> None:
    # The records go (an operator's DEL): the owners' sets still name the ids and the
    # counters say how many of each class, so the next call rebuilds them. Nobody settles,
    # nothing runs uncounted, and a release finds its record. (Before: a data loss that
    # froze the fleet for a settling window; the replicas then admitted locally within
    # their shares, which measured 10-11 of 9 on three real replicas.)
    a, b = await fleet(client, 4, "a", "b")
    losses = Losses(a, b)
    truth = Truth()
    for i in range(4):
        await arrive((a, b)[i % 2], truth, f"r{i}")
    await client.delete(f"pg:{{{FLEET}}}:adm")
    assert await arrive(a, truth, "more") is ArriveStatus.QUEUED  # 4 of 4: full
    assert losses.seen == [("a", "admissions_rebuilt")]
    assert await client.hlen(f"pg:{{{FLEET}}}:adm") == 4
    assert (await b.release("r1")).value == "released"
    truth.release(b, "r1")
    assert [e.kind for e in await a.take_events()] == ["grant"]  # "more" got r1's slot
    truth.admit(a, "more")
    # The owners' resyncs give the rebuilt records their class, first byte and tenant.
    for r in (a, b):
        st = await r.resync(truth.holdings(r), settle=SETTLE)
        assert st.known and st.settling == 0
    records = await client.hgetall(f"pg:{{{FLEET}}}:adm")
    assert sorted(records) == sorted(set().union(*truth.held.values()))
    assert all(v.split(" ")[3] in ("0", "1") and v.endswith(" t") for v in records.values())
    assert (await a.snapshot()).total_inflight == truth.total == 4
    assert len(losses.seen) == 1


async def test_a_restarted_process_with_the_same_replica_id_takes_over_its_holdings(
        client: redis.Redis) -> None:
    (old,) = await fleet(client, 3, "a")
    truth = Truth()
    await arrive(old, truth, "r0")
    await arrive(old, truth, "r1")
    await old.mark_preemptible("r1")
    await arrive(old, truth, "r2")
    assert await arrive(old, truth, "w") is ArriveStatus.QUEUED
    # The container restarts: a new process, same --replica-id, its registration still live.
    new = FleetLedger(client, FLEET, "a")
    new.settle = SETTLE
    taken: list[Holding] = []
    new.on_takeover = taken.extend
    st = await new.register(PLAIN, 3, settle=0.0)
    assert st.known and sorted(h.id for h in taken) == ["r0", "r1", "r2"]
    # It lists them from now on: its first resync keeps them (it used to drop them all).
    st = await new.resync(taken, min_age=0.0, settle=SETTLE)
    assert st.inflight == truth.total == 3
    snap = await new.snapshot()
    assert sum(snap.queue_depth.values()) == 0  # the waiter went with the old process
    # No stop channel any more: r1 is no preemption candidate.
    assert (await new.arrive("s", SYS, "t")).status is ArriveStatus.QUEUED
    assert not await client.exists(f"pg:{{{FLEET}}}:ev:a")
    # The same process again: nothing more to take over.
    assert (await new.heartbeat()).known and len(taken) == 3


async def test_adoption_re_adds_a_running_stream_the_ledger_had_ended(
        client: redis.Redis) -> None:
    (a,) = await fleet(client, 2, "a")
    await a.arrive("r0", DEF, "t")
    await a.resync([], min_age=0.0)  # ended as completed (a resync that did not list it)
    st = await a.reregister([Holding("r0", DEF, "t")])
    assert st.refused == ("r0",) and st.inflight == 0  # a reregister refuses it
    st = await a.adopt([Holding("r0", DEF, "t", first_byte=True)])
    assert st.refused == ("r0",) and st.inflight == 1  # Envoy runs it: counted again
    assert (await a.release("r0", ReleaseReason.COMPLETED)).value == "released"


async def test_a_restart_from_an_older_snapshot_is_a_loss_whoever_calls_first(
        tmp_path: Path) -> None:
    # A real restart from the RDB file. The first call after it comes from a client that
    # is not a replica (no generation of its own, no settling window): the server's
    # identity tells it all the same, and the fleet's window (as its replicas last gave
    # it) is opened.
    server = ValkeyServer(tmp_path / "valkey-rdb")
    server.start()
    c = redis.Redis(port=server.port, decode_responses=True)
    try:
        a, b = await fleet(c, 4, "a", "b")
        Losses(a, b)
        truth = Truth()
        for r in (a, b):
            await r.resync([], settle=SETTLE)  # a running replica's heartbeat: its window
        await arrive(a, truth, "a0")
        await c.save()
        await arrive(b, truth, "b0")
        await arrive(b, truth, "b1")
        server.restart()
        observer = FleetLedger(c, FLEET, "observer")
        causes: list[str] = []
        observer.on_loss = lambda cause, _seen: causes.append(cause)
        assert (await observer.snapshot()).total_inflight == 1  # the older copy
        assert causes == ["server_changed"]
        # Frozen for the fleet's window: nobody admits against the copy.
        assert await arrive(a, truth, "a1") is ArriveStatus.UNREGISTERED
        for r in (a, b):
            assert not (await r.resync(truth.holdings(r), settle=SETTLE)).known
        await asyncio.sleep(SETTLE + 0.05)
        for r in (a, b):
            assert (await r.resync(truth.holdings(r), settle=SETTLE)).known
        assert (await a.snapshot()).total_inflight == truth.total == 3
    finally:
        await c.aclose()
        server.stop()


async def test_a_lost_waiter_record_leaves_no_orphan_that_breaks_the_ledger(
        client: redis.Redis) -> None:
    # Only the waiters' hash is lost: their queue and deadline entries remain without a
    # record. Every call that dispatched used to fail on them (the replicas degraded for
    # good). They are forgotten; the replicas answer those requests at their own timeout.
    (a,) = await fleet(client, 1, "a")
    truth = Truth()
    await arrive(a, truth, "r0")
    assert await arrive(a, truth, "w0") is ArriveStatus.QUEUED
    await client.delete(f"pg:{{{FLEET}}}:w")
    await a.release("r0")
    truth.release(a, "r0")
    assert await arrive(a, truth, "r1") is ArriveStatus.ADMITTED
    assert await a.tick() is None
    snap = await a.snapshot()
    assert snap.total_inflight == truth.total == 1 and sum(snap.queue_depth.values()) == 0


async def test_a_lost_own_set_is_rebuilt_so_a_dead_replica_still_frees_its_slots(
        client: redis.Redis) -> None:
    a = FleetLedger(client, FLEET, "a", ttl=1.0)
    await a.register(PLAIN, 2)
    (b,) = await fleet(client, 2, "b")
    truth = Truth()
    await arrive(a, truth, "a0")
    await arrive(a, truth, "a1")
    faults: list[str] = []
    b.on_loss = lambda cause, _seen: faults.append(cause)
    await client.delete(f"pg:{{{FLEET}}}:own:a")
    await b.heartbeat()
    assert faults == ["owners_lost"]
    assert await client.scard(f"pg:{{{FLEET}}}:own:a") == 2
    await asyncio.sleep(1.1)  # A dies: its registration lapses
    assert await arrive(b, truth, "b0") is ArriveStatus.ADMITTED  # A's slots came back
    assert (await b.snapshot()).total_inflight == 1


async def test_a_process_taken_over_is_refused_and_cannot_take_its_admissions_back(
        client: redis.Redis) -> None:
    # Two live processes with one replica id (two sidecars on one host, both on the default
    # id): the second's registration takes over the first's admissions. The first's next
    # call used to take them back (and the second's back again, unnoticed). Now it is
    # refused, changes nothing, and says why, once.
    (old,) = await fleet(client, 3, "a")
    truth = Truth()
    await arrive(old, truth, "x")
    new = FleetLedger(client, FLEET, "a")
    taken: list[Holding] = []
    new.on_takeover = taken.extend
    await new.register(PLAIN, 3)
    assert [h.id for h in taken] == ["x"]
    before = await keyspace(client, FLEET)
    with capture_logs() as logs:
        for call in (old.arrive("y", DEF, "t"), old.heartbeat(), old.release("x")):
            with pytest.raises(ReplicaIdInUse, match="replica_id_in_use"):
                await call
    assert await keyspace(client, FLEET) == before
    assert [e["event"] for e in logs] == ["coordination_replica_id_in_use"]
    st = await new.heartbeat()
    assert st.known and st.held == 1 and [h.id for h in taken] == ["x"]  # taken once
    assert (await new.arrive("z", DEF, "t")).status is ArriveStatus.ADMITTED


async def test_an_adoption_under_a_new_replica_id_keeps_the_stream_counted_past_the_old_one(
        client: redis.Redis) -> None:
    # A sidecar restarted under a new --replica-id: its Envoy's periodic entries name the
    # streams the old process admitted, and the adoption moves them to the new id. Before,
    # the ledger skipped them ("already counted") and the old registration, lapsing,
    # freed them while they ran.
    old = FleetLedger(client, FLEET, "a-old", ttl=1.0)
    await old.register(PLAIN, 4)
    for aid in ("x", "y"):
        assert (await old.arrive(aid, DEF, "t")).status is ArriveStatus.ADMITTED
    (new, b) = await fleet(client, 4, "a-new", "b")
    st = await new.adopt([Holding("x", DEF, "t", first_byte=True),
                          Holding("y", DEF, "t", first_byte=True)])
    assert st.refused == () and st.inflight == 2 and st.held == 2
    await asyncio.sleep(1.1)  # the old process is gone: its registration lapses
    snap = await b.snapshot()
    assert snap.replicas == ("a-new", "b") and snap.total_inflight == 2
    for _ in range(2):
        assert (await b.arrive(f"b{_}", DEF, "t")).status is ArriveStatus.ADMITTED
    assert (await b.arrive("b-more", DEF, "t")).status is ArriveStatus.QUEUED  # 4 of 4
