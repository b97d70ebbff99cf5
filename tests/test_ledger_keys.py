"""The ledger's keys lost one after another while three replicas admit: never past capacity.

An evicted key or an operator's ``DEL`` must not make the fleet run more than its capacity,
and the fleet must admit again, exactly, within the documented time (docs/design.md, "Keys
the ledger rebuilds"). Against a real valkey-server, on the test build's fake clock (the
settling window and the heartbeats pass in no wall time).

The replicas are modelled as the controller drives the ledger (sidecar/coordination/
replica.py): each request is one ``arrive``; a grant, preemption or expiry is read from
the replica's list right after every call (the blocking pop); releases, candidate and
first-byte marks are single calls; every heartbeat interval a replica resyncs listing what
it holds and its waiters; an admission a resync reports as ended is stopped, or re-added
with ``adopt`` if its response has started; a waiter the ledger forgot is answered at its
own queue deadline. They admit only through the ledger (no degraded local share), so any
excess is the ledger's. Ground truth is what the replicas were told they hold (admitted
or granted, minus released, stopped and preempted), counted here, never read from the
ledger.

Each run deletes every key the fleet holds at that moment, one at a time, with a few calls
in between, in an order that starts with a different key each run (so every key is lost
first once, ``adm`` first included) and goes on in a seeded random order; keys that appear
meanwhile (ghosts, a notification list) are deleted at the end. ``KEYS_SEED`` replays.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field

import pytest
import redis.asyncio as redis

from devtools.valkey import ValkeyServer
from sidecar.classes import PriorityClass
from sidecar.coordination.ledger import ArriveStatus, FleetLedger, Holding
from sidecar.scheduler import ClassSettings, ReleaseReason
from tests.clock import FakeClock
from tests.ledger_support import connect, valkey_server

__all__ = ["valkey_server"]

SYS, INT, DEF, BULK = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
                       PriorityClass.BULK)
CAPACITY = 9
FLEET = "k"
PREFIX = f"pg:{{{FLEET}}}"
# As the controller sets them for --replica-ttl-secs 3: registered for 0.9 ttl, a heartbeat
# (resync) every third of that, calls time out after ttl / 5, the settling window is two
# intervals and a call timeout, and a resync drops an unlisted admission older than four
# call timeouts.
TTL = 0.9 * 3.0
INTERVAL = TTL / 3
CALL_TIMEOUT = 0.6
SETTLE = 2 * INTERVAL + CALL_TIMEOUT
MIN_AGE = 4 * CALL_TIMEOUT
# Admitting again within: a settling window (ghosts), then a heartbeat of every replica
# and the resync's min_age (placeholders nobody lists), then one more interval.
RECOVERY = SETTLE + MIN_AGE + 2 * INTERVAL
STEP = 0.1  # fake seconds per step
WARM_UP = 100  # steps before the first key is lost

CLASSES = {
    SYS: ClassSettings(1, 0.0, 8, 2.0, 5.0, True),
    # Fair queuing with weights and a per-tenant limit: the tenant keys are lost too.
    INT: ClassSettings(0, 0.0, 8, 3.0, 1.0, True, fair_queuing=True, max_queued_per_tenant=3,
                       tenant_weights={"t1": 2.0, "t2": 0.5}),
    DEF: ClassSettings(0, 0.0, 8, 2.0, 2.0, False),
    BULK: ClassSettings(0, 0.0, 16, 5.0, 3.0, False),
}
TENANTS = ("t1", "t2", "t3")


@dataclass
class Held:
    cls: PriorityClass
    tenant: str
    first_byte: bool = False
    marked: bool = False


@dataclass
class Rep:
    """One replica as the controller drives the ledger, and what it was told it holds."""

    led: FleetLedger
    held: dict[str, Held] = field(default_factory=dict)
    waiting: dict[str, tuple[PriorityClass, str, float]] = field(default_factory=dict)
    next_beat: float = 0.0
    causes: list[str] = field(default_factory=list)

    def holdings(self) -> list[Holding]:
        return [Holding(i, h.cls, h.tenant, first_byte=h.first_byte,
                        preemptible=h.marked and not h.first_byte)
                for i, h in self.held.items()]


class Fleet:
    def __init__(self, client: redis.Redis, clock: FakeClock, rng: random.Random) -> None:
        self.client = client
        self.clock = clock
        self.rng = rng
        self.reps: list[Rep] = []
        self.peak = 0
        self.seq = 0
        self.log: list[str] = []

    @property
    def running(self) -> int:
        return sum(len(r.held) for r in self.reps)

    async def start(self, n: int) -> None:
        for i in range(n):
            led = FleetLedger(self.client, FLEET, f"r{i}", ttl=TTL, clock=self.clock)
            led.settle = SETTLE
            rep = Rep(led, next_beat=self.clock() + INTERVAL * (i + 1) / n)
            led.on_loss = lambda cause, _seen, rep=rep: rep.causes.append(cause)
            self.reps.append(rep)
            await led.register(CLASSES, CAPACITY)

    def check(self, where: str) -> None:
        self.peak = max(self.peak, self.running)
        assert self.running <= CAPACITY, (
            f"{self.running} running of {CAPACITY} after {where}; log tail {self.log[-12:]}")

    async def events(self) -> None:
        """What the blocking pops would have read by now."""
        for rep in self.reps:
            for e in await rep.led.take_events():
                if e.kind == "grant":
                    w = rep.waiting.pop(e.id, None)
                    if w is None:  # its requester left: give the slot back
                        await rep.led.release(e.id, ReleaseReason.CANCELLED)
                    else:
                        rep.held[e.id] = Held(w[0], w[1])
                elif e.kind == "preempt":
                    rep.held.pop(e.id, None)  # stopped through its ext_proc stream
                else:
                    rep.waiting.pop(e.id, None)

    async def arrive(self, rep: Rep) -> None:
        self.seq += 1
        aid = f"{rep.led.replica}-{self.seq}"
        cls = self.rng.choice(list(PriorityClass))
        tenant = self.rng.choice(TENANTS)
        got = await rep.led.arrive(aid, cls, tenant)
        if got.status is ArriveStatus.ADMITTED:
            rep.held[aid] = Held(cls, tenant)
        elif got.status is ArriveStatus.QUEUED:
            rep.waiting[aid] = (cls, tenant, self.clock() + CLASSES[cls].queue_timeout_secs)

    async def heartbeat(self, rep: Rep) -> None:
        st = await rep.led.resync(rep.holdings(), CAPACITY, min_age=MIN_AGE,
                                  waiting=list(rep.waiting), settle=SETTLE)
        for aid in st.refused:  # ended in the ledger while it runs here
            h = rep.held.get(aid)
            if h is None:
                continue
            if h.first_byte:  # no stop channel any more: it runs on, counted again
                await rep.led.adopt([Holding(aid, h.cls, h.tenant, first_byte=True)])
            else:
                del rep.held[aid]
        rep.next_beat = self.clock() + INTERVAL

    async def step(self) -> None:
        self.clock.advance(STEP)
        now = self.clock()
        for rep in self.reps:
            for aid, (_, _, deadline) in list(rep.waiting.items()):
                if now >= deadline + CALL_TIMEOUT:  # a waiter the ledger forgot: 503 here
                    del rep.waiting[aid]
                    if (await rep.led.cancel(aid)).value == "admitted":
                        await rep.led.release(aid, ReleaseReason.CANCELLED)
            if now >= rep.next_beat:
                await self.heartbeat(rep)
                await self.events()
        rep = self.rng.choice(self.reps)
        roll = self.rng.random()
        if roll < 0.45:
            await self.arrive(rep)
        elif roll < 0.75 and rep.held:
            aid = self.rng.choice(sorted(rep.held))
            del rep.held[aid]
            await rep.led.release(aid)
        elif roll < 0.85 and rep.held:
            aid = self.rng.choice(sorted(rep.held))
            h = rep.held[aid]
            if not h.first_byte and not h.marked:
                h.marked = True
                await rep.led.mark_preemptible(aid)
        elif roll < 0.95 and rep.held:
            aid = self.rng.choice(sorted(rep.held))
            h = rep.held[aid]
            if not h.first_byte:
                h.first_byte = True
                if await rep.led.mark_first_byte(aid) == 0:
                    del rep.held[aid]  # preempted first: its response never starts
        else:
            await rep.led.tick()
        await self.events()


async def keys_now(client: redis.Redis) -> list[str]:
    return sorted(k.removeprefix(PREFIX + ":") for k in await client.keys(PREFIX + ":*"))


def orders(keys: list[str], seed: int) -> list[list[str]]:
    """One order per key, starting with it; the rest in a seeded random order."""
    out = []
    for i, first in enumerate(keys):
        rest = [k for k in keys if k != first]
        random.Random(seed * 1000 + i).shuffle(rest)
        out.append([first, *rest])
    return out


async def run(server: ValkeyServer, order_index: int | None, seed: int) -> tuple[int, str]:
    """One run; returns the peak of what ran and a description. ``order_index`` None: only
    the key list (for parametrising)."""
    client = connect(server)
    await client.flushall()
    clock = FakeClock()
    rng = random.Random(seed)
    fleet = Fleet(client, clock, rng)
    try:
        await fleet.start(3)
        for _ in range(WARM_UP):  # the fleet full, queues in every class
            await fleet.step()
            fleet.check("warm-up")
        present = await keys_now(client)
        assert "adm" in present and "inflight" in present and "w" in present, present
        order = orders(present, seed)[order_index or 0]
        deleted: list[str] = []
        for key in order:
            await client.delete(f"{PREFIX}:{key}")
            deleted.append(key)
            fleet.log.append(f"DEL {key}")
            for _ in range(rng.randint(1, 6)):
                await fleet.step()
                fleet.check(f"deleting {deleted}")
        for key in await keys_now(client):  # what appeared meanwhile (ghosts, ...)
            if key not in deleted:
                await client.delete(f"{PREFIX}:{key}")
                deleted.append(key)
                await fleet.step()
                fleet.check(f"deleting {deleted}")
        # Liveness: within the documented time the ledger counts exactly what runs.
        end = clock() + RECOVERY
        while clock() < end:
            await fleet.step()
            fleet.check("recovering")
        await fleet.step()
        for rep in fleet.reps:
            await fleet.heartbeat(rep)
        await fleet.events()
        snap = await fleet.reps[0].led.snapshot()
        assert snap.total_inflight == fleet.running, (
            f"the ledger counts {snap.total_inflight}, {fleet.running} run, "
            f"{RECOVERY:.2f} s after the last key was lost")
        # ... and it admits again, up to the capacity, at once.
        for rep in fleet.reps:
            for aid in sorted(rep.held):
                await rep.led.release(aid)
            rep.held.clear()
            for aid in sorted(rep.waiting):
                await rep.led.cancel(aid)
            rep.waiting.clear()
        await fleet.events()
        for rep in fleet.reps:
            for aid in sorted(rep.held):
                await rep.led.release(aid)
            rep.held.clear()
        admitted = 0
        for i in range(CAPACITY):
            rep = fleet.reps[i % 3]
            got = await rep.led.arrive(f"last-{i}", SYS, "t1")  # no class holds it back
            admitted += got.status is ArriveStatus.ADMITTED
        assert admitted == CAPACITY, f"{admitted} of {CAPACITY} admitted after recovery"
        causes = sorted({c for r in fleet.reps for c in r.causes})
        return fleet.peak, f"order {order[:3]}...: peak {fleet.peak}/{CAPACITY}, causes {causes}"
    finally:
        await client.aclose()


SEED = int(os.environ.get("KEYS_SEED", "7"))


def key_count(server: ValkeyServer) -> int:
    async def count() -> int:
        client = connect(server)
        await client.flushall()
        fleet = Fleet(client, FakeClock(), random.Random(SEED))
        try:
            await fleet.start(3)
            for _ in range(WARM_UP):
                await fleet.step()
            return len(await keys_now(client))
        finally:
            await client.aclose()
    return asyncio.run(count())


def test_every_key_lost_first_then_the_rest_never_past_capacity(
        valkey_server: ValkeyServer) -> None:
    n = key_count(valkey_server)
    assert n >= 20  # the warm-up reaches every kind of key (queues, tenants, candidates)
    print(f"seed {SEED} (KEYS_SEED), {n} keys, {n} orders")
    for i in range(n):
        peak, what = asyncio.run(run(valkey_server, i, SEED))
        print(what)
        assert peak == CAPACITY  # the fleet was full: an excess would have shown


@pytest.mark.parametrize("pair", [("adm", "inflight"), ("adm", "own:r0"), ("inflight", "w"),
                                  ("fleet", "meta"), ("replicas", "reports")])
async def test_two_keys_lost_at_once_are_still_within_capacity(
        valkey_server: ValkeyServer, pair: tuple[str, str]) -> None:
    # Not one after another: one DEL of two keys, no call in between. adm with inflight:
    # the owners' sets name the ids (the next call, as nothing looks admitted). adm with a
    # replica's own set: ghosts hold what no set names until every replica resynced.
    client = connect(valkey_server)
    await client.flushall()
    clock = FakeClock()
    fleet = Fleet(client, clock, random.Random(SEED))
    try:
        await fleet.start(3)
        for _ in range(WARM_UP):
            await fleet.step()
        await client.delete(*(f"{PREFIX}:{k}" for k in pair))
        end = clock() + RECOVERY
        while clock() < end:
            await fleet.step()
            fleet.check(f"{pair} lost at once")
        for rep in fleet.reps:
            await fleet.heartbeat(rep)
        await fleet.events()
        assert (await fleet.reps[0].led.snapshot()).total_inflight == fleet.running
    finally:
        await client.aclose()
