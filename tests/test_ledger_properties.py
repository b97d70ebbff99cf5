"""Fleet-wide invariants under random interleavings of 2-3 replicas' operations.

A real valkey-server; the replicas share the test's clock. Operations: arrivals on any
replica, releases (by the owner or another replica, and duplicates), cancels, marks,
capacity reports, time passing (live replicas heartbeat), a replica dying (it stops
heartbeating), the server losing its data (live replicas re-register what they hold) and
a replica's return from an outage with an admission replaced locally (its resync swaps
them).
After every step, the invariants of tests/test_scheduler_properties.py hold fleet-wide:

* Σ in flight ≤ fleet capacity after any step that admitted; a step that admitted nothing
  never raises Σ in flight (a capacity shrink drains; re-registration after data loss adds
  back slots that are really in use).
* Every admission ends exactly once (release, preemption, its replica's death); a second
  or late release changes nothing. Every arrival gets one decision.
* Grants of a class follow arrival order at the ledger, whichever replica holds the waiter.
* Queue depth ≤ queue_size; a victim is of a lower class, reachable and before its first byte.
* The ledger's counts equal the model's; a dead replica's admissions and waiters are gone
  once its TTL has passed; the ledger is empty at the end.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.valkey import ValkeyServer
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.coordination.ledger import ArriveStatus, CancelResult, FleetLedger, Holding
from sidecar.scheduler import ClassSettings, ReleaseResult
from tests.clock import FakeClock
from tests.ledger_support import connect, valkey_server
from tests.test_ledger_differential import configs

__all__ = ["valkey_server"]

EXAMPLES = 2000 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 150
TTL = 5.0

classes = st.sampled_from(list(PriorityClass))
who = st.integers(0, 2)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), who, classes),
        st.tuples(st.just("arrive"), who, classes),
        st.tuples(st.just("arrive"), who, classes),
        st.tuples(st.just("release"), who, st.integers(0, 1000)),
        st.tuples(st.just("release_again"), who, st.integers(0, 1000)),
        st.tuples(st.just("cancel"), who, st.integers(0, 1000)),
        st.tuples(st.just("first_byte"), who, st.integers(0, 1000)),
        st.tuples(st.just("reachable"), who, st.integers(0, 1000)),
        st.tuples(st.just("capacity"), who, st.integers(0, 8)),
        st.tuples(st.just("advance"), who, st.sampled_from([0.1, 0.5, 1.0, 2.5, 4.0])),
        st.tuples(st.just("kill"), who, st.just(0)),
        st.tuples(st.just("flush"), who, st.just(0)),
        st.tuples(st.just("turnover"), who, st.integers(0, 1000)),
    ),
    min_size=10,
    max_size=50,
)


@dataclass
class Req:
    id: str
    owner: int
    cls: PriorityClass
    state: str  # queued | admitted | ended | rejected
    first_byte: bool = False
    reachable: bool = False


async def run(server: ValkeyServer, cfg: dict[PriorityClass, ClassSettings], n: int,
              caps: list[int], steps: list[tuple[str, int, Any]]) -> None:
    clock = FakeClock()
    client = connect(server)
    await client.flushall()
    try:
        leds = [FleetLedger(client, "p", f"r{i}", ttl=TTL, clock=clock) for i in range(n)]
        alive = [True] * n
        registered = [True] * n
        expiry = [clock() + TTL] * n
        cap = list(caps[:n])
        for i, led in enumerate(leds):
            await led.register(cfg, cap[i])
        reqs: dict[str, Req] = {}
        fifo: dict[PriorityClass, list[str]] = {c: [] for c in PriorityClass}
        ended_once: dict[str, int] = {}
        seq = 0

        def end(r: Req) -> None:
            assert r.state == "admitted", f"{r.id} ended while {r.state}"
            r.state = "ended"
            ended_once[r.id] = ended_once.get(r.id, 0) + 1

        def unqueue(r: Req, state: str) -> None:
            assert r.state == "queued", f"{r.id} left the queue while {r.state}"
            fifo[r.cls].remove(r.id)
            r.state = state

        def held(state: str, i: int | None = None) -> list[Req]:
            return [r for r in reqs.values() if r.state == state and (i is None or r.owner == i)]

        def fleet_capacity() -> int:
            reports = [cap[i] for i in range(n) if registered[i]]
            return min(reports) if reports else 0

        for op, w, arg in steps:
            i = w % n
            if not alive[i]:
                i = alive.index(True)
            led = leds[i]
            before = sum(1 for r in reqs.values() if r.state == "admitted")
            admitted_now = False
            regrown = False
            if op == "arrive":
                seq += 1
                rid = f"x{seq}"
                got = await led.arrive(rid, arg, "t")
                req = Req(rid, i, arg, "rejected")
                reqs[rid] = req
                if got.status is ArriveStatus.ADMITTED:
                    req.state = "admitted"
                    admitted_now = True
                elif got.status is ArriveStatus.QUEUED:
                    req.state = "queued"
                    fifo[arg].append(rid)
                else:
                    assert got.status is ArriveStatus.REJECTED_QUEUE_FULL, got
            elif op in ("release", "release_again"):
                pool = held("admitted") if op == "release" else held("ended")
                if pool:
                    r = pool[arg % len(pool)]
                    result = await led.release(r.id)  # any replica may release any id
                    if op == "release":
                        assert result is ReleaseResult.RELEASED
                        end(r)
                    else:
                        assert result is not ReleaseResult.RELEASED
            elif op == "cancel":
                pool = held("queued", i)
                if pool:
                    r = pool[arg % len(pool)]
                    assert await led.cancel(r.id) is CancelResult.CANCELLED
                    unqueue(r, "cancelled")
            elif op == "first_byte":
                pool = held("admitted", i)
                if pool:
                    r = pool[arg % len(pool)]
                    assert await led.mark_first_byte(r.id) == int(not r.first_byte)
                    r.first_byte = True
            elif op == "reachable":
                pool = held("admitted", i)
                if pool:
                    r = pool[arg % len(pool)]
                    assert await led.mark_preemptible(r.id) == int(not r.first_byte)
                    r.reachable = r.reachable or not r.first_byte
            elif op == "capacity":
                cap[i] = arg
                await led.heartbeat(arg)
            elif op == "advance":
                clock.advance(arg)
                for j in range(n):
                    if alive[j]:
                        await leds[j].heartbeat()
                        expiry[j] = clock() + TTL
                await led.tick()
            elif op == "turnover":
                # A return after an outage: one admission ended locally and another took
                # its slot; the resync lists the replacement instead. The ledger swaps
                # them without handing the freed slot to a waiter in between.
                pool = held("admitted", i)
                if pool:
                    old = pool[arg % len(pool)]
                    end(old)
                    seq += 1
                    new = reqs[f"x{seq}"] = Req(f"x{seq}", i, old.cls, "admitted")
                    mine = [Holding(r.id, r.cls, "t", r.first_byte, r.reachable)
                            for r in held("admitted", i)]
                    status = await led.resync(mine, waiting=[r.id for r in held("queued", i)])
                    assert status.known and not status.refused
                    assert new.id in {h.id for h in mine}
            elif op == "kill" and sum(alive) > 1:
                alive[i] = False  # it stops heartbeating; the ledger notices after TTL
            elif op == "flush":
                await client.flushall()  # the server lost its data
                for r in held("queued"):
                    unqueue(r, "lost")  # the owners fail or re-send them (slice 2)
                for r in held("admitted"):
                    if not alive[r.owner]:
                        end(r)
                for j in range(n):
                    registered[j] = False
                for j in range(n):
                    if alive[j]:
                        mine = [Holding(r.id, r.cls, "t", r.first_byte, r.reachable)
                                for r in held("admitted", j)]
                        status = await leds[j].reregister(mine)
                        assert not status.known and not status.refused
                        registered[j] = True
                        expiry[j] = clock() + TTL
                regrown = True

            # A silent replica is reaped by the first call at or after its expiry.
            for j in range(n):
                if not alive[j] and registered[j] and expiry[j] <= clock():
                    registered[j] = False
                    for r in held("admitted", j):
                        end(r)
                    for r in held("queued", j):
                        unqueue(r, "reaped")

            # Notifications, of every replica (a dead one's list is read as the truth).
            grants: dict[PriorityClass, list[str]] = {c: [] for c in PriorityClass}
            for j in range(n):
                for e in await leds[j].take_events():
                    r = reqs[e.id]
                    assert r.owner == j, f"{e} went to r{j}"
                    if e.kind == "grant":
                        assert r.state == "queued", e
                        grants[r.cls].append(r.id)
                        admitted_now = True
                    elif e.kind == "expired":
                        assert e.waited >= cfg[r.cls].queue_timeout_secs - 1e-9
                        unqueue(r, "expired")
                    else:
                        assert e.by_class is not None and r.cls < e.by_class, e
                        assert r.reachable and not r.first_byte, e
                        end(r)
            for c in PriorityClass:
                # Fleet-wide FIFO: the granted ids are the oldest waiters of their class.
                k = len(grants[c])
                assert sorted(grants[c]) == sorted(fifo[c][:k]), (c, grants[c], fifo[c])
                for rid in grants[c]:
                    unqueue(reqs[rid], "admitted")

            snap = await leds[alive.index(True)].snapshot()
            now_in = sum(1 for r in reqs.values() if r.state == "admitted")
            assert snap.capacity == fleet_capacity()
            assert snap.replicas == tuple(f"r{j}" for j in range(n) if registered[j])
            if admitted_now:
                assert snap.total_inflight <= snap.capacity
            elif not regrown:
                assert now_in <= before
            for c in HIGH_TO_LOW:
                mine_in = sum(1 for r in reqs.values() if r.state == "admitted" and r.cls == c)
                assert snap.inflight[c] == mine_in, c
                assert snap.queue_depth[c] == len(fifo[c]) <= cfg[c].queue_size, c

        # Drain: owners release, time passes, silent replicas are reaped. A release
        # dispatches, so it can grant a waiter or let a queued preemptor take a candidate
        # still held: read the notifications after each one, as the owners would.
        while pending := [r for r in held("admitted") if alive[r.owner]]:
            r = pending[0]
            assert await leds[r.owner].release(r.id) is ReleaseResult.RELEASED
            end(r)
            for j in range(n):
                for e in await leds[j].take_events():
                    if e.kind == "grant":
                        unqueue(reqs[e.id], "admitted")
                    elif e.kind == "expired":
                        unqueue(reqs[e.id], "expired")
                    else:
                        assert reqs[e.id].reachable and not reqs[e.id].first_byte, e
                        end(reqs[e.id])
        for _ in range(20):
            clock.advance(4.0)
            for j in range(n):
                if alive[j]:
                    await leds[j].heartbeat()
                    for e in await leds[j].take_events():
                        if e.kind == "grant":
                            assert await leds[j].release(e.id) is ReleaseResult.RELEASED
        for j in range(n):
            if alive[j]:
                assert await leds[j].release("late") is ReleaseResult.UNKNOWN
        snap = await leds[alive.index(True)].snapshot()
        assert snap.total_inflight == 0 and sum(snap.queue_depth.values()) == 0
        assert snap.replicas == tuple(f"r{j}" for j in range(n) if alive[j])
        for key in ("adm", "w", "dl"):
            assert await client.exists(f"pg:{{p}}:{key}") == 0, key
        assert all(v == 1 for v in ended_once.values())
    finally:
        await client.aclose()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, n=st.integers(2, 3), caps=st.lists(st.integers(0, 6), min_size=3,
                                                         max_size=3), steps=ops)
def test_fleet_invariants(valkey_server: ValkeyServer, cfg: dict[PriorityClass, ClassSettings],
                          n: int, caps: list[int], steps: list[tuple[str, int, Any]]) -> None:
    asyncio.run(run(valkey_server, cfg, n, caps, steps))
