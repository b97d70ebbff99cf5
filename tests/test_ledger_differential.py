"""Differential property test: the in-process core and the fleet ledger decide alike.

The ``Scheduler`` of ``sidecar/scheduler/`` is the specification of the contract's rules;
``ledger.lua`` is their port to one atomic server-side script per decision. Both are
driven by the same random operation sequences -- one replica, the ledger on the test's
fake clock -- and after every step they must have made identical decisions: admitted /
queued / rejected, which queued head was granted (and whether by starvation or by
preemption), which victim was preempted, which waiters timed out and after how long, what
each release, cancel and mark answered, the in-flight counts, queue depths, reservations
and when the next timer is due -- also across hot reloads of the class settings. Queue
timeouts: the ledger expires waiters itself from stored deadlines, on any call, exactly
when the core's ``tick`` does.

Inputs the sidecar never sends are drawn too (``bad_input``: one field of one op set to a
non-finite, absurd, negative or non-numeric value, tests/ledger_support.py ``FIELDS``): the
ledger must refuse each with an error, and since the core sees nothing, every later
decision still being identical shows that the refused call changed nothing.

Fairness between tenants is drawn too: fair queuing on or off per class, per-tenant queue
limits, tenant weights (tenant keys with spaces and non-ASCII characters), several tenants
per class, and reloads switching any of them; the grants of a step must come in the same
order (which tenant goes next is the point of fair queuing). On a failure Hypothesis
prints the falsifying example and the blob that replays it (``@reproduce_failure``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import redis.asyncio as redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.valkey import ValkeyServer
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.coordination import ledger as ledger_module
from sidecar.coordination.ledger import ArriveStatus, CancelResult, Event, FleetLedger, Holding
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    Outcome,
    Preempted,
    Queued,
    Rejected,
    Scheduler,
)
from tests.clock import FakeClock
from tests.ledger_support import FIELDS, bad_call, connect, valkey_server
from tests.strategies import classes, tenant_class_config, tenants

__all__ = ["valkey_server"]

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
EXAMPLES = 3000 if LONG else 200

# Preemption needs a class that may preempt to find available == 0 exactly: few
# reservations and small queues make that (and the victim rules) common.
preempting_config = st.builds(
    ClassSettings,
    reserved_floor=st.integers(0, 1),
    reserved_per_slot=st.just(0.0),
    queue_size=st.integers(1, 4),
    queue_timeout_secs=st.sampled_from([1.0, 3.0, 10.0]),
    starvation_threshold_secs=st.sampled_from([0.5, 2.0, 5.0]),
    can_preempt=st.just(True),
    fair_queuing=st.booleans(),
    max_queued_per_tenant=st.none() | st.integers(1, 3),
    tenant_weights=st.sampled_from([{}, {"A": 3.0}, {"B": 0.5, "t t": 2.0}]),
)
# Fair dispatch needs deep queues served one by one, long enough for tenants to join an
# advanced virtual time: no reservations, little starvation or timeout.
fair_config = st.builds(
    ClassSettings,
    reserved_floor=st.just(0),
    reserved_per_slot=st.just(0.0),
    queue_size=st.integers(4, 10),
    queue_timeout_secs=st.sampled_from([10.0, 100.0]),
    starvation_threshold_secs=st.sampled_from([5.0, 100.0]),
    can_preempt=st.booleans(),
    fair_queuing=st.just(True),
    max_queued_per_tenant=st.none() | st.integers(2, 5),
    tenant_weights=st.sampled_from([{"A": 3.0, "B": 0.5}, {"A": 1.5, "é ü": 0.25, "t t": 2.0}]),
)
configs = st.one_of(
    st.fixed_dictionaries({c: tenant_class_config for c in PriorityClass}),
    st.fixed_dictionaries({c: preempting_config for c in PriorityClass}),
)
fair_configs = st.fixed_dictionaries({c: fair_config for c in PriorityClass})
arrival = st.tuples(classes, tenants)
bad_input = st.sampled_from([(f, v) for f, (_, values) in sorted(FIELDS.items())
                             for v in values])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), arrival),
        st.tuples(st.just("arrive"), arrival),
        st.tuples(st.just("arrive"), arrival),
        st.tuples(st.just("release"), st.integers(0, 1000)),
        st.tuples(st.just("release_bogus"), st.integers(0, 3)),
        st.tuples(st.just("cancel"), st.integers(0, 1000)),
        st.tuples(st.just("first_byte"), st.integers(0, 1000)),
        st.tuples(st.just("reachable"), st.integers(0, 1000)),
        st.tuples(st.just("reachable_all"), st.just(0)),
        st.tuples(st.just("capacity"), st.integers(0, 8)),
        st.tuples(st.just("adopt"), arrival),
        st.tuples(st.just("advance"), st.sampled_from([0.1, 0.5, 1.0, 2.5, 6.0])),
        st.tuples(st.just("reload"), st.just(0)),
        st.tuples(st.just("bad_input"), bad_input),
    ),
    min_size=10,
    max_size=60,
)

# Mostly arrivals and releases on a small capacity: queues build up and are served one by
# one, tenants join and leave while others are being served.
fair_ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), arrival),
        st.tuples(st.just("arrive"), arrival),
        st.tuples(st.just("arrive"), arrival),
        st.tuples(st.just("release"), st.integers(0, 1000)),
        st.tuples(st.just("release"), st.integers(0, 1000)),
        st.tuples(st.just("cancel"), st.integers(0, 1000)),
        st.tuples(st.just("reachable_all"), st.just(0)),
        st.tuples(st.just("capacity"), st.integers(1, 3)),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 6.0])),
        st.tuples(st.just("reload"), st.just(0)),
        st.tuples(st.just("bad_input"), bad_input),
    ),
    min_size=20,
    max_size=80,
)

Decision = tuple[Any, ...]


def core_decisions(events: list[Any]) -> list[Decision]:
    out: list[Decision] = []
    for e in events:
        if isinstance(e, Admitted):
            a = e.admission
            if e.adopted:
                out.append(("adopted", a.id))
            elif e.queued:
                out.append(("grant", a.id, e.waited, e.starvation, e.preempted))
            else:
                out.append(("admitted", a.id, e.preempted))
        elif isinstance(e, Rejected):
            if e.outcome is Outcome.REJECTED_QUEUE_FULL:
                out.append(("full", e.id))
            elif e.outcome is Outcome.REJECTED_QUEUE_TIMEOUT:
                out.append(("expired", e.id, e.waited))
            else:
                out.append(("cancelled", e.id))
        elif isinstance(e, Preempted):
            out.append(("preempt", e.victim.id, e.by_class))
    return out


def in_order(decisions: list[Decision]) -> list[Decision]:
    """Grants and preemptions, in the order decided. (Waiters timing out at one instant
    leave before any grant, whatever their order: it changes no later decision, and the
    ledger takes equal deadlines by id, the core by arrival.)"""
    return [d for d in decisions if d[0] in ("grant", "preempt")]


def ledger_decisions(events: list[Event]) -> list[Decision]:
    out: list[Decision] = []
    for e in events:
        if e.kind == "grant":
            out.append(("grant", e.id, e.waited, e.starvation, e.preempted))
        elif e.kind == "expired":
            out.append(("expired", e.id, e.waited))
        else:
            out.append(("preempt", e.id, e.by_class))
    return out


async def run(server: ValkeyServer, cfg: dict[PriorityClass, ClassSettings], capacity: int,
              steps: list[tuple[str, Any]], reload: dict[PriorityClass, ClassSettings]) -> None:
    clock = FakeClock()
    core = Scheduler(cfg, capacity, clock, preemptible_on_admit=False)
    client = connect(server)
    await client.flushall()
    try:
        led = FleetLedger(client, "d", "only", ttl=86400.0, remember_ended_secs=86400.0,
                          clock=clock)
        await led.register(cfg, capacity)
        ended: list[str] = []
        seq = 0
        for step, (op, arg) in enumerate(steps):
            mine: list[Decision] = []
            queued: list[Decision] = []
            live = [a.id for a in core.admissions()]
            waiting = sorted(i for c in PriorityClass for i in core.queued_ids(c))
            if op == "arrive":
                seq += 1
                rid = f"r{seq}"
                cls, tenant = arg
                decision = core.arrive(rid, cls, tenant)
                got = await led.arrive(rid, cls, tenant)
                if got.status is ArriveStatus.QUEUED:
                    mine.append(("queued", rid))
                elif got.status is ArriveStatus.ADMITTED:
                    mine.append(("admitted", rid, got.victim is not None))
                else:
                    assert got.status is ArriveStatus.REJECTED_QUEUE_FULL, got
                    mine.append(("full", rid))
                if isinstance(decision, Queued):
                    queued.append(("queued", rid))
            elif op == "release" and live:
                target = live[arg % len(live)]
                assert await led.release(target) is core.release(target)
                ended.append(target)
            elif op == "release_bogus":
                target = ended[arg % len(ended)] if ended and arg else "bogus"
                if target not in live:
                    assert await led.release(target) is core.release(target)
            elif op == "cancel" and waiting:
                target = waiting[arg % len(waiting)]
                expect = core.cancel(target)
                got_cancel = await led.cancel(target)
                assert (got_cancel is CancelResult.CANCELLED) == expect
                if expect:
                    mine.append(("cancelled", target))
            elif op == "first_byte" and live:
                target = live[arg % len(live)]
                assert await led.mark_first_byte(target) == int(core.mark_first_byte(target))
            elif op == "reachable" and live:
                target = live[arg % len(live)]
                assert await led.mark_preemptible(target) == int(core.mark_preemptible(target))
            elif op == "reachable_all" and live:
                # In the order admitted, as ext_proc streams open: one call, several ids.
                expect_n = sum(core.mark_preemptible(i) for i in live)
                assert await led.mark_preemptible(*live) == expect_n
            elif op == "capacity":
                core.set_capacity(arg)
                await led.heartbeat(arg)
            elif op == "adopt":
                seq += 1
                rid = f"r{seq}"
                cls, tenant = arg
                assert core.adopt(rid, cls, tenant)
                before = (await led.snapshot()).total_inflight
                status = await led.reregister([Holding(rid, cls, tenant, first_byte=True)])
                assert status.inflight == before + 1 and not status.refused
                mine.append(("adopted", rid))
            elif op == "reload":
                # Hot reload: new knobs for new decisions; waiters keep place and deadline.
                cfg, reload = reload, cfg
                core.update_config(cfg)
                await led.register(cfg, core.capacity)
            elif op == "bad_input":
                # Refused by the library; the core is not told: any change it made would
                # show in this step's or a later step's comparison.
                field, value = arg
                with pytest.raises(redis.ResponseError, match=r"^ledger: "):
                    await client.fcall(ledger_module.TEST_FUNCTION, *bad_call(led, field, value))
            elif op == "advance":
                clock.advance(arg)
                core.tick()
                await led.tick()
            events = core.take_events()
            expected = core_decisions(events) + queued
            notified = ledger_decisions(await led.take_events())
            where = f"step {step} {op} {arg}"
            assert in_order(notified) == in_order(expected), where
            mine += notified
            for e in events:
                if isinstance(e, Preempted):
                    ended.append(e.victim.id)
            assert sorted(mine, key=repr) == sorted(expected, key=repr), where
            snap = await led.snapshot()
            core_snap = core.snapshot()
            assert snap.capacity == core_snap.capacity, where
            for c in HIGH_TO_LOW:
                cs = core_snap.classes[c]
                assert (snap.inflight[c], snap.queue_depth[c], snap.reserved[c]) == (
                    cs.inflight, cs.queue_depth, cs.reserved), f"{where} {c.label}"
            due = core.next_deadline()
            assert await led.tick() == (None if due is None else due - clock()), where
    finally:
        await client.aclose()


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, capacity=st.integers(0, 6), steps=ops, reload=configs)
def test_ledger_decides_like_the_core(valkey_server: ValkeyServer,
                                      cfg: dict[PriorityClass, ClassSettings], capacity: int,
                                      steps: list[tuple[str, Any]],
                                      reload: dict[PriorityClass, ClassSettings]) -> None:
    asyncio.run(run(valkey_server, cfg, capacity, steps, reload))


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=fair_configs, capacity=st.integers(1, 2), steps=fair_ops, reload=fair_configs)
def test_ledger_serves_tenants_like_the_core(valkey_server: ValkeyServer,
                                             cfg: dict[PriorityClass, ClassSettings],
                                             capacity: int, steps: list[tuple[str, Any]],
                                             reload: dict[PriorityClass, ClassSettings]) -> None:
    asyncio.run(run(valkey_server, cfg, capacity, steps, reload))


def test_a_new_fair_head_takes_the_victim_the_old_head_could_not(
        valkey_server: ValkeyServer) -> None:
    # Found by the property above. Capacity 1: system B waits from t=0; at t=6 a starved
    # bulk request takes the slot and becomes a candidate, too late for B's head (a head
    # takes only a victim admitted before it queued). System A arrives at t=6 and, by
    # fair queuing, is the class's new head: it may take that victim, at once, in both
    # (the core used to leave it queued until some later event; the ledger's next tick
    # preempted).
    cfg = {c: ClassSettings(reserved_floor=0, reserved_per_slot=0.0, queue_size=4,
                            queue_timeout_secs=10.0,
                            starvation_threshold_secs=5.0, can_preempt=c is PriorityClass.SYSTEM,
                            fair_queuing=True, tenant_weights={"A": 3.0, "B": 0.5})
           for c in PriorityClass}
    bulk, system = PriorityClass.BULK, PriorityClass.SYSTEM
    steps: list[tuple[str, Any]] = [("arrive", (bulk, "A"))] * 5 + [
        ("arrive", (system, "A")), ("arrive", (system, "B")), ("release", 0),
        ("advance", 6.0), ("release", 0), ("reachable_all", 0), ("arrive", (system, "A")),
        ("release", 0)]
    asyncio.run(run(valkey_server, cfg, 1, steps, cfg))
