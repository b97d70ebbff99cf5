"""Degraded mode's local limit, against a real valkey-server.

While the server is unreachable each replica admits on its own within
``L_i = max(0, min(floor(C/N), h_i + floor((C − H)/N)))``, C, N, H (the fleet's admissions)
and h_i (its own) read from ONE atomic ledger reply. The property test builds random
holdings of 2-3 replicas through the real ledger, takes every replica's view from one
state, then lets each replica's real local core (the in-process :class:`Scheduler`, seeded
as the controller seeds it) admit and release at random: Σ in flight never exceeds
max(C, H) — C itself whenever the fleet was within capacity.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import redis.asyncio as redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.valkey import ValkeyServer
from sidecar.classes import PriorityClass
from sidecar.coordination.ledger import ArriveStatus, FleetLedger, FleetStatus, degraded_limit
from sidecar.scheduler import Admitted, ClassSettings, Preempted, Released, Scheduler
from tests.clock import FakeClock
from tests.ledger_support import client, connect, valkey_server

__all__ = ["client", "valkey_server"]  # fixtures used by name

EXAMPLES = 2000 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 120
SYS, INT, DEF, BULK = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
                       PriorityClass.BULK)
# No reservations, no queues: an arrival is admitted or refused at once, so a heartbeat
# (which dispatches) never changes what anyone holds between two replicas' views.
NO_QUEUE: dict[PriorityClass, ClassSettings] = {
    c: ClassSettings(0, 0.0, 0, 10.0, 5.0, c is SYS) for c in PriorityClass}


async def fleet(c: redis.Redis, caps: list[int], clock: FakeClock) -> list[FleetLedger]:
    out = []
    for i, cap in enumerate(caps):
        led = FleetLedger(c, "d", f"r{i}", ttl=60.0, clock=clock)
        await led.register(NO_QUEUE, cap)
        out.append(led)
    return out


# ------------------------------------------------------------------------- the formula


def test_the_formula_on_the_issues_example() -> None:
    # C = 4, two replicas, B holds all 4 (legal: no stranded capacity). A may take nothing.
    assert degraded_limit(4, 2, 4, 0) == 0
    assert degraded_limit(4, 2, 4, 4) == 2  # B: drains to its share, then reuses it
    # Nothing held: each an N-th. Never above floor(C/N), never below 0.
    assert [degraded_limit(4, 2, 0, 0), degraded_limit(7, 3, 0, 0)] == [2, 2]
    assert degraded_limit(4, 2, 1, 1) == 2  # min(2, 1 + floor(3/2))
    assert degraded_limit(4, 2, 3, 0) == 0  # floor(1/2): the one free slot is nobody's
    assert degraded_limit(4, 2, 6, 0) == 0  # over capacity (a shrink): nothing new
    assert degraded_limit(4, 0, 0, 0) == 0  # never saw the fleet


async def test_every_heartbeat_reply_is_one_view_of_the_fleet(client: redis.Redis) -> None:
    clock = FakeClock()
    a, b = await fleet(client, [4, 4], clock)
    for i, cls in enumerate((BULK, BULK, DEF)):
        assert (await b.arrive(f"b{i}", cls, "t")).status is ArriveStatus.ADMITTED
    assert (await a.arrive("a0", INT, "t")).status is ArriveStatus.ADMITTED
    sa, sb = await a.heartbeat(), await b.heartbeat()
    for s in (sa, sb):
        assert (s.capacity, s.live_replicas, s.inflight) == (4, 2, 4)
        assert dict(s.by_class) == {BULK: 2, DEF: 1, INT: 1, SYS: 0}
    assert (sa.held, sb.held) == (1, 3)
    assert (sa.degraded_limit(), sb.degraded_limit()) == (1, 2)
    # resync and reregister answer the same view (the resync's own list counts).
    r = await b.resync([], min_age=1e9)
    assert (r.inflight, r.held) == (4, 3)
    assert (await b.reregister([])).held == 3
    # a replica's waiters are not holdings: queue one (bulk may queue in this config)
    await a.register({**NO_QUEUE, BULK: ClassSettings(0, 0.0, 4, 10.0, 5.0, False)}, 4)
    assert (await a.arrive("aq", BULK, "t")).status is ArriveStatus.QUEUED
    assert (await a.heartbeat()).held == 1


# ------------------------------------------------------------- the property, Σ ≤ C

# Skewed towards one replica holding more than its share before the outage: the case
# floor(C/N) alone gets wrong.
step = st.tuples(st.sampled_from(["arrive", "arrive", "arrive", "release"]),
                 st.sampled_from([0, 1, 1, 1, 2]),
                 st.sampled_from([BULK, BULK, DEF, INT, SYS]), st.integers(0, 1000))


async def degrade_from_one_view(server: ValkeyServer, caps: list[int],
                                before: list[tuple[str, int, PriorityClass, int]],
                                after: list[tuple[str, int, PriorityClass, int]]) -> None:
    clock = FakeClock()
    c = connect(server)
    await c.flushall()
    try:
        n = len(caps)
        ledgers = await fleet(c, caps, clock)
        held: list[list[tuple[str, PriorityClass]]] = [[] for _ in range(n)]
        seq = 0
        # 1. Random holdings through the ledger (arrivals anywhere, releases, preemptions).
        for op, who, cls, pick in before:
            r = who % n
            if op == "arrive":
                seq += 1
                got = await ledgers[r].arrive(f"x{seq}", cls, "t")
                if got.status is ArriveStatus.ADMITTED:
                    held[r].append((f"x{seq}", cls))
                    await ledgers[r].mark_preemptible(f"x{seq}")
                if got.victim is not None:
                    for h in held:
                        h[:] = [(i, k) for i, k in h if i != got.victim]
            elif held[r]:
                aid, _ = held[r].pop(pick % len(held[r]))
                await ledgers[r].release(aid)
        # 2. Every replica's view from one state: nothing changes between the heartbeats.
        views: list[FleetStatus] = [await led.heartbeat() for led in ledgers]
        cap, total = views[0].capacity, views[0].inflight
        assert total == sum(len(h) for h in held)
        for i, v in enumerate(views):
            assert (v.capacity, v.inflight, v.live_replicas) == (cap, total, n)
            assert v.held == len(held[i])
        # 3. The server is gone: each replica's local core, seeded as the controller does.
        clock_local = FakeClock()
        cores = []
        for i, v in enumerate(views):
            core = Scheduler(NO_QUEUE, v.degraded_limit(caps[i]), clock_local)
            for aid, cls in held[i]:
                core.carry(aid, cls, "t", clock_local(), streaming=False)
                core.mark_preemptible(aid)
            cores.append(core)
        bound = max(cap, total)

        def in_flight() -> int:
            return sum(core.snapshot().inflight for core in cores)

        assert in_flight() == total
        ids = [{aid for aid, _ in h} for h in held]
        for op, who, cls, pick in after:
            i = who % n
            if op == "arrive":
                seq += 1
                cores[i].arrive(f"l{seq}", cls, "t")
            elif ids[i]:
                cores[i].release(sorted(ids[i])[pick % len(ids[i])])
            for e in cores[i].take_events():
                if isinstance(e, Admitted):
                    ids[i].add(e.admission.id)
                elif isinstance(e, Released):
                    ids[i].discard(e.admission.id)
            assert in_flight() <= bound, (in_flight(), cap, total, [v.held for v in views])
    finally:
        await c.aclose()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(caps=st.lists(st.integers(0, 8), min_size=2, max_size=3),
       before=st.lists(step, max_size=30), after=st.lists(step, max_size=40))
def test_all_replicas_degraded_from_one_view_never_exceed_capacity(
        valkey_server: ValkeyServer, caps: list[int],
        before: list[tuple[str, int, PriorityClass, int]],
        after: list[tuple[str, int, PriorityClass, int]]) -> None:
    asyncio.run(degrade_from_one_view(valkey_server, caps, before, after))


def test_the_bound_is_tight_a_replica_over_its_share_gets_nothing_more() -> None:
    """The gap the formula closes: with floor(C/N) alone A would add 2 (Σ = 6 > 4)."""
    clock = FakeClock()
    a = Scheduler(NO_QUEUE, degraded_limit(4, 2, 4, 0), clock)
    b = Scheduler(NO_QUEUE, degraded_limit(4, 2, 4, 4), clock)
    for i in range(4):
        b.carry(f"b{i}", BULK, "t", clock(), streaming=True)
    results: list[Any] = [a.arrive(f"a{i}", DEF, "t") for i in range(3)]
    assert not any(isinstance(r, Admitted) for r in results)
    b.release("b0")
    b.release("b1")
    assert not isinstance(b.arrive("b9", DEF, "t"), Admitted)  # 3 held ≥ its limit 2
    b.release("b2")
    assert isinstance(b.arrive("b9", DEF, "t"), Admitted)  # back within its limit
    assert a.snapshot().inflight + b.snapshot().inflight == 2


# ------------------------------------------------ carried-over admissions, preemptible


def test_a_carried_admission_before_its_first_byte_can_be_preempted_locally() -> None:
    clock = FakeClock()
    core = Scheduler(NO_QUEUE, 2, clock)
    core.carry("old", BULK, "t", clock(), streaming=False)
    clock.advance(1)
    core.carry("newer", BULK, "t", clock(), streaming=False)
    core.carry("streaming", BULK, "t", clock(), streaming=True)
    assert core.snapshot().inflight == 3  # carried over past the limit: they count
    assert not core.mark_preemptible("streaming")  # its response started
    assert core.mark_preemptible("old") and core.mark_preemptible("newer")
    core.release("streaming")
    core.take_events()
    got = core.arrive("sys", SYS, "t")
    assert isinstance(got, Admitted) and got.preempted
    preempted = [e for e in core.take_events() if isinstance(e, Preempted)]
    # the most recently admitted candidate, by its admission time before the outage
    assert [e.victim.id for e in preempted] == ["newer"]


# ------------------------------------------ views taken at different moments: the window

event = st.tuples(st.sampled_from(["admit", "admit", "release", "view"]), st.integers(0, 3))


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(n=st.integers(2, 4), cap=st.integers(1, 12), events=st.lists(event, max_size=60))
def test_stale_views_overshoot_at_most_the_admissions_since_the_oldest_view(
        n: int, cap: int, events: list[tuple[str, int]]) -> None:
    """What the reference states for views of different ages (pure arithmetic).

    The ledger admits while H < C; each replica's limit is from its own last view. If
    the server stopped now, the fleet could reach Σ max(h_i, L_i) (each replica keeps
    what it holds and fills up to its limit). That is at most C plus the admissions the
    ledger made after the oldest of the views, and at most C plus what the replicas hold
    beyond floor(C/N); with every view fresh, exactly within C.
    """
    held = [0] * n
    limit = [degraded_limit(cap, n, 0, 0)] * n
    view_at = [0] * n
    admitted_at: list[int] = []
    for t, (op, who) in enumerate(events, start=1):
        i = who % n
        if op == "admit" and sum(held) < cap:
            held[i] += 1
            admitted_at.append(t)
        elif op == "release" and held[i] > 0:
            held[i] -= 1
        elif op == "view":
            limit[i] = degraded_limit(cap, n, sum(held), held[i])
            view_at[i] = t
        reach = sum(max(h, lim) for h, lim in zip(held, limit, strict=True))
        since_oldest = sum(1 for a in admitted_at if a > min(view_at))
        over_share = sum(max(0, h - cap // n) for h in held)
        assert reach - cap <= min(since_oldest, over_share), (held, limit, view_at)
    fresh = [degraded_limit(cap, n, sum(held), h) for h in held]
    assert sum(max(h, lim) for h, lim in zip(held, fresh, strict=True)) <= cap
